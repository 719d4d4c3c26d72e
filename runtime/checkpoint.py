"""Checkpoints with torch.distributed.checkpoint (DCP): world-size independent, complete or absent.

Layout: `<folder>/step-<N>/` holds DCP shards of the model and optimizer state dicts (saved
through `get_state_dict`, so they do not depend on the world size or the sharding), a JSON
`train_state.json` (progress, extras), one `rng-rank<R>.pt` per rank (tensors only), and, written
last by rank 0 after every rank finished, the marker `COMPLETE`. A folder without the marker is
an interrupted save: it is never loaded and is deleted on the next start.

    checkpoint.resume(folder, model, optimizer, progress, load_path=..., seed=...)  # one call
    checkpoint.save(folder, model, optimizer, progress, keep=2, async_save=False)
    checkpoint.wait()  # an asynchronous save in flight: finished and marked complete
    checkpoint.export_safetensors(run_or_checkpoint, "model.safetensors")  # no process group

Loading never unpickles arbitrary objects. Stock DCP does in two places, and both are replaced
here: the `.metadata` file is read with an unpickler that admits only DCP's metadata classes
(plus torch.Size, dtypes, paths), and non-tensor entries (the optimizer's hyperparameters) are
read with `torch.load(weights_only=True)`. Tensors DCP already reads with `weights_only=True`;
JSON is JSON; the RNG files are read with `torch.load(weights_only=True)`.

Asynchronous save (`async_save=True`): the state is copied to CPU memory (DCP's stager makes
real copies, so training may change the parameters at once), then written by a background
thread that talks over its own gloo process group (the training group must not carry
collectives from two threads). DCP's coordinator (rank 0) finishes a save only after it has
gathered every rank's write results, so rank 0 writes the marker when its save finishes:
the marker never precedes any rank's data. The next `save()` and `wait()` wait for it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import threading
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from runtime.time import Progress

MARKER = "COMPLETE"
TRAIN_STATE = "train_state.json"
METADATA = ".metadata"
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


# ---------------------------------------------------------------- reading without pickle's risks

# What a DCP `.metadata` pickle legitimately refers to (torch 2.6 - 2.13).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            allowed = True  # torch.float32, torch.strided, ...
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, except that `.metadata` may name only DCP's own metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self._reading = sinfo.relative_path  # named in the error if this item is unreadable
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except Exception as error:
            if self._reading is None:
                raise
            file = Path(self.path) / self._reading
            if isinstance(error, pickle.UnpicklingError):  # torch.load(weights_only=True) refused
                why = "it holds a pickled object that is not plain data; refused, not executed"
            else:
                first = (str(error).splitlines() or [""])[0]
                why = f"{type(error).__name__}: {first[:200]}"
            raise RuntimeError(f"{file} is unreadable ({why})") from error


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that non-tensor entries are read with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(path: Path) -> Metadata:
    """A checkpoint's DCP metadata, read safely; CheckpointError if missing or damaged."""
    try:
        return SafeReader(path).read_metadata()
    except Exception as error:  # missing, truncated, or naming a forbidden class
        raise _damaged(path, f"cannot read {path / METADATA} ({type(error).__name__}: {error})") from error


