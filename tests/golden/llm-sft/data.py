"""Training data: plain text or conversations, tokenized by the model's own tokenizer,
packed into rows, and a resumable batch order.

`--data_format=text` (continued pretraining) reads a text file or a folder of text
files, one document per file; every token is a target. `--data_format=chat` (instruction
tuning) reads JSON Lines, one conversation per line: `{"messages": [{"role": "user",
"content": ...}, {"role": "assistant", "content": ...}, ...]}` or `{"prompt": ...,
"response": ...}`, rendered with the tokenizer's chat template; only the assistant's
tokens are targets (the loss is on the answers, not on the questions).

Without `--data`, both read Python's own documentation, offline: `pydoc_data.topics`
(the text `help("assert")` prints), as 79 topic documents, or as question/answer pairs
made from its section headings and their first paragraphs (`topic_pairs`).

A document of n tokens is n - 1 (input, next-token target) pairs. Packing puts several
documents in one row of seq_len pairs; `position_ids` restart at 0 with each document,
and transformers' attention mask keeps every token to its own document (a document
starts where the positions restart: `masking_utils.find_packed_sequence_indices`), so a
packed row computes exactly what its documents would alone. A document longer than a
row is cut into rows of seq_len pairs. Without packing, each document has its own row,
padded. Epoch e visits the rows in a permutation seeded by (seed, e): any batch is a
pure function of (seed, epoch, batch index), the same on any number of ranks.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# The label of a position that is not trained on (cross_entropy's ignore_index).
IGNORE = -100
# Held-out share of the documents or conversations when --val_data is not given.
VAL_FRACTION = 0.1
# A section heading of pydoc_data.topics: a line underlined by a line of * = - ~ or ^.
HEADING = re.compile(r"^(\S[^\n]*)\n[*=\-~^]{3,}\n\n(.+?)(?:\n\n|\Z)", re.M | re.S)


@dataclass
class Texts:
    train: list  # documents (str) or conversations (lists of messages)
    val: list
    source: str  # where they came from, for the log

    def words(self) -> list[str]:
        """All the text, for training `tiny`'s tokenizer."""
        items = self.train + self.val
        if items and isinstance(items[0], str):
            return items
        return [message["content"] for messages in items for message in messages]


def load_texts(data: str, val_data: str, data_format: str, seed: int) -> Texts:
    """The documents (text) or conversations (chat) named by --data and --val_data."""
    if not data:
        if data_format == "text":
            items, source = topic_documents()
        else:
            items, source = topic_pairs()
    else:
        items, source = read_items(data, data_format)
    if val_data:
        val = read_items(val_data, data_format)[0]
        return Texts(items, val, f"{source}; validation: {val_data}")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)  # a seeded share is held out
    held = max(1, int(len(items) * VAL_FRACTION))
    if len(items) < 2:
        raise ValueError(
            f"{source} holds {len(items)} item(s); train and validation need 2 or more"
        )
    val = [items[i] for i in sorted(order[:held])]
    return Texts([items[i] for i in sorted(order[held:])], val, source)


def read_items(data: str, data_format: str) -> tuple[list, str]:
    path = Path(data).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"--data={data}: no such file or folder; pass "
            + (
                "a text file or a folder of them"
                if data_format == "text"
                else "a .jsonl file"
            )
            + ", or leave it empty for the default"
        )
    if data_format == "chat":
        return read_conversations(path), f"conversations in {path}"
    files = (
        sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    )
    texts = [p.read_text(errors="replace") for p in files if not p.name.startswith(".")]
    return [text for text in texts if text.strip()], f"text files under {path}"


def read_conversations(path: Path) -> list[list[dict]]:
    """One conversation per JSON line; every problem names its line."""
    conversations = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            where = f"{path} line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{where}: not JSON ({error.msg}); one object per line"
                ) from None
            conversations.append(conversation(row, where))
    return conversations


