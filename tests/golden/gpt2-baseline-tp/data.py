"""Training data: token streams, their held-out split, and a resumable batch order.

The default data is real text every machine has offline: the Python standard
library's own source files, read from the running interpreter and tokenized as bytes
(vocabulary 256). `--data=PATH` takes a text file, a folder of text files (bytes
again), or a `.bin` file of uint16 token ids (nanoGPT's format: a `val.bin` beside it
is the validation split, a `meta.pkl` beside it gives the vocabulary size), or a
streaming dataset: litdata shards in a folder or at a URL (`s3://bucket/data`), written
by `python data.py convert OUT --data=...` (see `convert` and runtime/shards.py), or
MDS shards (train/, val/) written by mosaicml-streaming's MDSWriter, as llm-foundry's
are: pre-tokenized rows (`tokens`), or texts (`text`, read as bytes; `mds_tokens`);
`python data.py convert OUT --format mds` writes them.

A sample is a window of seq_len + 1 tokens (inputs plus next-token targets); windows
do not overlap. Epoch e visits the windows in a permutation seeded by (seed, e), so
any batch is a pure function of (seed, epoch, batch index): resuming jumps straight
to it, never replaying the loader, and the order is the same on any number of ranks.
Streaming data keeps that contract with a chunk-aware order (runtime/shards.py): a
window is litdata's block of seq_len + 1 tokens, and the chunks are shuffled, then the
windows within a few chunks at a time, so a rank streams chunk by chunk. An MDS row of
`tokens` holds row_len // (seq_len + 1) windows, one after another.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import pickle
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from runtime import dist, hf, shards

BYTE_VOCAB_SIZE = 256
# GPT-2's 50257 BPE tokens, padded to a multiple of 64 so the output layer runs faster.
GPT2_VOCAB_SIZE = 50304
# Held-out share of the tokens when the data has no separate validation file.
VAL_FRACTION = 0.02
# Tokens per item written to streaming shards (`convert`); chunks hold several.
PIECE_TOKENS = 1 << 14
# Standard-library folders that are not library source (tests, demos, packages).
STDLIB_SKIP = {"test", "tests", "idlelib", "turtledemo", "site-packages", "__pycache__"}


@dataclass
class TokenData:
    train: np.ndarray | shards.Shards  # 1-D token ids, or shards of windows
    val: np.ndarray | shards.Shards
    vocab_size: int
    source: str  # where the tokens came from, for the log

    def sizes(self) -> str:
        """How much data there is, for the log."""
        if isinstance(self.train, shards.Shards):
            return f"windows: {len(self.train):,} train, {len(self.val):,} validation"
        return f"tokens: {len(self.train):,} train, {len(self.val):,} validation"


class DataConfig(Protocol):
    """The fields of train.py's Config that choose and batch the tokens."""

    data: str
    vocab_size: int
    seq_len: int
    seed: int
    global_batch_size: int
    eval_batches: int
    init_from: str


def check(cfg: DataConfig) -> str | None:
    """None if the sizes in `cfg` can batch tokens, else the problem in one line
    (checked at start-up, before anything is read)."""
    for name in ("seq_len", "global_batch_size", "eval_batches"):
        if getattr(cfg, name) < 1:
            return f"{name}={getattr(cfg, name)} must be at least 1"
    return None


def load_splits(
    cfg: DataConfig, env: dist.DistEnv
) -> tuple[TokenData, Batches, list[torch.Tensor]]:
    """The tokens `cfg.data` names, their training batches (`Batches.get` gives a
    rank its share) and the validation batches, at the sizes `cfg` sets. OSError or
    ValueError (one line) for a missing path, too little data. With init_from and
    vocab_size 0, `cfg.vocab_size` becomes the checkpoint's (config.toml records it)."""
    if cfg.init_from and not cfg.vocab_size:  # as nanoGPT: the checkpoint's vocabulary
        cfg.vocab_size = hf.gpt2_vocab_size(cfg.init_from, missing_ok=True)
    tokens = load_tokens(cfg.data, cfg.vocab_size, cfg.seq_len)
    # CUDA: batches in page-locked memory, so their copy to the GPU is asynchronous.
    train = Batches(
        tokens.train,
        cfg.seq_len,
        cfg.global_batch_size,
        cfg.seed,
        pin_memory=env.device.type == "cuda",
    )
    val = val_batches(tokens.val, cfg.seq_len, cfg.global_batch_size, cfg.eval_batches)
    return tokens, train, val


