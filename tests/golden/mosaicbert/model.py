"""BERT encoder and masked-LM head: post-LayerNorm layers, LayerNorms in bf16 under
autocast, ALiBi (a per-head linear distance penalty on the attention scores) instead of
position embeddings, gated linear unit MLP (gelu gate), output layer tied to the token
embedding.

Sizes follow BERT (Devlin et al. 2019); `tiny` trains at several steps per second on 2
CPU cores. Every sequence of a batch is padded to the same length; `keep` (True: a real
token) keeps padding out of every attention. Its algorithms change BERT's layout:
`to_encoder_export` writes the encoder as it is (`scaffold export --format hf`) for a
text_classification project of the bert pack with the same algorithms. Algorithms that
change the architecture are written in where they act, each fenced `# algorithm: NAME`
... `# end algorithm: NAME`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F

# algorithm: unpadding
import functools
from collections.abc import Callable

from torch.nn.attention.flex_attention import BlockMask, flex_attention

# end algorithm: unpadding

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


# algorithm: low_precision_layernorm
class LowPrecisionLayerNorm(nn.LayerNorm):
    """LayerNorm in the autocast dtype (bf16) instead of autocast's fp32: half the
    memory traffic of a memory-bound op. nn.LayerNorm's parameters and checkpoint
    keys; without autocast it is the plain LayerNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        device = x.device.type
        if not torch.is_autocast_enabled(device):
            return super().forward(x)
        dtype = torch.get_autocast_dtype(device)
        weight = None if self.weight is None else self.weight.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        with torch.autocast(device, enabled=False):
            return F.layer_norm(
                x.to(dtype), self.normalized_shape, weight, bias, self.eps
            )


# end algorithm: low_precision_layernorm


# algorithm: unpadding
# Unpadding (MosaicBERT): padding is gathered out of the layers' input, so every
# linear layer, LayerNorm and MLP computes for real tokens only, and attention runs
# over each sequence's own tokens (varlen): padding costs no FLOPs in the layers.
@dataclass
class Packed:
    """Where the real tokens of a padded batch went: `unpad` keeps them as one
    (tokens, width) stream, row after row; attention keeps each row to itself."""

    index: torch.Tensor  # (tokens,): each token's flat position in the batch
    row: torch.Tensor  # (tokens,): the row (sequence) of each token
    position: torch.Tensor  # (tokens,): its column in that row
    shape: tuple[int, int]  # (batch, seq): the padded batch's
    # FlexAttention's document mask (CUDA): a query sees its own row's keys only.
    block_mask: BlockMask | None
    # (head, query position, key position) -> added to the attention scores; set by
    # an algorithm that biases attention by position (alibi), else None.
    score_bias: Callable[..., torch.Tensor] | None = None


def unpad(x: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, Packed]:
    """x (batch, seq, width) -> its real tokens (tokens, width) and where they were.

    `tokens`: their flat positions, found on the host (train.py), so the number of real
    tokens, every output size here, is known without asking the device (a sync). On
    CUDA the block mask is built here, once for all layers (outside compiled code).
    """
    batch, seq = x.shape[:2]
    row, position = tokens // seq, tokens % seq
    block_mask = document_mask(row) if x.is_cuda and len(tokens) else None
    packed = Packed(tokens, row, position, (batch, seq), block_mask)
    return x.flatten(0, 1).index_select(0, tokens), packed


def document_mask(row: torch.Tensor, block: int = 128) -> BlockMask:
    """Which (query, key) pairs of the packed tokens may attend: those of one row. Made
    from each 128-token block's first and last row, not by create_block_mask, which
    evaluates every pair (tokens^2 work and memory per batch): the kernel skips the
    blocks that share no row, and masks pairs only in blocks that hold more than one."""
    tokens = len(row)
    starts = torch.arange(0, tokens, block, device=row.device)
    first, last = row[starts], row[(starts + block).clamp(max=tokens) - 1]
    # Each row is one run of the stream, so two blocks share a row iff their spans meet.
    shared = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    inside = first == last  # the block lies in one row
    if tokens % block:
        # The last block's tail is past the stream's end: the mask decides there.
        inside[-1] = False
    same = inside[:, None] & inside[None, :] & (first[:, None] == first[None, :])

    def same_row(batch, head, q_idx, kv_idx):
        return row[q_idx] == row[kv_idx]

    return BlockMask.from_kv_blocks(
        *kv_blocks(shared & ~same),  # blocks where same_row decides
        *kv_blocks(same),  # blocks attended whole
        BLOCK_SIZE=block,
        mask_mod=same_row,
        seq_lengths=(tokens, tokens),
    )


