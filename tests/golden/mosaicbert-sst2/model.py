"""BERT encoder and a classifier on its [CLS] state: post-LayerNorm layers, ALiBi (a
per-head linear distance penalty on the attention scores) instead of position
embeddings, padding masked out of attention, gated linear unit MLP (gelu gate).

`--model=tiny` builds a small random encoder over a WordPiece tokenizer of the training
text's words; `--model=FOLDER` loads the encoder `scaffold export --format hf` wrote
from a masked_lm run of the bert pack, unchanged, with its tokenizer, when this model.py
renders the same algorithms (LAYOUT) as the project that pretrained it. Algorithms that
change the architecture are written in where they act, each fenced `# algorithm: NAME`
... `# end algorithm: NAME`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file

try:
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
except ModuleNotFoundError as missing:
    sys.exit(
        f"error: {missing.name} is not installed; this project needs the Hugging Face "
        "extra: pip install 'scaffold[hf]' (transformers, tokenizers, datasets, "
        "pyarrow)"
    )


# algorithm: alibi
import math

# end algorithm: alibi


@dataclass
class EncoderConfig:
    vocab_size: int  # embedding rows: the tokenizer's, padded (vocab_multiple)
    max_seq_len: int
    n_layer: int
    n_head: int
    n_embd: int
    pad_id: int  # the padding token: never attended to
    dropout: float = 0.0


Preset = Literal["tiny", "mini", "bert-base", "bert-large"]
# Size presets (layers, heads, width); bert-base and bert-large are BERT's (110M, 340M).
PRESETS: dict[Preset, dict[str, int]] = {
    "tiny": dict(n_layer=2, n_head=4, n_embd=128),  # a CPU trains it in minutes
    "mini": dict(n_layer=4, n_head=4, n_embd=256),  # Turc et al. 2019's BERT-Mini
    "bert-base": dict(n_layer=12, n_head=12, n_embd=768),
    "bert-large": dict(n_layer=24, n_head=16, n_embd=1024),
}


# algorithm: alibi
# ALiBi (Press et al. 2022) in an encoder (Composer's Alibi on BERT, MosaicBERT):
# instead of position embeddings, each head adds -slope * |i - j| to the scores,
# symmetric because every token attends both ways.
def alibi_slopes(n_head: int) -> torch.Tensor:
    """Per-head slopes for n heads: the geometric sequence 2^(-8/n), 2^(-16/n) ... 2^-8.

    For a head count that is not a power of two, take the slopes of the nearest lower
    power of two and fill up with every other slope of the next one (as in the paper).
    """

    def geometric(n: int) -> list[float]:
        ratio = 2 ** (-8 / n)
        return [ratio ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(n_head))
    slopes = geometric(closest)
    if closest < n_head:
        slopes += geometric(2 * closest)[0::2][: n_head - closest]
    return torch.tensor(slopes)


def alibi_encoder_bias(
    slopes: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(batch, n_head, seq, seq) additive attention bias: -slope * |i - j| between
    query i and key j, and the dtype's lowest value at padding keys (`keep` False).

    The lowest finite value, not -inf: a row of padding only (a piece of a split row)
    attends evenly instead of making NaN; its outputs are never predicted.
    """
    seq = keep.shape[-1]
    position = torch.arange(seq, device=keep.device)
    distance = (position[:, None] - position[None, :]).abs()
    bias = (-slopes[:, None, None] * distance).to(dtype)
    return bias.where(keep, torch.finfo(dtype).min)


# end algorithm: alibi


def layer_norm(width: int) -> nn.LayerNorm:
    """Every LayerNorm of the model: the embeddings', each layer's two, the head's."""
    return nn.LayerNorm(width, eps=1e-12)


class SelfAttention(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """Bidirectional self-attention over the real tokens (`keep`: batch, 1, 1,
        seq)."""
        qkv = self.qkv(x)
        batch, seq, width = *qkv.shape[:2], qkv.shape[2] // 3
        # (batch, seq, 3*width) -> three (batch, head, seq, head_dim) tensors
        q, k, v = (
            t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
            for t in qkv.split(width, dim=2)
        )
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout)
        y = y.transpose(1, 2).reshape(batch, seq, width)
        return F.dropout(self.proj(y), dropout, self.training)


