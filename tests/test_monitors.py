"""Monitors as catalog entries (fenced blocks at their events), each checked on a run that
provokes it.

nan_monitor: a gpt2-speedup project with it; a run whose learning rate is set to diverge stops
with one line naming the step, the first non-finite tensor and the newest complete checkpoint,
saves nothing after the bad step, and a rerun with the recipe's learning rate resumes from that
checkpoint and logs what an uninterrupted run logs, bitwise.

threshold_stopper: the same project with a threshold between two logged validation losses
stops at the first evaluation past it (saved), and a rerun of that run stays stopped.

optimizer_monitor: its norms equal torch's on a small model here; under FSDP2, DDP,
SHARD_GRAD_OP and HYBRID_SHARD they equal one process's (checked in test_distributed.py's
launches, which train a gpt2-speedup project with optimizer_monitor).

All share one project: gpt2-speedup plus the monitors, and one uninterrupted reference run.
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
    "--eval_interval=1ba",
    "--eval_batches=1",
    "--save_interval=2ba",
    "--save_num_checkpoints_to_keep=0",
    "--max_duration=4ba",
]


MONITORS = ["nan_monitor", "threshold_stopper", "optimizer_monitor"]


@pytest.fixture(scope="module")
def nan_project(tmp_path_factory: pytest.TempPathFactory, isolated_home: Path) -> Path:
    root = tmp_path_factory.mktemp("monitors")
    tables = "".join(f"\n[algorithms.{name}]\n" for name in MONITORS)
    (root / "recipe.toml").write_text(RECIPE + tables)
    new_project(str(root / "recipe.toml"), root / "p", [], "p")
    return root / "p"


@pytest.fixture(scope="module")
def reference(nan_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run `ref` (4 steps, evaluated at each): its folder's parent."""
    workdir = tmp_path_factory.mktemp("reference")
    result = run_train(nan_project, workdir, *RUN, "--run_name=ref")
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


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
    nan_project: Path, reference: Path, tmp_path: Path
) -> None:
    # Run x: the reference cut off after its step-2 save (a copy without step 4).
    shutil.copytree(reference / "runs/ref", tmp_path / "runs/ref")
    shutil.copytree(reference / "runs/ref", tmp_path / "runs/x")
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


def test_threshold_stopper_stops_at_the_first_logged_crossing_and_stays_stopped(
    nan_project: Path, reference: Path, tmp_path: Path
) -> None:
    ref = read_metrics(reference, "ref")
    val = {row["step"]: row["val_loss"] for row in ref}
    threshold = (val[2] + val[3]) / 2  # val_loss falls below it at step 3, not before
    assert val[1] > threshold and val[2] > threshold > val[3]
    args = [*RUN, "--run_name=t", f"--threshold_stopper_threshold={threshold!r}"]
    stopped = run_train(nan_project, tmp_path, *args)
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    assert (
        f"threshold_stopper: val_loss {val[3]:.6g} < {threshold:g} at step 3; stopping"
        in stopped.stdout
    )
    assert "done: step 3" in stopped.stdout
    rows = read_metrics(tmp_path, "t")
    assert [row["loss"] for row in rows] == [row["loss"] for row in ref[:3]]
    checkpoints = tmp_path / "runs/t/checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-3"]

    # The stop is saved: a rerun of the run resumes at step 3 and trains nothing more.
    rerun = run_train(nan_project, tmp_path, *args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert (
        "this run stopped at its checkpoint (threshold_stopper: val_loss"
        in rerun.stdout
    )
    assert "done: step 3" in rerun.stdout
    assert len(read_metrics(tmp_path, "t")) == 3
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2", "step-3"]


def test_optimizer_norms_are_the_gradient_weight_and_update_norms(
    nan_project: Path, reference: Path
) -> None:
    with project_modules(nan_project) as modules:
        optimizer_norms = modules["train"].optimizer_norms
        local_squared_norms = modules["train"].fsdp.local_squared_norms
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 1))
        model[1].bias.requires_grad_(False)  # no gradient: not logged
        model(torch.randn(5, 3)).square().sum().backward()
        stepped = [(n, p) for n, p in model.named_parameters() if p.grad is not None]
        grads = local_squared_norms([p.grad for _, p in stepped])
        before = [p.detach().clone() for _, p in stepped]
        torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5).step()
        updates = local_squared_norms(
            [p.detach() - b for (_, p), b in zip(stepped, before)]
        )
        norms = optimizer_norms(stepped, grads, updates)
    names = ["0.weight", "0.bias", "1.weight"]
    expected = {
        "l2_norm/grad/global": torch.cat([p.grad.flatten() for _, p in stepped]).norm()
    }
    for (name, param), old in zip(stepped, before, strict=True):
        update = (param.detach() - old).norm()
        expected |= {
            f"l2_norm/grad/{name}": param.grad.norm(),
            f"l2_norm/param/{name}": param.detach().norm(),
            f"l2_norm/update/{name}": update,
            f"update_ratio/{name}": update / param.detach().norm(),
        }
    assert [n for n, _ in stepped] == names and norms.keys() == expected.keys()
    for key, value in expected.items():
        assert norms[key] == pytest.approx(value.item(), rel=1e-6), key
    # In a run: every logged step has them, one per trained parameter; the console line
    # leaves the per-layer ones out.
    rows = read_metrics(reference, "ref")
    assert all(row["l2_norm/grad/global"] > 0 for row in rows)
    model_params = {
        k.removeprefix("l2_norm/param/")
        for k in rows[0]
        if k.startswith("l2_norm/param/")
    }
    assert "wte.weight" in model_params and len(model_params) > 10
    log = (reference / "runs/ref/log.txt").read_text()
    assert "loss=" in log and "l2_norm/" not in log
