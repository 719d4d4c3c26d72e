"""Monitors as catalog entries (fenced blocks at their events), each checked on a run that
provokes it.

nan_monitor: a gpt2-speedup project with it; a run whose learning rate is set to diverge stops
with one line naming the step, the first non-finite tensor and the newest complete checkpoint,
saves nothing after the bad step, and a rerun with the recipe's learning rate resumes from that
checkpoint and logs what an uninterrupted run logs, bitwise.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from projects import project_modules, read_metrics, run_train
from scaffold.render import new_project

RECIPE = (
    Path(__file__).resolve().parent.parent / "templates/recipes/gpt2-speedup.toml"
).read_text()
RUN = [
    "--seq_len=32",
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--eval_interval=1000ba",
    "--eval_batches=1",
    "--save_interval=2ba",
    "--save_num_checkpoints_to_keep=0",
    "--max_duration=4ba",
]


@pytest.fixture(scope="module")
def nan_project(tmp_path_factory: pytest.TempPathFactory, isolated_home: Path) -> Path:
    root = tmp_path_factory.mktemp("nan_monitor")
    (root / "recipe.toml").write_text(RECIPE + "\n[algorithms.nan_monitor]\n")
    new_project(str(root / "recipe.toml"), root / "p", [], "p")
    return root / "p"


def test_first_non_finite_names_the_loss_or_the_first_bad_gradient(
    nan_project: Path,
) -> None:
    with project_modules(nan_project) as modules:
        first_non_finite = modules["train"].first_non_finite
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
        model(torch.ones(1, 2)).sum().backward()
        loss = torch.tensor(3.0)
        assert first_non_finite(loss, model) == ""
        assert first_non_finite(torch.tensor(float("inf")), model) == "loss"
        model[1].bias.grad[0] = float("nan")
        model[0].weight.grad[1, 1] = float("-inf")
        assert first_non_finite(loss, model) == "gradient of 0.weight"
        model[0].weight.grad = None  # no gradient: nothing to check
        assert first_non_finite(loss, model) == "gradient of 1.bias"


def test_a_diverging_run_stops_in_one_line_and_resumes_from_the_named_checkpoint(
    nan_project: Path, tmp_path: Path
) -> None:
    reference = run_train(nan_project, tmp_path, *RUN, "--run_name=ref")
    assert reference.returncode == 0, reference.stderr[-3000:]
    # Run x: the reference cut off after its step-2 save (a copy without step 4).
    shutil.copytree(tmp_path / "runs/ref", tmp_path / "runs/x")
    shutil.rmtree(tmp_path / "runs/x/checkpoints/step-4")
    # From step 2, a learning rate of 1e30: step 3's update throws the weights to
    # infinity, step 4's loss is not finite, and step 4's save never happens.
    diverged = run_train(nan_project, tmp_path, *RUN, "--run_name=x", "--lr=1e30")
    assert diverged.returncode == 1, diverged.stderr[-3000:]
    assert diverged.stderr.strip().splitlines() == [
        f"error: step 4: non-finite loss; newest complete checkpoint: "
        f"{Path('runs/x/checkpoints/step-2')}; rerun to resume from it (with a lower --lr)"
    ]
    checkpoints = tmp_path / "runs/x/checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2"]
    assert [row["step"] for row in read_metrics(tmp_path, "x")] == [1, 2, 3]

    resumed = run_train(nan_project, tmp_path, *RUN, "--run_name=x")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from runs/x/checkpoints/step-2" in resumed.stdout
    # Every logged value of training (not timings) equals the uninterrupted run's.
    keys = ("step", "loss", "lr", "grad_norm", "seq_len", "tokens")

    def logged(run: str) -> list[dict]:
        return [{k: row.get(k) for k in keys} for row in read_metrics(tmp_path, run)]

    assert logged("x") == logged("ref") and len(logged("x")) == 4
