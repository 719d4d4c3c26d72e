"""unpadding's CUDA path, FlexAttention, against its CPU path (SDPA over the tokens put
back in their rows, which tests/test_mosaicbert_parts.py proves equal to the padded model),
forward and backward.

Needs only torch and pytest: it imports mosaicbert's generated model.py from
tests/golden (test_golden pins it to the templates), so it runs on a GPU machine without
scaffold's toolchain: `python -m pytest -q -p no:cacheprovider --noconftest
tests/test_unpadding_cuda.py`. Skipped without CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="FlexAttention's varlen path needs CUDA"
)
MODEL_PY = Path(__file__).parent / "golden" / "mosaicbert" / "model.py"
# Rows of very different lengths: within one 128-token block, across blocks, 1 token.
LENGTHS = [20, 7, 13, 1, 128, 3, 0, 100]
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}  # relative, as a norm


@pytest.fixture(scope="module")
def model_py() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mosaicbert_model", MODEL_PY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool((a.float() - b.float()).norm() <= TOLERANCE[dtype] * b.float().norm())


def rows(lengths: list[int], seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids padded (0) to `seq`, and masked-LM targets at every 3rd real token."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.zeros(len(lengths), seq, dtype=torch.long)
    targets = torch.full_like(ids, -100)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(5, vocab, (length,), generator=gen)
        targets[row, :length:3] = ids[row, :length:3]
    return ids.cuda(), targets.cuda()


@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_flex_attention_equals_the_padded_path(
    model_py: ModuleType, alibi: bool, dtype: torch.dtype
) -> None:
    """The document mask keeps each row to itself and ALiBi's score_mod biases by the
    positions within each row: outputs and q, k, v gradients equal padded SDPA's."""
    ids, _ = rows(LENGTHS, 128, 64)
    tokens = (ids != 0).flatten().nonzero()[:, 0]
    _, keep = model_py.unpad(ids[..., None].float(), tokens)
    assert keep.block_mask is not None  # built on CUDA
    if alibi:
        slopes = model_py.alibi_slopes(4).cuda()
        keep.score_bias = lambda head, query, key: -slopes[head] * (query - key).abs()
    shape = (1, 4, len(keep.row), 32)
    q, k, v = (torch.randn(shape, device="cuda", dtype=dtype) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=dtype)
    results = []
    for path in (model_py.flex_varlen_attention, model_py.padded_attention):
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        extra = () if path is model_py.flex_varlen_attention else (0.0,)
        y = path(*inputs, keep, *extra)
        y.backward(grad)
        results.append([y] + [t.grad for t in inputs])
    for flex, padded in zip(*results):
        assert close(flex, padded, dtype)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled_layers"])
@pytest.mark.parametrize("dtype", TOLERANCE, ids=str)
def test_mosaicbert_on_cuda_equals_its_padded_path(
    model_py: ModuleType,
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    compiled: bool,
) -> None:
    """mosaicbert's encoder (ALiBi, GeGLU, unpadding) on CUDA: loss, logits at the
    masked tokens and every gradient equal the same weights' through the padded path,
    in fp32 and under bf16 autocast; also with each layer compiled (compile=auto on
    CUDA: train.py's regional compilation), where FlexAttention is traced in."""
    config = model_py.EncoderConfig(64, 128, pad_id=0, **model_py.PRESETS["tiny"])
    torch.manual_seed(0)
    model = model_py.Encoder(config).cuda()
    if compiled:
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    ids, targets = rows(LENGTHS, 128, 64)
    results = []
    predict = (targets != -100).flatten().nonzero()[:, 0]
    tokens = (ids != 0).flatten().nonzero()[:, 0]
    for varlen in ("flex", "padded"):
        if varlen == "padded":

            def padded(q, k, v, keep, dropout):
                return model_py.padded_attention(q, k, v, keep, dropout)

            monkeypatch.setattr(model_py, "varlen_attention", padded)
            torch._dynamo.reset()
        model.zero_grad()
        with torch.autocast("cuda", dtype, enabled=dtype != torch.float32):
            logits = model(ids, predict, tokens)
            loss = F.cross_entropy(logits.float(), targets.flatten()[predict])
        loss.backward()
        results.append([loss, logits] + [p.grad.clone() for p in model.parameters()])
    for flex, padded in zip(*results):
        assert close(flex, padded, dtype)
