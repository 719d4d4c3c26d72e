"""Algorithms compose: pairs the catalog allows together train for 2 steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from projects import run_train
from scaffold.render import new_project

# The tiny ResNet on the digits, 12 samples per step in BatchNorm groups of 2.
IMAGE = [
    "--model=tiny",
    "--precision=fp32",
    "--global_batch_size=12",
    "--device_microbatch_size=2",
    "--bn_group_size=2",
    "--max_duration=2ba",
    "--lr_warmup=1ba",
    "--eval_interval=1000ba",
    "--save_interval=1000ba",
    "--eval_batches=1",
]


def generate(root: Path, task: str, model: str, algorithms: list[str]) -> Path:
    recipe = f'[answers]\ntask = "{task}"\nmodel_family = "{model}"\n'
    recipe += "".join(f"[algorithms.{name}]\n" for name in algorithms)
    (root / "recipe.toml").write_text(recipe)
    new_project(str(root / "recipe.toml"), root / "p", [], "p")
    return root / "p"


@pytest.mark.parametrize("mixer", ["mixup", "cutmix"])
def test_selective_backprop_then_a_batch_mixer_trains(
    mixer: str, tmp_path: Path
) -> None:
    """Selective backprop cuts the batch to its kept rows; the mixer after it pairs
    those rows (it crashed indexing a permutation of the whole global batch)."""
    project = generate(
        tmp_path, "image_classification", "resnet", ["selective_backprop", mixer]
    )
    result = run_train(
        project,
        tmp_path,
        *IMAGE,
        "--selective_backprop_start=0",
        "--selective_backprop_interval=1",
        f"--selective_backprop_keep={1 / 3!r}",
        f"--{mixer}_prob=1.0",
    )
    assert result.returncode == 0, result.stderr[-3000:]
