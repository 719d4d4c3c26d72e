"""Text from a fine-tuned model: the causal_lm task's sample.py for Hugging Face models.

    python sample.py --run=runs/NAME --prompt="What is a list in Python?"
    python sample.py --run=runs/NAME --prompt="def " --prompt_format=text
    python sample.py --model=FOLDER --prompt="Hello"  # any AutoModelForCausalLM

The weights: the folder train.py writes when a run ends (runs/NAME/hf, save_pretrained's
format), or any folder or hub id that AutoModelForCausalLM loads. A LoRA run exported as
an adapter (--lora_export=adapter) loads on its base model: --base, else the one its
adapter_config.json names. A chat prompt is one user message rendered with the
tokenizer's chat template and answered, as train.py's `sample:` lines are; a text
prompt is continued as is (continued pretraining).

transformers' `generate` samples, with its key/value cache (model.py's `complete`).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn

from model import ModelError, complete, load_tokenizer, not_found, respond
from runtime import config, dist


@dataclass
class Config:
    run: str = ""  # runs/NAME: the model its end wrote to runs/NAME/hf
    model: str = ""  # else: a folder written by save_pretrained, or a hub id
    base: str = ""  # a LoRA adapter's base model; "": the one its adapter names
    prompt: str = "What is a list in Python?"
    # chat: a user message, answered; text: continued as is; auto: as the run trained
    # (its data_format), else chat where the tokenizer has a chat template
    prompt_format: Literal["auto", "chat", "text"] = "auto"
    num_samples: int = 1
    max_new_tokens: int = 100
    temperature: float = 0.8  # 0: always the most likely token
    top_k: int = 200  # draw among the k most likely tokens; 0: among all
    seed: int = 0
    device: str = "auto"  # auto: the GPU where there is one, else the CPU


def load(cfg: Config) -> tuple[nn.Module, object, str, str]:
    """The model, its tokenizer, the prompt format and where they came from."""
    folder = Path(cfg.run) / "hf" if cfg.run else Path(cfg.model)
    trained = Path(cfg.run) / "config.toml"
    if cfg.run and not trained.is_file():
        raise ValueError(
            f"{cfg.run} is not a run folder (no config.toml); pass --run=runs/NAME"
        )
    if cfg.run and not folder.is_dir():
        raise ValueError(
            f"{folder} does not exist: train.py writes it when the run ends; "
            "finish the run (resume it with the same --run_name)"
        )
    name = str(folder) if folder.exists() else cfg.model  # a hub id
    tokenizer = load_tokenizer(name, [])
    adapter = folder / "adapter_config.json"
    if adapter.is_file():
        import peft  # a LoRA adapter: pip install 'scaffold[lora]'

        base = cfg.base or json.loads(adapter.read_text()).get(
            "base_model_name_or_path"
        )
        if not base:
            raise ValueError(
                f"{folder} is a LoRA adapter whose base model has no name (tiny "
                "is random and rebuilt only by train.py); pass --base=FOLDER, or "
                "train with --lora_export=merged"
            )
        model = peft.PeftModel.from_pretrained(loaded(base), folder)
    else:
        model = loaded(name)
    prompt_format = cfg.prompt_format
    if prompt_format == "auto" and cfg.run:
        prompt_format = tomllib.loads(trained.read_text())["data_format"]
    if prompt_format == "auto":
        prompt_format = "chat" if tokenizer.chat_template else "text"
    if prompt_format == "chat" and not tokenizer.chat_template:
        raise ValueError(
            f"{name}'s tokenizer has no chat template; pass --prompt_format=text"
        )
    return model.eval(), tokenizer, prompt_format, name


def loaded(name: str) -> nn.Module:
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ModelError(not_found(name, "model", error)) from None


def main() -> None:
    cfg = config.parse(Config)
    if not (cfg.run or cfg.model):
        config.fail("nothing to sample from; pass --run=runs/NAME or --model=FOLDER")
    if cfg.model == "tiny":
        config.fail("--model=tiny is random; sample from a run of it: --run=runs/NAME")
    if not cfg.prompt:
        config.fail("prompt is empty; pass --prompt with at least one token of text")
    env = dist.environment(cfg.device)
    with config.failing(OSError, ValueError, KeyError):
        model, tokenizer, prompt_format, source = load(cfg)
    model = model.to(env.device)
    print(f"sampling from {source} ({prompt_format} prompt)")
    torch.manual_seed(cfg.seed)
    args = (cfg.max_new_tokens, cfg.temperature, cfg.top_k)
    for _ in range(cfg.num_samples):
        if prompt_format == "chat":
            messages = [{"role": "user", "content": cfg.prompt}]
            print(respond(model, tokenizer, messages, *args))
        else:
            start = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
            ids = start + tokenizer(cfg.prompt, add_special_tokens=False).input_ids
            print(cfg.prompt + complete(model, tokenizer, ids, *args))
        print("---------------")


if __name__ == "__main__":
    main()
