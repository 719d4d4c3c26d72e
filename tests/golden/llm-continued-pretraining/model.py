"""The language model and its tokenizer: Hugging Face transformers, by name or folder.

`--model=Qwen/Qwen2.5-0.5B` (a hub id, downloaded once into the Hugging Face cache) or
`--model=path/to/folder` (written by `save_pretrained`) loads any AutoModelForCausalLM
with its AutoTokenizer, through transformers' own `from_pretrained`. `--model=tiny`
builds a small random Llama (LlamaConfig) and a byte-level BPE tokenizer trained on
the training text, with a chat template: no download, and a CPU trains it in minutes.

FSDP shards and activation checkpointing recompute the model's own decoder layers: the
modules its authors marked as never to be split (`_no_split_modules`), so no
architecture is hard-coded here.
"""

from __future__ import annotations

import sys

import torch
import torch.nn as nn

from runtime import quiet

# Where torchao is installed, the model libraries below import it, which prints
# deprecation lines about torchao on stderr: hide those lines and nothing else.
quiet.torchao_import_warnings()

try:
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
except ModuleNotFoundError as missing:
    sys.exit(
        f"error: {missing.name} is not installed; this project needs the Hugging Face "
        "extra: pip install 'scaffold[hf]' (transformers, tokenizers, datasets, "
        "pyarrow)"
    )


# The loop's log says what happens: no progress bars, no load reports.
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

# The offline `tiny` model: Llama's architecture (RMSNorm, rotary, SwiGLU, grouped KV
# heads) at a size a CPU trains in minutes.
TINY_LLAMA = dict(
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=352,
    tie_word_embeddings=True,
)
TINY_VOCAB_SIZE = 2048
# `tiny`'s special tokens: padding, start, end of a turn (the end-of-sequence token),
# and the three roles its chat template writes.
SPECIAL_TOKENS = [
    "<|pad|>",
    "<|bos|>",
    "<|end|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
]
# `tiny`'s chat template: each message is its role token, a newline, the content and
# <|end|>; a generation prompt is the assistant's role token and newline.
TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class ModelError(ValueError):
    """The model or tokenizer cannot be loaded; the message says why and what to do."""


def packed_mask(model: nn.Module, position_ids: torch.Tensor) -> torch.Tensor | None:
    """Causal attention within each document of rows that hold several, one after
    another (position_ids restart at 0 at each), as the 4-D mask the model's sdpa or
    eager attention takes as it is (transformers 5 and later). From position_ids alone,
    transformers would first read on the host whether any row holds more than one
    document: a device sync in every forward. Other kernels (flash_attention_2,
    flex_attention), sliding-window layers and older transformers: None, transformers'
    own mask from position_ids."""
    config = model.config
    implementation = config._attn_implementation
    major = int(transformers.__version__.split(".")[0])
    sliding = "sliding_attention" in (getattr(config, "layer_types", None) or ())
    if major < 5 or sliding or implementation not in ("sdpa", "eager"):
        return None
    # A document starts wherever the position does not go on by one (HF's rule).
    first = position_ids[:, :1] - 1
    documents = (torch.diff(position_ids, prepend=first) != 1).cumsum(-1)
    seq = position_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    keep = ((documents[:, :, None] == documents[:, None, :]) & causal)[:, None]
    if implementation == "sdpa":
        return keep  # (batch, 1, query, key)
    lowest = torch.finfo(torch.float32).min  # eager adds the mask to the scores
    return torch.zeros(keep.shape, device=keep.device).masked_fill(~keep, lowest)


