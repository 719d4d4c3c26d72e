"""Each algorithm's effect, checked in the code the generator writes (not in a copy of it)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from projects import project_modules, read_metrics, run_train
from runtime import parallel

TINY = [
    "--seq_len=64",
    "--global_batch_size=4",
    "--eval_batches=1",
    "--eval_interval=100ba",
]


@pytest.fixture(scope="module")
def speedup(generated: dict[str, Path]):
    with project_modules(generated["gpt2-speedup"]) as modules:
        yield modules


@pytest.fixture(scope="module")
def baseline(generated: dict[str, Path]):
    with project_modules(generated["gpt2-baseline"]) as modules:
        yield modules


# ---------------------------------------------------------------- alibi


def test_alibi_slopes_are_the_papers_geometric_sequence(speedup) -> None:
    slopes = speedup["model"].alibi_slopes
    assert slopes(8).tolist() == pytest.approx([2.0**-k for k in range(1, 9)])
    assert slopes(4).tolist() == pytest.approx([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])
    # 12 heads: the 8-head slopes, then every other slope of the 16-head sequence.
    expected = [2.0**-k for k in range(1, 9)] + [2.0 ** -(k / 2) for k in (1, 3, 5, 7)]
    assert slopes(12).tolist() == pytest.approx(expected)


def test_alibi_bias_penalises_distance_and_masks_the_future(speedup) -> None:
    slopes = speedup["model"].alibi_slopes(2)
    bias = speedup["model"].alibi_bias(slopes, 5)
    assert bias.shape == (2, 5, 5)
    for h in range(2):
        for i in range(5):
            for j in range(5):
                if j > i:
                    assert bias[h, i, j] == float("-inf")
                else:
                    assert bias[h, i, j].item() == pytest.approx(
                        -slopes[h].item() * (i - j)
                    )


def test_alibi_attention_matches_a_manual_softmax(speedup) -> None:
    model = speedup["model"]
    config = model.GPTConfig(
        vocab_size=256, max_seq_len=16, n_layer=1, n_head=4, n_embd=32
    )
    attention = model.CausalSelfAttention(config)
    torch.manual_seed(0)
    x = torch.randn(2, 7, 32)
    bias = model.alibi_bias(model.alibi_slopes(4), 7)
    actual = attention(x, bias)
    q, k, v = (
        t.view(2, 7, 4, 8).transpose(1, 2) for t in attention.qkv(x).split(32, dim=2)
    )
    scores = q @ k.transpose(-1, -2) / math.sqrt(8) + bias
    manual = (scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, 32)
    torch.testing.assert_close(actual, attention.proj(manual), rtol=1e-5, atol=1e-5)


def test_alibi_flex_attention_forward_matches_the_explicit_bias(
    speedup, monkeypatch
) -> None:
    """CUDA's path (FlexAttention, ALiBi score_mod, causal block mask) against the CPU's
    (SDPA with the dense bias). FlexAttention runs forward only on the CPU (no backward),
    eagerly here: the compiled kernel is CUDA's concern (bench/gpu.py)."""
    from torch.nn.attention.flex_attention import flex_attention

    model = speedup["model"]
    monkeypatch.setattr(model, "fused_flex_attention", lambda: flex_attention)
    generator = torch.Generator().manual_seed(0)
    for heads, seq in (
        (4, 16),
        (12, 200),
    ):  # 200: not a multiple of the 128-token block
        q, k, v = (
            torch.randn(2, heads, seq, 32, generator=generator) for _ in range(3)
        )
        expected = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=model.alibi_bias(model.alibi_slopes(heads), seq)
        )
        mask = model.causal_block_mask(seq, torch.device("cpu"))
        flex = model.alibi_flex_attention(q, k, v, mask, model.alibi_slopes(heads))
        torch.testing.assert_close(flex, expected, atol=1e-5, rtol=1e-5)
    # The whole model: forcing the CUDA path on the CPU gives the same logits.
    torch.manual_seed(0)
    gpt = model.GPT(
        model.GPTConfig(vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, n_embd=64)
    )
    idx = torch.randint(0, 256, (2, 40), generator=generator)
    with torch.no_grad():
        dense = gpt(idx)
        monkeypatch.setattr(model, "alibi_uses_flex", lambda device, dropout: True)
        fused = gpt(idx)
    torch.testing.assert_close(fused, dense, atol=1e-5, rtol=1e-5)


def test_alibi_uses_flex_on_cuda_without_dropout_only(speedup) -> None:
    uses_flex = speedup["model"].alibi_uses_flex
    assert uses_flex(torch.device("cuda", 0), 0.0)
    assert not uses_flex(torch.device("cuda", 0), 0.1) and not uses_flex(
        torch.device("cpu"), 0.0
    )


