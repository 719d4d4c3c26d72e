"""GPT language model: pre-LayerNorm blocks, ALiBi (a per-head linear distance penalty
on the attention scores) instead of position embeddings, GELU MLP, output head tied to
the token embedding.

Sizes follow the GPT-2 paper; `tiny` trains at several steps per second on 2 CPU cores.
GPT-2's layout cannot hold it (changed by alibi): no Hugging Face GPT-2 mapping is
generated; `scaffold export` writes its weights as safetensors.
Algorithms that change the architecture are written in where they act, each fenced
`# algorithm: NAME` ... `# end algorithm: NAME`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

# algorithm: alibi
import functools
from collections.abc import Callable

from torch.nn.attention.flex_attention import (
    BlockMask,
    create_block_mask,
    flex_attention,
)

# end algorithm: alibi


@dataclass
class GPTConfig:
    vocab_size: int
    max_seq_len: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0


Preset = Literal["tiny", "small", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"]
# Size presets (layers, heads, width); the gpt2* entries are the released GPT-2 sizes.
PRESETS: dict[Preset, dict[str, int]] = {
    "tiny": dict(n_layer=4, n_head=4, n_embd=128),  # 0.8M: a CPU trains it in minutes
    "small": dict(n_layer=6, n_head=6, n_embd=384),  # 11M: nanoGPT's character model
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768),  # 124M parameters
    "gpt2-medium": dict(n_layer=24, n_head=16, n_embd=1024),  # 350M
    "gpt2-large": dict(n_layer=36, n_head=20, n_embd=1280),  # 774M
    "gpt2-xl": dict(n_layer=48, n_head=25, n_embd=1600),  # 1558M
}

# The depth dial (train.py --depth=N): a dN model is sized by its layer count alone, by
# nanochat's rule (karpathy/nanochat scripts/base_train.py, --aspect-ratio 64): width =
# 64 * depth; heads of 64 channels, GPT-2's (nanochat's --head-dim is 128), so d12 is
# GPT-2.
ASPECT_RATIO = 64  # width per layer
HEAD_DIM = 64  # channels per attention head
# The best batch grows as the token horizon^0.383, at a fixed tokens:parameters ratio as
# the parameters^0.383 (nanochat's fit, scripts/base_train.py, "D^0.383").
BATCH_EXPONENT = 0.383


def depth_sizes(depth: int) -> dict[str, int]:
    """A dN model's sizes: ASPECT_RATIO * depth wide, HEAD_DIM channels per head."""
    width = ASPECT_RATIO * depth
    return dict(n_layer=depth, n_head=width // HEAD_DIM, n_embd=width)


def model_sizes(model: str) -> dict[str, int]:
    """Layers, heads and width of a preset or of "dN" (depth_sizes); else ValueError."""
    if model in PRESETS:
        return PRESETS[model]
    if model.startswith("d") and model[1:].isdigit() and int(model[1:]) > 0:
        return depth_sizes(int(model[1:]))
    raise ValueError(
        f"unknown model {model!r}; use one of {', '.join(PRESETS)} or dN (N layers)"
    )


def depth_dial(cfg: Any) -> tuple[str, int, float]:
    """train.py's (model, global_batch_size, lr) after --depth (cfg: its Config):
    unchanged where depth is 0 or `model` is already d<depth> (a rerun of its
    config.toml), else "d<depth>" and the batch and lr depth_scaled from those given for
    `model`. ValueError on a bad value."""
    model, depth, batch_size, lr = cfg.model, cfg.depth, cfg.global_batch_size, cfg.lr
    reference = model_sizes(model)
    if depth < 0:
        raise ValueError(f"depth={depth}; use 0 (the model preset) or a layer count")
    if depth == 0 or model == f"d{depth}":
        return model, batch_size, lr
    return (f"d{depth}", *depth_scaled(depth, reference, batch_size, lr))


def depth_scaled(
    depth: int, reference: dict[str, int], batch_size: int, lr: float
) -> tuple[int, float]:
    """(global batch size, peak AdamW lr) of a dN model, from those for `reference`.

    nanochat's rules (scripts/base_train.py and gpt.py setup_optimizer), measured from
    the reference instead of its d12: the batch grows as the parameters^BATCH_EXPONENT
    (the blocks' matrices, 12 * layers * width^2; nanochat adds the head), rounded to a
    power of two; the lr grows as sqrt(batch / reference batch) (its batch_lr_scale) and
    falls as 1 / sqrt(width / reference width) (its dmodel_lr_scale for AdamW).
    """
    sizes = depth_sizes(depth)
    params = 12 * depth * sizes["n_embd"] ** 2
    params_ref = 12 * reference["n_layer"] * reference["n_embd"] ** 2
    ideal = batch_size * (params / params_ref) ** BATCH_EXPONENT
    scaled_batch = 2 ** max(0, round(math.log2(ideal)))
    lr_scale = math.sqrt(scaled_batch / batch_size)
    lr_scale /= math.sqrt(sizes["n_embd"] / reference["n_embd"])
    return scaled_batch, lr * lr_scale


# algorithm: alibi
# ALiBi (Press et al. 2022) replaces position embeddings with a fixed per-head
# penalty on attention scores that grows linearly with query-key distance: it
# trains faster and extrapolates to sequences longer than those seen in training.
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


def alibi_bias(slopes: torch.Tensor, seq_len: int, start: int = 0) -> torch.Tensor:
    """(n_head, seq_len, start + seq_len) attention bias: -slope * (i - j)
    for keys j <= i, on the slopes' device.

    Queries are at positions start .. start + seq_len - 1 (start > 0: after cached keys
    while sampling). Keys after the query get -inf, so the bias is also the causal mask.
    """
    query = torch.arange(start, start + seq_len, device=slopes.device)
    key = torch.arange(start + seq_len, device=slopes.device)
    distance = (query[:, None] - key[None, :]).float()  # i - j
    bias = -slopes[:, None, None] * distance
    return bias.masked_fill(distance < 0, float("-inf"))


@functools.cache
def fused_flex_attention() -> Callable[..., torch.Tensor]:
    """FlexAttention, compiled: one fused kernel that computes the ALiBi penalty from
    the indices as it goes, so the (heads, seq, seq) bias is never built or read.
    Compiled on first use: a CPU run (SDPA) never pays for torch.compile's import."""
    return torch.compile(flex_attention)


def alibi_uses_flex(device: torch.device, dropout: float) -> bool:
    """FlexAttention on CUDA without dropout (it has no dropout; on the CPU it has no
    backward): elsewhere, SDPA with the explicit bias."""
    return device.type == "cuda" and dropout == 0.0


@functools.lru_cache(maxsize=8)
def causal_block_mask(seq_len: int, device: torch.device) -> BlockMask:
    """The (query, key) blocks on or below the diagonal; FlexAttention skips others."""

    def causal(batch, head, q_idx, kv_idx):
        return q_idx >= kv_idx

    return create_block_mask(causal, None, None, seq_len, seq_len, device=device)


def alibi_flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: BlockMask,
    slopes: torch.Tensor,
) -> torch.Tensor:
    """Causal attention, -slope * (i - j) added to each head's scores in the kernel."""

    def alibi(score, batch, head, q_idx, kv_idx):
        return score - slopes[head] * (q_idx - kv_idx)

    # Inside compiled blocks (compile=True) the block's graph takes flex_attention as
    # it is (dynamo would trace through the cache, with a warning at every compile).
    compiling = torch.compiler.is_compiling()
    attend = flex_attention if compiling else fused_flex_attention()
    return attend(q, k, v, score_mod=alibi, block_mask=block_mask)