def load_tokenizer(name: str, texts: list[str]) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of `name`; for `tiny`, byte-level BPE trained on `texts`.

    tokenizers' BPE trainer gives the same merges for the same texts (checked across
    processes), so a resumed or a multi-process run tokenizes as the first did.
    """
    if name != "tiny":
        try:
            return transformers.AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as error:
            raise ModelError(not_found(name, "tokenizer", error)) from None
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no unknowns
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|end|>",
        chat_template=TINY_CHAT_TEMPLATE,
    )


def load_model(name: str, tokenizer, max_seq_len: int, attention: str) -> nn.Module:
    """A causal LM: `tiny` from LlamaConfig (seeded by the caller), else loaded; its
    attention computed by transformers' `attention` kernel (auto: the model's own)."""
    if name == "tiny":
        config = transformers.LlamaConfig(
            vocab_size=len(tokenizer),
            max_position_embeddings=max_seq_len,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **TINY_LLAMA,
        )
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = load_pretrained(name, tokenizer, max_seq_len)
    if attention != "auto":
        use_attention(model, name, attention)

    return model


def use_attention(model: nn.Module, name: str, attention: str) -> None:
    """Switch the model to transformers' `attention` kernel, or say why it cannot."""
    try:
        model.set_attn_implementation(attention)
    except (ImportError, ValueError) as error:
        first = str(error).strip().splitlines()[0]
        raise ModelError(
            f"--attention={attention}: {first}; use --attention=auto"
        ) from None
    if model.config._attn_implementation != attention:
        raise ModelError(
            f"--attention={attention}: {name} keeps its own attention "
            f"({model.config._attn_implementation}); use --attention=auto"
        )


def load_pretrained(name: str, tokenizer, max_seq_len: int) -> nn.Module:
    """A hub id's or a saved folder's model in fp32 (autocast computes in bf16 on a
    GPU), checked against its tokenizer and its length."""
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            name, dtype=torch.float32
        )
    except (OSError, ValueError) as error:
        raise ModelError(not_found(name, "model", error)) from None
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise ModelError(
            f"--model={name}: its tokenizer has {len(tokenizer)} tokens but the model "
            f"embeds only {embeddings}; the tokenizer and the model do not belong "
            "together"
        )
    positions = getattr(model.config, "max_position_embeddings", max_seq_len)
    if max_seq_len > positions:
        raise ModelError(
            f"--seq_len={max_seq_len} is longer than {name}'s {positions} positions; "
            f"use --seq_len={positions} or less"
        )
    return model


def training_bytes(name: str, frozen: bool = False) -> int:
    """Bytes the fp32 weights of `name` take in training with their gradients and
    AdamW's two moments: 16 per parameter (`frozen`, the weights alone: 4). Counted
    from its config on the meta device, so nothing is loaded; 0 for `tiny`."""
    if name == "tiny":
        return 0
    try:
        config = transformers.AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ModelError(not_found(name, "config", error)) from None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()) * (4 if frozen else 16)


def not_found(name: str, what: str, error: Exception) -> str:
    first = (
        str(error).strip().splitlines()[0]
        if str(error).strip()
        else type(error).__name__
    )
    return (
        f"--model={name}: cannot load its {what} ({first}); pass a folder written by "
        "save_pretrained, or a hub id with network access once (then it is cached)"
    )


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer layers (and embeddings): each its own FSDP unit.

    `_no_split_modules` names the classes its authors keep whole (BertLayer, GPT2Block,
    ...); the outermost modules of those classes, in order, are the blocks.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[nn.Module] = []
    for module in model.modules():
        inside = any(
            module is not b and any(m is module for m in b.modules()) for b in blocks
        )
        if type(module).__name__ in names and not inside:
            blocks.append(module)
    return blocks


def respond(
    model: nn.Module,
    tokenizer,
    messages: list[dict],
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int = 0,
) -> str:
    """The model's answer to a conversation (rendered with the chat template): greedy,
    or drawn at `temperature` (see `complete`).

    Under FSDP every rank runs this with the same prompt and the same gathered weights,
    so every rank stops at the same token and runs the same forwards (each all-gathers).
    """
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return complete(model, tokenizer, ids, max_new_tokens, temperature, top_k).strip()


@torch.no_grad()
def complete(
    model: nn.Module,
    tokenizer,
    ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int,
) -> str:
    """The text the model writes after the token `ids` (transformers' `generate`, with
    its key/value cache), up to its end token or `max_new_tokens`: the most likely token
    each time at temperature 0, else drawn from the `top_k` most likely (0: all) with
    logits / temperature. The model's own generation_config (top_p, ...) is overridden.
    """
    if temperature > 0:
        rule = dict(
            do_sample=True, temperature=temperature, top_k=top_k or None, top_p=1.0
        )
    else:
        rule = dict(do_sample=False, temperature=None, top_k=None, top_p=None)
    device = next(model.parameters()).device
    prompt = torch.tensor([ids], device=device)
    output = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=max_new_tokens,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        **rule,
    )
    return tokenizer.decode(output[0, len(ids) :], skip_special_tokens=True)
