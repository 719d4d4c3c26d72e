"""Labelled text: loading, tokenising once (cached), and a resumable batch order.

`--data=PATH` takes a CSV file, a JSON Lines file (.jsonl) or a Parquet file with a text
column (`--text_column`; by default `text` or `sentence`) and a label column
(`--label_column`, default `label`), or a folder written by `datasets`'
`save_to_disk` (its `validation` split, else `test`, is the validation set), or MDS
shards (a folder or URL with train/ and val/ written by mosaicml-streaming's MDSWriter,
one row a sample, e.g. columns `text` and `label`; read whole through
`streaming.StreamingDataset`). Labels are integers 0..num_labels-1 or strings (sorted,
then numbered). A file's validation set is `--val_data`, or else a seeded 10% of its
rows. `python data.py convert OUT --data=...` writes any of these as MDS shards.

The default data works offline: lines of the Python standard library's own source, each
labelled prose (a comment's text) or code (a statement) -- real text with a real signal.

Texts are tokenised once and cached beside the data (`.scaffold-cache/`), under a key
of the data file, the columns, the tokenizer and the maximum length. A sample is one
text; a batch is padded to its longest text (dynamic padding). Epoch e visits the
samples in a permutation seeded by (seed, e), so any batch is a pure function of (seed,
epoch, batch index): resuming jumps to it, and the order is the same on any number of
ranks.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from runtime import shards

# Share of a file's rows held out for validation when there is no --val_data.
VAL_FRACTION = 0.1
# The embedded data: at most this many lines of each label, from this many stdlib files.
EMBEDDED_PER_LABEL = 640
TEXT_COLUMNS = ("text", "sentence")


@dataclass
class Texts:
    texts: list[str]
    labels: np.ndarray  # int64 label ids


@dataclass
class TextData:
    train: Texts
    val: Texts
    label_names: list[str]  # label id -> name
    source: str  # where the texts came from, for the log
    cache_dir: Path  # where the tokenised texts are cached
    fingerprint: str  # identifies the data in cache keys

    @property
    def num_labels(self) -> int:
        return len(self.label_names)


def load_texts(
    data: str,
    val_data: str,
    text_column: str,
    label_column: str,
    num_labels: int,
    seed: int,
) -> TextData:
    """The labelled texts named by `--data` ("" for the embedded default)."""
    if not data:
        return embedded_texts(seed)
    path = Path(data).expanduser()
    if shards.is_shards(data):  # MDS shards: a folder or URL holding train/ and val/
        if val_data:
            raise ValueError(
                f"--val_data={val_data}: --data={data} holds its own val/ split; "
                "remove --val_data"
            )
        (train_rows, val_rows), identity = mds_rows(data)
        # A URL's texts are tokenised into the working folder's cache.
        cache_dir = (path if "://" not in data else Path.cwd()) / ".scaffold-cache"
    elif not path.exists():
        raise FileNotFoundError(
            f"--data={data}: no such file or folder; pass a .csv, .jsonl or .parquet "
            "file, a datasets folder or MDS shards, or leave it empty for the embedded "
            "default"
        )
    elif path.is_dir():
        train_rows, val_rows = dataset_folder_rows(path)
        cache_dir, identity = path / ".scaffold-cache", file_stats(path)
    else:
        train_rows = table_rows(path)
        val_rows = table_rows(Path(val_data).expanduser()) if val_data else []
        cache_dir, identity = path.parent / ".scaffold-cache", file_stats(path)
    column = text_column or next(
        (c for c in TEXT_COLUMNS if train_rows and c in train_rows[0]), "text"
    )
    train_texts = column_of(train_rows, column, f"--data={data}")
    train_raw = column_of(train_rows, label_column, f"--data={data}", label=True)
    if val_rows:
        val_texts = column_of(val_rows, column, f"--val_data={val_data}")
        val_raw = column_of(
            val_rows, label_column, f"--val_data={val_data}", label=True
        )
    else:  # a seeded share of the rows, the same on every rank and every run
        order = np.random.default_rng([seed, 7]).permutation(len(train_rows))
        held = set(order[: max(1, int(len(train_rows) * VAL_FRACTION))].tolist())
        val_texts = [t for i, t in enumerate(train_texts) if i in held]
        val_raw = [v for i, v in enumerate(train_raw) if i in held]
        train_texts = [t for i, t in enumerate(train_texts) if i not in held]
        train_raw = [v for i, v in enumerate(train_raw) if i not in held]
    names, (train_labels, val_labels) = label_ids(
        [train_raw, val_raw], num_labels, label_column
    )
    fingerprint = digest([identity, val_data, column, label_column, num_labels, seed])
    return TextData(
        Texts(train_texts, train_labels),
        Texts(val_texts, val_labels),
        names,
        f"{data if '://' in data else path} (text: {column}, label: {label_column})",
        cache_dir,
        fingerprint,
    )


def embedded_texts(seed: int) -> TextData:
    """Stdlib source lines labelled prose (0: a comment's words) or code (1)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    prose: list[str] = []
    code: list[str] = []
    for path in sorted(root.glob("*.py")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            line = line.strip()
            if line.startswith("# ") and len(line) > 20 and line[2:3].isalpha():
                prose.append(line[2:])
            elif len(line) > 20 and not line.startswith(("#", '"', "'")):
                code.append(line)
        if min(len(prose), len(code)) >= EMBEDDED_PER_LABEL:
            break
    prose, code = prose[:EMBEDDED_PER_LABEL], code[:EMBEDDED_PER_LABEL]
    texts = prose + code
    labels = np.array([0] * len(prose) + [1] * len(code), dtype=np.int64)
    order = np.random.default_rng([seed, 7]).permutation(len(texts))
    split = int(len(texts) * (1 - VAL_FRACTION))
    pick = lambda ids: Texts([texts[i] for i in ids], labels[ids])  # noqa: E731
    return TextData(
        pick(order[:split]),
        pick(order[split:]),
        ["prose", "code"],
        f"Python standard library lines, prose or code ({root})",
        Path("runs") / ".scaffold-cache",
        digest([str(root), len(texts), seed]),
    )


def table_rows(path: Path) -> list[dict]:
    """The rows of a .csv, .jsonl or .parquet file, as dicts."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such file; pass a .csv, .jsonl or .parquet file"
        )
    if path.suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as file:
            return list(csv.DictReader(file))
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as error:
                    message = f"{path}, line {number}: not JSON ({error})"
                    raise ValueError(f"{message}; write one object a line") from None
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet

        return pyarrow.parquet.read_table(path).to_pylist()
    raise ValueError(
        f"{path}: unknown format {path.suffix!r}; use .csv, .jsonl or .parquet"
    )


def dataset_folder_rows(path: Path) -> tuple[list[dict], list[dict]]:
    """The train and validation rows of a folder written by datasets' save_to_disk."""
    import datasets

    try:
        saved = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as error:
        raise ValueError(f"--data={path}: not a datasets folder ({error})") from None
    if not isinstance(saved, datasets.DatasetDict) or "train" not in saved:
        raise ValueError(f"--data={path}: the datasets folder needs a 'train' split")
    val_split = next((s for s in ("validation", "test") if s in saved), None)
    if val_split is None:
        raise ValueError(
            f"--data={path}: the datasets folder needs a 'validation' or 'test' split"
        )
    return saved["train"].to_list(), saved[val_split].to_list()


def mds_rows(data: str) -> tuple[tuple[list[dict], list[dict]], list[str]]:
    """The train/ and val/ rows of MDS shards, read whole (a labelled text set fits in
    memory and is tokenised once, as a file's), and what identifies them for the cache:
    the URL and its index files' hashes."""
    if not shards.is_mds(data):
        raise shards.ShardError(
            f"--data={data}: no MDS index in train/ (index.json with `shards`); text "
            "classification reads MDS shards written by MDSWriter, a .csv, .jsonl or "
            ".parquet file, or a datasets folder"
        )
    splits = [shards.open_split(data, split) for split in ("train", "val")]
    rows = tuple([plain(split[i]) for i in range(len(split))] for split in splits)
    return rows, [data, *(split.fingerprint for split in splits)]


def plain(row: dict) -> dict:
    """An MDS sample with numpy scalars (an `int64` label) as Python values."""
    return {k: v.item() if isinstance(v, np.generic) else v for k, v in row.items()}


def column_of(rows: list[dict], column: str, where: str, label: bool = False) -> list:
    if not rows:
        raise ValueError(f"{where} has no rows")
    if column not in rows[0]:
        flag = "--label_column" if label else "--text_column"
        found = ", ".join(map(str, rows[0]))
        raise ValueError(
            f"{where} has no column {column!r} (it has: {found}); set {flag}"
        )
    values = [row.get(column) for row in rows]
    for number, value in enumerate(values, 1):
        if value is None or (not label and not str(value).strip()):
            raise ValueError(
                f"{where}, row {number}: empty {column!r}; remove the row or fill it in"
            )
    return values if label else [str(value) for value in values]


def label_ids(
    splits: list[list], num_labels: int, column: str
) -> tuple[list[str], list[np.ndarray]]:
    """Integer labels as they are; string labels numbered in sorted order."""
    values = [v for split in splits for v in split]
    as_int = [
        (
            int(v)
            if isinstance(v, int)
            or (isinstance(v, str) and v.strip().lstrip("-").isdigit())
            else None
        )
        for v in values
    ]
    if all(v is not None for v in as_int):
        count = num_labels or max(as_int) + 1
        bad = next((v for v in as_int if not 0 <= v < count), None)
        if bad is not None:
            raise ValueError(
                f"label {bad} in column {column!r} is outside 0..{count - 1}; "
                "set --num_labels or fix the data"
            )
        names = [str(i) for i in range(count)]
        ids = [np.array([int(v) for v in split], dtype=np.int64) for split in splits]
        return names, ids
    names = sorted({str(v) for v in values})
    if num_labels and len(names) != num_labels:
        raise ValueError(
            f"column {column!r} has {len(names)} distinct labels, "
            f"not --num_labels={num_labels}"
        )
    index = {name: i for i, name in enumerate(names)}
    return names, [
        np.array([index[str(v)] for v in split], dtype=np.int64) for split in splits
    ]


def file_stats(path: Path) -> list[tuple]:
    """(path, size, modification time) of its files: a changed file is a new key."""
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return [
        (str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns)
        for p in files
        if p.is_file() and ".scaffold-cache" not in p.parts
    ]


def digest(parts: object) -> str:
    return hashlib.sha256(
        json.dumps(parts, sort_keys=True, default=str).encode()
    ).hexdigest()[:16]


@dataclass
class Encoded:
    """Token ids of many texts, ragged: text i is ids[offsets[i]:offsets[i + 1]]."""

    ids: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.labels)

    def lengths(self, rows: np.ndarray) -> np.ndarray:
        return self.offsets[rows + 1] - self.offsets[rows]

    def batch(
        self, rows: np.ndarray, width: int, pad_id: int
    ) -> dict[str, torch.Tensor]:
        """Rows padded to `width`: input_ids, attention_mask (1: real token), labels."""
        input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for out, row in enumerate(rows):
            ids = self.ids[self.offsets[row] : self.offsets[row + 1]]
            input_ids[out, : len(ids)] = ids
            mask[out, : len(ids)] = 1
        return {
            "input_ids": torch.from_numpy(input_ids),
            "attention_mask": torch.from_numpy(mask),
            "labels": torch.from_numpy(self.labels[rows]),
        }


def tokenize(
    texts: Texts, tokenizer, max_seq_len: int, cache_dir: Path, key: list
) -> Encoded:
    """Token ids of every text (truncated to max_seq_len), cached under a key of
    (data, split, tokenizer, max length): a second run, or another rank, reads it."""
    path = (
        cache_dir
        / f"tokens-{digest([*key, tokenizer_key(tokenizer), max_seq_len])}.npz"
    )
    if path.exists():
        with np.load(path) as cached:
            return Encoded(cached["ids"], cached["offsets"], cached["labels"])
    encoded = tokenizer(texts.texts, truncation=True, max_length=max_seq_len)[
        "input_ids"
    ]
    lengths = np.array([len(ids) for ids in encoded], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = np.fromiter(
        (i for row in encoded for i in row), dtype=np.int64, count=int(offsets[-1])
    )
    result = Encoded(ids, offsets, texts.labels)
    cache_dir.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(
        f"{path.stem}.{os.getpid()}.tmp.npz"
    )  # ranks race: rename wins
    np.savez(temporary, ids=ids, offsets=offsets, labels=texts.labels)
    os.replace(temporary, path)
    return result


def tokenizer_key(tokenizer) -> str:
    """What makes a tokenizer's ids: vocabulary, normalizer, pre- and post-processing
    (a fast tokenizer's JSON, minus the truncation and padding a call sets)."""
    if not tokenizer.is_fast:
        return digest([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())])
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec.pop("truncation", None)
    spec.pop("padding", None)
    return digest(spec)


class Batches:
    """Global batches of texts in a seeded, resumable order (no partial batch)."""

    def __init__(self, encoded: Encoded, batch_size: int, seed: int, pad_id: int):
        self.encoded = encoded
        self.batch_size = batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.batches_per_epoch = len(encoded) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the data holds {len(encoded)} texts, fewer than one global batch of "
                f"{batch_size}; use more data or a smaller global_batch_size"
            )
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of text indices for one epoch (computed once per epoch)."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order_epoch, self._order = epoch, rng.permutation(len(self.encoded))
        return self._order

    def get(
        self, epoch: int, index: int, rank: int = 0, world_size: int = 1
    ) -> dict[str, torch.Tensor]:
        """This rank's share of batch `index` of `epoch`, padded to the longest text of
        the whole global batch (so every rank, and one process, sees the same tensors).
        """
        rows = self.order(epoch)[
            index * self.batch_size : (index + 1) * self.batch_size
        ]
        width = int(self.encoded.lengths(rows).max())
        share = self.batch_size // world_size
        return self.encoded.batch(
            rows[rank * share : (rank + 1) * share], width, self.pad_id
        )

    def num_tokens(self, epoch: int, index: int) -> int:
        """Real (unpadded) tokens in global batch `index` of `epoch`, over all ranks."""
        rows = self.order(epoch)[
            index * self.batch_size : (index + 1) * self.batch_size
        ]
        return int(self.encoded.lengths(rows).sum())


