"""Monitors as catalog entries (fenced blocks at their events), each checked on a run that
provokes it.

nan_monitor: a gpt2-speedup project with it; a run whose learning rate is set to diverge stops
with one line naming the step, the first non-finite tensor and the newest checkpoint saved
before the loss left its range, saves nothing after the bad step, and a rerun that follows the
advice (--load_path, the recipe's learning rate) logs what an uninterrupted run logs, bitwise.
Where the loss exploded for a few steps before it went non-finite, the newest checkpoints hold
exploded weights (a rerun resuming them stops again at any --lr): the advice names an older
one, and following it trains to the end, each later checkpoint replaced by the new run's.

threshold_stopper: the same project with a threshold between two logged validation losses
stops at the first evaluation past it (saved), and a rerun of that run stays stopped.

optimizer_monitor: its norms equal torch's on a small model here; under FSDP2, DDP,
SHARD_GRAD_OP and HYBRID_SHARD they equal one process's (checked in test_distributed.py's
launches, which train a gpt2-speedup project with optimizer_monitor).

activation_monitor: its statistics are torch's, a layer whose weights are scaled up shows in
them, only the step's first forward is recorded and the hooks go; in a run, exactly the
watched steps have them; an interval that is not a multiple of log_interval is one line.

system_metrics: a busy and an idle stretch of this process read as such; every record of a
run has the readings.

generate: each evaluation's record holds each prompt's text, which is what sample.py writes
from that step's checkpoint with the run's seed; a prompt that gives no tokens is one line.

memory_snapshot and oom_observer (CUDA only): on this CPU a run is refused in one line before
anything is written; memory_snapshot's choice of steps. Their recording is not run here.

image_visualizer: its grid shows each input as fed to the model, its label and the model's
prediction (green when right, red when wrong); a run writes one PNG per evaluation and
TensorBoard holds the same pixels.

scale_schedule (not a monitor; it shares the project): --scale_schedule_ratio=0.25 runs a
quarter of max_duration, the cosine over the quarter, the warmup in batches unchanged.

gradient_clipping's value mode: with a tiny limit every gradient entry is clamped to it, so
each parameter's logged (clipped) gradient norm is the limit times the root of its size.

All share one project: gpt2-speedup (its clipping in value mode) plus the monitors, and one
uninterrupted reference run.
"""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from projects import (
    checkout_env,
    project_modules,
    read_metrics,
    run_train,
    run_train_apart,
)
from test_vision_catalog_augment import SMALL as SMALL_IMAGES
from scaffold.render import new_project

RECIPE_DIR = Path(__file__).resolve().parent.parent / "templates/recipes"
RECIPE = (RECIPE_DIR / "gpt2-speedup.toml").read_text()
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


MONITORS = {
    "nan_monitor": "",
    "threshold_stopper": "",
    "optimizer_monitor": "",
    "activation_monitor": "interval = 2\n",  # steps 2 and 4 of the reference
    "system_metrics": "",
    "generate": "",  # its defaults: "def " and "import ", 32 tokens each
    "scale_schedule": "",  # ratio 1: the flag, no change
}


# The recipe's gradient clipping in Composer's value mode (checked here by the monitor).
VALUE_CLIPPING = '[algorithms.gradient_clipping]\nclipping_type = "value"\n'


@pytest.fixture(scope="module")
def nan_project(tmp_path_factory: pytest.TempPathFactory, isolated_home: Path) -> Path:
    root = tmp_path_factory.mktemp("monitors")
    tables = "".join(f"\n[algorithms.{name}]\n{v}" for name, v in MONITORS.items())
    recipe = RECIPE.replace("[algorithms.gradient_clipping]\n", VALUE_CLIPPING)
    assert VALUE_CLIPPING in recipe
    (root / "recipe.toml").write_text(recipe + tables)
    new_project(str(root / "recipe.toml"), root / "p", [], "p")
    return root / "p"


