"""Sample text from a trained model (nanoGPT's sample.py).

    python sample.py --run=runs/NAME --prompt="def " --max_new_tokens=200
    python sample.py --checkpoint=runs/NAME/checkpoints/step-400    # one checkpoint
    python sample.py --checkpoint=model.safetensors --run=runs/NAME  # scaffold export
    python sample.py --init_from=FOLDER --tokenizer=FOLDER  # Hugging Face GPT-2 weights

The weights: the run's newest complete checkpoint (saved on any number of ranks and
assembled here without a process group; the entry the run exports, e.g. EMA's averaged
weights, unless --entry names another), a checkpoint folder, or a safetensors file
written by `scaffold export`, or a Hugging Face GPT2LMHeadModel folder. The run's
config.toml gives the model preset and the data, and the data the tokenizer: bytes for
text (the default data), meta.pkl's characters for nanoGPT's .bin; GPT-2 token ids need
--tokenizer (a Hugging Face tokenizer folder).

The model samples with its key/value cache (GPT.generate in model.py): the prompt is one
forward, then each new token one forward of that token alone.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from data import PlainUnpickler
from model import GPT, PRESETS, GPTConfig, from_hf_gpt2
from runtime import checkpoint, config, dist, shards, hf

Codec = tuple[Callable[[str], list[int]], Callable[[list[int]], str]]


@dataclass
class Config:
    run: str = ""  # runs/NAME: its newest checkpoint and its config.toml
    checkpoint: str = (
        ""  # else: a step-N folder, or a .safetensors from scaffold export
    )
    entry: str = ""  # the checkpoint's state entry; "": the one the run exports
    init_from: str = ""  # else: a Hugging Face GPT-2 folder (GPT2LMHeadModel)
    tokenizer: str = (
        ""  # "": from the run's data; bytes; a Hugging Face tokenizer folder
    )
    prompt: str = "\n"  # the text to continue
    num_samples: int = 1
    max_new_tokens: int = 200
    temperature: float = 0.8  # 0: always the most likely token
    top_k: int = 200  # draw among the k most likely tokens; 0: among all
    seed: int = 0
    device: str = "auto"  # auto: the GPU where there is one, else the CPU


def byte_codec() -> Codec:
    """Bytes as tokens (the default data and text files): UTF-8 in, UTF-8 out."""
    encode = lambda text: list(text.encode())  # noqa: E731
    return encode, lambda ids: bytes(i for i in ids if i < 256).decode(errors="replace")


def load_codec(data: str, tokenizer: str) -> Codec:
    """Text <-> token ids for a model trained on `data` (its --data, "" the default)."""
    if tokenizer == "bytes":
        return byte_codec()
    if tokenizer:
        from transformers import AutoTokenizer  # optional: pip install transformers

        folder = Path(tokenizer)
        if folder.is_dir() and not any(folder.glob("tokenizer*")):
            raise ValueError(
                f"{tokenizer} holds no tokenizer: pass --tokenizer=FOLDER (one saved "
                "with save_pretrained) or bytes"
            )

        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        except (OSError, ValueError, TypeError) as error:
            first = (str(error).strip() or type(error).__name__).splitlines()[0]
            raise ValueError(
                f"no Hugging Face tokenizer in {tokenizer} ({first}); pass "
                "--tokenizer=FOLDER (one saved with save_pretrained) or bytes"
            ) from None
        return hf_tokenizer.encode, hf_tokenizer.decode
    path = Path(data).expanduser()
    if data and shards.is_shards(data):
        if (
            shards.read_meta(data, optional=shards.is_mds(data)).get("vocab_size")
            == 256
        ):
            return byte_codec()
    elif path.suffix == ".bin":
        meta = path.with_name("meta.pkl")
        if meta.exists():
            with open(meta, "rb") as file:  # plain data only: see PlainUnpickler
                chars = PlainUnpickler(file).load()
            stoi, itos = chars["stoi"], chars["itos"]
            return (lambda text: [stoi[c] for c in text]), (
                lambda ids: "".join(itos.get(i, "") for i in ids)
            )
    else:
        return byte_codec()
    raise ValueError(
        f"the tokens of data={data} are not bytes or characters: pass "
        "--tokenizer=FOLDER, the Hugging Face tokenizer the data was made with"
    )


def run_config(cfg: Config) -> dict:
    """The training run's config.toml: --run, or found above --checkpoint."""
    source = Path(cfg.run or cfg.checkpoint)
    if source.suffix == ".safetensors" and not cfg.run:
        raise ValueError(f"{source}: also pass --run=runs/NAME, the run it came from")
    for folder in (source, source.parent, source.parent.parent):
        if (folder / "config.toml").is_file():
            return tomllib.loads((folder / "config.toml").read_text())
    raise ValueError(f"no config.toml in {source} or above it: pass --run=runs/NAME")


