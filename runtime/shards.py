"""Streaming datasets: litdata or MDS shards in a local folder or at an object-store URL.

A streaming dataset is what litdata's `optimize` writes, one folder per split, plus a small
`meta.json` at the root that says what a model needs before it sees any sample (a
vocabulary size, class names):

    ROOT/meta.json
    ROOT/train/index.json, ROOT/train/chunk-*.bin
    ROOT/val/index.json,   ROOT/val/chunk-*.bin

ROOT is a local folder or a URL (`s3://bucket/data`, ...); litdata downloads the chunks a
run touches into its cache (`$SCAFFOLD_SHARD_CACHE`, else litdata's default). Credentials
and endpoints come from the store's usual environment and config files (AWS_ENDPOINT_URL,
~/.aws/...), never from the run's config.

MDS shards, as mosaicml-streaming's `MDSWriter` writes them (Composer's and llm-foundry's
data), have the same layout without meta.json (ROOT/train/index.json, ROOT/val/index.json,
ROOT/*/shard.*.mds[.zstd]); their samples are read by index through
`streaming.StreamingDataset`, which fetches and expands the shards a job reads into a cache
folder of that job's own ($SCAFFOLD_SHARD_CACHE, else the temporary folder: delete old
`mds-*` folders there).

Order: the samples are read by index, in an order this module computes, never in litdata's
own iteration order, which assigns chunks to ranks and so changes with the world size. An
epoch visits the chunks in a permutation seeded by (seed, epoch) and shuffles the samples
within each group of `group` consecutive chunks of that permutation: global batch b is a
pure function of (seed, epoch, b) and the shard layout, the same on any number of ranks and
after any resume, and a rank reads from at most `group` + 1 chunks at a time. An MDS shard
is a chunk here.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

INDEX = "index.json"
META = "meta.json"
# Chunks whose samples are shuffled together: more mixes better, fewer caches less.
SHUFFLE_CHUNKS = 4
INSTALL = (
    "pip install 'scaffold[stream]' (CUDA), or with a CPU torch: pip install "
    "'scaffold[stream-cpu]' && pip install --no-deps litdata==0.2.76"
)

MDS_INSTALL = (
    "pip install 'scaffold[mds]' && pip install --no-deps mosaicml-streaming==0.13.0 "
    "(it imports torchvision: with a CPU torch, pip install torch==2.14.1 "
    "torchvision==0.29.1 first)"
)


class ShardError(ValueError):
    """A streaming dataset that cannot be used; the message names it and the fix."""


def is_shards(data: str) -> bool:
    """`--data` names a streaming dataset: a URL, or a folder with a `meta.json` or with
    `train/index.json` (MDS shards)."""
    folder = Path(data).expanduser()
    return (
        "://" in data
        or (folder / META).is_file()
        or (folder / "train" / INDEX).is_file()
    )


def _read_text(url: str) -> str:
    """A small file's text from a local path or an fsspec URL."""
    if "://" not in url:
        return Path(url).read_text()
    import fsspec

    with _asking(url), fsspec.open(url, "r") as file:
        return file.read()