@pytest.fixture(scope="module")
def reference(nan_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The uninterrupted run `ref` (4 steps, evaluated at each): its folder's parent."""
    workdir = tmp_path_factory.mktemp("reference")
    result = run_train(nan_project, workdir, *RUN, "--run_name=ref")
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


@pytest.fixture(scope="module")
def refused(
    nan_project: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """The runs of the tests below that stop in setup, in one interpreter (torch
    imported once). Each name: (workdir, result)."""
    unscaled = [a for a in RUN if not a.startswith("--max_duration")]
    runs = {
        "log_interval": [*RUN, "--log_interval=3ba"],
        "prompt": [*RUN, "--generate_prompts=def |"],
        "short": [
            *unscaled,
            "--run_name=short",
            "--max_duration=16ba",
            "--scale_schedule_ratio=0.0625",
            "--lr_warmup=2ba",
        ],
    }
    return run_train_apart(nan_project, tmp_path_factory.mktemp("refused"), runs)


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
    first = read_metrics(reference, "ref")[0]["loss"]
    step_2 = Path("runs/x/checkpoints/step-2")
    assert diverged.stderr.strip().splitlines() == [
        f"error: step 4: non-finite loss; the newest checkpoint saved before the loss "
        f"left its range (finite and at most {first:.4g}, the first logged loss) is "
        f"{step_2}: rerun with --load_path={step_2} and a lower --lr"
    ]
    checkpoints = tmp_path / "runs/x/checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-2"]
    assert [row["step"] for row in read_metrics(tmp_path, "x")] == [1, 2, 3]

    resumed = run_train(
        nan_project, tmp_path, *RUN, "--run_name=x", f"--load_path={step_2}"
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {step_2}" in resumed.stdout
    # Every logged value of training (not timings) equals the uninterrupted run's.
    keys = ("step", "loss", "lr", "grad_norm", "seq_len", "tokens")

    def logged(run: str) -> list[dict]:
        return [{k: row.get(k) for k in keys} for row in read_metrics(tmp_path, run)]

    assert logged("x") == logged("ref") and len(logged("x")) == 4


def test_after_an_exploding_loss_the_advice_names_an_older_checkpoint_that_trains(
    nan_project: Path, tmp_path: Path
) -> None:
    """A learning rate of 1000 (warmed up over one step): the loss explodes from step 3
    on (finite, ~1e7) before a gradient goes non-finite; the checkpoints of steps 2 and
    later hold exploded weights. The advice names step 1, and following it trains."""
    kept = [arg for arg in RUN if not arg.startswith(("--save_interval", "--max_dur"))]
    every_step = [*kept, "--save_interval=1ba", "--max_duration=6ba", "--run_name=e"]
    diverged = run_train(
        nan_project, tmp_path, *every_step, "--lr=1000", "--lr_warmup=1ba"
    )
    assert diverged.returncode == 1, diverged.stderr[-3000:]
    losses = [row["loss"] for row in read_metrics(tmp_path, "e")]
    assert losses[1] <= losses[0] < 1e3 < losses[2], losses
    checkpoints = tmp_path / "runs/e/checkpoints"
    saved = sorted(int(p.name.removeprefix("step-")) for p in checkpoints.iterdir())
    assert saved == list(range(1, len(losses) + 1)) and len(saved) >= 3
    step_1 = Path("runs/e/checkpoints/step-1")
    (line,) = diverged.stderr.strip().splitlines()
    assert line.endswith(
        f"the newest checkpoint saved before the loss left its range (finite and at "
        f"most {losses[0]:.4g}, the first logged loss) is {step_1}: rerun with "
        f"--load_path={step_1} and a lower --lr"
    ), line

    followed = run_train(nan_project, tmp_path, *every_step, f"--load_path={step_1}")
    assert followed.returncode == 0, followed.stderr[-3000:]
    rows = read_metrics(tmp_path, "e")
    assert [row["step"] for row in rows] == [1, 2, 3, 4, 5, 6]
    assert all(row["loss"] < losses[0] + 1 for row in rows)
    # Each step's checkpoint is this run's now: step 3's weights are finite again.
    step_3 = checkpoints / "step-3"
    dcp_to_torch_save(step_3, tmp_path / "step-3.pt")
    weights = torch.load(tmp_path / "step-3.pt", weights_only=True)["model"]
    assert all(w.isfinite().all() and w.abs().max() < 100 for w in weights.values())


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
        local_squared_norms = modules["train"].parallel.local_squared_norms
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


def test_activation_statistics_show_a_scaled_layer_for_the_first_forward_only(
    nan_project: Path, reference: Path, refused: dict
) -> None:
    with project_modules(nan_project) as modules:
        train = modules["train"]
        value = torch.randn(3, 5, 8)
        centered = value - value.mean(-1, keepdim=True)
        kurtosis = (centered**4).mean(-1) / (centered**2).mean(-1) ** 2
        expected = [
            value.mean(),
            value.max(-1).values.mean(),
            value.norm(dim=-1).mean(),
            kurtosis.mean(),
        ]
        got = train.feature_statistics(value)
        torch.testing.assert_close(got, torch.stack(expected))

        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
        )
        found: dict[str, torch.Tensor] = {}
        hooks = train.watch_activations(model, found)
        inputs = torch.randn(6, 8)
        model(inputs)
        first = train.activation_metrics(found)
        with torch.no_grad():
            model[0].weight.mul_(100)
            model[0].bias.mul_(100)
        model(inputs)  # a second forward (microbatch) of the step: not recorded
        assert train.activation_metrics(found) == first
        for hook in hooks:
            hook.remove()
        found.clear()
        model(inputs)  # hooks removed: nothing recorded
        assert found == {}
        hooks = train.watch_activations(model, found)
        model(inputs)
        scaled = train.activation_metrics(found)
        for hook in hooks:
            hook.remove()
    assert set(first) == {
        f"activations/{stat}/{name}"
        for stat in ("average", "max", "l2_norm", "kurtosis")
        for name in ("0", "1", "2")
    }
    for name in ("0", "1"):  # the scaled layer's output and its ReLU: 100x
        key = f"activations/l2_norm/{name}"
        assert scaled[key] == pytest.approx(100 * first[key], rel=1e-4)
    assert scaled["activations/l2_norm/2"] > 10 * first["activations/l2_norm/2"]
    # In the run (interval 2): the watched steps and only they have them.
    rows = read_metrics(reference, "ref")
    watched = [r["step"] for r in rows if "activations/l2_norm/blocks.0.attn" in r]
    assert watched == [2, 4]

    # An interval that is not a multiple of the logging interval: one line, exit 2.
    _, result = refused["log_interval"]
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: activation_monitor_interval=2 is not a multiple of log_interval=3ba; "
        "pick a multiple of a batch log_interval (e.g. --log_interval=1ba), so each "
        "record is logged at its step"
    ]


