"""Hugging Face GPT-2 weights in and out: the plumbing around the project's own mapping.

    hf_config, hf_weights = hf.read_gpt2("gpt2")  # a hub id or a save_pretrained folder
    state = model.from_hf_gpt2(hf_config, hf_weights, config)  # model.py: names, transposes
    hf.export_gpt2("runs/NAME", "out/")  # config.json + model.safetensors for transformers

Which weight is which, and which are transposed (GPT-2's Conv1D), is the model's business and
lives in the generated model.py (`from_hf_gpt2`, `to_hf_gpt2`, generated only where the model
has GPT-2's layout), where a user who changes the model changes it too. This module reads and
writes the files: it imports transformers only to read (the optional `hf` extra), and writes
without it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tomllib
from pathlib import Path
from typing import Any

import torch

from runtime import quiet
from runtime.checkpoint import export, storage
from runtime.checkpoint.layout import CheckpointError

INSTALL = "pip install 'scaffold[hf]'"


class HFError(ValueError):
    """The Hugging Face checkpoint cannot be read or written; the message says why."""


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def _transformers() -> Any:
    quiet.torchao_import_warnings()  # before transformers brings torchao in
    try:
        import transformers
    except ModuleNotFoundError:
        raise HFError(
            f"reading Hugging Face weights needs transformers: {INSTALL}"
        ) from None
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def _gpt2_config(transformers: Any, source: str) -> Any:
    try:
        config = transformers.AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as error:
        raise HFError(f"no Hugging Face model there ({_first_line(error)})") from None
    if config.model_type != "gpt2":
        raise HFError(f"a {config.model_type} model, not GPT-2 (GPT2LMHeadModel)")
    return config


def gpt2_vocab_size(source: str, missing_ok: bool = False) -> int:
    """The vocabulary size of a GPT-2 checkpoint (its config only; 50257 for GPT-2's);
    `missing_ok`: 0 where there is no GPT-2 model to read."""
    try:
        return int(_gpt2_config(_transformers(), source).vocab_size)
    except HFError:
        if missing_ok:
            return 0
        raise


def read_gpt2(source: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """GPT2LMHeadModel's config (a dict) and fp32 CPU weights, through transformers'
    `from_pretrained` (a hub id, or a folder written by `save_pretrained`)."""
    transformers = _transformers()
    config = _gpt2_config(transformers, source)
    try:
        model = transformers.GPT2LMHeadModel.from_pretrained(
            source
        )  # converted to fp32 by model.py
    except (OSError, ValueError, RuntimeError) as error:
        raise HFError(_first_line(error)) from None
    weights = {
        name: tensor.detach().cpu() for name, tensor in model.state_dict().items()
    }
    return config.to_dict(), weights


def write_gpt2(
    out_dir: Path | str,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    metadata: dict[str, str],
) -> Path:
    """config.json and model.safetensors in `out_dir`, as GPT2LMHeadModel.save_pretrained
    would write them (each file replaced atomically)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        str(tmp),
        metadata={**metadata, "format": "pt"},
    )
    os.replace(tmp, out / "model.safetensors")
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.replace(tmp, out / "config.json")
    return out