def test_alibi_model_has_no_position_embeddings(speedup, baseline) -> None:
    def build(modules):
        model = modules["model"]
        return model.GPT(
            model.GPTConfig(vocab_size=256, max_seq_len=32, **model.PRESETS["tiny"])
        )

    alibi_names = {name for name, _ in build(speedup).named_parameters()}
    baseline_names = {name for name, _ in build(baseline).named_parameters()}
    assert baseline_names - alibi_names == {"wpe.weight"}
    # Without position embeddings, the model still tells positions apart through the bias:
    # the same token at two positions gets different outputs.
    torch.manual_seed(0)
    logits = build(speedup)(torch.zeros(1, 6, dtype=torch.long))
    assert not torch.allclose(logits[0, 1], logits[0, 5])


def test_gpt2_preset_has_124m_parameters(baseline) -> None:
    model = baseline["model"]
    with torch.device("meta"):
        gpt2 = model.GPT(
            model.GPTConfig(vocab_size=50257, max_seq_len=1024, **model.PRESETS["gpt2"])
        )
    assert round(gpt2.num_params() / 1e6) == 124


def test_alibi_split_rows_keeps_every_target_once(speedup) -> None:
    """Composer's train_sequence_length_scaling: 4x the rows at a quarter of the length,
    a microbatch's inputs and targets alike; a length 4 does not divide is filled out.
    """
    split = speedup["train"].alibi_split_rows
    batch = torch.arange(2 * 17).view(2, 17)  # two rows of 16 inputs + 1
    inputs = split(batch[:, :-1], 0.25, fill=0)
    targets = split(batch[:, 1:], 0.25, fill=-100)
    assert inputs.shape == targets.shape == (8, 4)
    # Each (input, target) pair of the original rows appears once, in order; a piece's
    # last target is the next piece's first input.
    assert inputs.reshape(2, 16).equal(batch[:, :-1])
    assert targets.reshape(2, 16).equal(batch[:, 1:])
    for row in (0, 4):  # pieces 0-3 are row 0's, 4-7 row 1's
        assert targets[row : row + 3, -1].equal(inputs[row + 1 : row + 4, 0])
    assert split(batch, 1.0, fill=0).equal(batch)
    # 14 tokens: 4 pieces of 4, the last two positions of each row's last piece filled.
    uneven = split(batch[:, :14], 0.25, fill=-100)
    assert uneven.shape == (8, 4)
    assert uneven.reshape(2, 16)[:, :14].equal(batch[:, :14])
    assert (uneven.reshape(2, 16)[:, 14:] == -100).all()