def kv_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(query block, key block) booleans -> FlexAttention's lists: each query block's
    number of key blocks, and their indices, first in the row."""
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    count = blocks.sum(-1, dtype=torch.int32)
    return count[None, None], order.to(torch.int32)[None, None]


def repad(x: torch.Tensor, keep: Packed) -> torch.Tensor:
    """Real tokens (tokens, width) back to (batch, seq, width), zeros at padding."""
    rows = x.new_zeros(keep.shape[0] * keep.shape[1], x.shape[-1])
    return rows.index_copy(0, keep.index, x).view(*keep.shape, -1)


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: Packed, dropout: float
) -> torch.Tensor:
    """q, k, v and the result (1, head, tokens, head_dim), every real token in one
    row: each token attends to its own sequence's tokens only, which is what SDPA
    over the padded rows computes at real tokens."""
    if q.is_cuda and dropout == 0.0 and q.shape[2] > 0:
        return flex_varlen_attention(q, k, v, keep)
    return padded_attention(q, k, v, keep, dropout)


@functools.cache
def compiled_flex_attention() -> Callable[..., torch.Tensor]:
    """FlexAttention compiled to one fused kernel, on first use: a CPU run never
    pays for torch.compile's import."""
    return torch.compile(flex_attention)


def flex_varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: Packed
) -> torch.Tensor:
    """CUDA without dropout (FlexAttention has none): the packed tokens as one
    sequence under the document mask, any score bias added inside the kernel from
    each token's position in its own sequence."""
    score_mod = None
    if keep.score_bias is not None:
        bias, position = keep.score_bias, keep.position

        def score_mod(score, batch, head, q_idx, kv_idx):
            return score + bias(head, position[q_idx], position[kv_idx])

    # Inside compiled layers (compile=True) their compilation fuses flex_attention.
    compiling = torch.compiler.is_compiling()
    attend = flex_attention if compiling else compiled_flex_attention()
    return attend(q, k, v, score_mod=score_mod, block_mask=keep.block_mask)


def padded_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: Packed, dropout: float
) -> torch.Tensor:
    """The CPU's path (FlexAttention has no backward there) and CUDA's with dropout (it
    has none), as MosaicBERT's with dropout: the tokens put back in their rows for SDPA,
    a real token attending to its own row's real tokens only, and taken out again.
    Here attention computes over the padding (the layers still do not); grouping the
    rows by length instead would need their lengths on the host, a sync."""
    batch, seq = keep.shape
    head, dim = q.shape[1], q.shape[3]

    def rows(t: torch.Tensor) -> torch.Tensor:  # -> (batch, head, seq, head_dim)
        padded = t.new_zeros(head, batch * seq, dim).index_copy(1, keep.index, t[0])
        return padded.view(head, batch, seq, dim).transpose(0, 1)

    real = torch.zeros(batch * seq, dtype=torch.bool, device=q.device)
    real = real.index_fill(0, keep.index, True).view(batch, 1, seq)
    # Real keys for real queries; a padding query (its output is dropped) sees every
    # key, so a row of padding only has no row of -inf scores (NaN).
    mask = real[..., None, :] | ~real[..., :, None]  # (batch, 1, seq, seq)
    if keep.score_bias is not None:
        position = torch.arange(seq, device=q.device)
        heads = torch.arange(head, device=q.device)[:, None, None]
        bias = keep.score_bias(heads, position[:, None], position[None, :])
        mask = bias.to(q.dtype).masked_fill(~mask, float("-inf"))
    y = F.scaled_dot_product_attention(
        rows(q), rows(k), rows(v), attn_mask=mask, dropout_p=dropout
    )
    y = y.transpose(0, 1).reshape(head, batch * seq, dim)
    return y.index_select(1, keep.index)[None]


# end algorithm: unpadding


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


# end algorithm: alibi


