"""Training data: token streams, their held-out split, and a resumable batch order.

The default data is real text every machine has offline: the Python standard
library's own source files, read from the running interpreter and tokenized as bytes
(vocabulary 256). `--data=PATH` takes a text file, a folder of text files (bytes
again), or a `.bin` file of uint16 token ids (nanoGPT's format; a `val.bin` beside it
is the validation split).

A sample is a window of seq_len + 1 tokens (inputs plus next-token targets); windows
do not overlap. Epoch e visits the windows in a permutation seeded by (seed, e), so
any batch is a pure function of (seed, epoch, batch index): resuming jumps straight
to it, never replaying the loader, and the order is the same on any number of ranks.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BYTE_VOCAB_SIZE = 256
# GPT-2's 50257 BPE tokens, padded to a multiple of 64 so the output layer runs faster.
GPT2_VOCAB_SIZE = 50304
# Held-out share of the tokens when the data has no separate validation file.
VAL_FRACTION = 0.02
# Standard-library folders that are not library source (tests, demos, packages).
STDLIB_SKIP = {"test", "tests", "idlelib", "turtledemo", "site-packages", "__pycache__"}


@dataclass
class TokenData:
    train: np.ndarray  # 1-D token ids
    val: np.ndarray
    vocab_size: int
    source: str  # where the tokens came from, for the log


def load_tokens(data: str) -> TokenData:
    """The tokens named by `--data` ("" for the embedded standard-library source)."""
    if not data:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = [
            path
            for path in root.rglob("*.py")
            if not STDLIB_SKIP.intersection(path.relative_to(root).parts)
        ]
        return byte_tokens(root, files, f"Python standard library source ({root})")
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"--data={data}: no such file or folder; pass a text file, a folder of "
            "text files or a .bin of uint16 tokens, or leave it empty for the default"
        )
    if path.suffix == ".bin":
        return uint16_tokens(path)
    if path.is_dir():
        files = [
            p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
        ]
        return byte_tokens(path, files, f"text files under {path}")
    return byte_tokens(path.parent, [path], f"text file {path}")


def byte_tokens(root: Path, files: list[Path], source: str) -> TokenData:
    """Concatenate files as bytes in a fixed shuffled order; hold out the tail.

    Sorting by a hash of each relative path mixes the files, so the held-out tail is a
    random sample of them rather than whatever sorts last alphabetically.
    """
    files = sorted(
        files,
        key=lambda p: hashlib.sha1(p.relative_to(root).as_posix().encode()).digest(),
    )
    if not files:
        raise ValueError(f"no files found for {source}; check the --data path")
    tokens = np.frombuffer(b"\n".join(p.read_bytes() for p in files), dtype=np.uint8)
    split = int(len(tokens) * (1 - VAL_FRACTION))
    return TokenData(tokens[:split], tokens[split:], BYTE_VOCAB_SIZE, source)


def uint16_tokens(path: Path) -> TokenData:
    """nanoGPT-style uint16 tokens, memory-mapped; validation: val.bin, or the tail."""
    if path.stat().st_size % 2:
        raise ValueError(
            f"{path} has an odd number of bytes; a .bin must hold uint16 tokens"
        )
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    val_path = path.with_name("val.bin")
    if val_path.exists() and val_path != path:
        val = np.memmap(val_path, dtype=np.uint16, mode="r")
    else:
        split = int(len(tokens) * (1 - VAL_FRACTION))
        tokens, val = tokens[:split], tokens[split:]
    vocab_size = max(GPT2_VOCAB_SIZE, int(tokens.max()) + 1)
    return TokenData(tokens, val, vocab_size, f"uint16 tokens in {path}")


class Batches:
    """Global batches of windows in a seeded, resumable order (no partial batch)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.num_samples = (len(tokens) - 1) // seq_len
        self.batches_per_epoch = self.num_samples // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the data holds {self.num_samples} windows of {seq_len + 1} tokens, "
                f"fewer than one global batch of {batch_size}; use more data or a "
                "smaller global_batch_size or seq_len"
            )
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of window indices for one epoch (computed once per epoch)."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order_epoch, self._order = epoch, rng.permutation(self.num_samples)
        return self._order

    def get(
        self, epoch: int, index: int, rank: int = 0, world_size: int = 1
    ) -> torch.Tensor:
        """This rank's share of batch `index` of `epoch`: (batch/world, seq_len + 1)."""
        share = self.batch_size // world_size
        start = index * self.batch_size + rank * share
        return windows(
            self.tokens, self.order(epoch)[start : start + share], self.seq_len
        )


def windows(tokens: np.ndarray, ids: np.ndarray, seq_len: int) -> torch.Tensor:
    """Stack windows `ids` (each seq_len + 1 tokens) into an int64 tensor."""
    rows = [tokens[i * seq_len : i * seq_len + seq_len + 1] for i in ids]
    return torch.from_numpy(np.stack(rows).astype(np.int64))


def val_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, max_batches: int
) -> list[torch.Tensor]:
    """The first `max_batches` batches of validation windows, in a fixed order."""
    num_samples = min((len(tokens) - 1) // seq_len, batch_size * max_batches)
    if num_samples == 0:
        raise ValueError(
            f"the validation split holds fewer than {seq_len + 1} tokens; use more "
            "data or a smaller seq_len"
        )
    ids = np.arange(num_samples)
    return [
        windows(tokens, ids[i : i + batch_size], seq_len)
        for i in range(0, num_samples, batch_size)
    ]
