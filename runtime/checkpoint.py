"""Checkpoints with torch.distributed.checkpoint (DCP): world-size independent, complete or absent.

Layout: `<folder>/step-<N>/` holds DCP shards of the model and optimizer state dicts (saved
through `get_state_dict`, so they do not depend on the world size or the sharding), a JSON
`train_state.json` (progress, extras), one `rng-rank<R>.pt` per rank (tensors only), and, written
last by rank 0 after every rank finished, the marker `COMPLETE`. A folder without the marker is
an interrupted save: it is never loaded and is deleted on the next start.

Loading never unpickles arbitrary objects: DCP reads tensors, JSON is JSON, and the RNG files
are read with `torch.load(weights_only=True)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from runtime.time import Progress

MARKER = "COMPLETE"
TRAIN_STATE = "train_state.json"
_STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the folder or file and what to do."""


def _rank() -> int:
    return torch_dist.get_rank() if torch_dist.is_initialized() else 0


def _world_size() -> int:
    return torch_dist.get_world_size() if torch_dist.is_initialized() else 1


def _barrier() -> None:
    if torch_dist.is_initialized():
        torch_dist.barrier()


def _step_dirs(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    found = ((_STEP_DIR.fullmatch(p.name), p) for p in folder.iterdir() if p.is_dir())
    return sorted((int(match.group(1)), path) for match, path in found if match)


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint under `folder`, or None."""
    complete = [path for _, path in _step_dirs(folder) if is_complete(path)]
    return complete[-1] if complete else None


def remove_incomplete(folder: Path) -> list[Path]:
    """Delete interrupted saves (no marker). Rank 0 only; call before training starts."""
    removed = []
    if _rank() == 0:
        for _, path in _step_dirs(folder):
            if not is_complete(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    _barrier()
    return removed


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    extra: dict[str, Any] | None = None,
    keep: int = 0,
) -> Path:
    """Save `step-<progress.batch>` under `folder` on every rank; mark it complete; keep the newest `keep` (0: all)."""
    path = folder / f"step-{progress.batch}"
    if is_complete(path):
        return path  # e.g. the final save landing on a save_interval step
    model_state, optimizer_state = get_state_dict(model, optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            {"model": model_state, "optimizer": optimizer_state},
            checkpoint_id=path,
            no_dist=not torch_dist.is_initialized(),
        )
    torch.save(_rng_state(), path / f"rng-rank{_rank()}.pt")
    if _rank() == 0:
        train_state = {
            "progress": progress.state_dict(),
            "world_size": _world_size(),
            "extra": extra or {},
        }
        _write_atomic(path / TRAIN_STATE, json.dumps(train_state, indent=2))
    _barrier()  # every rank's shards and RNG file are on disk before the marker
    if _rank() == 0:
        _write_atomic(path / MARKER, f"step {progress.batch}\n")
        if keep > 0:
            # Count complete checkpoints only: an interrupted save must not push a good one out.
            complete = [old for _, old in _step_dirs(folder) if is_complete(old)]
            for old in complete[:-keep]:
                if old != path:
                    shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return path


def _damaged(path: Path, what: str) -> CheckpointError:
    # Autoresume picks the newest complete checkpoint, so the way back is removing this one.
    return CheckpointError(f"{what}; the checkpoint is damaged: delete {path} to resume from "
                           "the previous complete checkpoint")


def _read_train_state(path: Path, batches_per_epoch: int | None) -> dict[str, Any]:
    """train_state.json, checked before anything is restored (so a bad file changes nothing)."""
    file = path / TRAIN_STATE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise _damaged(path, f"{file} is unreadable ({error})") from error
    if not (isinstance(state, dict) and isinstance(state.get("progress"), dict)
            and isinstance(state.get("world_size"), int) and isinstance(state.get("extra"), dict)):
        raise _damaged(path, f"{file} lacks progress, world_size or extra")
    try:
        # A scratch Progress validates every counter (and batches_per_epoch against this run).
        saved = state["progress"]
        Progress(batches_per_epoch=batches_per_epoch or saved.get("batches_per_epoch")).load_state_dict(saved)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{file}: {error}") from error
    return state


def _check_model_keys(path: Path, model_state: dict[str, Any]) -> None:
    """Name every key and shape that differs; DCP reports only the first, and not unexpected keys."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception as error:  # missing or truncated .metadata
        raise _damaged(path, f"cannot read {path / '.metadata'} ({type(error).__name__}: {error})") from error
    saved = {key.removeprefix("model."): meta for key, meta in metadata.state_dict_metadata.items()
             if key.startswith("model.")}
    problems = []
    for label, keys in (
        ("missing from the checkpoint", [key for key in model_state if key not in saved]),
        ("in the checkpoint but not in this model", [key for key in saved if key not in model_state]),
        ("different shapes", [
            f"{key} (saved {list(saved[key].size)}, model {list(value.shape)})"
            for key, value in model_state.items()
            if key in saved and isinstance(value, torch.Tensor) and hasattr(saved[key], "size")
            and tuple(saved[key].size) != tuple(value.shape)
        ]),
    ):
        if keys:
            more = f" and {len(keys) - 10} more" if len(keys) > 10 else ""
            problems.append(f"{label}: {', '.join(keys[:10])}{more}")
    if problems:
        raise CheckpointError(f"{path} was saved from a different model ({'; '.join(problems)}); "
                              "build the model with the configuration it was trained with")


def _describe(error: BaseException) -> str:
    # DCP's str() is a full traceback per rank; the exceptions themselves say what went wrong.
    def one(exc: BaseException) -> str:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__  # bare EOFError

    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(f"rank {rank}: {one(exc)}" for rank, (exc, _) in failures.items())
    return one(error)


def load(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    progress: Progress | None,
    seed: int = 0,
) -> dict[str, Any]:
    """Restore a checkpoint saved on any world size into `model` (and `optimizer`, `progress`).

    RNG states come back exactly when the world size matches; otherwise each rank's generator
    is re-seeded from (seed, step, rank), deterministically. Returns the saved `extra` dict
    plus `rng_restored` (bool).
    """
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker); "
                              "pass a step-<N> folder written by a finished save")
    train_state = _read_train_state(path, progress.batches_per_epoch if progress is not None else None)
    if optimizer is not None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    else:
        state = {"model": get_model_state_dict(model)}
    _check_model_keys(path, state["model"])
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=path, no_dist=not torch_dist.is_initialized())
    except BaseException as error:  # DCP's CheckpointException derives from BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        # Not necessarily damage (another optimizer's state also fails here), so only a hint.
        raise CheckpointError(f"cannot load {path}: {_describe(error)[:2000]}; if its files are damaged, "
                              "delete it to resume from the previous complete checkpoint") from error
    if optimizer is not None:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
    else:
        set_model_state_dict(model, state["model"])
    if progress is not None:
        progress.load_state_dict(train_state["progress"])
    rng_file = path / f"rng-rank{_rank()}.pt"
    rng_restored = train_state["world_size"] == _world_size() and rng_file.is_file()
    if rng_restored:
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    else:
        step = train_state["progress"]["batch"]
        digest = hashlib.sha256(f"{seed}/{step}/{_rank()}".encode()).digest()
        torch.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return {**train_state["extra"], "rng_restored": rng_restored}
