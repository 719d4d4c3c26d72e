"""Export for inference: a checkpoint's model weights as one safetensors file, no process group."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from runtime.checkpoint import layout, reading, storage
from runtime.checkpoint.layout import CheckpointError


def read_weights(
    source: Path | str, entry: str = ""
) -> tuple[dict[str, torch.Tensor], int, Path | str, str]:
    """A checkpoint's full weights of one state entry (keys without the entry's prefix), its
    step, the checkpoint it read (a local folder, or the URL of a remote one) and the entry.

    `source` is a step-<N> folder, or a run or checkpoints folder (its newest complete
    checkpoint), local or at an fsspec URL (downloaded to a temporary folder). Shards saved
    on any number of ranks are assembled into full tensors, without a process group.
    `entry` is the module entry of the loop's `state`; "" takes the one the run recorded in
    train_state.json (`Checkpointer(export=...)`: e.g. averaged weights), else "model".
    """
    if storage.is_remote(source):
        remote = storage.Remote(str(source))
        try:
            found = remote.resolve(remote.root)
            with tempfile.TemporaryDirectory(prefix="scaffold-export-") as scratch:
                local = remote.download(found, Path(scratch))
                weights, step, entry = _read(local, entry)
                return weights, step, remote.display(found), entry
        except CheckpointError:
            raise
        except Exception as error:  # noqa: BLE001 - unreachable or refusing store
            from runtime.checkpoint.failures import cause

            raise CheckpointError(f"cannot read {remote}: {cause(error)}") from error
    path = layout.resolve(storage.local_path(source))
    weights, step, entry = _read(path, entry)
    return weights, step, path, entry


def export_safetensors(
    source: Path | str, out_file: Path | str, entry: str = ""
) -> dict[str, Any]:
    """Consolidate a checkpoint's weights of one state entry (see `read_weights`) into one
    safetensors file.

    Tied weights (GPT-2's `lm_head.weight` is `wte.weight`) are saved under each name as
    separate copies, so `model.load_state_dict(safetensors.torch.load_file(out))` works
    unchanged (and re-ties them: both names load into the one shared parameter). The file's
    metadata records the source checkpoint and its step. Returns a summary dict.
    """
    from safetensors.torch import save_file

    weights, step, checkpoint, entry = read_weights(source, entry)
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        str(tmp),
        metadata={"checkpoint": str(checkpoint), "step": str(step), "format": "pt"},
    )
    os.replace(tmp, out)
    return {
        "checkpoint": checkpoint,
        "step": step,
        "entry": entry,
        "tensors": len(weights),
        "numel": sum(v.numel() for v in weights.values()),
        "file": out,
    }


def _read(path: Path, entry: str) -> tuple[dict[str, torch.Tensor], int, str]:
    metadata = reading.read_metadata(path)
    reading.check_files(path, metadata)
    train_state = layout.read_train_state(path)
    entry = entry or str(train_state.get("export", "model"))
    weights = {
        key.removeprefix(f"{entry}."): torch.empty(
            tuple(meta.size), dtype=meta.properties.dtype
        )
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(f"{entry}.") and isinstance(meta, TensorStorageMetadata)
    }
    if not weights:
        raise CheckpointError(f"{path} holds no weights of state entry '{entry}'")
    reading.load({entry: weights}, path, no_dist=True)
    return weights, int(train_state["progress"]["batch"]), entry