def layer_norm(width: int) -> nn.LayerNorm:
    """Every LayerNorm of the model: the embeddings', each layer's two, the head's."""

    # algorithm: low_precision_layernorm
    # Low-precision LayerNorm: under bf16 autocast, normalize in bf16 (BERT eps).
    return LowPrecisionLayerNorm(width, eps=1e-12)
    # end algorithm: low_precision_layernorm


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
        # algorithm: unpadding
        # All real tokens of the batch in one row, (1, tokens, 3*width); attention keeps
        # each sequence to itself (`keep`), so no padding is put back.
        qkv = qkv[None]
        # end algorithm: unpadding

        batch, seq, width = *qkv.shape[:2], qkv.shape[2] // 3
        # (batch, seq, 3*width) -> three (batch, head, seq, head_dim) tensors
        q, k, v = (
            t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
            for t in qkv.split(width, dim=2)
        )
        dropout = self.dropout if self.training else 0.0

        # algorithm: unpadding
        # Each real token attends to the tokens of its own sequence only (varlen).
        y = varlen_attention(q, k, v, keep, dropout)
        # end algorithm: unpadding

        y = y.transpose(1, 2).reshape(batch, seq, width)
        # algorithm: unpadding
        # Back to the (tokens, width) stream of real tokens.
        y = y[0]
        # end algorithm: unpadding

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
    """Token ids (batch, seq) -> masked-LM logits at the masked tokens."""

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
        # The masked-LM head (BERT's): dense, GELU, LayerNorm, then the token embedding
        # transposed (tied) plus a bias per token.
        self.head_fc = nn.Linear(config.n_embd, config.n_embd)
        self.head_ln = layer_norm(config.n_embd)
        self.head_bias = nn.Parameter(torch.zeros(config.vocab_size))
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
        self.head_bias.zero_()

    def encode(self, input_ids: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden states (batch, seq, n_embd).

        `tokens`: the flat (row-major) positions of the real tokens of input_ids, found
        on the host (train.py): the layers see those only."""
        seq = input_ids.shape[1]
        assert seq <= self.config.max_seq_len, f"sequence of {seq} > max_seq_len"

        # algorithm: alibi
        # No position embedding: positions enter as the attention bias.
        x = self.wte(input_ids)
        # end algorithm: alibi

        x = F.dropout(self.ln_e(x), self.config.dropout, self.training)
        # algorithm: unpadding
        # The layers see the real tokens only, as one (tokens, width) tensor; `keep` now
        # says which row and column each came from.
        x, keep = unpad(x, tokens)
        # end algorithm: unpadding

        # algorithm: alibi
        # Unpadded: unpadding's attention adds the distance penalty to the scores, from
        # each token's column in its own row (no dense bias is built).
        slopes = self.alibi_slopes
        keep.score_bias = lambda head, query, key: -slopes[head] * (query - key).abs()
        # end algorithm: alibi

        for block in self.blocks:
            x = block(x, keep)
        # algorithm: unpadding
        # Back to (batch, seq, width) for the head; padding positions hold zeros.
        x = repad(x, keep)
        # end algorithm: unpadding

        return x

    def forward(
        self, input_ids: torch.Tensor, predict: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """Masked-LM logits (predicted tokens, vocab) at `predict`, the flat (row-major)
        positions of the tokens to predict, found on the host (train.py), so no output
        size here depends on values only the device holds (that would be a host sync).
        As in Google's BERT (run_pretraining.py gathers `masked_lm_positions` before its
        head), the head computes there only."""
        h = self.encode(input_ids, tokens).flatten(0, 1)[predict]
        h = self.head_ln(F.gelu(self.head_fc(h)))
        return F.linear(h, self.wte.weight, self.head_bias)

    def num_params(self) -> int:
        """Parameter count (the tied output layer is the token embedding)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int, mask_rate: float) -> float:
        """Training FLOPs per token (forward + backward), for MFU: 6N + attention.

        6N: each weight is one multiply-add (2 FLOPs) forward and two backward; N
        counts the weights that multiply: the position table is looked up, and the
        token embedding counts once, as the output layer's matmul; the head's weights
        (its dense layer and the output layer) count at the `mask_rate` share of tokens
        it predicts. Attention: QK^T and the weighted sum of V, 2 * 2 * seq_len * width
        per layer forward, times 3 with backward (PaLM, appendix B), padding included.
        """
        lookups = sum(
            m.weight.numel()
            for m in self.modules()
            if isinstance(m, nn.Embedding) and m is not self.wte
        )
        head = self.head_fc.weight.numel() + self.wte.weight.numel()
        n = self.num_params() - lookups - head + mask_rate * head
        return 6 * n + 12 * self.config.n_layer * seq_len * self.config.n_embd


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


def to_encoder_export(
    weights: dict[str, torch.Tensor], config: EncoderConfig
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Our weights -> the encoder's config.json (its sizes and LAYOUT) and weights, the
    masked-LM head left out: what `scaffold export --format hf` writes for a
    text_classification project of the bert pack."""
    encoder = {
        k: v.contiguous() for k, v in weights.items() if not k.startswith("head_")
    }
    return {"scaffold_bert": asdict(config), "layout": LAYOUT}, encoder