def test_system_metrics_read_a_busy_and_an_idle_process(
    nan_project: Path, reference: Path
) -> None:
    with project_modules(nan_project) as modules:
        system = modules["train"].SystemMetrics(torch.device("cpu"))
        end = time.perf_counter() + 0.5
        while time.perf_counter() < end:  # one core busy
            pass
        busy = system.read()
        time.sleep(0.5)
        idle = system.read()
    assert busy["system/process_cpu_percent"] > 40 > idle["system/process_cpu_percent"]
    assert 0 < busy["system/memory_used_gb"] and 0 < busy["system/memory_percent"] < 100
    assert idle["system/network_received_gb"] >= busy["system/network_received_gb"]
    rows = read_metrics(reference, "ref")
    keys = {"system/cpu_percent", "system/disk_used_gb", "system/network_sent_gb"}
    assert all(keys <= row.keys() for row in rows) and len(rows) == 4


def test_value_clipping_clamps_every_gradient_entry(
    nan_project: Path, tmp_path: Path
) -> None:
    limit = 1e-6
    args = [*RUN[:-1], "--max_duration=1ba", f"--gradient_clipping_max_value={limit}"]
    result = run_train(nan_project, tmp_path, *args, "--run_name=v")
    assert result.returncode == 0, result.stderr[-3000:]
    (row,) = read_metrics(tmp_path, "v")
    dcp_to_torch_save(tmp_path / "runs/v/checkpoints/step-1", tmp_path / "v.pt")
    weights = torch.load(tmp_path / "v.pt", weights_only=True)["model"]
    assert row["grad_norm"] > 1e3 * limit  # before clipping
    names = [k.removeprefix("l2_norm/param/") for k in row if "/param/" in k]
    assert len(names) > 10
    for name in names:
        most = limit * weights[name].numel() ** 0.5  # every entry at +-limit
        # fp32 rounding of the norm: torch.linalg.vector_norm of 65,536 equal entries on
        # the CPU is 3.3e-5 off their exact norm
        assert row[f"l2_norm/grad/{name}"] <= most * (1 + 1e-4), name
    # A layer norm's weight has no zero gradient entries: all of them are at the limit.
    numel = weights["ln_f.weight"].numel()
    assert row["l2_norm/grad/ln_f.weight"] == pytest.approx(
        limit * numel**0.5, rel=1e-5
    )


