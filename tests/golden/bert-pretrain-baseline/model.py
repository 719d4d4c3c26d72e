"""BERT encoder and masked-LM head: post-LayerNorm layers, learned position embeddings,
padding masked out of attention, GELU MLP, output layer tied to the token embedding.

Sizes follow BERT (Devlin et al. 2019); `tiny` trains at several steps per second on 2
CPU cores. Every sequence of a batch is padded to the same length; `keep` (True: a real
token) keeps padding out of every attention. This is BERT's layout: `to_hf_bert` maps
the weights to Hugging Face's BertForMaskedLM (`scaffold export --format hf`), which a
text_classification project fine-tunes. Algorithms that change the architecture are
written in where they act, each fenced `# algorithm: NAME` ... `# end algorithm: NAME`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F


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
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = F.gelu(h)
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
        self.wpe = nn.Embedding(config.max_seq_len, config.n_embd)
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

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The encoder's last hidden states (batch, seq, n_embd)."""
        seq = input_ids.shape[1]
        assert seq <= self.config.max_seq_len, f"sequence of {seq} > max_seq_len"
        # True where a real token is: padding is never attended to.
        keep = (input_ids != self.config.pad_id)[:, None, None, :]
        position = torch.arange(seq, device=input_ids.device)
        x = self.wte(input_ids) + self.wpe(position)
        x = F.dropout(self.ln_e(x), self.config.dropout, self.training)
        for block in self.blocks:
            x = block(x, keep)
        return x

    def forward(self, input_ids: torch.Tensor, predict: torch.Tensor) -> torch.Tensor:
        """Masked-LM logits (predicted tokens, vocab) at `predict`, the flat (row-major)
        positions of the tokens to predict, found on the host (train.py), so no output
        size here depends on values only the device holds (that would be a host sync).
        As in Google's BERT (run_pretraining.py gathers `masked_lm_positions` before its
        head), the head computes there only."""
        h = self.encode(input_ids).flatten(0, 1)[predict]
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


# Hugging Face BERT (`BertForMaskedLM`) weights out (`scaffold export --format hf`): the
# same function under other names; the fused qkv is split into query, key and value, and
# BERT's token-type table (unused here) is zeros, which adds nothing.
HF_LAYER_NAMES = {
    "attn.proj": "attention.output.dense",
    "ln_1": "attention.output.LayerNorm",
    "mlp.fc": "intermediate.dense",
    "mlp.proj": "output.dense",
    "ln_2": "output.LayerNorm",
}


def to_hf_bert(
    weights: dict[str, torch.Tensor], config: EncoderConfig
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Our weights -> BertForMaskedLM's config.json and safetensors weights."""
    hf_config = {
        "architectures": ["BertForMaskedLM"],
        "model_type": "bert",
        "vocab_size": config.vocab_size,
        "hidden_size": config.n_embd,
        "num_hidden_layers": config.n_layer,
        "num_attention_heads": config.n_head,
        "intermediate_size": 4 * config.n_embd,
        "hidden_act": "gelu",  # exact GELU, as F.gelu
        "max_position_embeddings": config.max_seq_len,
        "type_vocab_size": 2,
        "layer_norm_eps": 1e-12,
        "pad_token_id": config.pad_id,
        "hidden_dropout_prob": config.dropout,
        "attention_probs_dropout_prob": config.dropout,
        "tie_word_embeddings": True,
    }
    out = {
        "bert.embeddings.word_embeddings.weight": weights["wte.weight"],
        "bert.embeddings.position_embeddings.weight": weights["wpe.weight"],
        "bert.embeddings.token_type_embeddings.weight": torch.zeros(
            2, config.n_embd, dtype=weights["wte.weight"].dtype
        ),
        "cls.predictions.transform.dense.weight": weights["head_fc.weight"],
        "cls.predictions.transform.dense.bias": weights["head_fc.bias"],
        "cls.predictions.bias": weights["head_bias"],
    }
    for kind in ("weight", "bias"):
        out[f"bert.embeddings.LayerNorm.{kind}"] = weights[f"ln_e.{kind}"]
        out[f"cls.predictions.transform.LayerNorm.{kind}"] = weights[f"head_ln.{kind}"]
        for i in range(config.n_layer):
            ours, theirs = f"blocks.{i}.", f"bert.encoder.layer.{i}."
            qkv = weights[f"{ours}attn.qkv.{kind}"].chunk(3, dim=0)
            for part, tensor in zip(("query", "key", "value"), qkv):
                out[f"{theirs}attention.self.{part}.{kind}"] = tensor
            for name, hf_name in HF_LAYER_NAMES.items():
                out[f"{theirs}{hf_name}.{kind}"] = weights[f"{ours}{name}.{kind}"]
    return hf_config, {k: v.contiguous() for k, v in out.items()}
