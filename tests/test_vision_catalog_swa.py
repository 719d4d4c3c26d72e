"""Vision catalog: stochastic weight averaging (`swa`, image_classification; issue 26).

One tiny-ResNet project trains 6 steps, averaging from step 3 (0.5dur) every step and
swapping the average in at step 5 (0.8dur), with the SWA learning rate annealed to 0.05
over 2 averages and the BatchNorm statistics recomputed over 2 batches. Every step is
saved: the checkpoints' `swa` entries are the mean of the `model` entries at the averaging
points, the swap puts it into the model, and the logged learning rates are SWALR's. The
BatchNorm refresh is checked against a hand computation of the group statistics. (The
kill -9 resume is tests/test_catalog_resume.py's `swa` case.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from projects import project_modules
from runtime.checkpoint import read_weights
from runtime.time import Time
from test_vision_catalog_model import render, train

SWA = {
    "start": "0.5dur",
    "end": "0.8dur",
    "update_interval": "1ba",
    "schedule_lr": True,
    "anneal_steps": 2,
    "lr": 0.05,
    "bn_batches": 2,
}
STEPS = 6


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, isolated_home: Path) -> Path:
    return render(tmp_path_factory.mktemp("swa"), "swa", {"swa": SWA})


def weights(run: Path, step: int, entry: str) -> dict[str, torch.Tensor]:
    found, saved_step, _, _ = read_weights(run / "checkpoints" / f"step-{step}", entry)
    assert saved_step == step
    return found


def params(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The trained tensors (no BatchNorm statistics, no SWA counters)."""
    return {
        k: v
        for k, v in state.items()
        if not k.startswith("swa_") and "running" not in k and "tracked" not in k
    }


def test_swa_averages_the_weights_swaps_them_in_and_anneals_the_lr(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = [
        f"--max_duration={STEPS}ba",
        "--device_microbatch_size=4",
        "--save_interval=1ba",
        "--save_num_checkpoints_to_keep=0",
        "--log_interval=1ba",
    ]
    train(project, tmp_path, monkeypatch, *args)
    run = tmp_path / "runs" / "r"
    model = {step: weights(run, step, "model") for step in range(1, STEPS + 1)}
    swa = {step: weights(run, step, "swa") for step in range(3, STEPS + 1)}
    # averaging points: steps 3, 4, 5 (fraction >= 0.5 after the step, up to the swap)
    assert [int(swa[s]["swa_count"]) for s in range(3, 7)] == [1, 2, 3, 3]
    assert [bool(swa[s]["swa_done"]) for s in range(3, 7)] == [0, 0, 1, 1]
    for key, value in params(model[3]).items():
        torch.testing.assert_close(swa[3][key], value, rtol=0, atol=0)
        mean = (model[3][key] + model[4][key]) / 2
        torch.testing.assert_close(swa[4][key], mean, rtol=1e-6, atol=1e-7)
        # step 5 swapped the average of steps 3-5 into the model; step 6 trained on
        torch.testing.assert_close(model[5][key], swa[5][key], rtol=0, atol=0)
        torch.testing.assert_close(swa[6][key], swa[5][key], rtol=0, atol=0)
    moved = [k for k, v in params(model[6]).items() if not torch.equal(v, model[5][k])]
    assert moved
    # the swap recomputed the BatchNorm statistics (the average's were not trained on)
    stats = [k for k in model[5] if k.endswith("running_mean")]
    assert stats and all(not torch.equal(model[5][k], swa[5][k]) for k in stats)

    # learning rates: the schedule up to step 3; then SWALR after k averages:
    # 0.05 * a + lr0 * (1 - a), a = k / 2, lr0 the schedule's at 0.5dur
    with project_modules(project) as loaded:
        module = loaded["train"]
        cfg = dataclasses.replace(
            module.Config(),
            lr=0.2,
            lr_warmup=Time.parse("0.25dur"),
            max_duration=Time.parse(f"{STEPS}ba"),
        )
        schedule = [module.lr_at(b / STEPS, cfg, 100) for b in range(STEPS)]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    logged = [row["lr"] for row in rows if "lr" in row]
    lr0 = schedule[3]  # the schedule at 0.5dur (before step 4)
    expected = schedule[:3] + [0.5 * 0.05 + 0.5 * lr0, 0.05, 0.05]
    assert lr0 != 0.05
    assert logged == pytest.approx(expected, rel=1e-6)


def test_refresh_batchnorm_sets_the_mean_group_statistics(project: Path) -> None:
    with project_modules(project) as loaded:
        model, train_module = loaded["model"], loaded["train"]
        torch.manual_seed(0)
        net = model.ResNet(
            model.ResNetConfig(
                num_classes=10, in_channels=1, bn_group_size=2, **model.PRESETS["tiny"]
            )
        )
        batches = [
            (torch.randint(0, 256, (4, 1, 8, 8), dtype=torch.uint8), None, None)
            for _ in range(3)
        ]
        images = type("Images", (), {"mean": (0.5,), "std": (0.25,)})()
        norm = net.stem[1]
        norm.running_mean.fill_(7.0)  # stale statistics: replaced, not blended
        before = int(norm.num_batches_tracked)
        train_module.refresh_batchnorm(net, batches, 2, images, 2, torch.device("cpu"))
    # the stem's BatchNorm sees conv(x) of batches 0 and 1 in 4 groups of 2 samples each
    x = torch.cat([(b[0].float() / 255 - 0.5) / 0.25 for b in batches[:2]])
    with torch.no_grad():
        y = net.stem[0](x)
    groups = y.view(4, 2, *y.shape[1:]).transpose(1, 2).flatten(2)  # group, C, values
    torch.testing.assert_close(norm.running_mean, groups.mean(2).mean(0))
    torch.testing.assert_close(norm.running_var, groups.var(2).mean(0))
    assert norm.momentum == 0.1 and int(norm.num_batches_tracked) == before + 1


def test_swa_window_out_of_order_is_one_error_line(
    project: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    with pytest.raises(SystemExit) as stopped:
        train(
            project, tmp_path, monkeypatch, "--max_duration=2ba", "--swa_start=0.9dur"
        )
    assert stopped.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith("error: swa_start=0.9dur must come before swa_end=0.8dur")
    )