class MLP(nn.Module):
    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()

        # algorithm: gated_linear_units
        # Composer's BERT form (MosaicBERT's BertGatedLinearUnitMLP): one bias-free
        # layer makes gate and value halves at BERT's width 4 * n_embd: 3 matrices
        # where BERT's MLP has 2 (more parameters, as Composer's).
        self.fc = nn.Linear(config.n_embd, 2 * 4 * config.n_embd, bias=False)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        # end algorithm: gated_linear_units

        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)

        # algorithm: gated_linear_units
        # The gate half (the first, as Composer's), through the activation, scales the
        # value half.
        gate, value = h.chunk(2, dim=-1)
        h = F.gelu(gate) * value  # exact GELU, BERT's own (GeGLU)
        # end algorithm: gated_linear_units

        return F.dropout(self.proj(h), self.dropout, self.training)


class Layer(nn.Module):
    """Post-LayerNorm encoder layer (BERT's): ln(x + attn(x)), then ln(x + mlp(x))."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(config)
        self.ln_1 = layer_norm(config.n_embd)
        self.mlp = MLP(config)
        self.ln_2 = layer_norm(config.n_embd)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.ln_1(x + self.attn(x, keep))
        return self.ln_2(x + self.mlp(x))


class Encoder(nn.Module):
    """Token ids (batch, seq) -> hidden states (batch, seq, n_embd)."""

    def __init__(self, config: EncoderConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)

        # algorithm: alibi
        # No position embedding: the per-head slopes of the distance penalty instead, on
        # the model's device (a buffer: moved with the model, not saved: a function of
        # n_head), so no forward copies them there.
        self.register_buffer(
            "alibi_slopes", alibi_slopes(config.n_head), persistent=False
        )
        # end algorithm: alibi

        self.ln_e = layer_norm(config.n_embd)
        self.blocks = nn.ModuleList(Layer(config) for _ in range(config.n_layer))
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """BERT's init: N(0, 0.02) weights, zero biases, unit LayerNorm gains."""
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden states (batch, seq, n_embd)."""
        seq = input_ids.shape[1]
        assert seq <= self.config.max_seq_len, f"sequence of {seq} > max_seq_len"
        # True where a real token is: padding is never attended to.
        keep = (input_ids != self.config.pad_id)[:, None, None, :]

        # algorithm: alibi
        # No position embedding: positions enter as the attention bias.
        x = self.wte(input_ids)
        # end algorithm: alibi

        x = F.dropout(self.ln_e(x), self.config.dropout, self.training)
        # algorithm: alibi
        # The distance penalty and the padding mask as one additive bias, every layer's
        # attention mask (a dense bias keeps SDPA off its flash kernel).
        keep = alibi_encoder_bias(self.alibi_slopes, keep, x.dtype)
        # end algorithm: alibi

        for block in self.blocks:
            x = block(x, keep)
        return x


# What the algorithms change in BERT's weights or function, each with what it makes of
# the encoder: `scaffold export` records it, and a fine-tune project loads the encoder
# only where its own model.py renders the same.
LAYOUT: dict[str, str] = {
    "gated_linear_units": "gated linear unit MLP (gelu gate)",
    "alibi": (
        "ALiBi (a per-head linear distance penalty on the attention "
        "scores) instead of position embeddings"
    ),
}


class Classifier(nn.Module):
    """Logits (batch, num_labels) from the encoder's state of each text's first token,
    [CLS]: BERT's pooler (dense, tanh), dropout, then a linear layer (as BERT's and
    MosaicBERT's BertForSequenceClassification)."""

    def __init__(self, config: EncoderConfig, num_labels: int) -> None:
        super().__init__()
        self.encoder = Encoder(config)
        self.pooler = nn.Linear(config.n_embd, config.n_embd)
        self.classifier = nn.Linear(config.n_embd, num_labels)
        self.dropout = config.dropout
        with torch.no_grad():  # BERT's init: N(0, 0.02) weights, zero biases
            for layer in (self.pooler, self.classifier):
                layer.weight.normal_(0.0, 0.02)
                layer.bias.zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        pooled = torch.tanh(self.pooler(self.encoder.encode(input_ids)[:, 0]))
        return self.classifier(F.dropout(pooled, self.dropout, self.training))


class ModelError(ValueError):
    """The model or tokenizer cannot be loaded; the message says why and what to do."""