def val_batches(
    encoded: Encoded, batch_size: int, pad_id: int
) -> list[dict[str, torch.Tensor]]:
    """Every validation text once, in a fixed order, in batches of `batch_size`."""
    rows = np.arange(len(encoded))
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        batches.append(encoded.batch(chunk, int(encoded.lengths(chunk).max()), pad_id))
    return batches


def convert(
    data: str,
    output: str,
    chunk_bytes: str = "64MB",
    val_data: str = "",
    text_column: str = "",
    label_column: str = "label",
    seed: int = 42,
) -> None:
    """Write the labelled texts `--data` names (with --val_data, --text_column,
    --label_column and --seed as train.py takes them) as MDS shards in folder `output`
    (mosaicml-streaming's MDSWriter, zstd): train/ and val/, columns `text` (str) and
    `label` (the label id, int), the split train.py would make. Upload the folder as it
    is and train with --data=OUT, or read it with Composer's streaming datasets."""
    texts = load_texts(data, val_data, text_column, label_column, 0, seed)
    for split in ("train", "val"):
        part = getattr(texts, split)
        rows = (
            {"text": text, "label": int(label)}
            for text, label in zip(part.texts, part.labels, strict=True)
        )
        columns = {"text": "str", "label": "int"}
        shards.write_mds(output, split, columns, rows, chunk_bytes)


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
    parser.add_argument("--val_data", default="", help="as train.py's --val_data")
    parser.add_argument("--text_column", default="", help="as train.py's --text_column")
    parser.add_argument(
        "--label_column", default="label", help="as train.py's --label_column"
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=42,
        help="as train.py's --seed: the held-out share without --val_data",
    )
    args = parser.parse_args()
    try:
        convert(
            args.data,
            args.output,
            args.chunk_bytes,
            val_data=args.val_data,
            text_column=args.text_column,
            label_column=args.label_column,
            seed=args.seed,
        )
    except ImportError:
        need = shards.MDS_INSTALL
        print(f"error: MDS shards need mosaicml-streaming: {need}", file=sys.stderr)
        sys.exit(2)
    except (OSError, ValueError) as error:  # a missing file or column, a bad label
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote a streaming dataset to {args.output}")


if __name__ == "__main__":
    main()
