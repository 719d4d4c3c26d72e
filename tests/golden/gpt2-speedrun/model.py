"""GPT language model: pre-LayerNorm blocks, rotary position embeddings on q and k, a
bigram hash embedding (5 x vocabulary rows) added to the token embedding, QK-norm, ReLU²
MLP, an untied, zero-initialised output head; zero-initialised residual projections,
logits soft-capped at 15.0 (tanh).

Sizes follow the GPT-2 paper; `tiny` trains at several steps per second on 2 CPU cores.
GPT-2's layout cannot hold it (changed by bigram_hash_embedding, logit_softcap, qk_norm,
relu_squared, rotary, zero_init): no Hugging Face GPT-2 mapping is generated; `scaffold
export` writes its weights as safetensors.
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


# algorithm: bigram_hash_embedding
def bigram_hash(idx: torch.Tensor, rows: int) -> torch.Tensor:
    """Row of the bigram table for each position: a hash of (previous token, token).

    The record's hash (modded-nanogpt 2026-01-19_BigramHashEmbedding, get_bigram_hash):
    xor of the two ids times large odd numbers, modulo rows - 1; the first position of
    each sequence, which has no previous token, takes the reserved last row.
    """
    mod = rows - 1
    out = torch.full_like(idx, mod)
    out[:, 1:] = torch.bitwise_xor(36313 * idx[:, 1:], 27191 * idx[:, :-1]) % mod
    return out


# end algorithm: bigram_hash_embedding


# algorithm: rotary
# Rotary embeddings (Su et al. 2021): turn pairs of q and k dimensions by an
# angle proportional to the position, so q.k depends only on the offset i - j.
def rotary(
    x: torch.Tensor, base: float, fraction: float, start: int = 0
) -> torch.Tensor:
    """x (batch, head, seq, head_dim), its first `fraction` of dims rotated by position
    (start, start + 1, ...).

    Dims d and d + r/2 (d < r/2, r rotated dims) form a pair that turns by the angle
    position * base^(-2d/r); the remaining head_dim - r dims pass through unchanged.
    """
    seq, head_dim = x.shape[-2], x.shape[-1]
    half = int(head_dim * fraction) // 2
    inv_freq = base ** (
        -torch.arange(half, device=x.device, dtype=torch.float32) / half
    )
    position = torch.arange(start, start + seq, device=x.device, dtype=torch.float32)
    angle = position[:, None] * inv_freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)  # (seq, half)
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest), dim=-1)


# end algorithm: rotary


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
        # algorithm: qk_norm
        # QK-norm: an RMS norm over each head's dims of q and of k.
        head_dim = config.n_embd // config.n_head
        self.q_norm = nn.RMSNorm(head_dim, elementwise_affine=False)
        self.k_norm = nn.RMSNorm(head_dim, elementwise_affine=False)
        # end algorithm: qk_norm

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """Causal self-attention.

        `cache` (sampling): the earlier tokens' keys and values, extended in place.
        """
        batch, seq, width = x.shape
        # (batch, seq, 3*width) -> three (batch, head, seq, head_dim) tensors
        q, k, v = (
            t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)
            for t in self.qkv(x).split(width, dim=2)
        )
        # algorithm: qk_norm
        # Unit-RMS q and k bound the attention logits (stable at high learning rates).
        q, k = self.q_norm(q), self.k_norm(k)
        # end algorithm: qk_norm

        # algorithm: rotary
        # Encode positions by rotating q and k (the values are not rotated); sampling
        # with a cache: the new tokens' positions start after the cached ones.
        start = 0 if cache is None else cache.length
        q = rotary(q, base=10000.0, fraction=1.0, start=start)
        k = rotary(k, base=10000.0, fraction=1.0, start=start)
        # end algorithm: rotary

        if cache is not None:
            k, v = cache.extend(k, v)  # the cached tokens' keys and values come first
        dropout = self.dropout if self.training else 0.0
        # Causal; one new token after a cache attends to every key (no mask).
        causal = q.shape[2] > 1
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout)
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

        # algorithm: relu_squared
        # ReLU squared (Primer): sparse like ReLU, smooth at zero; faster than GELU.
        h = F.relu(h).square()
        # end algorithm: relu_squared

        return F.dropout(self.proj(h), self.dropout, self.training)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = layer_norm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = layer_norm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = layer_norm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # algorithm: bigram_hash_embedding
        # Bigram hash embedding: table_factor x vocabulary rows, one looked up per
        # (previous token, token) hash, scaled by a learned gain (0.1 at first, as in
        # the record).
        self.bigram_embed = nn.Embedding(5 * config.vocab_size, config.n_embd)
        self.bigram_lambda = nn.Parameter(torch.full((1,), 0.1))
        # end algorithm: bigram_hash_embedding

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
        # algorithm: bigram_hash_embedding
        # The bigram table starts at zero: the model starts as if it were not there.
        self.bigram_embed.weight.zero_()
        # end algorithm: bigram_hash_embedding

        # algorithm: zero_init
        # Zero-initialised residual projections and head: every block starts as the
        # identity and the first prediction is uniform (loss = ln(vocab_size)).
        for block in self.blocks:
            block.attn.proj.weight.zero_()
            block.mlp.proj.weight.zero_()
        self.lm_head.weight.zero_()
        # end algorithm: zero_init

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

        # algorithm: rotary
        x = self.wte(idx)
        # end algorithm: rotary

        # algorithm: bigram_hash_embedding
        # Add the bigram table's row for (previous token, token) to every position.
        x = x + self.bigram_lambda * self.bigram_embed(
            bigram_hash(idx, self.bigram_embed.num_embeddings)
        )
        # end algorithm: bigram_hash_embedding

        for block, layer_cache in zip(self.blocks, caches):
            x = block(x, layer_cache)
        logits = self.lm_head(self.ln_f(x))
        # algorithm: logit_softcap
        # Soft-cap: |logits| < cap, nearly unchanged where small (Gemma 2, speedrun).
        logits = 15.0 * torch.tanh(logits / 15.0)
        # end algorithm: logit_softcap

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
        """Parameter count."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), for MFU: 6N + attention.

        6N: each weight is one multiply-add (2 FLOPs) forward and two backward; N
        counts the weights that multiply, not embedding tables, which are looked up.
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