@contextlib.contextmanager
def _asking(url: str) -> Iterator[None]:
    """Inside, a store that refuses (credentials, permissions), has no such bucket or does
    not answer is a ShardError naming the URL and what to check; other errors (a file
    that is not there) pass for the caller to explain."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - any storage client's
        from runtime.checkpoint.failures import store_problem

        problem = store_problem(error)
        if problem is None:
            raise
        raise ShardError(f"--data: cannot read {url}: {problem}") from None


def read_meta(root: str, optional: bool = False) -> dict[str, Any]:
    """ROOT/meta.json as a dict; a missing (unless `optional`: then {}) or unreadable one
    is a ShardError."""
    root = root.rstrip("/")
    try:
        meta = json.loads(_read_text(f"{root}/{META}"))
    except ShardError:
        raise
    except (OSError, ValueError, ImportError) as error:
        if optional and isinstance(error, FileNotFoundError):
            return {}
        raise ShardError(
            f"--data={root}: cannot read {META} ({type(error).__name__}: {error}); a "
            "streaming dataset is a folder or URL holding meta.json, train/ and val/ "
            "as `python data.py convert` writes them"
        ) from None
    if not isinstance(meta, dict):
        raise ShardError(f"--data={root}: {META} must hold a JSON object")
    return meta


def is_mds(root: str) -> bool:
    """ROOT/train/index.json is an MDS index (mosaicml-streaming's: a `shards` list)."""
    try:
        index = json.loads(_read_text(f"{root.rstrip('/')}/train/{INDEX}"))
    except ShardError:
        raise
    except (OSError, ValueError, ImportError):
        return False
    return isinstance(index, dict) and "shards" in index


@dataclass
class Shards:
    """One split of a streaming dataset: `len`, `shards[i]`, and the epoch order."""

    url: str
    dataset: Any  # litdata's or mosaicml-streaming's StreamingDataset, read by index
    chunk_sizes: list[int]  # samples per chunk (MDS: shard), in the index's order
    columns: tuple[str, ...] = ()  # MDS: the shards' column names (litdata: unknown)
    fingerprint: str = ""  # a hash of the split's index.json: names this version of it
    # Items one sample holds (a causal LM's windows of an MDS token row): `len` and the
    # epoch order count items; item i is part i % per_sample of sample i // per_sample.
    per_sample: int = 1

    def __len__(self) -> int:
        return sum(self.chunk_sizes) * self.per_sample

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[int(index)]
        except KeyError:
            # litdata 0.2.76 reading a bucket: moving to the next chunk, its reader unmaps
            # the previous one (item_loader.close: a membership check, then a delete) and
            # the entry can be gone in between (KeyError: 0, seen once on 2 ranks). The
            # item was not read yet and the entry is gone, so a second read goes through.
            return self.dataset[int(index)]

    def take(self, ids: np.ndarray) -> list[Any]:
        """Samples `ids` in the order given, read in index order: chunk by chunk, since
        litdata pays ~1 ms of file locking each time a read moves to another chunk."""
        loaded = {int(i): self[int(i)] for i in sorted(set(map(int, ids)))}
        return [loaded[int(i)] for i in ids]

    def order(self, seed: int, epoch: int, group: int = SHUFFLE_CHUNKS) -> np.ndarray:
        sizes = [n * self.per_sample for n in self.chunk_sizes]
        return chunk_order(sizes, seed, epoch, group)


def chunk_order(sizes: list[int], seed: int, epoch: int, group: int) -> np.ndarray:
    """Every sample index once: chunks in a permutation seeded by (seed, epoch), samples
    shuffled within each run of `group` consecutive chunks of it."""
    rng = np.random.default_rng([seed, epoch])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    chunks = rng.permutation(len(sizes))
    parts = []
    for first in range(0, len(chunks), group):
        ids = [
            np.arange(starts[c], starts[c] + sizes[c])
            for c in chunks[first : first + group]
        ]
        parts.append(rng.permutation(np.concatenate(ids)))
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


def open_split(root: str, split: str, block_size: int = 0) -> Shards:
    """ROOT/split as Shards; `block_size` > 0 reads token arrays as windows of that many
    tokens (litdata's TokensLoader). Every chunk the index names must be present."""
    url = f"{root.rstrip('/')}/{split}"
    try:
        text = _read_text(f"{url}/{INDEX}")
        index = json.loads(text)
    except ShardError:
        raise
    except (OSError, ValueError, ImportError) as error:
        raise ShardError(
            f"--data={root}: no readable {split}/{INDEX} ({type(error).__name__}: {error}); "
            "write the dataset with `python data.py convert` (litdata's optimize) or "
            "mosaicml-streaming's MDSWriter"
        ) from None
    fingerprint = hashlib.sha1(text.encode()).hexdigest()[:16]
    if isinstance(index, dict) and "shards" in index:
        return open_mds(root, split, index["shards"], fingerprint)
    try:
        chunks = index["chunks"]
        names = [chunk["filename"] for chunk in chunks]
        counts = [
            chunk["dim"] // block_size if block_size else chunk["chunk_size"]
            for chunk in chunks
        ]
    except (ValueError, KeyError, TypeError) as error:
        raise ShardError(
            f"--data={root}: {split}/{INDEX} is not litdata's ({type(error).__name__}: "
            f"{error}); write the dataset with `python data.py convert` (litdata's optimize)"
        ) from None
    check_present(root, split, names, "chunk")
    try:
        import litdata
    except ImportError:
        raise ShardError(f"--data={root} is a streaming dataset: {INSTALL}") from None
    loader = litdata.TokensLoader(block_size=block_size) if block_size else None
    cache = os.environ.get("SCAFFOLD_SHARD_CACHE") or None
    dataset = litdata.StreamingDataset(url, item_loader=loader, cache_dir=cache)
    # Fetch the index into the cache now, before DataLoader workers start. Ranks sharing a
    # cache race for it, and litdata gives up after 1 s on an index another process is
    # still downloading ("doesn't contain any index.json"): a retry then finds it there.
    for wait in (0.5, 1, 2, 4, 8, None):
        try:
            len(dataset)  # creates litdata's cache: downloads index.json
            break
        except Exception as error:  # a refusing store, or that race
            if wait is None:
                raise ShardError(
                    f"--data={root}: cannot open {split}/ ({type(error).__name__}: "
                    f"{str(error).splitlines()[0] if str(error) else ''})"
                ) from None
            time.sleep(wait)
    return Shards(url, dataset, counts, fingerprint=fingerprint)


def open_mds(
    root: str, split: str, entries: list[dict[str, Any]], fingerprint: str = ""
) -> Shards:
    """ROOT/split holding MDS shards (mosaicml-streaming's index.json `shards`) as Shards,
    read through streaming.StreamingDataset. Every shard file must be present."""
    url = f"{root.rstrip('/')}/{split}"
    try:
        # A compressed shard is stored as its zip_data (raw_data is what it expands to).
        names = [
            (entry["zip_data"] or entry["raw_data"])["basename"] for entry in entries
        ]
        counts = [int(entry["samples"]) for entry in entries]
        formats = {entry["format"] for entry in entries}
        columns = {tuple(entry["column_names"]) for entry in entries}
    except (KeyError, TypeError, ValueError) as error:
        raise ShardError(
            f"--data={root}: {split}/{INDEX} is not an MDS index ({type(error).__name__}: "
            f"{error}); write the shards with mosaicml-streaming's MDSWriter"
        ) from None
    if not sum(counts):
        raise ShardError(
            f"--data={root}: {split}/ holds no samples; write some with MDSWriter"
        )
    if formats != {"mds"} or len(columns) != 1:
        raise ShardError(
            f"--data={root}: {split}/ holds {', '.join(sorted(formats))} shards with "
            f"{len(columns)} column layouts; one MDS layout is read (MDSWriter's)"
        )
    check_present(root, split, names, "shard")
    try:
        import streaming
    except ImportError:
        raise ShardError(f"--data={root} holds MDS shards: {MDS_INSTALL}") from None
    # Shards are fetched (and expanded) into a folder of this job's own: streaming refuses
    # a local folder that another job's dataset uses (its shared memory is keyed by it),
    # so two runs on one machine, or a test beside a run, would collide. The ranks of a
    # job share it (torchrun's run id; one process: its pid).
    cache = os.environ.get("SCAFFOLD_SHARD_CACHE") or tempfile.gettempdir()
    job = os.environ.get("TORCHELASTIC_RUN_ID") or str(os.getpid())
    key = hashlib.sha1(f"{url} {job}".encode()).hexdigest()[:16]
    local = str(Path(cache) / f"mds-{key}")
    try:
        dataset = streaming.StreamingDataset(
            remote=url, local=local, batch_size=1, shuffle=False
        )
    except Exception as error:  # a refusing store
        raise ShardError(
            f"--data={root}: cannot open {split}/ ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''})"
        ) from None
    return Shards(url, dataset, counts, columns=columns.pop(), fingerprint=fingerprint)


def write_mds(
    output: str,
    split: str,
    columns: dict[str, str],
    rows: Iterable[dict[str, Any]],
    chunk_bytes: str,
) -> None:
    """`rows` as MDS shards in OUTPUT/split (mosaicml-streaming's MDSWriter, zstd, shards
    of about `chunk_bytes`), replacing what is there: what `open_mds` reads, and
    Composer's and llm-foundry's readers too."""
    import streaming

    with streaming.MDSWriter(
        out=str(Path(output) / split),
        columns=columns,
        compression="zstd",
        size_limit=chunk_bytes,
        exist_ok=True,  # overwrite, as litdata's mode="overwrite"
    ) as writer:
        for row in rows:
            writer.write(row)


def check_present(root: str, split: str, names: list[str], kind: str) -> None:
    """Every file the index names (`kind`: chunk, shard) is in ROOT/split."""
    missing = sorted(set(names) - set(_listing(f"{root.rstrip('/')}/{split}")))
    if missing:
        raise ShardError(
            f"--data={root}: {split}/{INDEX} names {len(missing)} {kind} file(s) that are "
            f"not there ({missing[0]}, ...); copy the whole folder again"
        )


def _listing(url: str) -> list[str]:
    """File names in a local folder or under a URL prefix."""
    if "://" not in url:
        folder = Path(url)
        return [p.name for p in folder.iterdir()] if folder.is_dir() else []
    from fsspec.core import url_to_fs

    fs, path = url_to_fs(url)
    with _asking(url):
        return [name.rsplit("/", 1)[-1] for name in fs.ls(path, detail=False)]