def test_generate_logs_what_sample_py_writes_from_that_steps_checkpoint(
    nan_project: Path, reference: Path, refused: dict
) -> None:
    rows = {row["step"]: row for row in read_metrics(reference, "ref")}
    assert all({"generate/0", "generate/1"} <= set(row) for row in rows.values())
    assert all(row["generate/0"].startswith("def ") for row in rows.values())
    assert all(row["generate/1"].startswith("import ") for row in rows.values())
    assert rows[2]["generate/0"] != rows[4]["generate/0"]  # the model changed
    for step in (2,):
        sampled = subprocess.run(
            [
                sys.executable,
                str(nan_project / "sample.py"),
                f"--checkpoint=runs/ref/checkpoints/step-{step}",
                "--prompt=def ",
                "--seed=42",
                "--max_new_tokens=32",
                "--device=cpu",
            ],
            cwd=reference,
            env=checkout_env(),
            capture_output=True,
            timeout=300,
        )
        assert sampled.returncode == 0, sampled.stderr[-3000:]
        text = rows[step]["generate/0"]
        assert f"\n{text}\n---------------\n".encode() in sampled.stdout
    # A prompt that gives no tokens: one line, exit 2, no run folder.
    workdir, result = refused["prompt"]
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: generate: the prompt '' gives no tokens with this data's tokenizer; "
        "change --generate_prompts (prompts separated by |)"
    ]
    assert not (workdir / "runs").exists()


def test_scale_schedule_runs_a_quarter_of_the_budget_with_the_warmup_unscaled(
    nan_project: Path, refused: dict, tmp_path: Path
) -> None:
    args = [a for a in RUN if not a.startswith("--max_duration")]
    run = run_train(
        nan_project,
        tmp_path,
        *args,
        "--run_name=s",
        "--max_duration=16ba",
        "--scale_schedule_ratio=0.25",
        "--lr_warmup=2ba",
        "--min_lr_ratio=0.1",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = read_metrics(tmp_path, "s")
    assert [row["step"] for row in rows] == [1, 2, 3, 4]  # 16ba x 0.25
    # Step k trains at the lr of fraction (k-1)/4: warmup over 2 steps (not 2 x 0.25),
    # then the cosine from lr to 0.1 lr over the scaled run's remaining 2 steps.
    recorded = (tmp_path / "runs/s/config.toml").read_text()
    assert (
        'max_duration = "4ba"' in recorded and "scale_schedule_ratio = 1.0" in recorded
    )
    lr = float(recorded.split("\nlr = ")[1].split("\n")[0])
    expected = [0.0, lr / 2, lr, (lr + 0.1 * lr) / 2]
    assert [row["lr"] for row in rows] == pytest.approx(expected, rel=1e-12)
    # A scaled run shorter than its warmup (16ba x 0.0625): one line, nothing written.
    workdir, short = refused["short"]
    assert short.returncode == 2
    assert short.stderr.strip().splitlines() == [
        "error: lr_warmup=2ba is longer than the scaled max_duration=1ba; pick a "
        "larger --scale_schedule_ratio or a shorter --lr_warmup"
    ]
    assert not (workdir / "runs/short").exists()


@pytest.mark.parametrize("name", ["memory_snapshot", "oom_observer"])
def test_cuda_memory_entries_are_refused_on_the_cpu_before_anything_is_written(
    name: str, tmp_path: Path, isolated_home: Path
) -> None:
    recipe = (
        RECIPE_DIR / "gpt2-baseline.toml"
    ).read_text() + f"\n[algorithms.{name}]\n"
    (tmp_path / "recipe.toml").write_text(recipe)
    new_project(str(tmp_path / "recipe.toml"), tmp_path / "p", [], "p")
    refused = run_train(tmp_path / "p", tmp_path, *RUN)
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        f"error: {name} records the CUDA allocator's memory history, but this run is "
        f"on cpu; run it on a GPU (--device=cuda) or remove it (scaffold remove {name})"
    ]
    assert not (tmp_path / "runs").exists()