def export_gpt2(
    source: Path | str,
    out_dir: Path | str,
    *,
    run_config: Path | str | None = None,
    project: Path | str | None = None,
) -> dict[str, Any]:
    """Write a checkpoint of a causal_lm project as a Hugging Face GPT-2 folder.

    `source`: a run folder, its checkpoints folder or a step-<N> checkpoint, local or a URL.
    `run_config`: the run's config.toml (default: found beside a local `source`). `project`:
    the folder holding the model.py that trained it (default: the one holding runs/<name>/).
    Raises CheckpointError (one line) for a model GPT-2's layout cannot hold.
    """
    config_file = Path(run_config) if run_config else _find_run_config(source)
    try:
        run = tomllib.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(
            f"cannot read the run's config {config_file}: {error}"
        ) from None
    folder = Path(project) if project else config_file.resolve().parent.parent.parent
    if not project and not (folder / "model.py").is_file():
        folder = Path.cwd()  # runs/ written away from the project: run from the project
    model = _import_model(folder / "model.py")
    if hasattr(model, "EncoderConfig"):  # a masked_lm project's BERT encoder
        return export_bert(model, source, out_dir, run, config_file)
    changes = getattr(
        model, "HF_LAYOUT_CHANGES", {}
    )  # older projects: the mapping, and why not
    if changes:
        reasons = "; ".join(f"{name}: {why}" for name, why in changes.items())
        raise CheckpointError(
            f"GPT2LMHeadModel cannot hold this model ({reasons}); "
            "export it with --format safetensors"
        )
    if hasattr(model, "training_bytes"):  # llm_finetune: any transformers causal LM
        raise CheckpointError(
            "an llm_finetune run writes its Hugging Face folder itself (runs/NAME/hf, "
            "when it finishes); for this checkpoint run `python train.py --config "
            "runs/NAME/config.toml --run_name=NEW --load_path=CHECKPOINT "
            "--max_duration=STEPba` (its step), which writes runs/NEW/hf (README: Export)"
        )
    if not hasattr(model, "to_hf_gpt2"):
        if hasattr(model, "GPTConfig"):  # a GPT whose algorithms changed GPT-2's layout
            raise CheckpointError(
                f"GPT2LMHeadModel cannot hold this model: its algorithms change GPT-2's "
                f"layout (the docstring of {folder / 'model.py'} says how), so it has no "
                "Hugging Face GPT-2 mapping; export it with --format safetensors"
            )
        raise CheckpointError(
            f"{folder / 'model.py'} has no Hugging Face GPT-2 mapping "
            "(to_hf_gpt2); --format hf exports causal_lm GPT projects"
        )
    if run.get("model") not in model.PRESETS:
        raise CheckpointError(
            f"{config_file}: model={run.get('model')!r} is not a preset of {folder / 'model.py'}"
        )
    weights, step, checkpoint, _ = export.read_weights(source)
    sizes = model.PRESETS[run["model"]]
    gpt_config = model.GPTConfig(
        vocab_size=weights["wte.weight"].shape[0],
        max_seq_len=weights["wpe.weight"].shape[0],
        dropout=float(run.get("dropout", 0.0)),
        **sizes,
    )
    try:
        hf_config, hf_weights = model.to_hf_gpt2(weights, gpt_config)
    except KeyError as missing:
        raise CheckpointError(
            f"{checkpoint} has no weight {missing} of GPT-2's layout"
        ) from None
    out = write_gpt2(
        out_dir,
        hf_config,
        hf_weights,
        {"checkpoint": str(checkpoint), "step": str(step)},
    )
    return {
        "checkpoint": checkpoint,
        "step": step,
        "tensors": len(hf_weights),
        "numel": sum(v.numel() for v in hf_weights.values()),
        "folder": out,
    }


