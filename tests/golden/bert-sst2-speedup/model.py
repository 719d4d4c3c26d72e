"""The classifier and its tokenizer: Hugging Face transformers, by name or folder.

`--model=bert-base-uncased` (a hub id, downloaded once into the Hugging Face cache) or
`--model=path/to/folder` (written by `save_pretrained`) loads any
AutoModelForSequenceClassification with its AutoTokenizer; the classification head is
new and sized to the data's labels. `--model=tiny` builds a small random BERT and a
WordPiece tokenizer over the training text's words: no download, and a CPU trains it
in minutes.

FSDP shards and activation checkpointing recompute the model's own transformer layers:
the modules its authors marked as never to be split (`_no_split_modules`), so no
architecture is hard-coded here.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn as nn

from runtime import quiet

# Where torchao is installed, the model libraries below import it, which prints
# deprecation lines about torchao on stderr: hide those lines and nothing else.
quiet.torchao_import_warnings()

try:
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
except ModuleNotFoundError as missing:
    sys.exit(
        f"error: {missing.name} is not installed; this project needs the Hugging Face "
        "extra: pip install 'scaffold[hf]' (transformers, tokenizers, datasets, "
        "pyarrow)"
    )


# algorithm: low_precision_layernorm
import torch
import torch.nn.functional as F

# end algorithm: low_precision_layernorm


# The loop's log says what happens: no progress bars, and no load report (listing the
# new classification head's weights as missing, the pretraining head's as unexpected).
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()

# The offline `tiny` model: BERT's architecture at a size a CPU trains in minutes.
TINY_BERT = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256
)
TINY_VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


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


def use_low_precision_layernorm(model: nn.Module) -> int:
    """transformers or diffusers built the layers: make every nn.LayerNorm a
    LowPrecisionLayerNorm, in place; returns how many."""
    norms = [m for m in model.modules() if type(m) is nn.LayerNorm]
    for norm in norms:
        norm.__class__ = LowPrecisionLayerNorm  # same parameters, same state-dict keys
    return len(norms)


# end algorithm: low_precision_layernorm


class ModelError(ValueError):
    """The model or tokenizer cannot be loaded; the message says why and what to do."""


def padding_mask(model: nn.Module, real: torch.Tensor) -> torch.Tensor:
    """The attention mask of rows whose real (not padding) tokens `real` (batch, seq)
    marks, made 4-D for the model's sdpa or eager attention, which transformers (5 and
    later) then takes as it is. From the 2-D mask it would first read it on the host, to
    skip it where no row is padded: a device sync in every forward. Other kernels, and
    older transformers, take the 2-D mask."""
    implementation = model.config._attn_implementation
    major = int(transformers.__version__.split(".")[0])
    if major < 5 or implementation not in ("sdpa", "eager"):
        return real
    keep = real[:, None, None, :]  # (batch, head, query, key), broadcast
    if implementation == "sdpa":
        return keep
    lowest = torch.finfo(torch.float32).min  # eager adds the mask to the scores
    return torch.zeros(keep.shape, device=real.device).masked_fill(~keep, lowest)


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


def load_model(name: str, num_labels: int, tokenizer, max_seq_len: int) -> nn.Module:
    """A sequence classifier with a new `num_labels`-way head (seeded by the caller)."""
    if name == "tiny":
        config = transformers.BertConfig(
            vocab_size=len(tokenizer),
            max_position_embeddings=max_seq_len,
            num_labels=num_labels,
            pad_token_id=tokenizer.pad_token_id,
            **TINY_BERT,
        )
        model = transformers.AutoModelForSequenceClassification.from_config(config)
    else:
        model = load_pretrained(name, num_labels, tokenizer, max_seq_len)

    # algorithm: low_precision_layernorm
    # Low-precision LayerNorm: transformers' LayerNorm layers become the bf16 kind.
    use_low_precision_layernorm(model)
    # end algorithm: low_precision_layernorm

    return model


def load_pretrained(
    name: str, num_labels: int, tokenizer, max_seq_len: int
) -> nn.Module:
    """A hub id's or a saved folder's model, checked against its tokenizer and its
    length."""
    exported = Path(name) / "config.json"
    if exported.is_file() and '"scaffold_bert"' in exported.read_text():
        raise ModelError(
            f"--model={name}: an encoder `scaffold export` wrote in the bert pack's "
            "own layout (its algorithms change BERT's); fine-tune it in a project of "
            "the bert pack with the same algorithms, e.g. scaffold new --recipe "
            "mosaicbert-sst2 DIR for mosaicbert's"
        )
    try:
        model, loaded = transformers.AutoModelForSequenceClassification.from_pretrained(
            name,
            num_labels=num_labels,
            ignore_mismatched_sizes=True,
            output_loading_info=True,
        )
    except (OSError, ValueError) as error:
        raise ModelError(not_found(name, "model", error)) from None
    # transformers starts what the weights lack (or hold in another shape) from random
    # values, silently: only the new head may (the classifier; the pooler, which a
    # masked LM's folder has none of).
    fresh = [*loaded["missing_keys"], *(key for key, *_ in loaded["mismatched_keys"])]
    fresh = sorted(
        k
        for k in fresh
        if k.startswith(f"{model.base_model_prefix}.") and ".pooler." not in k
    )
    if fresh:
        raise ModelError(
            f"--model={name}: {len(fresh)} of its encoder's tensors are not in its "
            f"weights (e.g. {fresh[0]}) and would start random; pass a folder "
            "written by save_pretrained or by scaffold export --format hf"
        )
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise ModelError(
            f"--model={name}: its tokenizer has {len(tokenizer)} tokens but the model "
            f"embeds only {embeddings}; the tokenizer and the model do not belong "
            "together"
        )
    positions = getattr(model.config, "max_position_embeddings", max_seq_len)
    if max_seq_len > positions:
        raise ModelError(
            f"--max_seq_len={max_seq_len} is longer than {name}'s {positions} "
            f"positions; use --max_seq_len={positions} or less"
        )
    if model.config.pad_token_id is None:  # GPT-2 style: no padding token of its own
        model.config.pad_token_id = tokenizer.pad_token_id
    return model


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


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's transformer layers (and embeddings): each its own FSDP unit.

    `_no_split_modules` names the classes its authors keep whole (BertLayer, GPT2Block,
    ...); the outermost modules of those classes, in order, are the blocks.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks: list[nn.Module] = []
    for module in model.modules():
        inside = any(
            module is not b and any(m is module for m in b.modules()) for b in blocks
        )
        if type(module).__name__ in names and not inside:
            blocks.append(module)
    return blocks