def load_tokens(data: str, vocab_size: int = 0, seq_len: int = 0) -> TokenData:
    """The tokens named by `--data` ("" for the embedded standard-library source).

    `vocab_size` > 0 overrides the vocabulary size the data implies; it must exceed
    every token id. `seq_len`: streaming data is read in windows of seq_len + 1.
    """
    if shards.is_shards(data):
        return shard_tokens(data, vocab_size, seq_len)
    tokens = find_tokens(data, vocab_size)
    if vocab_size:
        top = max_token(tokens.train, tokens.val)
        if vocab_size <= top:
            raise ValueError(
                f"--vocab_size={vocab_size} but the data holds token id {top}; use "
                f"--vocab_size={top + 1} or more, or 0 to take it from the data"
            )
        tokens.vocab_size = vocab_size
    return tokens


def find_tokens(data: str, vocab_size: int) -> TokenData:
    """The tokens and the vocabulary size their source implies."""
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
        return uint16_tokens(path, read_meta=not vocab_size)
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


def uint16_tokens(path: Path, read_meta: bool = True) -> TokenData:
    """nanoGPT-style uint16 tokens, memory-mapped; validation: val.bin, or the tail.

    The vocabulary: `vocab_size` in a meta.pkl beside the .bin (nanoGPT's character
    data: 65 tokens for Shakespeare), else GPT-2's (the .bin is assumed to hold GPT-2
    BPE ids). `read_meta=False` (--vocab_size given) leaves meta.pkl unread. A 65-token
    model with a 50,304-row output layer trains many times slower.
    """
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
    top = max_token(tokens, val)
    meta_path = path.with_name("meta.pkl")
    if read_meta and meta_path.exists():
        vocab_size = read_meta_vocab_size(meta_path)
        if vocab_size <= top:
            raise ValueError(
                f"{meta_path} says vocab_size={vocab_size} but the data holds token id "
                f"{top}; fix meta.pkl or pass --vocab_size={top + 1}"
            )
        source = f"uint16 tokens in {path}, vocabulary from {meta_path}"
    else:
        # Ids beyond GPT-2's: the next multiple of 64 that holds them.
        vocab_size = max(GPT2_VOCAB_SIZE, (top + 64) // 64 * 64)
        source = f"uint16 tokens in {path} (no meta.pkl: GPT-2's vocabulary)"
    return TokenData(tokens, val, vocab_size, source)


def shard_tokens(root: str, vocab_size: int, seq_len: int) -> TokenData:
    """A streaming dataset's windows; the vocabulary from its meta.json (optional for
    MDS shards: `mds_tokens`)."""
    mds = shards.is_mds(root)
    meta = shards.read_meta(root, optional=mds)
    meta_size = meta.get("vocab_size", 0)
    if meta and (not isinstance(meta_size, int) or meta_size < 1):
        raise shards.ShardError(
            f"--data={root}: meta.json has no positive integer vocab_size; add one"
        )
    if vocab_size and vocab_size < meta_size:
        raise ValueError(
            f"--vocab_size={vocab_size} but {root} has a vocabulary of {meta_size}; "
            f"use {meta_size} or more, or 0 to take it from meta.json"
        )
    if mds:
        return mds_tokens(root, vocab_size or meta_size, seq_len)
    train = shards.open_split(root, "train", block_size=seq_len + 1)
    val = shards.open_split(root, "val", block_size=seq_len + 1)
    source = f"streaming dataset {root} (litdata shards)"
    return TokenData(train, val, vocab_size or meta_size, source)


def mds_tokens(root: str, vocab_size: int, seq_len: int) -> TokenData:
    """MDS shards as llm-foundry writes them, in one of its two layouts:
    - pre-tokenized rows (`convert_dataset_hf --concat_tokens`: column `tokens`, an
      ndarray, or int64 bytes): a row of L tokens holds L // (seq_len + 1) windows,
      back to back (`window`; the rest of the row is unused), so shards written once
      train at any seq_len < L (llm-foundry's rows of 2048: --seq_len=2047 reads one
      window a row, as llm-foundry does, 1023 two); every row of a split is as long
      as its first (concat_tokens writes them so); the vocabulary is --vocab_size or
      meta.json's (the shards do not record the tokenizer's);
    - text rows (column `text`): read whole into memory as UTF-8 bytes, rows joined
      by newlines, as text files are (`mds_text`)."""
    train, val = (shards.open_split(root, split) for split in ("train", "val"))
    if train.columns != val.columns or not {"tokens", "text"} & set(train.columns):
        found = [", ".join(split.columns) for split in (train, val)]
        raise shards.ShardError(
            f"--data={root}: train/ has columns {found[0]} and val/ {found[1]}; "
            "language MDS shards need the same columns, with pre-tokenized rows in "
            "`tokens` (llm-foundry's convert_dataset_hf --concat_tokens) or texts in "
            "`text`"
        )
    if "tokens" not in train.columns:
        return mds_text(root, train, val, vocab_size)
    if vocab_size < 1:
        raise shards.ShardError(
            f"--data={root}: MDS shards do not record their vocabulary; pass "
            "--vocab_size (the tokenizer's) or add a meta.json with vocab_size"
        )
    for split in (train, val):
        length = len(row_tokens(split[0]))
        split.per_sample = length // (seq_len + 1)
        if split.per_sample < 1:
            raise shards.ShardError(
                f"--data={root}: rows of {length} tokens are shorter than a window of "
                f"seq_len + 1 = {seq_len + 1}; use --seq_len={length - 1} or less"
            )
    return TokenData(train, val, vocab_size, f"MDS shards {root} (tokens)")


def mds_text(
    root: str, train: shards.Shards, val: shards.Shards, vocab_size: int
) -> TokenData:
    """Each split's `text` rows as one array of UTF-8 bytes (rows joined by newlines),
    in memory: byte tokens, as a text file's."""
    if vocab_size and vocab_size < BYTE_VOCAB_SIZE:
        raise ValueError(
            f"--vocab_size={vocab_size}: {root} holds text, read as bytes; use "
            f"{BYTE_VOCAB_SIZE} or more, or 0"
        )

    def byte_array(split: shards.Shards) -> np.ndarray:
        texts = (str(split[i]["text"]).encode() for i in range(len(split)))
        return np.frombuffer(b"\n".join(texts), dtype=np.uint8)

    source = f"MDS shards {root} (text, as bytes)"
    return TokenData(
        byte_array(train), byte_array(val), vocab_size or BYTE_VOCAB_SIZE, source
    )


def window(row: np.ndarray | dict, seq_len: int, part: int = 0) -> np.ndarray:
    """A streaming window: litdata's array, or window `part` of an MDS row (its tokens
    part * (seq_len + 1) onwards)."""
    if not isinstance(row, dict):
        return np.asarray(row)
    tokens = row_tokens(row)[part * (seq_len + 1) : (part + 1) * (seq_len + 1)]
    if len(tokens) < seq_len + 1:  # a row shorter than the split's first
        raise shards.ShardError(
            f"an MDS row of {len(row_tokens(row))} tokens has no window {part} of "
            f"{seq_len + 1} tokens: the split's rows differ in length; write rows of "
            "one length (`python data.py convert OUT --format mds`)"
        )
    return tokens


def row_tokens(row: dict) -> np.ndarray:
    """An MDS row's `tokens`: llm-foundry's ndarray, or int64 bytes (older versions)."""
    tokens = row["tokens"]
    if isinstance(tokens, bytes):
        return np.frombuffer(tokens, dtype=np.int64)
    return np.asarray(tokens)


def convert(
    data: str, output: str, chunk_bytes: str = "64MB", format: str = "litdata"
) -> None:
    """Write the tokens `--data` names as a streaming dataset in folder `output`:
    litdata shards (its `optimize`) of train/ and val/, and meta.json. Upload the folder
    as it is (`aws s3 sync OUT s3://bucket/data`), train with --data=s3://bucket/data.
    `format` mds: MDS shards instead (MDSWriter, zstd), llm-foundry's layout: rows of
    PIECE_TOKENS tokens (a split shorter than that: one row of all its tokens; the
    tokens after the last whole row are left out) in a `tokens` column, trainable at
    any seq_len below the row length. Texts (a text file, llm-foundry's `text` shards)
    are tokenized here, once, as train.py would (bytes).
    """
    tokens = load_tokens(data)
    if isinstance(tokens.train, shards.Shards):
        raise ValueError(
            f"--data={data} is already a streaming dataset of tokens; train on it as "
            "it is"
        )
    dtype = np.uint16 if tokens.vocab_size <= 1 << 16 else np.int32
    if format == "mds":
        for split, ids in (("train", tokens.train), ("val", tokens.val)):
            if not len(ids):
                raise ValueError(f"--data={data}: its {split} split holds no tokens")
            row = min(PIECE_TOKENS, len(ids))
            rows = (
                {"tokens": np.asarray(ids[start : start + row], dtype=dtype)}
                for start in range(0, len(ids) - row + 1, row)
            )
            columns = {"tokens": f"ndarray:{np.dtype(dtype).name}"}
            shards.write_mds(output, split, columns, rows, chunk_bytes)
    else:
        write_litdata(tokens, output, chunk_bytes, dtype)
    meta = {"vocab_size": tokens.vocab_size, "source": tokens.source}
    (Path(output) / shards.META).write_text(json.dumps(meta, indent=1) + "\n")


def write_litdata(
    tokens: TokenData, output: str, chunk_bytes: str, dtype: type
) -> None:
    """train/ and val/ as litdata shards of token pieces (its TokensLoader's layout)."""
    import litdata

    for split, ids in (("train", tokens.train), ("val", tokens.val)):
        # Pieces of 16Ki tokens; litdata packs them into chunks of `chunk_bytes`.
        litdata.optimize(
            fn=functools.partial(token_piece, ids=ids, dtype=dtype),
            inputs=list(range(0, len(ids), PIECE_TOKENS)),
            output_dir=str(Path(output) / split),
            chunk_bytes=chunk_bytes,
            item_loader=litdata.TokensLoader(),
            num_workers=1,
            start_method="fork",  # the worker inherits the tokens (no pickling)
            mode="overwrite",
            verbose=False,
        )


def token_piece(start: int, ids: np.ndarray, dtype: type) -> np.ndarray:
    """Tokens start .. start + PIECE_TOKENS of an array, as one shard item."""
    return np.asarray(ids[start : start + PIECE_TOKENS], dtype=dtype)


def max_token(*arrays: np.ndarray) -> int:
    """The largest token id in the arrays (-1 if all are empty)."""
    return max((int(array.max()) for array in arrays if len(array)), default=-1)


class PlainUnpickler(pickle.Unpickler):
    """Unpickles plain data only: dicts, lists, tuples, strings, numbers.

    Any class or function a pickle names is refused, so a crafted meta.pkl cannot run
    code (a normal pickle.load would call whatever it names).
    """

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"it names {module}.{name}")


