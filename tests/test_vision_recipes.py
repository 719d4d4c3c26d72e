"""The ResNet speed-up recipes: Composer's mild / medium / hot ResNet-50 recipes and the two
scaled to CIFAR. Each is generated through the CLI (tests/test_golden.py pins every file, black
included), trains offline on the embedded digits with every algorithm it holds, and FSDP2 on 2
ranks gives one process's per-step losses and validation metrics, the EMA's included: MixUp's
partners, SAM's ascent, stochastic depth's draws and ColOut's rows do not depend on the split.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from projects import read_metrics, run_train
from test_image import SMALL, TOLERANCE, ok, torchrun

SPEEDUPS = [
    "cifar-resnet56-mild",
    "cifar-resnet56-medium",
    "resnet50-mild",
    "resnet50-medium",
    "resnet50-hot",
]
# Two steps, an evaluation after each.
ARGS = [*SMALL, "--max_duration=2ba", "--eval_interval=1ba"]
METRICS = ("loss", "val_loss", "val_top1", "ema_val_loss", "ema_val_top1")


def trajectory(workdir: Path, run: str) -> list[dict]:
    return [
        {key: row[key] for key in ("step", *METRICS) if key in row}
        for row in read_metrics(workdir, run)
    ]


@pytest.mark.parametrize("recipe", SPEEDUPS)
def test_recipe_trains_offline_and_two_fsdp_ranks_equal_one_process(
    recipe: str, generated: dict[str, Path], tmp_path: Path
) -> None:
    project = generated[recipe]
    train = (project / "train.py").read_text()
    args = list(ARGS)
    if "sam_interval" in train:  # SAM's ascent at both steps
        args.append("--sam_interval=1")
    if "ema_update_interval" in train:  # the average moves at both steps
        args += ["--ema_update_interval=1ba", "--ema_half_life=2ba"]
    ok(run_train(project, tmp_path, *args, "--run_name=one"))
    one = trajectory(tmp_path, "one")
    assert [row["step"] for row in one] == [1, 2]
    assert all("val_loss" in row for row in one)
    assert ("ema_val_loss" in one[-1]) == ("# algorithm: ema" in train)

    ok(
        torchrun(
            2,
            project / "train.py",
            *args,
            "--parallelism=fsdp",
            "--run_name=two",
            cwd=tmp_path,
        )
    )
    two = trajectory(tmp_path, "two")
    assert [sorted(row) for row in two] == [sorted(row) for row in one]
    for ours, theirs in zip(two, one, strict=True):
        for key in METRICS:
            if key in theirs:
                assert abs(ours[key] - theirs[key]) <= TOLERANCE, (
                    recipe,
                    ours["step"],
                    key,
                    ours[key],
                    theirs[key],
                )


def test_an_epoch_warmup_converts_in_a_short_run_in_batches(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """resnet50-mild warms up 8 epochs, as Composer's yaml (t_warmup: 8ep, unscaled); a
    trial run of 3ba converts them into batches once the data's length is known:
    the rate rises linearly by lr / (8 x batches per epoch) a step."""
    project = generated["resnet50-mild"]
    assert 'lr_warmup: Time = Time.parse("8ep")' in (project / "train.py").read_text()
    args = [a for a in SMALL if not a.startswith("--lr_warmup")]
    ok(run_train(project, tmp_path, *args, "--max_duration=3ba", "--run_name=w"))
    rates = [row["lr"] for row in read_metrics(tmp_path, "w")]
    per_epoch = 1437 // 12  # the digits' training split, in whole batches
    step = 0.2 / (8 * per_epoch)
    assert rates == pytest.approx([0.0, step, 2 * step], rel=1e-6)
