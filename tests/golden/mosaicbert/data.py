"""Text for masked-LM pretraining: loading, the tokenizer, sequences, masking, and a
resumable batch order.

`--data=PATH` takes a text file (paragraphs separated by blank lines), a JSON Lines file
(one `{"text": ...}` object a line), a folder of .txt files, a folder written by
`datasets`' `save_to_disk` (its `train` split's `text` column), or a litdata folder
(written by litdata's `optimize`, items that are strings or `{"text": ...}`).

The default data works offline: the documentation topics that ship with Python
(`pydoc_data.topics`: 79 topics of the language reference, about 465 KB of English
prose); the log names them with the SHA-256 of their text.

Tokenizer: `--tokenizer` (a folder or hub id), or else a WordPiece tokenizer trained on
the data with `tokenizers`, the same vocabulary from the same data in every process
(train_tokenizer says how). It is trained once, by rank 0, into `runs/.scaffold-cache/`
under a key of the data and the vocabulary size; every rank and every later run with the
same data reads that file, and each run saves a copy beside itself (`runs/<run_name>/
tokenizer/`) for fine-tuning.

Sequences: each document's paragraphs are tokenised and packed, in order, into
sequences of at most seq_len - 2 tokens, then framed [CLS] ... [SEP] and padded to
seq_len. Masking (BERT's): each real token is picked with probability mask_rate; a
picked token is a target, and in the input becomes [MASK] (80%), a random token (10%)
or stays itself (10%). Epoch e visits the sequences in a permutation seeded by (seed,
e), and the masks of a global batch are drawn from (seed, e, batch index): any batch is
a pure function of (seed, epoch, batch index), the same on any number of ranks, so
resuming jumps to it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from runtime import dist

try:
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
except ModuleNotFoundError as missing:
    sys.exit(
        f"error: {missing.name} is not installed; this project needs the Hugging Face "
        "extra: pip install 'scaffold[hf]' (transformers, tokenizers, datasets)"
    )

transformers.utils.logging.set_verbosity_error()

# Share of the sequences held out for validation (seeded).
VAL_FRACTION = 0.05
# The target of a token that is not predicted (cross_entropy's ignore_index).
IGNORE = -100
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


@dataclass
class Corpus:
    documents: list[str]
    source: str  # where the text came from, for the log
    fingerprint: str  # identifies the text in cache keys


def load_corpus(data: str) -> Corpus:
    """The documents named by `--data` ("" for Python's documentation topics)."""
    if not data:
        from pydoc_data.topics import topics

        documents = [topics[name] for name in sorted(topics)]
        sha = hashlib.sha256("\n".join(documents).encode()).hexdigest()
        chars = sum(map(len, documents))
        source = (
            f"Python's documentation topics (pydoc_data.topics: {len(documents)} "
            f"topics, {chars:,} characters, sha256 {sha[:16]})"
        )
        return Corpus(documents, source, sha)
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"--data={data}: no such file or folder; pass a .txt or .jsonl file, a "
            "folder of .txt files, a datasets or litdata folder, or leave it empty"
        )
    if path.is_file():
        documents = read_file(path)
    elif (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        documents = dataset_folder(path)
    elif (path / "index.json").is_file():
        documents = litdata_folder(path)
    else:
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise ValueError(f"--data={data}: the folder holds no .txt files")
        documents = [text for file in files for text in read_file(file)]
    documents = [text for text in documents if text.strip()]
    if not documents:
        raise ValueError(f"--data={data} holds no text; give it some")
    return Corpus(documents, str(path), digest(file_stats(path)))


def read_file(path: Path) -> list[str]:
    """A .jsonl file's `text` fields, or a text file as one document."""
    if path.suffix != ".jsonl":
        return [path.read_text(encoding="utf-8", errors="replace")]
    documents = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            message = f"{path}, line {number}: not JSON ({error})"
            raise ValueError(f"{message}; write one object a line") from None
        if not isinstance(row, dict) or not isinstance(row.get("text"), str):
            where = f"{path}, line {number}"
            raise ValueError(where + ': no "text" string; write {"text": ...} a line')
        documents.append(row["text"])
    return documents


def dataset_folder(path: Path) -> list[str]:
    """The `text` column of a datasets folder's train split (or its only split)."""
    import datasets

    saved = datasets.load_from_disk(str(path))
    if isinstance(saved, datasets.DatasetDict):
        if "train" not in saved:
            raise ValueError(
                f"--data={path}: the datasets folder needs a 'train' split"
            )
        saved = saved["train"]
    if "text" not in saved.column_names:
        found = ", ".join(saved.column_names)
        raise ValueError(f"--data={path} has no 'text' column (it has: {found})")
    return list(saved["text"])


def litdata_folder(path: Path) -> list[str]:
    """The items of a litdata folder: strings, or dicts with a `text` string."""
    index = json.loads((path / "index.json").read_text())
    if "chunks" not in index:  # e.g. MosaicML streaming's MDS index: {"shards": ...}
        raise ValueError(
            f"--data={path}: index.json is not litdata's; MDS shards are not read"
        )
    import litdata

    items = list(litdata.StreamingDataset(str(path)))
    return [item["text"] if isinstance(item, dict) else str(item) for item in items]


def file_stats(path: Path) -> list[tuple]:
    """(path, size, modification time) of its files: a changed file is a new key."""
    files = sorted(path.rglob("*")) if path.is_dir() else [path]
    return [
        (str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns)
        for p in files
        if p.is_file()
    ]


def digest(parts: object) -> str:
    return hashlib.sha256(
        json.dumps(parts, sort_keys=True, default=str).encode()
    ).hexdigest()[:16]


def trained_tokenizer_path(corpus: Corpus, vocab_size: int) -> Path:
    """Where the WordPiece tokenizer trained on `corpus` is kept (trained once)."""
    key = digest([corpus.fingerprint, vocab_size, SPECIAL_TOKENS])
    return Path("runs") / ".scaffold-cache" / f"wordpiece-{key}.json"


def bert_wordpiece(vocab: dict[str, int] | None = None) -> Tokenizer:
    """BERT's lower-cased WordPiece tokenizer: untrained, or over `vocab`."""
    tokenizer = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tokenizer


def train_tokenizer(corpus: Corpus, vocab_size: int) -> None:
    """Train BERT's WordPiece tokenizer on the corpus, once.

    tokenizers' trainer (BPE underneath) numbers the word-continuing pieces ("##e") in
    the order of a Rust HashMap, new in each process, and breaks ties between merges of
    equal count by those numbers: the vocabulary itself (not only its ids) changed from
    process to process (huggingface/tokenizers#1794). Given to the trainer up front, in
    sorted order, the pieces have fixed numbers, and the same corpus gives the same
    vocabulary; the tokens are then numbered by name."""
    path = trained_tokenizer_path(corpus, vocab_size)
    if path.exists():
        return
    # The pieces, as the trainer makes them: a first pass that counts the words and
    # merges nothing (a vocabulary of one holds the alphabet and the pieces).
    alphabet = bert_wordpiece()
    alphabet.train_from_iterator(
        corpus.documents, trainers.WordPieceTrainer(vocab_size=1, show_progress=False)
    )
    pieces = sorted(token for token in alphabet.get_vocab() if token.startswith("##"))
    tokenizer = bert_wordpiece()
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + pieces,
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus.documents, trainer)
    vocab = sorted(set(tokenizer.get_vocab()) - set(SPECIAL_TOKENS))
    # A new tokenizer over that vocabulary: the pieces are ordinary tokens in it, and
    # only BERT's own are special.
    tokenizer = bert_wordpiece({t: i for i, t in enumerate([*SPECIAL_TOKENS, *vocab])})
    tokenizer.add_special_tokens(SPECIAL_TOKENS)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
    tokenizer.save(str(temporary))
    os.replace(temporary, path)


