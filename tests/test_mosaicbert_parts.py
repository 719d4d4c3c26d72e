"""MosaicBERT's architecture changes on the bert pack, each by its effect: `alibi` on an
encoder (a symmetric distance penalty that gives a position-free model its order, rows
split for short-sequence training), `gated_linear_units` in Composer's BERT form, and
`unpadding` (the loss of the padded model; the layers' FLOPs count real tokens only)."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.flex_attention import (  # noqa: E402
    create_block_mask,
    flex_attention,
)
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

from projects import project_modules  # noqa: E402
from scaffold.render import new_project  # noqa: E402

VOCAB, PAD = 64, 0
PROJECTS = {
    "plain": "",
    "glu": "[algorithms.gated_linear_units]\n",  # its defaults: BERT's own GELU
    "alibi": "[algorithms.alibi]\ntrain_sequence_length_scaling = 0.5\n",
    "padded": "[algorithms.alibi]\n[algorithms.gated_linear_units]\n",
    "unpadded": "[algorithms.alibi]\n[algorithms.gated_linear_units]\n"
    "[algorithms.unpadding]\n",
    "unpadding": "[algorithms.unpadding]\n",
}
# Each unpadded project beside the padded one with the same weights, with and without
# ALiBi (then a score bias in unpadding's varlen attention).
UNPADDED = {"alibi": ("unpadded", "padded"), "plain": ("unpadding", "plain")}


@pytest.fixture(scope="module")
def projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parts")
    made = {}
    for name, algorithms in PROJECTS.items():
        recipe = root / f"{name}.toml"
        recipe.write_text(
            '[answers]\ntask = "masked_lm"\nmodel_family = "bert"\n' + algorithms
        )
        new_project(str(recipe), root / name, [], name)
        made[name] = root / name
    return made


def encoder(project: Path, seed: int = 0) -> tuple[torch.nn.Module, object]:
    with project_modules(project) as found:
        model_py = found["model"]
        config = model_py.EncoderConfig(
            VOCAB, 32, pad_id=PAD, **model_py.PRESETS["tiny"]
        )
        torch.manual_seed(seed)
        return model_py.Encoder(config).eval(), model_py


def model_inputs(model: torch.nn.Module, ids: torch.Tensor, predicted: torch.Tensor):
    """The model's inputs as train.py's microbatch_inputs makes them: token ids, the
    flat positions of the tokens `predicted` marks and, with unpadding, of the real ones.
    """
    inputs = {"input_ids": ids, "predict": predicted.flatten().nonzero()[:, 0]}
    if "tokens" in inspect.signature(model.forward).parameters:
        inputs["tokens"] = (ids != PAD).flatten().nonzero()[:, 0]
    return inputs


def test_alibi_is_a_symmetric_distance_penalty_that_orders_a_position_free_encoder(
    projects: dict[str, Path],
) -> None:
    """No position table; the bias is -slope * |i - j| per head with the padding keys at
    the dtype's lowest value (finite: a row of padding only stays finite). The bias is
    the encoder's only sense of order: with zero slopes, swapping two tokens swaps their
    outputs and leaves the others; with ALiBi's slopes it changes the others. The slopes
    are a buffer, moved with the model and not saved."""
    alibi, model_py = encoder(projects["alibi"])
    assert not hasattr(alibi, "wpe")
    slopes = model_py.alibi_slopes(4)
    assert torch.equal(alibi.alibi_slopes, slopes)
    assert "alibi_slopes" not in alibi.state_dict()
    keep = torch.tensor([[True] * 5 + [False] * 3])[:, None, None, :]
    bias = model_py.alibi_encoder_bias(slopes, keep, torch.float32)
    assert torch.allclose(slopes, torch.tensor([2**-2, 2**-4, 2**-6, 2**-8]))
    i, j = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    expected = -slopes[:, None, None] * (i - j).abs()
    assert torch.equal(bias[0, :, :, :5], expected[:, :, :5])
    assert (bias[0, :, :, 5:] == torch.finfo(torch.float32).min).all()
    ids = torch.tensor([[2, 10, 11, 12, 13, 14, 3]])
    swapped = ids[:, [0, 1, 4, 3, 2, 5, 6]]  # tokens 11 and 13 trade places
    others = [0, 1, 3, 5, 6]
    every = torch.ones_like(ids, dtype=torch.bool)  # the head at every position
    with torch.no_grad():
        padding = torch.cat([ids, torch.full((1, 7), PAD)])
        assert torch.isfinite(alibi(**model_inputs(alibi, padding, padding >= 0))).all()
        a, b = (alibi(**model_inputs(alibi, x, every)) for x in (ids, swapped))
        assert not torch.allclose(a[others], b[others], atol=1e-3)
        alibi.alibi_slopes.zero_()
        a, b = (alibi(**model_inputs(alibi, x, every)) for x in (ids, swapped))
        assert torch.allclose(a[others], b[others], atol=1e-5)
        assert torch.allclose(a[2], b[4], atol=1e-5)


def test_alibi_splits_masked_lm_rows_with_their_targets(
    projects: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """train_sequence_length_scaling=0.5 on masked_lm: each row and its targets become
    two rows of half the length (Composer's reshape; no target lost), and a seq_len the
    pieces do not divide is one error line."""
    with project_modules(projects["alibi"]) as found:
        train = found["train"]
        rows = torch.arange(24).view(2, 12)
        split = train.alibi_split_rows(rows, 0.5)
        assert split.tolist() == [list(range(k, k + 6)) for k in (0, 6, 12, 18)]
        with pytest.raises(SystemExit) as exited:
            train.setup(train.Config(seq_len=33, device="cpu"))
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: seq_len=33 must be a multiple of 2 (1/alibi_train_sequence_length_scaling:"
        " rows split evenly)"
    ]


def test_gated_linear_units_in_composers_bert_form(projects: dict[str, Path]) -> None:
    """The MLP is gelu(x W_gate) * (x W_value) W_out + b: one bias-free (8d x d) layer,
    gate first, exact GELU (BERT's own: the default), BERT's 4d hidden width kept.
    """
    glu, _ = encoder(projects["glu"])
    plain, _ = encoder(projects["plain"])
    mlp, d = glu.blocks[0].mlp, glu.config.n_embd
    assert mlp.fc.bias is None and mlp.fc.weight.shape == (8 * d, d)
    assert mlp.proj.weight.shape == (d, 4 * d)
    extra = glu.num_params() - plain.num_params()
    assert extra == glu.config.n_layer * (4 * d * d - 4 * d)  # + W_gate, - fc's bias
    x = torch.randn(3, d)
    gate, value = mlp.fc.weight.split(4 * d)
    expected = F.linear(F.gelu(x @ gate.T) * (x @ value.T), *mlp.proj.parameters())
    with torch.no_grad():
        assert torch.allclose(mlp(x), expected, atol=1e-6)
        tanh = F.linear(
            F.gelu(x @ gate.T, approximate="tanh") * (x @ value.T),
            *mlp.proj.parameters(),
        )
        assert not torch.allclose(mlp(x), tanh, atol=1e-7)


def batch_of(lengths: list[int], seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of `lengths` real tokens padded to `seq`, and targets at every 3rd token."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.full((len(lengths), seq), PAD)
    targets = torch.full((len(lengths), seq), -100)
    for row, length in enumerate(lengths):
        ids[row, :length] = torch.randint(5, VOCAB, (length,), generator=gen)
        targets[row, 1:length:3] = ids[row, 1:length:3]
    return ids, targets


def encode_flops(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, int]:
    """FLOPs of `encode` by operator; SDPA through its math kernel, whose matmuls the
    counter sees (aten.bmm: attention only; addmm/mm: the linear layers)."""
    counter = FlopCounterMode(display=False)
    inputs = model_inputs(model, ids, ids == PAD)
    with counter, torch.no_grad(), sdpa_kernel(SDPBackend.MATH):
        model.encode(ids, *([inputs["tokens"]] if "tokens" in inputs else []))
    return {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}


def loss_logits_grads(
    model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    inputs = model_inputs(model, ids, targets != -100)
    logits = model(**inputs)  # the head at the labelled tokens only
    loss = F.cross_entropy(logits.float(), targets.flatten()[inputs["predict"]])
    loss.backward()
    return loss, logits, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("bias", UNPADDED)
def test_unpadding_keeps_the_loss_and_spends_no_flops_on_padding_in_the_layers(
    projects: dict[str, Path], bias: str
) -> None:
    """The same weights with and without unpadding (with ALiBi and GLU in both, or
    neither), rows of 20, 7, 13 and 1 real tokens padded to 32: equal logits at the
    labelled tokens, loss and gradients. The layers' matmuls cost 2 FLOPs per weight per
    real token, however much padding the rows hold; the padded model pays for every
    position of every row. Attention on this path (the CPU's) runs over the padded rows:
    4 * width FLOPs per layer per pair of positions of one row (CUDA's FlexAttention
    skips the blocks between rows)."""
    unpadded, model_py = encoder(projects[UNPADDED[bias][0]])
    padded, _ = encoder(projects[UNPADDED[bias][1]])
    padded.load_state_dict(unpadded.state_dict())
    lengths = [20, 7, 13, 1]
    ids, targets = batch_of(lengths, 32)
    loss_u, logits_u, grads_u = loss_logits_grads(unpadded, ids, targets)
    loss_p, logits_p, grads_p = loss_logits_grads(padded, ids, targets)
    assert torch.allclose(logits_u, logits_p, atol=1e-5)  # at the labelled tokens
    assert torch.allclose(loss_u, loss_p, rtol=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads_u, grads_p))

    config = unpadded.config
    weights = sum(
        m.weight.numel()
        for m in unpadded.blocks.modules()
        if isinstance(m, torch.nn.Linear)
    )
    short = encode_flops(unpadded, ids[:, :20])  # padded to the longest row only
    long = encode_flops(unpadded, ids)
    for flops in (short, long):
        matmuls = flops.get("aten.addmm", 0) + flops.get("aten.mm", 0)
        assert matmuls == 2 * sum(lengths) * weights
    assert long["aten.bmm"] == config.n_layer * 4 * config.n_embd * 4 * 32**2
    flops = encode_flops(padded, ids)
    assert flops["aten.bmm"] == config.n_layer * 4 * config.n_embd * 4 * 32**2
    padded_matmuls = flops.get("aten.addmm", 0) + flops.get("aten.mm", 0)
    assert padded_matmuls == 2 * 4 * 32 * weights
    nothing = torch.full((2, 8), PAD)  # a microbatch of padding only (split rows)
    with torch.no_grad():
        assert (unpadded.encode(nothing, torch.zeros(0, dtype=torch.long)) == 0).all()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("bias", UNPADDED)
def test_unpaddings_flex_attention_path_equals_its_padded_path(
    projects: dict[str, Path], monkeypatch: pytest.MonkeyPatch, bias: str
) -> None:
    """CUDA's path (FlexAttention over the packed tokens: the document mask and
    ALiBi's score bias from positions within each row) equals the CPU's (SDPA over the
    tokens put back in their rows): forward, in eager FlexAttention on the CPU (no
    backward there: the CUDA test checks it)."""
    _, model_py = encoder(projects[UNPADDED[bias][0]])
    monkeypatch.setattr(model_py, "compiled_flex_attention", lambda: flex_attention)
    ids, _ = batch_of([20, 7, 13, 1, 0, 32], 32)
    tokens = (ids != PAD).flatten().nonzero()[:, 0]
    x, keep = model_py.unpad(torch.zeros(*ids.shape, 1), tokens)
    keep.block_mask = model_py.document_mask(keep.row)  # built on CUDA only
    if bias == "alibi":
        slopes = model_py.alibi_slopes(4)
        keep.score_bias = lambda head, query, key: -slopes[head] * (query - key).abs()
    q, k, v = torch.randn(3, 1, 4, len(x), 8).unbind()
    flex = model_py.flex_varlen_attention(q, k, v, keep)
    assert torch.allclose(
        flex, model_py.padded_attention(q, k, v, keep, 0.0), atol=1e-5
    )


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_unpaddings_document_mask_equals_create_block_masks(
    projects: dict[str, Path],
) -> None:
    """document_mask makes FlexAttention's block lists from each 128-token block's
    first and last row: the same lists as create_block_mask, which evaluates every
    (query, key) pair, and the same attention; rows shorter than, equal to and longer
    than a block, and a stream that ends inside a block."""
    _, model_py = encoder(projects[UNPADDED["plain"][0]])
    generator = torch.Generator().manual_seed(0)
    for lengths in (
        [20, 7, 13, 1, 32, 3],
        [128, 128],
        [300, 1, 77, 129, 128, 5],
        [1] * 130,
        torch.randint(1, 200, (40,), generator=generator).tolist(),
    ):
        row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        tokens = len(row)

        def same_row(batch, head, q_idx, kv_idx):
            return row[q_idx] == row[kv_idx]

        ours = model_py.document_mask(row)
        theirs = create_block_mask(same_row, None, None, tokens, tokens, device="cpu")
        for count, index in (
            ("kv_num_blocks", "kv_indices"),
            ("full_kv_num_blocks", "full_kv_indices"),
        ):
            counts = getattr(theirs, count)
            assert torch.equal(getattr(ours, count), counts), lengths
            for block, n in enumerate(counts[0, 0].tolist()):
                listed = (getattr(m, index)[0, 0, block, :n] for m in (ours, theirs))
                assert torch.equal(*listed), lengths
        q, k, v = torch.randn(3, 1, 2, tokens, 8, generator=generator).unbind()
        assert torch.equal(
            flex_attention(q, k, v, block_mask=ours),
            flex_attention(q, k, v, block_mask=theirs),
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention needs CUDA")
@pytest.mark.parametrize("bias", UNPADDED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_unpaddings_flex_attention_equals_the_padded_model(
    projects: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    bias: str,
    dtype: torch.dtype,
) -> None:
    """On CUDA, unpadding's attention is compiled FlexAttention (the padded path made
    to fail, so it cannot stand in): loss, logits at labelled tokens and every gradient
    equal the padded model's (SDPA, same weights), in fp32 and under bf16 autocast."""
    unpadded, model_py = encoder(projects[UNPADDED[bias][0]])
    padded, _ = encoder(projects[UNPADDED[bias][1]])
    padded.load_state_dict(unpadded.state_dict())
    unpadded, padded = unpadded.cuda(), padded.cuda()

    def no_fallback(*args: object) -> None:
        raise AssertionError("the padded path ran on CUDA without dropout")

    monkeypatch.setattr(model_py, "padded_attention", no_fallback)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    ids, targets = (t.cuda() for t in batch_of([20, 7, 13, 1, 32, 3], 32))
    with torch.autocast("cuda", dtype, enabled=dtype != torch.float32):
        loss_u, logits_u, grads_u = loss_logits_grads(unpadded, ids, targets)
        loss_p, logits_p, grads_p = loss_logits_grads(padded, ids, targets)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    assert torch.allclose(loss_u, loss_p, rtol=tolerance)
    assert torch.allclose(
        logits_u.float(), logits_p.float(), rtol=tolerance, atol=tolerance
    )
    for a, b in zip(grads_u, grads_p):
        assert (a - b).norm() <= tolerance * b.norm() + 1e-6
