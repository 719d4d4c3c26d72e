"""The size dial: `--depth=N` derives the GPT's shape, global batch and learning rate."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from projects import project_modules, run_train, run_train_apart


@pytest.fixture(scope="module")
def baseline(generated: dict[str, Path]):
    with project_modules(generated["gpt2-baseline"]) as modules:
        yield modules


def test_depth_sizes_follow_the_aspect_ratio_and_d12_is_gpt2(baseline) -> None:
    model = baseline["model"]
    assert model.model_sizes("d12") == model.PRESETS["gpt2"]
    assert model.model_sizes("d3") == dict(n_layer=3, n_head=3, n_embd=192)
    assert model.model_sizes("tiny") == model.PRESETS["tiny"]
    for bad in ("d0", "dx", "huge"):
        with pytest.raises(ValueError, match="unknown model"):
            model.model_sizes(bad)


def test_depth_scaling_follows_nanochats_batch_and_lr_rules(baseline) -> None:
    model = baseline["model"]
    reference = model.PRESETS["gpt2"]  # d12
    # Same shape: nothing changes.
    assert model.depth_scaled(12, reference, 64, 1e-3) == (64, 1e-3)
    # d24 has 8x the parameters: batch x 8^0.383 = 2.22 -> 128 (a power of two), lr x
    # sqrt(2) for the batch and / sqrt(2) for the doubled width.
    batch, lr = model.depth_scaled(24, reference, 64, 1e-3)
    assert batch == 2 ** round(math.log2(64 * 8**0.383)) == 128
    assert lr == pytest.approx(1e-3 * math.sqrt(2) / math.sqrt(2))
    # d6 has 1/8 the parameters and half the width.
    batch, lr = model.depth_scaled(6, reference, 64, 1e-3)
    assert batch == 32
    assert lr == pytest.approx(1e-3 * math.sqrt(0.5) * math.sqrt(2))


def test_depth_flag_trains_a_dN_model_and_records_it(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    args = ["--max_duration=2ba", "--eval_interval=2ba", "--save_interval=2ba"]
    done = run_train(
        generated["gpt2-baseline"], tmp_path, "--depth=1", "--run_name=r", *args
    )
    assert done.returncode == 0, done.stderr
    recorded = tomllib.loads((tmp_path / "runs/r/config.toml").read_text())
    # tiny (4 x 128) -> d1 (1 x 64): 1/32 of the parameters, batch 16 -> 16 * 32^-0.383
    # = 4.4 -> 4; lr x sqrt(4/16) x sqrt(2).
    assert recorded["model"] == "d1" and recorded["depth"] == 1
    assert recorded["global_batch_size"] == 4
    assert recorded["lr"] == pytest.approx(2e-3 * 0.5 * math.sqrt(2))
    assert "d1, " in (tmp_path / "runs/r/log.txt").read_text()
    # The recorded config reruns the same model without rescaling again.
    again = run_train(
        generated["gpt2-baseline"],
        tmp_path,
        "--config",
        str(tmp_path / "runs/r/config.toml"),
        "--run_name=again",
        "--max_duration=1ba",
    )
    assert again.returncode == 0, again.stderr
    rerun = tomllib.loads((tmp_path / "runs/again/config.toml").read_text())
    assert (rerun["global_batch_size"], rerun["lr"]) == (4, recorded["lr"])


def test_bad_depth_and_model_are_one_error_line(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    cases = {"--depth=-1": "depth=-1 is outside", "--model=d0": "unknown model"}
    # Runs that stop in setup: one interpreter for both (imports once).
    results = run_train_apart(
        generated["gpt2-baseline"], tmp_path, {flag: [flag] for flag in cases}
    )
    for flag, says in cases.items():
        _, done = results[flag]
        assert done.returncode == 2
        assert done.stderr.strip().startswith(f"error: {says}"), done.stderr