def load_tokenizer(name: str, corpus: Corpus, vocab_size: int):
    """`--tokenizer` (a folder or hub id), else the WordPiece one trained on the
    corpus."""
    if name:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as error:
            first = (
                str(error).strip().splitlines()[0]
                if str(error).strip()
                else type(error).__name__
            )
            raise ValueError(f"--tokenizer={name}: cannot load it ({first})") from None
    else:
        tokenizer = transformers.BertTokenizerFast(
            tokenizer_object=Tokenizer.from_file(
                str(trained_tokenizer_path(corpus, vocab_size))
            )
        )
    for role in ("mask", "pad", "cls", "sep"):
        if getattr(tokenizer, f"{role}_token_id") is None:
            raise ValueError(
                f"--tokenizer={name or 'WordPiece'} has no {role} token; a masked-LM "
                "tokenizer needs [MASK], [PAD], [CLS] and [SEP] (BERT's have them)"
            )
    return tokenizer


@dataclass
class Encoded:
    """Token ids of many sequences, ragged: sequence i is
    ids[offsets[i]:offsets[i + 1]]."""

    ids: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self, rows: np.ndarray, width: int, pad_id: int) -> np.ndarray:
        """Rows padded to `width` with pad_id."""
        out = np.full((len(rows), width), pad_id, dtype=np.int64)
        for i, row in enumerate(rows):
            ids = self.ids[self.offsets[row] : self.offsets[row + 1]]
            out[i, : len(ids)] = ids
        return out