def read_meta_vocab_size(path: Path) -> int:
    """`vocab_size` from nanoGPT's meta.pkl, read with PlainUnpickler."""
    try:
        with open(path, "rb") as file:
            meta = PlainUnpickler(file).load()
    except Exception as error:  # whatever a crafted or truncated file raises
        raise ValueError(
            f"{path}: refused ({error}); a meta.pkl may hold only plain dicts, strings "
            "and numbers: pass --vocab_size instead (meta.pkl is then not read)"
        ) from None
    vocab_size = meta.get("vocab_size") if isinstance(meta, dict) else None
    if (
        not isinstance(vocab_size, int)
        or isinstance(vocab_size, bool)
        or vocab_size < 1
    ):
        raise ValueError(
            f"{path} has no positive integer vocab_size; fix it, or pass --vocab_size "
            "(meta.pkl is then not read)"
        )
    return vocab_size


class Batches:
    """Global batches of windows in a seeded, resumable order (no partial batch)."""

    def __init__(
        self,
        tokens: np.ndarray | shards.Shards,
        seq_len: int,
        batch_size: int,
        seed: int,
        pin_memory: bool = False,
    ):
        self.tokens = tokens
        # Page-locked batches: asynchronous copies to a GPU.
        self.pin_memory = pin_memory
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.num_samples = num_windows(tokens, seq_len)
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
            if isinstance(self.tokens, shards.Shards):  # chunk by chunk, see above
                order = self.tokens.order(self.seed, epoch)
            else:
                order = np.random.default_rng([self.seed, epoch]).permutation(
                    self.num_samples
                )
            self._order_epoch, self._order = epoch, order
        return self._order

    def get(
        self, epoch: int, index: int, rank: int = 0, world_size: int = 1
    ) -> torch.Tensor:
        """This rank's share of batch `index` of `epoch`: (batch/world, seq_len + 1)."""
        share = self.batch_size // world_size
        start = index * self.batch_size + rank * share
        ids = self.order(epoch)[start : start + share]
        return windows(self.tokens, ids, self.seq_len, self.pin_memory)