def load_model(cfg: Config) -> tuple[GPT, Codec, str]:
    """The model to sample from, its codec and a line saying where it came from."""
    if cfg.init_from:
        hf_config, hf_weights = hf.read_gpt2(cfg.init_from)
        model_config = GPTConfig(
            vocab_size=int(hf_config["vocab_size"]),
            max_seq_len=int(hf_config["n_positions"]),
            **{key: int(hf_config[key]) for key in ("n_layer", "n_head", "n_embd")},
        )
        model = GPT(model_config)
        model.load_state_dict(from_hf_gpt2(hf_config, hf_weights, model_config))
        return model, load_codec("", cfg.tokenizer or cfg.init_from), cfg.init_from
    trained = run_config(cfg)
    if Path(cfg.checkpoint).suffix == ".safetensors":
        from safetensors.torch import load_file

        weights, source = load_file(cfg.checkpoint), cfg.checkpoint
    else:
        read = checkpoint.read_weights(cfg.checkpoint or cfg.run, cfg.entry)
        weights, step, found, entry = read
        source = f"{found} (step {step}, entry {entry})"
    model_config = GPTConfig(
        vocab_size=weights["wte.weight"].shape[0],
        max_seq_len=trained["seq_len"],
        **PRESETS[trained["model"]],
    )
    model = GPT(model_config)
    model.load_state_dict(weights)
    return model, load_codec(trained["data"], cfg.tokenizer), source


@torch.no_grad()
def complete(
    model: GPT,
    codec: Codec,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    generator: torch.Generator,
) -> str:
    """The prompt and max_new_tokens sampled after it, as text."""
    encode, decode = codec
    device = next(model.parameters()).device
    idx = torch.tensor([encode(prompt)], dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    # Eager: a compiled block would recompile for every cache length.
    with torch.compiler.set_stance("force_eager"):
        out = model.generate(idx, max_new_tokens, temperature, top_k, generator)
    model.train(was_training)
    return decode(out[0].tolist())


# Tokens in train.py's closing sample.
PREVIEW_TOKENS = 64


def preview(model: GPT, trained: object) -> str:
    """train.py's closing lines: what the model writes after a newline, or after the
    vocabulary's first token where it has no newline (`trained`: its Config: data,
    seed)."""
    try:
        codec = load_codec(trained.data, "")
    except ValueError as error:
        return f"no sample: {error}"
    encode, decode = codec
    try:
        prompt = decode(encode("\n"))
    except KeyError:  # a meta.pkl vocabulary without a newline
        prompt = decode([0])
    device = next(model.parameters()).device
    generator = torch.Generator(device).manual_seed(trained.seed)
    args = (PREVIEW_TOKENS, Config.temperature, Config.top_k, generator)
    text = complete(model, codec, prompt, *args)
    return f"a sample (python sample.py --help for more):{text}"


def main() -> None:
    cfg = config.parse(Config)
    if not (cfg.run or cfg.checkpoint or cfg.init_from):
        config.fail(
            "nothing to sample from; pass --run=runs/NAME or --init_from=FOLDER"
        )
    if not cfg.prompt:
        config.fail("prompt is empty; pass --prompt with at least one token of text")
    env = dist.environment(cfg.device)
    errors = (OSError, ValueError, KeyError, checkpoint.CheckpointError)
    with config.failing(*errors):
        model, codec, source = load_model(cfg)
        if not codec[0](cfg.prompt):
            raise ValueError(
                f"prompt={cfg.prompt!r} gives no tokens; check --tokenizer"
            )
    model = model.to(env.device)
    print(f"sampling from {source}")
    generator = torch.Generator(env.device).manual_seed(cfg.seed)
    for _ in range(cfg.num_samples):
        print(
            complete(
                model,
                codec,
                cfg.prompt,
                cfg.max_new_tokens,
                cfg.temperature,
                cfg.top_k,
                generator,
            )
        )
        print("---------------")


if __name__ == "__main__":
    main()
