"""GPT-2 language model: pre-LayerNorm blocks, learned position embeddings, GELU MLP,
output head tied to the token embedding.

Sizes follow the GPT-2 paper; `tiny` trains at several steps per second on 2 CPU cores.
This is GPT-2's layout: Hugging Face GPT2LMHeadModel weights load into it (train.py
--init_from, through from_hf_gpt2 below) and export from it (`scaffold export --format
hf`, through to_hf_gpt2).
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
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from runtime import hf


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
        self.head_dim = config.n_embd // config.n_head
        # Queries, keys, values: three layers, which tensor parallelism splits by heads.
        self.q = nn.Linear(config.n_embd, config.n_embd)
        self.k = nn.Linear(config.n_embd, config.n_embd)
        self.v = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        """Causal self-attention.

        `cache` (sampling): the earlier tokens' keys and values, extended in place.
        """
        batch, seq, _ = x.shape
        # Three (batch, head, seq, head_dim) tensors; under tensor parallelism this
        # rank's heads only (-1: n_head / tensor_parallel of them).
        q, k, v = (
            layer(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for layer in (self.q, self.k, self.v)
        )
        if cache is not None:
            k, v = cache.extend(k, v)  # the cached tokens' keys and values come first
        dropout = self.dropout if self.training else 0.0
        # Causal; one new token after a cache attends to every key (no mask).
        causal = q.shape[2] > 1
        y = F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout)
        y = y.transpose(1, 2).reshape(batch, seq, -1)
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

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.max_seq_len, config.n_embd)
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
        position = torch.arange(start, start + seq, device=idx.device)
        x = self.wte(idx) + self.wpe(position)
        for block, layer_cache in zip(self.blocks, caches):
            x = block(x, layer_cache)
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


def tensor_parallel_plan(model: nn.Module) -> dict[str, ParallelStyle]:
    """How tensor parallelism splits each layer kind over the "tp" ranks (train.py
    --tensor_parallel), as torchtitan's parallelize_llama splits Llama's, sequence
    parallel included: between the attention and the MLP the activations are split by
    sequence position (LayerNorms run on the split), all-gathered at each layer's
    input; q, k, v and the MLP's fc split by output columns (heads, hidden units), the
    projections back by input rows, reduce-scattered to the sequence split. The token
    embedding and the tied output layer split the vocabulary (the loss runs on the
    split: train.py's loss_parallel); the position embedding splits its positions."""
    return {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "blocks.*.ln_1": SequenceParallel(),
        "blocks.*.attn": PrepareModuleInput(
            input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
        ),
        "blocks.*.attn.q": ColwiseParallel(),
        "blocks.*.attn.k": ColwiseParallel(),
        "blocks.*.attn.v": ColwiseParallel(),
        "blocks.*.attn.proj": RowwiseParallel(output_layouts=Shard(1)),
        "blocks.*.ln_2": SequenceParallel(),
        "blocks.*.mlp": PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        ),
        "blocks.*.mlp.fc": ColwiseParallel(),
        "blocks.*.mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_f": SequenceParallel(),
        # Logits stay split by vocabulary (a DTensor) for the loss.
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        ),
    }


def tensor_parallel_problem(model: nn.Module, tp: int) -> str | None:
    """Why tensor_parallel_plan cannot split this model over `tp` ranks (one line naming
    the fix), or None."""
    config = model.config
    sizes = dict(
        n_head=config.n_head,
        vocab_size=config.vocab_size,
        seq_len=config.max_seq_len,
    )
    for name, size in sizes.items():
        if size % tp:
            return (
                f"tensor_parallel={tp} does not divide {name}={size}; pick a "
                f"tensor_parallel that does, or a {name} that is a multiple of {tp}"
                + (
                    " (e.g. --vocab_size=50304 for GPT-2's)"
                    if name == "vocab_size"
                    else ""
                )
            )
    if tp > 1 and config.dropout:
        return f"dropout={config.dropout} is not split by tensor_parallel; use 0"
    return None


class ModelConfig(Protocol):
    """The fields of train.py's Config that choose and size the model."""

    model: str  # a preset (PRESETS) or dN
    seq_len: int
    dropout: float
    init_from: str


def build_model(
    cfg: ModelConfig, vocab_size: int, device: torch.device, init: bool = True
) -> GPT:
    """GPT `cfg.model` on `device`, for `vocab_size` tokens and sequences of up to
    `cfg.seq_len`; with `init` (a run that resumes takes its weights from its
    checkpoint instead), init_from's GPT-2 weights, read and checked (sizes,
    vocabulary, positions) before anything is written: ValueError (one line, naming
    init_from) where they do not fit."""
    config = GPTConfig(
        vocab_size=vocab_size,
        max_seq_len=cfg.seq_len,
        dropout=cfg.dropout,
        **model_sizes(cfg.model),
    )
    model = GPT(config)
    if cfg.init_from and init:
        try:
            weights = from_hf_gpt2(*hf.read_gpt2(cfg.init_from), config)
        except ValueError as error:
            raise ValueError(f"init_from={cfg.init_from}: {error}") from None
        model.load_state_dict(weights)  # every weight; lm_head re-tied to wte
    return model.to(device)