# end algorithm: alibi


def sample_token(
    logits: torch.Tensor,
    temperature: float,
    top_k: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(batch, vocab) logits -> (batch, 1) next tokens: the most likely at temperature
    0, else drawn from softmax(logits / temperature) over the top_k (0: all)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # Non-finite logits (a diverged model) become finite: a draw rather than an error.
    logits = torch.nan_to_num(logits / temperature)
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = F.softmax(logits, dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator)


class LayerCache:
    """One attention layer's keys and values of the tokens seen so far, for sampling
    (GPT.generate): each new token is then one forward of that token alone."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        """How many tokens are cached: the position of the next one."""
        return 0 if self.k is None else self.k.shape[2]

    def extend(
        self, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache this forward's keys and values; return all keys and values so far."""
        if self.k is not None:
            # Several tokens attend causally only from an empty cache (a prompt).
            assert k.shape[2] == 1, "after the prompt, one token per forward"
            k, v = torch.cat((self.k, k), dim=2), torch.cat((self.v, v), dim=2)
        self.k, self.v = k, v
        return k, v


def layer_norm(width: int) -> nn.LayerNorm:
    """The model's LayerNorm layers: each block's ln_1 and ln_2, and ln_f."""
    return nn.LayerNorm(width)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be divisible by n_head"
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(
        self, x: torch.Tensor, attn_bias: object, cache: LayerCache | None = None
    ) -> torch.Tensor:
        """Causal self-attention, `attn_bias` (from GPT.forward) added to its scores.

        `cache` (sampling): the earlier tokens' keys and values, extended in place.
        """
        batch, seq, width = x.shape
        # (batch, seq, 3*width) -> three (batch, head, seq, head_dim) tensors
        q, k, v = (
            t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        if cache is not None:
            k, v = cache.extend(k, v)  # the cached tokens' keys and values come first
        dropout = self.dropout if self.training else 0.0

        # algorithm: alibi
        if isinstance(attn_bias, tuple):  # (block mask, slopes): FlexAttention
            y = alibi_flex_attention(q, k, v, *attn_bias)
        else:
            # The per-head distance penalty on the scores is the causal mask too.
            # (A dense mask keeps SDPA off its flash kernel: the CPU and dropout path.)
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_bias.to(q.dtype), dropout_p=dropout
            )
        # end algorithm: alibi

        y = y.transpose(1, 2).reshape(batch, seq, width)
        return F.dropout(self.proj(y), dropout, self.training)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = F.gelu(h, approximate="tanh")
        return F.dropout(self.proj(h), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = layer_norm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = layer_norm(config.n_embd)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, attn_bias: object, cache: LayerCache | None = None
    ) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attn_bias, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
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

        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = layer_norm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Tied embeddings: the output projection reuses the token embedding matrix.
        self.lm_head.weight = self.wte.weight
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer)."""
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                module.reset_parameters()
            elif isinstance(module, (nn.Linear, nn.Embedding)):
                module.weight.normal_(0.0, 0.02)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                param.normal_(0.0, 0.02 / math.sqrt(2 * self.config.n_layer))

    def forward(
        self, idx: torch.Tensor, cache: list[LayerCache] | None = None
    ) -> torch.Tensor:
        """Token ids (batch, seq) -> next-token logits (batch, seq, vocab).

        `cache` (sampling, see generate): one LayerCache per block holding the keys and
        values of the tokens before idx; idx then holds only the new tokens.
        """
        seq = idx.shape[1]
        caches = cache or [None] * len(self.blocks)
        start = cache[0].length if cache else 0  # the position of idx's first token
        assert start + seq <= self.config.max_seq_len, f"{start + seq} > max_seq_len"

        # algorithm: alibi
        x = self.wte(idx)
        # end algorithm: alibi

        # attn_bias: added to every layer's attention scores.
        # algorithm: alibi
        dropout = self.config.dropout if self.training else 0.0
        if start == 0 and alibi_uses_flex(idx.device, dropout):
            # CUDA: FlexAttention adds the penalty in its kernel; it takes a block mask.
            attn_bias = (causal_block_mask(seq, idx.device), self.alibi_slopes)
        else:
            # One dense bias for all layers: these queries against every key
            # (the cached ones too).
            attn_bias = alibi_bias(self.alibi_slopes, seq, start=start)
        # end algorithm: alibi

        for block, layer_cache in zip(self.blocks, caches):
            x = block(x, attn_bias, layer_cache)
        logits = self.lm_head(self.ln_f(x))
        return logits

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Continue idx (batch, seq) with max_new_tokens sampled tokens (nanoGPT's).

        With a key/value cache: the prompt is one forward, then each new token one
        forward of that token alone. When the context is full, its newest half is read
        again into a fresh cache (one forward per max_seq_len / 2 tokens).
        """
        context = self.config.max_seq_len
        cache = None
        for _ in range(max_new_tokens):
            if cache is None or cache[0].length == context:
                # A fresh cache: the prompt, or the newest half of a full context.
                keep = context if idx.shape[1] < context else context // 2
                cache = [LayerCache() for _ in self.blocks]
                logits = self(idx[:, -keep:], cache)
            else:
                logits = self(idx[:, -1:], cache)
            next_token = sample_token(
                logits[:, -1].float(), temperature, top_k, generator
            )
            idx = torch.cat((idx, next_token), dim=1)
        return idx

    def num_params(self) -> int:
        """Parameter count, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), for MFU: 6N + attention.

        6N: each weight is one multiply-add (2 FLOPs) forward and two backward; N
        counts the weights that multiply, not embedding tables, which are looked up
        (the tied token embedding counts once: it is the output projection's matmul).
        Attention: QK^T and the weighted sum of V, 2 * 2 * seq_len * width per layer
        forward, times 3 with backward (PaLM, appendix B; the causal mask's skipped half
        is counted, as usual).
        """
        lookups = sum(
            module.weight.numel()
            for module in self.modules()
            if isinstance(module, nn.Embedding)
            and module.weight is not self.lm_head.weight
        )
        n = self.num_params() - lookups
        return 6 * n + 12 * self.config.n_layer * seq_len * self.config.n_embd


class ModelConfig(Protocol):
    """The fields of train.py's Config that choose and size the model."""

    model: str  # a preset (PRESETS) or dN
    seq_len: int
    dropout: float


def build_model(cfg: ModelConfig, vocab_size: int, device: torch.device) -> GPT:
    """GPT `cfg.model` on `device`, for `vocab_size` tokens and sequences of up to
    `cfg.seq_len`."""
    config = GPTConfig(
        vocab_size=vocab_size,
        max_seq_len=cfg.seq_len,
        dropout=cfg.dropout,
        **model_sizes(cfg.model),
    )
    model = GPT(config)
    return model.to(device)