def test_memory_snapshot_records_the_chosen_steps_once() -> None:
    from runtime import memory

    # start=1, steps=3: recording begins before step 2 and is written after step 4.
    due = {batch: memory.snapshot_due(batch, 1, 3) for batch in range(7)}
    assert due == {0: "", 1: "record", 2: "", 3: "", 4: "write", 5: "", 6: ""}
    assert memory.snapshot_due(0, 0, 1) == "record"
    assert memory.snapshot_due(1, 0, 1) == "write"
    assert memory.check("x", torch.device("cuda", 0)) is None


def test_image_visualizer_shows_inputs_labels_and_predictions_in_png_and_tensorboard(
    tmp_path: Path, isolated_home: Path
) -> None:
    pytest.importorskip("tensorboard")
    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recipe = (RECIPE_DIR / "cifar-resnet56-baseline.toml").read_text()
    (tmp_path / "recipe.toml").write_text(recipe + "\n[algorithms.image_visualizer]\n")
    project = tmp_path / "p"
    new_project(str(tmp_path / "recipe.toml"), project, [], "p")

    class PredictsOne(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.one_hot(torch.ones(len(x)).long(), 10).float()

    with project_modules(project) as modules:
        train, data = modules["train"], modules["data"]
        images = data.digits()  # 8x8 grey digits, 10 classes
        pixels = torch.randint(0, 256, (4, 1, 8, 8), dtype=torch.uint8)
        cfg = train.Config(precision="fp32", image_visualizer_num_images=3)
        inputs = data.normalize(pixels, images)
        grid = train.visualize(
            PredictsOne(), inputs, torch.tensor([1, 0, 1, 5]), images, cfg
        )
    grid.save(tmp_path / "grid.png")
    shown = np.asarray(Image.open(tmp_path / "grid.png"))
    assert shown.shape == (64 + 24, 3 * 64, 3)  # 3 tiles enlarged 8x, captions below
    for i, right in enumerate([True, False, True]):
        tile = shown[:64, i * 64 : (i + 1) * 64]
        enlarged = pixels[i, 0].repeat_interleave(8, 0).repeat_interleave(8, 1)
        assert np.array_equal(tile[..., 0], enlarged.numpy()), i  # grey: R = G = B
        red, green = (
            shown[64 + 11 :, i * 64 : (i + 1) * 64].astype(int).transpose(2, 0, 1)[:2]
        )
        assert ((green > red + 60).any(), (red > green + 60).any()) == (
            right,
            not right,
        )

    # A run: a grid per evaluation (steps 2, 4), the same pixels in TensorBoard.
    run = run_train(
        project,
        tmp_path,
        *SMALL_IMAGES,
        "--max_duration=4ba",
        "--eval_interval=2ba",
        "--trackers=tensorboard",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    folder = tmp_path / "runs/p"
    assert sorted(p.name for p in (folder / "images").iterdir()) == [
        "step-2.png",
        "step-4.png",
    ]
    events = EventAccumulator(str(folder / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    logged = events.Images("images/train")
    assert [event.step for event in logged] == [2, 4]
    for event in logged:
        written = Image.open(folder / f"images/step-{event.step}.png")
        assert written.size == (8 * 64, 64 + 24)  # the default 8 images of 8
        decoded = Image.open(io.BytesIO(event.encoded_image_string))
        assert np.array_equal(np.asarray(decoded), np.asarray(written.convert("RGB")))