def export_bert(
    model: Any,
    source: Path | str,
    out_dir: Path | str,
    run: dict[str, Any],
    config_file: Path,
) -> dict[str, Any]:
    """A masked_lm checkpoint with the run's tokenizer (runs/<name>/tokenizer/): what a
    text_classification project loads with --model=FOLDER. BERT's layout: a Hugging Face
    BertForMaskedLM folder (`to_hf_bert`, transformers fine-tunes it); a layout of its
    own (algorithms changed BERT's): the encoder's weights as they are, with its sizes
    and the algorithms' LAYOUT in config.json (`to_encoder_export`), for a project of
    the bert pack."""
    convert = getattr(model, "to_hf_bert", None) or getattr(
        model, "to_encoder_export", None
    )
    if convert is None:  # projects before the bert pack wrote its own layout out
        raise CheckpointError(
            "BertForMaskedLM cannot hold this model: its algorithms change BERT's layout "
            "(the docstring of its model.py says how); export it with --format safetensors"
        )
    if run.get("model") not in model.PRESETS:
        raise CheckpointError(
            f"{config_file}: model={run.get('model')!r} is not a preset"
        )
    weights, step, checkpoint, _ = export.read_weights(source)
    tokenizer = config_file.parent / "tokenizer"
    if not (tokenizer / "tokenizer_config.json").is_file():
        raise CheckpointError(
            f"{tokenizer}: no saved tokenizer beside the run (a masked_lm run saves the "
            "one it trains with there); save that tokenizer there (save_pretrained), e.g. "
            "a copy of another run's with the same --data, --tokenizer and --vocab_size"
        )
    from transformers import AutoTokenizer

    pad_id = AutoTokenizer.from_pretrained(tokenizer).pad_token_id
    positions = weights.get("wpe.weight")  # none where ALiBi replaced the table
    encoder_config = model.EncoderConfig(
        vocab_size=weights["wte.weight"].shape[0],
        max_seq_len=int(run["seq_len"]) if positions is None else positions.shape[0],
        pad_id=pad_id,
        dropout=float(run.get("dropout", 0.0)),
        **model.PRESETS[run["model"]],
    )
    hf_config, hf_weights = convert(weights, encoder_config)
    metadata = {"checkpoint": str(checkpoint), "step": str(step)}
    out = write_gpt2(out_dir, hf_config, hf_weights, metadata)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return {
        "checkpoint": checkpoint,
        "step": step,
        "tensors": len(hf_weights),
        "numel": sum(v.numel() for v in hf_weights.values()),
        "folder": out,
    }


def _find_run_config(source: Path | str) -> Path:
    """runs/<name>/config.toml from a run folder, its checkpoints folder or a checkpoint."""
    if storage.is_remote(source):
        raise CheckpointError(
            f"{storage.redact(str(source))} is remote: pass the run's config.toml "
            "with --run-config (runs/<name>/config.toml where it trained)"
        )
    path = Path(source).resolve()
    for folder in (path, path.parent, path.parent.parent):
        if (folder / "config.toml").is_file():
            return folder / "config.toml"
    raise CheckpointError(
        f"no config.toml in {source} or above it: pass the run's config.toml with --run-config"
    )


def _import_model(path: Path) -> Any:
    """The project's model.py as a module (its folder on sys.path while it is imported)."""
    if not path.is_file():
        raise CheckpointError(
            f"{path} does not exist: pass the project folder with --project"
        )
    spec = importlib.util.spec_from_file_location("_scaffold_export_model", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop(spec.name, None)
    return module


def save_pretrained(
    model: torch.nn.Module, tokenizer: Any, folder: Path, merge: bool = False
) -> None:
    """Write a trained transformers model and its tokenizer as `save_pretrained` does:
    a folder `from_pretrained` (and servers that read the hub's format) load. A peft
    model writes its adapter (`PeftModel.from_pretrained(base, folder)` loads it), or with
    `merge` the model with the adapters merged into its weights (plain transformers).

    Call it on every rank: under FSDP2 each rank holds a shard, so the full weights are
    gathered (a collective) to rank 0's CPU, which writes; a DDP model is unwrapped.
    """
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )
    from torch.nn.parallel import DistributedDataParallel

    module = model.module if isinstance(model, DistributedDataParallel) else model
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(module, options=options)  # every rank takes part
    if not dist.is_initialized() or dist.get_rank() == 0:
        if merge:
            module = _merged(module, weights)
            weights = module.state_dict()
        module.save_pretrained(folder, state_dict=weights)
        tokenizer.save_pretrained(folder)
    if dist.is_initialized():
        dist.barrier()


def _merged(peft_model: Any, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A CPU copy of a peft model holding `weights` (its full state dict), its adapters
    merged into the weights they adapt (peft's merge_and_unload): a plain transformers
    model. Built anew because a sharded model's own parameters are shards."""
    import peft
    import transformers

    config = peft_model.get_base_model().config
    copy = transformers.AutoModelForCausalLM.from_config(config)
    copy = peft.get_peft_model(copy, peft_model.peft_config["default"])
    copy.load_state_dict(weights)
    return copy.merge_and_unload()