def load_model(name: str, num_labels: int, tokenizer, max_seq_len: int) -> Classifier:
    """A classifier with a new `num_labels`-way head (seeded by the caller) on a random
    `tiny` encoder, or on the encoder of a masked_lm export, its weights unchanged."""
    if name == "tiny":
        config = EncoderConfig(
            len(tokenizer),
            max_seq_len,
            pad_id=tokenizer.pad_token_id,
            **PRESETS["tiny"],
        )
        return Classifier(config, num_labels)
    config, weights = read_export(name)
    if len(tokenizer) > config.vocab_size:
        raise ModelError(
            f"--model={name}: its tokenizer has {len(tokenizer)} tokens but the "
            f"encoder embeds only {config.vocab_size}; they do not belong together"
        )
    if max_seq_len > config.max_seq_len:
        if "wpe.weight" in weights:  # a position table: no longer texts
            most = config.max_seq_len
            raise ModelError(
                f"--max_seq_len={max_seq_len} is longer than {name}'s {most} "
                f"positions; use --max_seq_len={most} or less"
            )
        config = replace(config, max_seq_len=max_seq_len)
    model = Classifier(config, num_labels)
    model.encoder.load_state_dict(weights)  # every weight, as exported
    return model


def read_export(name: str) -> tuple[EncoderConfig, dict[str, torch.Tensor]]:
    """The encoder's sizes and weights from the folder `scaffold export --format hf`
    wrote; refused unless this model.py renders the LAYOUT that trained them."""
    try:
        exported = json.loads((Path(name) / "config.json").read_text())
    except (OSError, ValueError) as error:
        raise ModelError(
            f"--model={name}: no readable config.json ({type(error).__name__}); pass "
            "tiny or a folder `scaffold export --format hf` wrote from a masked_lm run"
        ) from None
    if "scaffold_bert" not in exported:
        raise ModelError(
            f"--model={name}: not an encoder exported from a masked_lm project of the "
            "bert pack; a Hugging Face folder fine-tunes in a project generated with "
            "--set model_family=hf"
        )
    if exported["layout"] != LAYOUT:
        ours, theirs = (
            ", ".join(f"{k} ({v})" for k, v in layout.items()) or "BERT's layout"
            for layout in (LAYOUT, exported["layout"])
        )
        raise ModelError(
            f"--model={name}: its encoder was pretrained with {theirs}, this "
            f"project's model.py renders {ours}; fine-tune it in a project generated "
            "with the same algorithms (mosaicbert's: scaffold new --recipe "
            "mosaicbert-sst2 DIR)"
        )
    return EncoderConfig(**exported["scaffold_bert"]), load_file(
        Path(name) / "model.safetensors"
    )


def transformer_blocks(model: Classifier) -> list[nn.Module]:
    """The encoder's layers: each its own FSDP unit."""
    return list(model.encoder.blocks)


# The offline `tiny` tokenizer's size and BERT's special tokens.
TINY_VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def load_tokenizer(name: str, texts: list[str]) -> transformers.PreTrainedTokenizerBase:
    """The tokenizer of `name`; for `tiny`, WordPiece over the words of `texts`."""
    if name == "tiny":
        tokenizer = Tokenizer(
            models.WordPiece(tiny_vocabulary(texts), unk_token="[UNK]")
        )
        tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
        tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        return transformers.BertTokenizerFast(tokenizer_object=tokenizer)
    try:
        return transformers.AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise ModelError(not_found(name, "tokenizer", error)) from None


def tiny_vocabulary(texts: list[str]) -> dict[str, int]:
    """WordPiece vocabulary for `tiny`: every character (alone and as a word piece) and
    the most frequent whole words, ties broken alphabetically. Deterministic, unlike
    tokenizers' trainer (its merges vary from run to run), so a resumed run gets the
    same token ids."""
    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(
            word
            for word, _ in pre_tokenizer.pre_tokenize_str(
                normalizer.normalize_str(text)
            )
        )
    chars = sorted({char for word in counts for char in word})
    words = sorted(counts, key=lambda word: (-counts[word], word))
    tokens = SPECIAL_TOKENS + chars + [f"##{char}" for char in chars]
    tokens += [word for word in words if len(word) > 1][
        : max(0, TINY_VOCAB_SIZE - len(tokens))
    ]
    return {token: i for i, token in enumerate(tokens)}


def not_found(name: str, what: str, error: Exception) -> str:
    first = (
        str(error).strip().splitlines()[0]
        if str(error).strip()
        else type(error).__name__
    )
    return (
        f"--model={name}: cannot load its {what} ({first}); pass a folder written by "
        "save_pretrained, or a hub id with network access once (then it is cached)"
    )