def test_alibi_sequence_length_scaling_in_the_training_loop(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """The catalog default 0.25 trains on quarter rows (another loss than full length), fills
    out a length the pieces do not divide, refuses a scaling that is not 1/k, and 1.0 trains at
    full length."""
    losses = {}
    for scaling in ("0.25", "1.0"):
        result = run_train(
            generated["gpt2-speedup"],
            tmp_path,
            *TINY,
            "--max_duration=3ba",
            "--seq_length_warmup_min_len=64",
            f"--alibi_train_sequence_length_scaling={scaling}",
            "--log_interval=1ba",
            f"--run_name=alibi{scaling}",
        )
        assert result.returncode == 0, result.stderr
        records = read_metrics(tmp_path, f"alibi{scaling}")
        assert [r["seq_len"] for r in records] == [64, 64, 64]
        losses[scaling] = [r["loss"] for r in records]
    assert losses["0.25"] != losses["1.0"]
    # 62 tokens a row: quarter rows of 16, each row's last piece filled out with two
    # positions the loss ignores; all 62 targets are trained and counted.
    uneven = run_train(
        generated["gpt2-speedup"],
        tmp_path,
        *(arg for arg in TINY if not arg.startswith("--seq_len=")),
        "--seq_len=62",
        "--max_duration=1ba",
        "--seq_length_warmup_min_len=62",
        "--alibi_train_sequence_length_scaling=0.25",
        "--run_name=uneven",
    )
    assert uneven.returncode == 0, uneven.stderr
    assert "done: step 1, 248 tokens" in uneven.stdout
    refused = run_train(
        generated["gpt2-speedup"],
        tmp_path,
        *TINY,
        "--alibi_train_sequence_length_scaling=0.3",
    )
    assert refused.returncode == 2
    assert "must be 1/k for a whole k" in refused.stderr


# ---------------------------------------------------------------- seq_length_warmup


def test_seq_length_warmup_schedule(speedup) -> None:
    length = speedup["train"].seq_length_warmup_len
    assert length(0.0, 8, 128) == 8
    assert (
        length(0.5, 8, 128) == 64
    )  # 8 + 0.5 * 120 = 68, rounded down to a multiple of 8
    assert length(1.0, 8, 128) == 128 and length(3.0, 8, 128) == 128
    schedule = [length(k / 100, 8, 128) for k in range(101)]
    assert schedule == sorted(schedule) and all(n % 8 == 0 for n in schedule)
    assert (
        length(0.999, 8, 100) == 96 and length(1.0, 8, 100) == 100
    )  # full length not a multiple of 8
    assert length(0.0, 5, 100) == 5  # never below the minimum


def test_seq_length_warmup_in_the_training_loop(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """The loop trains on the scheduled length each step, reaching full length after 30%."""
    result = run_train(
        generated["gpt2-speedup"],
        tmp_path,
        *TINY,
        "--max_duration=10ba",
        "--seq_length_warmup_duration=0.5dur",
        "--run_name=swu",
    )
    assert result.returncode == 0, result.stderr
    lengths = [r["seq_len"] for r in read_metrics(tmp_path, "swu")]
    expected = [
        min(64, max(8, int(8 + 56 * (k / 10) / 0.5) // 8 * 8)) if k < 5 else 64
        for k in range(10)
    ]
    assert lengths == expected == [8, 16, 24, 40, 48, 64, 64, 64, 64, 64]


# ---------------------------------------------------------------- gradient clipping


def test_gradient_clipping_bounds_the_update(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """With a tiny max_norm the logged pre-clip norm exceeds it, and training still runs."""
    result = run_train(
        generated["gpt2-baseline"],
        tmp_path,
        *TINY,
        "--max_duration=3ba",
        "--gradient_clipping_max_norm=0.01",
        "--run_name=clip",
    )
    assert result.returncode == 0, result.stderr
    assert all(r["grad_norm"] > 0.01 for r in read_metrics(tmp_path, "clip"))


def test_gradient_clipping_changes_training(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    common = [*TINY, "--max_duration=4ba", "--lr=0.01"]
    run_train(
        generated["gpt2-baseline"],
        tmp_path,
        *common,
        "--gradient_clipping_max_norm=1e-3",
        "--run_name=a",
    )
    run_train(
        generated["gpt2-baseline"],
        tmp_path,
        *common,
        "--gradient_clipping_max_norm=1e3",
        "--run_name=b",
    )
    clipped, free = read_metrics(tmp_path, "a"), read_metrics(tmp_path, "b")
    assert clipped[0]["loss"] == free[0]["loss"]  # same start
    assert clipped[-1]["loss"] != free[-1]["loss"]  # different updates


def test_adaptive_clipping_scales_each_unit_to_its_weight_norm() -> None:
    """AGC as Brock et al. (and Composer) define it, on a convolution (a unit: an output
    channel), a linear layer (a row) and biases (whole vectors, one zero-initialised).
    """
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3), torch.nn.Flatten(), torch.nn.Linear(12, 4)
    )
    torch.nn.init.zeros_(model[2].bias)
    (model(torch.randn(5, 2, 4, 4)) * torch.arange(4.0)).sum().backward()
    before = {name: param.grad.clone() for name, param in model.named_parameters()}
    parallel.clip_grad_adaptive_(model.parameters(), 0.05)
    scales = []
    for name, param in model.named_parameters():
        weight, grad = param.detach(), before[name]
        units = [slice(None)] if param.ndim < 2 else list(range(param.shape[0]))
        for unit in units:
            limit = 0.05 * max(weight[unit].norm().item(), 1e-3)
            norm = grad[unit].norm().item()
            scale = min(1.0, limit / norm) if norm else 1.0  # 0/0 counts as 1
            scales.append(scale)
            torch.testing.assert_close(param.grad[unit], grad[unit] * scale)
    assert min(scales) < 0.5 and max(scales) == 1.0  # some units clipped, some not
    assert model[2].bias.grad.norm() > 0  # a zero weight still learns (eps)


# ---------------------------------------------------------------- the loop's arithmetic


def test_lr_schedule_warms_up_then_decays(baseline) -> None:
    train = baseline["train"]
    cfg = train.Config(lr=1.0, lr_warmup=train.Time.parse("0.1dur"), min_lr_ratio=0.1)
    assert train.lr_at(0.0, cfg, 1) == 0.0
    assert train.lr_at(0.05, cfg, 1) == pytest.approx(0.5)
    assert train.lr_at(0.1, cfg, 1) == pytest.approx(1.0)
    assert train.lr_at(0.55, cfg, 1) == pytest.approx(
        0.55
    )  # cosine midpoint between 1.0 and 0.1
    assert train.lr_at(1.0, cfg, 1) == pytest.approx(0.1)


@pytest.mark.parametrize("recipe", ["gpt2-baseline", "gpt2-speedup"])
def test_gradient_accumulation_is_invariant_to_microbatch_size(
    recipe: str, generated: dict[str, Path], tmp_path: Path
) -> None:
    """Microbatches of 4 (no accumulation), 3 (uneven: 3 + 1) and 1 take the same steps."""
    losses = {}
    for microbatch in (4, 3, 1):
        result = run_train(
            generated[recipe],
            tmp_path,
            *TINY,
            "--max_duration=4ba",
            f"--device_microbatch_size={microbatch}",
            f"--run_name=mb{microbatch}",
        )
        assert result.returncode == 0, result.stderr
        losses[microbatch] = [
            r["loss"] for r in read_metrics(tmp_path, f"mb{microbatch}")
        ]
    assert len(losses[4]) == 4
    for microbatch in (3, 1):
        # Same gradients up to float summation order: agreement to ~1e-6 over 4 steps.
        assert losses[microbatch] == pytest.approx(losses[4], rel=1e-5, abs=1e-6)