# Hugging Face GPT-2 (`GPT2LMHeadModel`) weights in (train.py --init_from) and out
# (`scaffold export --format hf`). Same architecture, other names, and GPT-2's Conv1D
# layers store their weight as (in, out): the transpose of nn.Linear's (out, in).
# ours -> GPT-2's, inside each block; True: a Conv1D (its weight transposed)
HF_BLOCK_NAMES = {
    "ln_1": ("ln_1", False),
    "attn.q": ("attn.c_attn", True),
    "attn.k": ("attn.c_attn", True),
    "attn.v": ("attn.c_attn", True),
    "attn.proj": ("attn.c_proj", True),
    "ln_2": ("ln_2", False),
    "mlp.fc": ("mlp.c_fc", True),
    "mlp.proj": ("mlp.c_proj", True),
}
# q, k and v sit side by side in GPT-2's c_attn (its output columns, in that order).
QKV_THIRDS = {"q": 0, "k": 1, "v": 2}


def hf_gpt2_names(n_layer: int) -> dict[str, tuple[str, bool]]:
    """Our parameter name -> (GPT2LMHeadModel's name, transposed) for every weight.

    lm_head.weight is not listed: both models tie it to the token embedding.
    """
    names = {"wte.weight": ("transformer.wte.weight", False)}
    names["wpe.weight"] = ("transformer.wpe.weight", False)
    names["ln_f.weight"] = ("transformer.ln_f.weight", False)
    names["ln_f.bias"] = ("transformer.ln_f.bias", False)
    for i in range(n_layer):
        for ours, (theirs, conv1d) in HF_BLOCK_NAMES.items():
            for kind in ("weight", "bias"):
                transposed = conv1d and kind == "weight"
                names[f"blocks.{i}.{ours}.{kind}"] = (
                    f"transformer.h.{i}.{theirs}.{kind}",
                    transposed,
                )
    return names


def matching_preset(sizes: dict[str, int]) -> str:
    """What to pass for a checkpoint of these sizes: its preset, or how to add one."""
    found = [name for name, preset in PRESETS.items() if preset == sizes]
    return (
        f"pass --model={found[0]}"
        if found
        else "add a preset of those sizes to PRESETS"
    )


def from_hf_gpt2(
    hf_config: dict[str, object], hf_weights: dict[str, torch.Tensor], config: GPTConfig
) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's config and weights -> a state dict for GPT(config).

    Raises ValueError naming the first mismatch. The position table is cut to
    config.max_seq_len rows (a model may train on shorter sequences than GPT-2's).
    """
    theirs = {k.removeprefix("transformer."): v for k, v in hf_weights.items()}
    sizes = {k: int(hf_config[k]) for k in ("n_layer", "n_head", "n_embd")}
    ours = dict(n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd)
    if sizes != ours:
        raise ValueError(
            f"the checkpoint has {sizes}, the model {ours}: {matching_preset(sizes)}"
        )
    # Settings of GPT-2 variants that compute another function than this model does.
    allowed = {
        "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # both tanh GELU
        "n_inner": (None, 4 * config.n_embd),
        "layer_norm_epsilon": (1e-5,),
        "scale_attn_weights": (True,),
        "scale_attn_by_inverse_layer_idx": (False,),
        "tie_word_embeddings": (True,),
    }
    for key, values in allowed.items():
        if hf_config.get(key, values[0]) not in values:
            raise ValueError(
                f"{key}={hf_config[key]}: this model has {key}={values[0]}"
            )
    vocab, positions = int(hf_config["vocab_size"]), int(hf_config["n_positions"])
    if vocab != config.vocab_size:
        raise ValueError(
            f"the checkpoint has {vocab} tokens, the model {config.vocab_size}: pass "
            f"--vocab_size={vocab} with data in its tokenizer's ids"
        )
    if positions < config.max_seq_len:
        raise ValueError(
            f"the checkpoint has {positions} positions: pass --seq_len<={positions}"
        )
    state = {}
    for name, (key, transposed) in hf_gpt2_names(config.n_layer).items():
        tensor = theirs.get(key.removeprefix("transformer."))
        if tensor is None:
            raise ValueError(
                f"the checkpoint has no {key}: not GPT2LMHeadModel's layout"
            )
        third = QKV_THIRDS.get(
            name.split(".")[-2]
        )  # attention's q, k, v: c_attn's thirds
        if third is not None:
            tensor = tensor.chunk(3, dim=-1)[third]
        state[name] = (tensor.t() if transposed else tensor).float().contiguous()
    state["wpe.weight"] = state["wpe.weight"][: config.max_seq_len].clone()
    state["lm_head.weight"] = state["wte.weight"]  # tied
    return state


def to_hf_gpt2(
    weights: dict[str, torch.Tensor], config: GPTConfig
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Our weights -> GPT2LMHeadModel's config.json and safetensors weights."""
    hf_config = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.max_seq_len,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": None,  # 4 * n_embd
        "activation_function": "gelu_new",  # GELU, tanh approximation
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "tie_word_embeddings": True,
    }
    # <|endoftext|> is token 50256 in GPT-2's vocabulary (50257, or padded to 50304).
    end_of_text = 50256 if config.vocab_size >= 50257 else None
    hf_config.update(bos_token_id=end_of_text, eos_token_id=end_of_text)
    hf_weights = {}
    for name, (key, transposed) in hf_gpt2_names(config.n_layer).items():
        tensor = weights[name]
        tensor = tensor.t() if transposed else tensor
        if key in hf_weights:  # k after q, v after k: c_attn holds them side by side
            tensor = torch.cat([hf_weights[key], tensor], dim=-1)
        hf_weights[key] = tensor.contiguous()
    return hf_config, hf_weights