def num_windows(tokens: np.ndarray | shards.Shards, seq_len: int) -> int:
    """Windows of seq_len + 1 tokens (arrays: overlapping by one token)."""
    if isinstance(tokens, shards.Shards):
        return len(tokens)
    return (len(tokens) - 1) // seq_len


def windows(
    tokens: np.ndarray | shards.Shards,
    ids: np.ndarray,
    seq_len: int,
    pin_memory: bool = False,
) -> torch.Tensor:
    """Stack windows `ids` (each seq_len + 1 tokens) into an int64 tensor."""
    if isinstance(tokens, shards.Shards):  # item i: part i % per_sample of a sample
        rows = tokens.take(ids // tokens.per_sample)
        parts = ids % tokens.per_sample
        rows = [window(row, seq_len, int(part)) for row, part in zip(rows, parts)]
    else:
        rows = [tokens[i * seq_len : i * seq_len + seq_len + 1] for i in ids]
    if not pin_memory:
        return torch.from_numpy(np.stack(rows).astype(np.int64))
    batch = torch.empty((len(ids), seq_len + 1), dtype=torch.int64, pin_memory=True)
    np.stack(rows, out=batch.numpy())  # straight into page-locked memory
    return batch


def val_batches(
    tokens: np.ndarray | shards.Shards, seq_len: int, batch_size: int, max_batches: int
) -> list[torch.Tensor]:
    """The first `max_batches` batches of validation windows, in a fixed order."""
    num_samples = min(num_windows(tokens, seq_len), batch_size * max_batches)
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


def main() -> None:
    """`python data.py convert OUT --data=...`: write a streaming dataset."""
    parser = argparse.ArgumentParser(description=convert.__doc__)
    parser.add_argument("command", choices=["convert"])
    parser.add_argument("output", help="the folder to write (train/, val/, meta.json)")
    parser.add_argument(
        "--data", default="", help="as train.py's --data; '': the default"
    )
    parser.add_argument(
        "--chunk_bytes", default="64MB", help="the size of one chunk file"
    )
    parser.add_argument(
        "--format",
        choices=["litdata", "mds"],
        default="litdata",
        help="litdata shards, or MDS shards (mosaicml-streaming's, as Composer's data)",
    )
    args = parser.parse_args()
    try:
        convert(args.data, args.output, args.chunk_bytes, args.format)
    except ImportError:
        need = "litdata: " + shards.INSTALL
        if args.format == "mds":
            need = "mosaicml-streaming: " + shards.MDS_INSTALL
        print(f"error: streaming datasets need {need}", file=sys.stderr)
        sys.exit(2)
    except (OSError, ValueError) as error:  # a missing path, too little data
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote a streaming dataset to {args.output}")


if __name__ == "__main__":
    main()
