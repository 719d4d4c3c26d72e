"""Checkpoints on disk. `<folder>/step-<N>/` holds DCP shards of the state entries with
tensors, each rank's `rng-rank<R>.pt`, rank 0's `train_state.json` (progress, world
size, the `load_path` the run started from, the entry `scaffold export` writes out, and
the state dicts of the other entries: see `contents`) and, written last by rank 0 after
every rank finished, the marker `COMPLETE`.
A folder without the marker is an interrupted save: it is never loaded and is deleted on the
next start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from runtime import dist
from runtime.time import Progress

MARKER = "COMPLETE"
TRAIN_STATE = "train_state.json"
METADATA = ".metadata"
STEP_DIR = re.compile(r"step-(\d+)")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the folder or file and what to do."""


class Damaged(CheckpointError):
    """A complete checkpoint whose files are unreadable: `what` says which and why. A run
    that resumes on its own falls back to the previous complete checkpoint (and says so);
    one told to load this checkpoint stops with this message."""

    def __init__(self, path: Path, what: str) -> None:
        super().__init__(
            f"{what}; the checkpoint is damaged: pass an earlier step-<N> folder as "
            f"load_path, or delete {path}"
        )
        self.what = what


def damaged(path: Path, what: str) -> Damaged:
    return Damaged(path, what)


def step_dirs(folder: Path) -> list[tuple[int, Path]]:
    if not folder.is_dir():
        return []
    found = ((STEP_DIR.fullmatch(p.name), p) for p in folder.iterdir() if p.is_dir())
    return sorted((int(match.group(1)), path) for match, path in found if match)


def is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def latest(folder: Path) -> Path | None:
    """The newest complete checkpoint under `folder`, or None."""
    complete = complete_newest_first(folder)
    return complete[0] if complete else None


def complete_newest_first(folder: Path) -> list[Path]:
    return [path for _, path in reversed(step_dirs(folder)) if is_complete(path)]


def remove(path: Path) -> None:
    """Delete a checkpoint, the marker first (a kill mid-delete leaves it incomplete)."""
    (path / MARKER).unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def remove_incomplete(folder: Path) -> list[Path]:
    """Delete interrupted saves (no marker). Rank 0 only; call before training starts."""
    removed = []
    if dist.rank() == 0:
        for _, path in step_dirs(folder):
            if not is_complete(path):
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
    dist.barrier()
    return removed


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def mark_complete(path: Path, step: int) -> None:
    write_atomic(path / MARKER, f"step {step}\n")


def rotate(folder: Path, keep: int, current: Path) -> None:
    """Keep the newest `keep` complete checkpoints (0: all), and `current` (just written)."""
    if keep > 0:
        # Count complete checkpoints only: an interrupted save must not push a good one out.
        complete = [old for _, old in step_dirs(folder) if is_complete(old)]
        for old in (old for old in complete[:-keep] if old != current):
            remove(old)


def read_train_state(
    path: Path, batches_per_epoch: int | None = None
) -> dict[str, Any]:
    """train_state.json, checked before anything is restored (so a bad file changes nothing)."""
    file = path / TRAIN_STATE
    try:
        state = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise damaged(path, f"{file} is unreadable ({error})") from error
    if not (
        isinstance(state, dict)
        and isinstance(state.get("progress"), dict)
        and isinstance(state.get("world_size"), int)
    ):
        raise damaged(path, f"{file} lacks progress or world_size")
    try:
        # A scratch Progress validates every counter (and batches_per_epoch against this run).
        saved = state["progress"]
        Progress(
            batches_per_epoch=batches_per_epoch or saved.get("batches_per_epoch")
        ).load_state_dict(saved)
    except (ValueError, TypeError) as error:
        raise CheckpointError(f"{file}: {error}") from error
    return state


def resolve(path: Path | str) -> Path:
    """A checkpoint from a user's path: a step-<N> folder, or the newest complete one in a
    checkpoints folder or a run folder (`runs/<name>` holding `checkpoints/`)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(
            f"{path} does not exist; pass a step-<N> checkpoint folder, a "
            "checkpoints folder or a run folder"
        )
    if is_complete(path) or (path / METADATA).exists() or STEP_DIR.fullmatch(path.name):
        if not is_complete(path):
            raise CheckpointError(
                f"{path} is not a complete checkpoint (no {MARKER} marker): "
                "its save was interrupted"
            )
        return path
    for folder in (path, path / "checkpoints"):
        found = latest(folder)
        if found is not None:
            return found
    raise CheckpointError(
        f"{path} holds no complete checkpoint (no step-<N> folder with a "
        f"{MARKER} marker in it or in {path / 'checkpoints'})"
    )
