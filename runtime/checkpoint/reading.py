"""Reading DCP checkpoints without pickle's risks, and naming what is wrong with a damaged one.

Stock DCP unpickles in two places, and both are replaced here: the `.metadata` file is read
with an unpickler that admits only DCP's metadata classes (plus torch.Size, dtypes, paths),
and non-tensor entries (the optimizer's hyperparameters) are read with
`torch.load(weights_only=True)`. Tensors DCP already reads with `weights_only=True`.
"""

from __future__ import annotations

import io
import pickle
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    Metadata,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from runtime import dist
from runtime.checkpoint.layout import METADATA, CheckpointError, damaged

# What a DCP `.metadata` pickle legitimately refers to (torch 2.6 - 2.13).
_METADATA_MODULES = ("torch.distributed.checkpoint.metadata",)
_METADATA_GLOBALS = frozenset(
    {
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
)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = module in _METADATA_MODULES or (module, name) in _METADATA_GLOBALS
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout)
        ):
            allowed = True  # torch.float32, torch.strided, ...
        if not allowed:
            raise pickle.UnpicklingError(
                f"{module}.{name} is not allowed in checkpoint metadata"
            )
        return super().find_class(module, name)


class Unreadable(RuntimeError):
    """A shard file DCP could not read (names the file and why)."""


class SafeReader(dcp.FileSystemReader):
    """DCP's file reader, except that `.metadata` may name only DCP's own metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(
                f"{path} holds a {type(metadata).__name__}, not DCP metadata"
            )
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self._reading = (
            sinfo.relative_path
        )  # named in the error if this item is unreadable
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: Any, planner: Any) -> Future[None]:
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except Exception as error:
            if self._reading is None:
                raise
            file = Path(self.path) / self._reading
            if isinstance(
                error, pickle.UnpicklingError
            ):  # torch.load(weights_only=True) refused
                why = "it holds a pickled object that is not plain data; refused, not executed"
            else:
                first = (str(error).splitlines() or [""])[0]
                why = f"{type(error).__name__}: {first[:200]}"
            raise Unreadable(f"{file} is unreadable ({why})") from error


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that non-tensor entries are read with weights_only=True."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(
                self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj
            )
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read_metadata(path: Path) -> Metadata:
    """A checkpoint's DCP metadata, read safely; CheckpointError if missing or damaged."""
    try:
        return SafeReader(path).read_metadata()
    except Exception as error:  # missing, truncated, or naming a forbidden class
        raise damaged(
            path, f"cannot read {path / METADATA} ({type(error).__name__}: {error})"
        ) from error


def check_files(path: Path, metadata: Metadata) -> None:
    """Every shard file exists and is as long as the metadata says (names a truncated file)."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise damaged(path, f"{file} is missing")
        actual = file.stat().st_size
        if actual < size:
            raise damaged(
                path,
                f"{file} is truncated ({actual:,} bytes; the metadata needs {size:,})",
            )


def check_written(path: Path) -> None:
    """Every item the metadata lists was written: DCP drops a failed extra writer thread's files
    from the metadata without an error (torch 2.13), and such a save must not be marked complete.
    """
    metadata = read_metadata(path)
    written = {
        (index.fqn, None if index.offset is None else tuple(index.offset))
        for index in metadata.storage_data
    }

    def items(fqn: str, meta: Any) -> list[tuple]:
        if isinstance(
            meta, TensorStorageMetadata
        ):  # one item per non-empty chunk (shard)
            return [
                (fqn, tuple(chunk.offsets))
                for chunk in meta.chunks
                if chunk.sizes.numel()
            ]
        return [(fqn, None)]

    lost = [
        fqn
        for fqn, meta in metadata.state_dict_metadata.items()
        if any(item not in written for item in items(fqn, meta))
    ]
    if lost:
        raise CheckpointError(
            f"{path}: {len(lost)} items were not written (first: {lost[0]}); "
            "a writer failed: check the disk (space, permissions)"
        )


def describe(error: BaseException) -> str:
    """One line per failed rank: DCP's str() is a full traceback per rank."""

    def one(exc: BaseException) -> str:
        return (
            f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        )  # bare EOFError

    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return "; ".join(
            f"rank {rank}: {one(exc)}" for rank, (exc, _) in failures.items()
        )
    return one(error)


def _unreadable(error: BaseException) -> Unreadable | None:
    """The `Unreadable` behind DCP's error (its per-rank failures, or the chain)."""
    failures = getattr(error, "failures", None)
    found = [exc for exc, _ in failures.values()] if isinstance(failures, dict) else []
    seen: BaseException | None = error
    while seen is not None:
        found.append(seen)
        seen = seen.__cause__ or seen.__context__
    return next((exc for exc in found if isinstance(exc, Unreadable)), None)


def load(
    state: dict[str, Any], path: Path, hint: str = "", no_dist: bool | None = None
) -> None:
    """DCP's load into `state` (in place), read safely; a failure is a CheckpointError + `hint`."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                state,
                storage_reader=SafeReader(path),
                planner=SafeLoadPlanner(),
                no_dist=not dist.is_distributed() if no_dist is None else no_dist,
            )
    except (
        BaseException
    ) as error:  # DCP's CheckpointException derives from BaseException
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        unreadable = _unreadable(error)
        if unreadable is not None:
            raise damaged(path, str(unreadable)) from error
        raise CheckpointError(
            f"cannot load {path}: {describe(error)[:2000]}{hint}"
        ) from error