def conversation(row: object, where: str) -> list[dict]:
    """The messages of one JSON line: `messages`, or `prompt` and `response`."""
    if isinstance(row, dict) and "prompt" in row and "response" in row:
        row = {
            "messages": [
                {"role": "user", "content": row["prompt"]},
                {"role": "assistant", "content": row["response"]},
            ]
        }
    messages = row.get("messages") if isinstance(row, dict) else None
    if not isinstance(messages, list) or not all(
        isinstance(m, dict)
        and isinstance(m.get("role"), str)
        and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise ValueError(
            f"{where}: expected "
            + '{"messages": [{"role": ..., "content": ...}, ...]} or '
            + '{"prompt": ..., "response": ...} (strings)'
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(
            f"{where}: the conversation has no assistant turn, so nothing to learn; "
            + 'add a {"role": "assistant", "content": ...} message or drop the line'
        )
    return messages


def topic_documents() -> tuple[list[str], str]:
    """Python's documentation topics as documents."""
    from pydoc_data import topics

    texts = [topics.topics[key] for key in sorted(topics.topics)]
    python = f"pydoc_data.topics (Python {sys.version.split()[0]})"
    return texts, f"{python}: {len(texts)} topics, sha256 {digest(texts)}"


def topic_pairs() -> tuple[list[list[dict]], str]:
    """Questions and answers from Python's documentation topics: for each section
    heading, "What is <heading> in Python?" answered by its first paragraph (at most
    two sentences)."""
    from pydoc_data import topics

    pairs = []
    for key in sorted(topics.topics):
        for heading, paragraph in HEADING.findall(topics.topics[key]):
            answer = " ".join(paragraph.split())
            answer = " ".join(re.split(r"(?<=\.)\s", answer)[:2])
            question = f"What is {heading.strip()} in Python?"
            pairs.append(
                [
                    {"role": "user", "content": question},
                    {"role": "assistant", "content": answer},
                ]
            )
    python = f"pydoc_data.topics (Python {sys.version.split()[0]})"
    return (
        pairs,
        f"{python}: {len(pairs)} question/answer pairs, sha256 {digest(pairs)}",
    )


def digest(items: list) -> str:
    """The first 12 hex digits of the sha256 of the items as JSON: names the data."""
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:12]


@dataclass
class Document:
    ids: np.ndarray  # token ids
    targets: np.ndarray  # bool per token: trained on as a next-token target


def tokenize(items: list, tokenizer, data_format: str) -> list[Document]:
    if data_format == "text":
        return [text_document(text, tokenizer) for text in items]
    return [
        chat_document(messages, tokenizer, f"conversation {i}")
        for i, messages in enumerate(items)
    ]


def text_document(text: str, tokenizer) -> Document:
    """Start token (if the tokenizer has one), the text's tokens, end token: all are
    targets."""
    ids = tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    if tokenizer.bos_token_id is not None:
        ids = [tokenizer.bos_token_id] + ids
    return Document(np.array(ids, dtype=np.int64), np.ones(len(ids), dtype=bool))


def chat_document(messages: list[dict], tokenizer, where: str) -> Document:
    """A conversation rendered by the chat template; its assistant turns' tokens are
    the targets.

    Each assistant turn is the text the template adds between the conversation before
    it with the generation prompt and the conversation up to it (its content and end
    marker); a token is a target where it starts inside such a span. Any template that
    renders a conversation's turns as prefixes of the whole works.
    """
    text = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            before = render(tokenizer, messages[:i], generation_prompt=True)
            upto = render(tokenizer, messages[: i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(
                    f"{where}: the chat template does not render the turns as prefixes "
                    "of the whole conversation, so the answers cannot be found; use a "
                    "template that appends turn by turn (--chat_template=FILE)"
                )
            spans.append((len(before), len(upto)))
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    targets = [
        any(a <= start < b for a, b in spans) for start, _ in encoded.offset_mapping
    ]
    return Document(
        np.array(encoded.input_ids, dtype=np.int64), np.array(targets, dtype=bool)
    )


def render(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation_prompt
    )


@dataclass
class Rows:
    """Rows of seq_len (input, target) pairs."""

    input_ids: torch.Tensor  # (rows, seq_len)
    labels: torch.Tensor  # the next token where it is a target, else IGNORE
    position_ids: torch.Tensor  # 0, 1, ... from each document's start
    real: torch.Tensor  # (rows,) tokens of each row that are not padding

    def __len__(self) -> int:
        return len(self.input_ids)

    def take(self, ids: np.ndarray | slice) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids[ids],
            "labels": self.labels[ids],
            "position_ids": self.position_ids[ids],
        }


def pack(documents: list[Document], seq_len: int, pad_id: int, packing: bool) -> Rows:
    """Documents into rows: several per row in order while they fit (packing), else one
    per row; the padding at a row's end is its own document (positions from 0)."""
    pieces = []  # (inputs, labels) of at most seq_len pairs
    for doc in documents:
        inputs, labels = doc.ids[:-1], np.where(doc.targets[1:], doc.ids[1:], IGNORE)
        for start in range(0, len(inputs), seq_len):
            pieces.append(
                (inputs[start : start + seq_len], labels[start : start + seq_len])
            )
    rows, row, filled = [], [], 0
    for piece in pieces:
        if row and (not packing or filled + len(piece[0]) > seq_len):
            rows.append(row)
            row, filled = [], 0
        row.append(piece)
        filled += len(piece[0])
    rows += [row] if row else []
    input_ids = np.full((len(rows), seq_len), pad_id, dtype=np.int64)
    label_ids = np.full((len(rows), seq_len), IGNORE, dtype=np.int64)
    position_ids = np.zeros((len(rows), seq_len), dtype=np.int64)
    real = np.zeros(len(rows), dtype=np.int64)
    for r, row in enumerate(rows):
        at = 0
        for inputs, labels in row:
            input_ids[r, at : at + len(inputs)] = inputs
            label_ids[r, at : at + len(inputs)] = labels
            position_ids[r, at : at + len(inputs)] = np.arange(len(inputs))
            at += len(inputs)
        position_ids[r, at:] = np.arange(seq_len - at)
        real[r] = at
    return Rows(
        *(torch.from_numpy(a) for a in (input_ids, label_ids, position_ids, real))
    )


class Batches:
    """Global batches of rows in a seeded, resumable order (no partial batch)."""

    def __init__(
        self, rows: Rows, batch_size: int, seed: int, pin_memory: bool = False
    ):
        self.rows = rows
        self.batch_size = batch_size
        self.seed = seed
        self.pin_memory = pin_memory  # page-locked: asynchronous copies to a GPU
        self.batches_per_epoch = len(rows) // batch_size
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the data fills {len(rows)} rows, fewer than one global batch of "
                f"{batch_size}; use more data or a smaller global_batch_size or seq_len"
            )

    def ids(self, epoch: int, index: int) -> np.ndarray:
        """The rows of global batch `index` of `epoch`."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))
        return order[index * self.batch_size : (index + 1) * self.batch_size]

    def get(
        self, epoch: int, index: int, rank: int = 0, world_size: int = 1
    ) -> dict[str, torch.Tensor]:
        """This rank's share of batch `index` of `epoch`: (batch/world, seq_len)."""
        share = self.batch_size // world_size
        batch = self.rows.take(
            self.ids(epoch, index)[rank * share : (rank + 1) * share]
        )
        return (
            {k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch
        )

    def num_targets(self, epoch: int, index: int) -> int:
        """Target tokens in the whole global batch (all ranks): the loss's divisor."""
        return int((self.rows.labels[self.ids(epoch, index)] != IGNORE).sum())

    def num_tokens(self, epoch: int, index: int) -> int:
        """Tokens in the whole global batch that are not padding: the throughput's."""
        return int(self.rows.real[self.ids(epoch, index)].sum())


def val_batches(
    rows: Rows, batch_size: int, max_batches: int
) -> list[dict[str, torch.Tensor]]:
    """The first `max_batches` batches of validation rows, in a fixed order."""
    count = min(len(rows), batch_size * max_batches)
    return [
        rows.take(slice(i, min(i + batch_size, count)))
        for i in range(0, count, batch_size)
    ]
