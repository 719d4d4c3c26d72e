"""float8 (torchao): which layers the surgery converts and how, the refusals, and training in
torchao's fp32 emulation on the CPU: the loss tracks the run without float8, and FSDP2 with
the float8 all-gather on 2 ranks trains as one process does."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from projects import (
    assert_same_series,
    one_error_line,
    project_modules,
    read_metrics,
    real_library,
    run_train_many,
    torchrun,
    TINY,
    TINY_STEPS,
)
from scaffold.paths import template_dir
from scaffold.render import new_project

torchao = real_library("torchao")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor  # noqa: E402

BASELINE = template_dir() / "recipes" / "gpt2-baseline.toml"
# The parity runs: the tiny GPT, 256 tokens a step, one evaluation at the end.
PARITY_STEPS = 200
PARITY = [
    "--model=tiny",
    "--seq_len=32",
    "--global_batch_size=8",
    "--device_microbatch_size=8",
    f"--max_duration={PARITY_STEPS}ba",
    "--eval_interval=1000ba",
    "--eval_batches=2",
    "--save_interval=1000ba",
]


@pytest.fixture(scope="module")
def projects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """gpt2-baseline, and gpt2-baseline with float8 emulated (the CPU has no float8)."""
    root = tmp_path_factory.mktemp("float8")
    recipe = root / "float8.toml"
    recipe.write_text(BASELINE.read_text() + "\n[algorithms.float8]\nemulate = true\n")
    new_project(str(recipe), root / "float8", [], "float8")
    new_project(str(BASELINE), root / "baseline", [], "baseline")
    return {"float8": root / "float8", "baseline": root / "baseline"}


@pytest.fixture(scope="module")
def modules(projects: dict[str, Path]):
    with project_modules(projects["float8"]) as found:
        yield found


def settings(recipe: str, skip_first_last: bool) -> SimpleNamespace:
    """The Config fields float8_training reads, emulated."""
    return SimpleNamespace(
        float8_recipe=recipe,
        float8_emulate=True,
        float8_skip_first_last=skip_first_last,
    )


def tiny_gpt(model) -> nn.Module:
    torch.manual_seed(0)
    sizes = model.PRESETS["tiny"]
    return model.GPT(model.GPTConfig(vocab_size=64, max_seq_len=32, **sizes))


def test_surgery_converts_the_blocks_linears_but_the_first_and_the_head(
    modules,
) -> None:
    model = modules["model"]
    gpt = tiny_gpt(model)
    linears = [n for n, m in gpt.named_modules() if isinstance(m, nn.Linear)]
    assert linears[0] == "blocks.0.attn.qkv" and linears[-1] == "lm_head"
    before = {k: v.clone() for k, v in gpt.state_dict().items()}
    converted = model.float8_training(gpt, settings("tensorwise", True), fsdp=False)
    assert converted == linears[1:-1]  # 4 layers x 4 linears, less block 0's qkv
    assert [n for n, m in gpt.named_modules() if isinstance(m, Float8Linear)] == (
        converted
    )
    assert type(gpt.lm_head) is nn.Linear and gpt.lm_head.weight is gpt.wte.weight
    # The same parameters and keys: checkpoints load either way.
    after = gpt.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
    config = gpt.blocks[0].mlp.fc.config
    assert config.emulate and not config.enable_fsdp_float8_all_gather
    assert config.cast_config_input.scaling_granularity.value == "tensorwise"
    assert config.cast_config_grad_output.target_dtype == torch.float8_e5m2
    # Its effect: the same layer's output, within float8's rounding but not exact.
    x = torch.randn(64, 128)
    plain = nn.functional.linear(
        x, gpt.blocks[0].mlp.fc.weight, gpt.blocks[0].mlp.fc.bias
    )
    float8 = gpt.blocks[0].mlp.fc(x)
    error = (float8 - plain).norm() / plain.norm()
    assert 1e-3 < error < 0.1, error  # e4m3: 3 mantissa bits, ~2^-4 relative each


def test_surgery_rowwise_all_gather_and_the_size_rule(modules) -> None:
    model = modules["model"]
    gpt = tiny_gpt(model)
    converted = model.float8_training(gpt, settings("rowwise", False), fsdp=True)
    assert "blocks.0.attn.qkv" in converted  # skip_first_last=False
    assert "lm_head" not in converted  # tied to the token embedding: never
    config = gpt.blocks[1].attn.qkv.config
    assert not config.enable_fsdp_float8_all_gather  # torchao: tensorwise only
    assert config.cast_config_weight.scaling_granularity.value == "axiswise"
    assert config.round_scales_to_power_of_2
    assert config.cast_config_grad_output.target_dtype == torch.float8_e4m3fn
    # Dimensions not multiples of 16 stay nn.Linear (float8 matmuls need them).
    stack = nn.Sequential(nn.Linear(32, 48), nn.Linear(48, 40), nn.Linear(40, 32))
    stack.append(nn.Linear(32, 32))
    converted = model.float8_training(stack, settings("tensorwise", False), fsdp=True)
    assert converted == ["0", "3"]
    # FSDP2's float8 all-gather: the weight is torchao's float8-casting tensor.
    assert isinstance(stack[0].weight, WeightWithDynamicFloat8CastTensor)


@pytest.fixture(scope="module")
def runs(
    projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, subprocess.CompletedProcess[str]]]:
    """Every train.py run on one process, in one interpreter (run_train_many), each in its
    own folder: the two refusals, PARITY_STEPS steps of the tiny GPT with and without
    float8 (tensorwise, emulated), and TINY_STEPS steps of the one-process reference of
    the FSDP2 launch. First the run without torchao: a copy of the project with a
    `torchao` package that fails to import ahead of the real one on the path (the
    interpreter has not imported the real one yet)."""
    root = tmp_path_factory.mktemp("float8-runs")
    blocked = root / "blocked"
    shutil.copytree(projects["float8"], blocked)
    (blocked / "torchao").mkdir()
    (blocked / "torchao" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'torchao'\", name='torchao')\n"
    )
    jobs = {
        "missing": (blocked, []),
        "cpu": (projects["float8"], ["--float8_emulate=false"]),
        "baseline": (projects["baseline"], PARITY),
        "float8": (projects["float8"], PARITY),
        "one": (projects["float8"], [*TINY[1:], f"--max_duration={TINY_STEPS}ba"]),
    }
    for name in jobs:
        (root / name).mkdir()
    results = run_train_many(
        {
            name: (project, root / name, [*args, f"--run_name={name}"])
            for name, (project, args) in jobs.items()
        }
    )
    return root, results


def test_refusals(modules, runs, monkeypatch) -> None:
    train = modules["train"]
    for capability, refused in [((9, 0), False), ((8, 9), False), ((8, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: capability)
        problem = train.float8_problem(torch.device("cuda"), emulate=False)
        assert bool(problem) == refused, problem
        assert not train.float8_problem(torch.device("cuda"), emulate=True)
    assert "cuda (compute capability 8.0) lacks" in problem  # an A100
    root, results = runs
    line = one_error_line(results["missing"], root / "missing")
    assert line == (
        "error: float8 needs torchao, not installed: pip install 'scaffold[float8]'"
    )
    line = one_error_line(results["cpu"], root / "cpu")
    assert "float8 tensor cores" in line and "the CPU lacks" in line
    assert "--float8_emulate=true" in line


def test_float8_training_tracks_the_run_without_it(runs) -> None:
    """The tiny GPT's loss with float8 (tensorwise, emulated) against the same run
    without it: same weights and batches, 200 steps of 256 tokens. Measured (CPU, torch
    2.14.1, torchao 0.18.0): loss 5.30 -> ~2.7; mean |gap| per step 0.032 (1.1% of the
    loss; the largest 0.28, one noisy batch); final val loss 2.489 against 2.467 (0.9%).
    Bounds: 2.5x the measured gap, 3x the val difference, room for other CPUs' kernels
    without admitting a float8 that learns a visibly different curve."""
    root, results = runs
    for name in ("baseline", "float8"):
        assert results[name].returncode == 0, (name, results[name].stderr[-3000:])
    plain = [r["loss"] for r in read_metrics(root / "baseline", "baseline")]
    float8 = [r["loss"] for r in read_metrics(root / "float8", "float8")]
    assert len(plain) == len(float8) == PARITY_STEPS
    gaps = [abs(a - b) for a, b in zip(float8, plain)]
    mean_gap = sum(gaps) / len(gaps)
    final = [read_metrics(root / n, n)[-1]["val_loss"] for n in ("float8", "baseline")]
    assert float8[0] == pytest.approx(plain[0], rel=1e-3)  # same weights and data
    assert mean_gap > 1e-3  # float8 changed the arithmetic ...
    assert plain[-1] < plain[0] - 2.0  # ... both learn ...
    assert mean_gap < 0.08  # ... the same curve
    assert final[0] == pytest.approx(final[1], rel=0.03)


def test_fsdp2_float8_all_gather_trains_as_one_process(
    projects: dict[str, Path], runs, tmp_path: Path
) -> None:
    """FSDP2 on 2 ranks with the weights all-gathered in float8 (tensorwise, emulated;
    gloo moves the float8 bytes) and their scales precomputed after each step: the
    global max |w| per weight, as one process computes it, so the same losses."""
    root, results = runs
    assert results["one"].returncode == 0, results["one"].stderr[-3000:]
    train = projects["float8"] / "train.py"
    launch = torchrun(
        tmp_path, 2, train, *TINY, f"--max_duration={TINY_STEPS}ba", "--run_name=two"
    )
    assert launch.returncode == 0, launch.stderr[-3000:]
    two = [r["loss"] for r in read_metrics(tmp_path, "two")]
    one = [r["loss"] for r in read_metrics(root / "one", "one")]
    assert_same_series(two, one, rel=1e-3, what="loss")
    # Saved (at the end) as plain tensors: torchao's weight class would be refused by
    # any reader without torchao imported (sample.py, scaffold export).
    shards = list((tmp_path / "runs" / "two" / "checkpoints").rglob("*.distcp"))
    assert shards and not any(b"torchao" in shard.read_bytes() for shard in shards)