def _check_files(path: Path, metadata: Metadata) -> None:
    """Every shard file exists and is as long as the metadata says (names a truncated file)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise _damaged(path, f"{file} is missing")
        actual = file.stat().st_size
        if actual < size:
            raise _damaged(path, f"{file} is truncated ({actual:,} bytes; the metadata needs {size:,})")


def _dcp_load(state: dict[str, Any], path: Path) -> None:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(
            state,
            storage_reader=SafeReader(path),
            planner=SafeLoadPlanner(),
            no_dist=not torch_dist.is_initialized(),
        )


# ---------------------------------------------------------------- save


@dataclass
class _Pending:
    """An asynchronous save in flight."""

    path: Path
    future: Future
    finisher: threading.Thread | None = None  # rank 0: marks complete, rotates
    errors: list[BaseException] = field(default_factory=list)


_pending: _Pending | None = None
_async_group: tuple[Any, Any] | None = None  # (the default group it was made for, the group)
_origin: str | None = None  # the load_path this run started from, carried into its checkpoints


def _writer(path: Path) -> dcp.FileSystemWriter:
    """DCP's file writer with two writer threads per rank: on this project's 2-core test
    machine that cut a 1.1 GB save from 0.97 s to 0.59 s (torch.save: 1.01 s), disk-bound
    either way. Files are fsynced (DCP's default) so the marker never outlives its data."""
    return dcp.FileSystemWriter(path, thread_count=2)


def _save_group() -> Any:
    """The gloo group asynchronous saves talk over: made once (collectively) per process group."""
    global _async_group
    if not torch_dist.is_initialized():
        return None
    default = torch_dist.distributed_c10d._get_default_group()
    if _async_group is None or _async_group[0] is not default:
        _async_group = (default, torch_dist.new_group(backend="gloo"))
    return _async_group[1]


def _finish(folder: Path, path: Path, step: int, keep: int) -> None:
    """Rank 0, after every rank's data is on disk: the marker, then rotation."""
    _write_atomic(path / MARKER, f"step {step}\n")
    if keep > 0:
        # Count complete checkpoints only: an interrupted save must not push a good one out.
        complete = [old for _, old in _step_dirs(folder) if is_complete(old)]
        for old in complete[:-keep]:
            if old != path:
                (old / MARKER).unlink(missing_ok=True)  # a kill mid-delete leaves it incomplete
                shutil.rmtree(old, ignore_errors=True)


def _optimizers(optimizer: Any) -> Any:
    """The optimizer, or the list a `runtime.muon.Chain` holds (DCP keys each one's state by
    parameter name, so several optimizers share one checkpoint)."""
    return getattr(optimizer, "optimizers", optimizer)


def save(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    extra: dict[str, Any] | None = None,
    keep: int = 0,
    async_save: bool = False,
) -> Path:
    """Save `step-<progress.batch>` under `folder` on every rank; mark it complete; keep the newest `keep` (0: all).

    With `async_save`, return once the state is copied; the write, the marker and the rotation
    happen in the background (the next `save()` or `wait()` waits for them).
    """
    global _pending
    wait()
    path = folder / f"step-{progress.batch}"
    if is_complete(path):
        return path  # e.g. the final save landing on a save_interval step
    model_state, optimizer_state = get_state_dict(model, _optimizers(optimizer))
    state = {"model": model_state, "optimizer": optimizer_state}
    path.mkdir(parents=True, exist_ok=True)
    # Each rank's RNG file and rank 0's JSON are written before the rank joins DCP's
    # collectives, which the marker waits for: so they, too, precede the marker.
    torch.save(_rng_state(), path / f"rng-rank{_rank()}.pt")
    if _rank() == 0:
        train_state = {
            "progress": progress.state_dict(),
            "world_size": _world_size(),
            "extra": extra or {},
            "origin": _origin,
        }
        _write_atomic(path / TRAIN_STATE, json.dumps(train_state, indent=2))
    no_dist = not torch_dist.is_initialized()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        if async_save:
            future = dcp.async_save(state, storage_writer=_writer(path),
                                    process_group=_save_group(), no_dist=no_dist)
            _pending = _Pending(path, future)
            if _rank() == 0:
                pending = _pending

                def finish_when_written() -> None:
                    try:
                        pending.future.result()  # every rank's data is written (DCP's gather)
                        _finish(folder, path, progress.batch, keep)
                    except BaseException as error:  # noqa: BLE001 - DCP's error is a BaseException
                        pending.errors.append(error)

                pending.finisher = threading.Thread(target=finish_when_written, name="checkpoint-finish")
                pending.finisher.start()
            return path
        dcp.save(state, storage_writer=_writer(path), no_dist=no_dist)
    _barrier()  # every rank's shards are on disk before the marker
    if _rank() == 0:
        _finish(folder, path, progress.batch, keep)
    _barrier()
    return path


def wait() -> None:
    """Wait for an asynchronous save in flight to be written and marked complete (all ranks)."""
    global _pending
    if _pending is None:
        return
    pending, _pending = _pending, None
    errors = list(pending.errors)
    try:
        pending.future.result()
    except BaseException as error:  # noqa: BLE001
        errors.append(error)
    if pending.finisher is not None:
        pending.finisher.join()
        errors += pending.errors
    failed = torch.tensor([1.0 if errors else 0.0])
    if torch_dist.is_initialized():  # also a barrier: the marker is there for everyone
        torch_dist.all_reduce(failed, op=torch_dist.ReduceOp.MAX, group=_save_group())
    if failed.item():
        what = _describe(errors[0]) if errors else "failed on another rank"
        raise CheckpointError(f"asynchronous save of {pending.path} failed: {what[:2000]}")


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


def _check_model_keys(path: Path, metadata: Metadata, model_state: dict[str, Any]) -> None:
    """Name every key and shape that differs; DCP reports only the first, and not unexpected keys."""
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
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore a checkpoint saved on any world size into `model` (and `optimizer`, `progress`).

    RNG states come back exactly when the world size matches; otherwise each rank's generator
    is re-seeded from (seed, step, rank), deterministically. Returns the saved `extra` dict
    plus `rng_restored` (bool) and `world_size` (the saver's). Everything is checked before
    anything is restored, and nothing on disk is changed.
    """
    if not path.is_dir():
        raise CheckpointError(f"{path} does not exist")
    if not is_complete(path):
        raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker); "
                              "pass a step-<N> folder written by a finished save")
    train_state = _read_train_state(path, progress.batches_per_epoch if progress is not None else None)
    if optimizer is not None:
        model_state, optimizer_state = get_state_dict(model, _optimizers(optimizer))
        state: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    else:
        state = {"model": get_model_state_dict(model)}
    metadata = read_metadata(path)
    _check_model_keys(path, metadata, state["model"])
    _check_files(path, metadata)
    try:
        _dcp_load(state, path)
    except BaseException as error:  # DCP's CheckpointException derives from BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        # Not necessarily damage (another optimizer's state also fails here), so only a hint.
        raise CheckpointError(f"cannot load {path}: {_describe(error)[:2000]}; if its files are damaged, "
                              "delete it to resume from the previous complete checkpoint") from error
    if optimizer is not None:
        set_state_dict(model, _optimizers(optimizer), model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])
    else:
        set_model_state_dict(model, state["model"])
    if progress is not None:
        progress.load_state_dict(train_state["progress"])
    rng_file = path / f"rng-rank{_rank()}.pt"
    rng_restored = restore_rng and train_state["world_size"] == _world_size() and rng_file.is_file()
    if rng_restored:
        rng = torch.load(rng_file, weights_only=True)
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    elif restore_rng:
        step = train_state["progress"]["batch"]
        digest = hashlib.sha256(f"{seed}/{step}/{_rank()}".encode()).digest()
        torch.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return {**train_state["extra"], "rng_restored": rng_restored, "world_size": train_state["world_size"]}


# ---------------------------------------------------------------- resume


def resolve(path: Path | str) -> Path:
    """A checkpoint from a user's path: a step-<N> folder, or the newest complete one in a
    checkpoints folder or a run folder (`runs/<name>` holding `checkpoints/`)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; pass a step-<N> checkpoint folder, a "
                              "checkpoints folder or a run folder")
    if is_complete(path) or (path / METADATA).exists() or _STEP_DIR.fullmatch(path.name):
        if not is_complete(path):
            raise CheckpointError(f"{path} is not a complete checkpoint (no {MARKER} marker): "
                                  "its save was interrupted")
        return path
    for folder in (path, path / "checkpoints"):
        found = latest(folder)
        if found is not None:
            return found
    raise CheckpointError(f"{path} holds no complete checkpoint (no step-<N> folder with a "
                          f"{MARKER} marker in it or in {path / 'checkpoints'})")


@dataclass
class Resumed:
    """What `resume()` loaded, and the lines that say so in the log."""

    path: Path
    step: int
    weights_only: bool
    rng_restored: bool
    saved_world_size: int
    extra: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def describe(self) -> list[str]:
        if self.weights_only:
            first = f"loaded model weights from {self.path} (fresh optimizer, progress from step 0)"
        else:
            first = f"resumed from {self.path} at step {self.step}"
            if self.saved_world_size != _world_size():
                first += f" (saved on {self.saved_world_size} rank(s), now {_world_size()})"
            if not self.rng_restored:
                first += "; RNG re-seeded from (seed, step, rank)"
        return [*self.notes, first]


def resume(
    folder: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: Progress,
    *,
    load_path: str = "",
    weights_only: bool = False,
    autoresume: bool = True,
    seed: int = 0,
) -> Resumed | None:
    """Start or continue a run: clean up interrupted saves, then load what the run starts from.

    - `load_path` (a checkpoint, a checkpoints folder or a run folder) is where a run starts:
      it is loaded in preference to this run's own checkpoints, except when those were
      written by this very run after it started from the same `load_path` (a restart after a
      preemption continues the run instead of starting it over).
    - otherwise, with `autoresume`, the newest complete checkpoint in `folder`.
    - `weights_only`: model weights only (a fine-tune): the optimizer and progress stay fresh
      and the RNG is left as seeded.
    Returns None for a fresh start. Raises CheckpointError (nothing on disk is changed).
    """
    global _origin
    remove_incomplete(folder)
    own = latest(folder) if autoresume else None
    notes = []
    if load_path:
        origin = str(Path(load_path).resolve())
        explicit = resolve(load_path)
        if own is not None and _read_train_state(own, None).get("origin") == origin:
            notes.append(f"load_path {load_path}: continuing this run from its own checkpoint")
        else:
            if own is not None:
                notes.append(f"load_path {load_path} takes precedence over this run's {own}")
            _origin = origin
            return _load_into(explicit, model, optimizer, progress, weights_only, seed, notes)
    if own is None:
        return None
    _origin = _read_train_state(own, None).get("origin")
    return _load_into(own, model, optimizer, progress, False, seed, notes)


def _load_into(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               progress: Progress, weights_only: bool, seed: int, notes: list[str]) -> Resumed:
    if weights_only:
        extra = load(path, model, None, None, seed=seed, restore_rng=False)
    else:
        extra = load(path, model, optimizer, progress, seed=seed)
    rng_restored, world_size = extra.pop("rng_restored"), extra.pop("world_size")
    step = int(_read_train_state(path, None)["progress"]["batch"])
    return Resumed(path, step, weights_only, rng_restored, world_size, extra, notes)


# ---------------------------------------------------------------- export


def export_safetensors(source: Path | str, out_file: Path | str) -> dict[str, Any]:
    """Consolidate a checkpoint's model weights into one safetensors file, without a process group.

    `source` is a step-<N> folder, or a run or checkpoints folder (its newest complete
    checkpoint). Shards saved on any number of ranks are assembled into full tensors. Tied
    weights (GPT-2's `lm_head.weight` is `wte.weight`) are saved under each name as separate
    copies, so `model.load_state_dict(safetensors.torch.load_file(out))` works unchanged
    (and re-ties them: both names load into the one shared parameter). The file's metadata
    records the source checkpoint and its step. Returns a summary dict.
    """
    from safetensors.torch import save_file

    path = resolve(source)
    metadata = read_metadata(path)
    _check_files(path, metadata)
    weights = {
        key.removeprefix("model."): torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    if not weights:
        raise CheckpointError(f"{path} holds no model weights")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": weights}, storage_reader=SafeReader(path), planner=SafeLoadPlanner(),
                     no_dist=True)
    except BaseException as error:
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        raise CheckpointError(f"cannot read {path}: {_describe(error)[:2000]}") from error
    step = int(_read_train_state(path, None)["progress"]["batch"])
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp),
              metadata={"checkpoint": str(path), "step": str(step), "format": "pt"})
    os.replace(tmp, out)
    return {"checkpoint": path, "step": step, "tensors": len(weights),
            "numel": sum(v.numel() for v in weights.values()), "file": out}