def sequences(
    corpus: Corpus, tokenizer, seq_len: int, seed: int
) -> tuple[Encoded, Encoded]:
    """Train and validation sequences: paragraphs packed in order, [CLS] ... [SEP]."""
    body = seq_len - 2
    packed: list[list[int]] = []
    for document in corpus.documents:
        paragraphs = [p for p in document.split("\n\n") if p.strip()]
        current: list[int] = []
        for ids in (
            tokenizer(paragraphs, add_special_tokens=False)["input_ids"]
            if paragraphs
            else []
        ):
            if current and len(current) + len(ids) > body:
                packed.append(current)
                current = []
            current = current + ids
            while (
                len(current) > body
            ):  # a long paragraph: full sequences, then the rest
                packed.append(current[:body])
                current = current[body:]
        if current:
            packed.append(current)
    if not packed:
        raise ValueError(
            f"{corpus.source}: the text holds no tokens; give it some words"
        )
    framed = [[tokenizer.cls_token_id, *ids, tokenizer.sep_token_id] for ids in packed]
    order = np.random.default_rng([seed, 7]).permutation(len(framed))
    held = max(1, int(len(framed) * VAL_FRACTION))
    return encode([framed[i] for i in order[held:]]), encode(
        [framed[i] for i in order[:held]]
    )


def encode(rows: list[list[int]]) -> Encoded:
    offsets = np.concatenate([[0], np.cumsum([len(row) for row in rows])]).astype(
        np.int64
    )
    ids = np.fromiter(
        (i for row in rows for i in row), dtype=np.int64, count=int(offsets[-1])
    )
    return Encoded(ids, offsets)


@dataclass
class Masking:
    rate: float  # share of the real tokens picked as targets
    mask_id: int
    pad_id: int
    special_ids: np.ndarray  # never picked: [CLS], [SEP], padding, ...
    normal_ids: np.ndarray  # what a random replacement draws from

    @classmethod
    def of(cls, tokenizer, rate: float) -> Masking:
        special = np.array(sorted(tokenizer.all_special_ids), dtype=np.int64)
        normal = np.setdiff1d(np.arange(len(tokenizer), dtype=np.int64), special)
        return cls(
            rate, tokenizer.mask_token_id, tokenizer.pad_token_id, special, normal
        )

    def apply(
        self, ids: np.ndarray, rng: np.random.Generator
    ) -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets) of token rows `ids`: BERT's 80/10/10 masking; a target is
        IGNORE wherever a token is not predicted."""
        picked = (rng.random(ids.shape) < self.rate) & ~np.isin(ids, self.special_ids)
        targets = np.where(picked, ids, IGNORE)
        draw = rng.random(ids.shape)
        random_ids = self.normal_ids[rng.integers(len(self.normal_ids), size=ids.shape)]
        inputs = np.where(picked & (draw < 0.8), self.mask_id, ids)
        inputs = np.where(picked & (draw >= 0.8) & (draw < 0.9), random_ids, inputs)
        return inputs, targets


@dataclass
class Batch:
    inputs: torch.Tensor  # this rank's rows (rows, seq_len), masked
    targets: torch.Tensor  # the original ids where predicted, IGNORE elsewhere
    # The same rows' real (not padding) and predicted tokens, marked on the host: what
    # needs their positions finds them here, without asking the device (a sync).
    real: torch.Tensor
    predicted: torch.Tensor
    num_masked: int  # targets in the whole global batch (all ranks)
    num_tokens: int  # real (not padding) tokens in the whole global batch

    def to(self, device: torch.device) -> Batch:
        """The batch with its token ids and targets on `device`, their copies queued
        without waiting for them (dist.to_device); the marks stay on the host."""
        inputs, targets = dist.to_device((self.inputs, self.targets), device)
        return replace(self, inputs=inputs, targets=targets)


class Batches:
    """Global batches of masked sequences in a seeded, resumable order (no partial
    batch)."""

    def __init__(
        self,
        encoded: Encoded,
        seq_len: int,
        batch_size: int,
        masking: Masking,
        seed: int,
    ):
        self.encoded, self.seq_len, self.batch_size = encoded, seq_len, batch_size
        self.masking, self.seed = masking, seed
        self.batches_per_epoch = len(encoded) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the data holds {len(encoded)} training sequences, fewer than one "
                f"global batch of {batch_size}; use more data or a smaller "
                "global_batch_size"
            )
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        """The permutation of sequences for one epoch (computed once per epoch)."""
        if epoch != self._order_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order_epoch, self._order = epoch, rng.permutation(len(self.encoded))
        return self._order

    def get(self, epoch: int, index: int, rank: int = 0, world_size: int = 1) -> Batch:
        """This rank's share of batch `index` of `epoch`: the whole global batch is
        masked (so the masks do not depend on the world size), then split."""
        rows = self.order(epoch)[
            index * self.batch_size : (index + 1) * self.batch_size
        ]
        ids = self.encoded.rows(rows, self.seq_len, self.masking.pad_id)
        inputs, targets = self.masking.apply(
            ids, np.random.default_rng([self.seed, epoch, index, 1])
        )
        share = slice(
            rank * (self.batch_size // world_size),
            (rank + 1) * (self.batch_size // world_size),
        )
        real, predicted = ids != self.masking.pad_id, targets != IGNORE
        return Batch(
            *(torch.from_numpy(a[share]) for a in (inputs, targets, real, predicted)),
            num_masked=int(predicted.sum()),
            num_tokens=int(real.sum()),
        )


def val_batches(
    encoded: Encoded,
    seq_len: int,
    batch_size: int,
    masking: Masking,
    seed: int,
    limit: int,
) -> list[torch.Tensor]:
    """The validation sequences in a fixed order, masked once (the same masks at every
    evaluation): batches of (inputs, targets) stacked, (rows, 2, seq_len)."""
    batches = []
    for number, start in enumerate(range(0, len(encoded), batch_size)):
        rows = np.arange(start, min(start + batch_size, len(encoded)))
        ids = encoded.rows(rows, seq_len, masking.pad_id)
        inputs, targets = masking.apply(
            ids, np.random.default_rng([seed, 2**31, number])
        )
        batches.append(torch.from_numpy(np.stack([inputs, targets], axis=1)))
    return batches[: limit or None]
