"""The diffusion task with the sd model pack: the tiny parts train offline on the captioned
digits; the exported folder loads and samples through diffusers' own StableDiffusionPipeline
and fine-tunes again as `--model`; JSON Lines data; bad input is one line, exit 2, nothing
written; SIGTERM and SIGUSR1 save and stop, and the same command resumes bitwise, into the
same tracker runs, which hold the metrics and every sample grid (read back with each
tracker's own library). Nothing is downloaded (HF_HUB_OFFLINE=1 in every subprocess)."""

from __future__ import annotations

import glob
import importlib.util
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("sklearn")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from projects import (  # noqa: E402
    checkout_env,
    read_metrics,
    run_train,
    run_train_many,
)

RECIPE = "sd-baseline"
SMALL = [
    "--tiny_vae_steps=10",
    "--global_batch_size=8",
    "--device_microbatch_size=4",
    "--samples_per_prompt=1",
    "--sample_steps=3",
    "--eval_timesteps=2",
]
EIGHT = ["--max_duration=8ba", "--eval_interval=4ba"]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def exported(
    generated: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """An 8-step run of the tiny parts (evaluated at steps 4 and 8): its exported
    pipeline folder, in runs/short/ of a working folder of its own."""
    workdir = tmp_path_factory.mktemp("sd-export")
    result = run_train(generated[RECIPE], workdir, *SMALL, *EIGHT, "--run_name=short")
    assert result.returncode == 0, result.stderr
    records = read_metrics(workdir, "short")
    assert [r["step"] for r in records] == [*range(1, 9)]
    assert 0 <= records[-1]["judged_accuracy"] <= 1 and records[-1]["val_loss"] > 0
    assert [r["step"] for r in records if "val_loss" in r] == [4, 8]
    for step in (4, 8):
        grid = Image.open(workdir / "runs" / "short" / "samples" / f"step-{step}.png")
        assert grid.size == (10 * 64, 64)  # ten prompts, one seed, 16 px scaled to 64
    return workdir / "runs" / "short" / "pipeline"


def test_export_samples_through_diffusers_pipeline(exported: Path) -> None:
    pipeline = diffusers.StableDiffusionPipeline.from_pretrained(exported)
    assert isinstance(pipeline.scheduler, diffusers.DDIMScheduler)
    generator = torch.Generator().manual_seed(0)
    images = pipeline(
        ["a handwritten digit seven", "a handwritten digit one"],
        num_inference_steps=3,
        guidance_scale=3.0,
        height=16,
        width=16,
        generator=generator,
        output_type="np",
    ).images
    assert images.shape == (2, 16, 16, 3) and np.isfinite(images).all()
    # The same UNet weights as the run's final checkpoint: not a fresh init.
    fresh = diffusers.UNet2DConditionModel.from_config(pipeline.unet.config)
    assert any(
        not torch.equal(a, b)
        for a, b in zip(
            pipeline.unet.state_dict().values(), fresh.state_dict().values()
        )
    )


def write_images(folder: Path, count: int) -> list[dict]:
    """Small PNGs of two kinds (bright, dark) with captions saying which."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(count):
        level = 220 if i % 2 else 30
        pixels = np.full((20, 24, 3), level, np.uint8)
        pixels[i % 20, :, 0] = 255 - level
        Image.fromarray(pixels).save(folder / f"{i}.png")
        rows.append(
            {"file": f"img/{i}.png", "caption": ["a dark one", "a bright one"][i % 2]}
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_fine_tunes_the_exported_pipeline_on_jsonl(
    generated: dict[str, Path], exported: Path, tmp_path: Path
) -> None:
    """`--model=FOLDER` loads every part (its tokenizer and VAE, not tiny's), JSON Lines
    images are decoded, resized and cropped to the model's 16 pixels, and training runs.
    """
    data = write_jsonl(tmp_path / "captions.jsonl", write_images(tmp_path / "img", 40))
    result = run_train(
        generated[RECIPE],
        tmp_path,
        *SMALL,
        f"--model={exported}",
        f"--data={data}",
        "--run_name=tune",
        "--max_duration=2ba",
    )
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "runs" / "tune" / "log.txt").read_text()
    assert "images: 36 train, 4 validation, 16px" in log, log
    records = read_metrics(tmp_path, "tune")
    assert "judged_accuracy" not in records[-1]  # captions name no class: no judge
    assert not (tmp_path / "runs" / ".scaffold-cache").exists()  # no tiny VAE fitted


def test_bad_input_is_one_line_and_writes_nothing(
    generated: dict[str, Path], exported: Path, tmp_path: Path
) -> None:
    rows = write_images(tmp_path / "img", 12)
    (tmp_path / "img" / "broken.png").write_bytes(b"not a png")
    broken = write_jsonl(
        tmp_path / "broken.jsonl", rows + [{"file": "img/broken.png", "caption": "x"}]
    )
    missing = write_jsonl(
        tmp_path / "missing.jsonl", rows + [{"file": "img/gone.png", "caption": "x"}]
    )
    wordy = "a dark one " * 10
    long = write_jsonl(
        tmp_path / "long.jsonl", rows + [{"file": "img/0.png", "caption": wordy}]
    )
    no_unet = tmp_path / "no-unet"
    no_unet.mkdir()
    (no_unet / "model_index.json").write_text("{}")
    cases = {
        "undecodable": (
            [f"--data={broken}"],
            "broken.jsonl, line 13: the image does not decode",
        ),
        "missing": ([f"--data={missing}"], "line 13: the image"),
        "no_unet": (
            [f"--model={no_unet}"],
            f"--model={no_unet}: no UNet could be loaded",
        ),
        "too_long": (
            [f"--data={long}", f"--model={exported}"],
            "is longer than the text encoder's 16 tokens; shorten it",
        ),
    }
    for name in cases:
        (tmp_path / name).mkdir()
    results = run_train_many(
        {
            name: (generated[RECIPE], tmp_path / name, [*SMALL, *args])
            for name, (args, _) in cases.items()
        }
    )
    for name, (args, expected) in cases.items():
        workdir = tmp_path / name
        result = results[name]
        assert result.returncode == 2, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert (
            len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
        ), (name, lines)
        assert not (workdir / "runs").exists(), name


# ---------------------------------------------------------------- pre-emption and trackers

TRACKERS = [
    n for n in ("tensorboard", "mlflow", "wandb") if importlib.util.find_spec(n)
]


def signalled(
    project: Path, workdir: Path, args: list[str], sig: str, rows: int
) -> str:
    """Run `train.py ARGS` (run `pre`); once metrics.jsonl has `rows` rows, `sig` to it
    (paused, so that it lands mid-run however fast the steps are). Its output."""
    command = [sys.executable, str(project / "train.py"), "--device=cpu", *args]
    run = subprocess.Popen(
        command,
        cwd=workdir,
        env=checkout_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    metrics = workdir / "runs" / "pre" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows):
        assert run.poll() is None, run.communicate()[0][-3000:]
        assert time.monotonic() < deadline, "no metrics"
        time.sleep(0.05)
    os.kill(run.pid, signal.SIGSTOP)
    os.kill(run.pid, getattr(signal, sig))
    os.kill(run.pid, signal.SIGCONT)
    output, _ = run.communicate(timeout=300)
    assert run.returncode == 0, output[-3000:]
    return output


@pytest.mark.slow  # ~3 CI minutes of one worker; CI runs kill -9 resume on this task
def test_preempted_twice_resumes_bitwise_into_the_same_trackers(
    generated: dict[str, Path],
    exported: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM once step 2 is logged: the run finishes its step, saves, says so in one
    line and exits 0; the same command resumes, SIGUSR1 stops it likewise; the same
    command again finishes. Every step is logged once, with the uninterrupted run's
    losses, validation losses and judged accuracies, bitwise. TensorBoard, MLflow and W&B
    (offline; those installed) each hold one run: the losses of every step once, and
    the sample grids of steps 4 and 8 as images, pixel for pixel the PNGs."""
    if not TRACKERS:
        pytest.skip("no tracker installed")
    for name in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no W&B login: offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    project = generated[RECIPE]
    whole = read_metrics(exported.parents[2], "short")  # the same run, uninterrupted
    pre = [*SMALL, *EIGHT, "--run_name=pre", f"--trackers={','.join(TRACKERS)}"]
    stops = [0]
    for sig in ("SIGTERM", "SIGUSR1"):
        output = signalled(project, tmp_path, pre, sig, stops[-1] + 1)
        said = re.findall(rf"stopped by {sig} after step (\d+), saved", output)
        assert len(said) == 1, output[-3000:]
        stops.append(int(said[0]))
        assert stops[-2] < stops[-1] < 8
        checkpoint = tmp_path / "runs" / "pre" / "checkpoints" / f"step-{said[0]}"
        assert (checkpoint / "COMPLETE").exists()
    last = run_train(project, tmp_path, *pre)
    assert last.returncode == 0, last.stderr[-3000:]
    assert f"step-{stops[-1]} at step {stops[-1]}" in last.stdout
    keys = ("step", "loss", "val_loss", "judged_accuracy")
    rows = read_metrics(tmp_path, "pre")
    assert [[r.get(k) for k in keys] for r in rows] == [
        [r.get(k) for k in keys] for r in whole
    ]
    run_dir = tmp_path / "runs" / "pre"
    losses = [(r["step"], r["loss"]) for r in rows]
    grids = {
        step: np.asarray(Image.open(run_dir / "samples" / f"step-{step}.png"))
        for step in (4, 8)
    }
    assert all(grid.shape == (64, 640, 3) for grid in grids.values())
    ids = json.loads((run_dir / "trackers.json").read_text())
    if "tensorboard" in TRACKERS:
        from tensorboard.backend.event_processing.event_accumulator import (
            EventAccumulator,
        )

        events = EventAccumulator(
            str(run_dir / "tensorboard"), size_guidance={"images": 0, "scalars": 0}
        )
        events.Reload()
        logged = [(e.step, e.value) for e in events.Scalars("loss")]
        assert logged == [(s, pytest.approx(v, rel=1e-6)) for s, v in losses]
        assert [e.step for e in events.Scalars("val_loss")] == [4, 8]
        images = events.Images("images/samples")
        assert [image.step for image in images] == [4, 8]
        for image in images:
            decoded = Image.open(io.BytesIO(image.encoded_image_string))
            assert np.array_equal(np.asarray(decoded.convert("RGB")), grids[image.step])
    if "mlflow" in TRACKERS:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(
            tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
        )
        history = client.get_metric_history(ids["mlflow"], "loss")
        assert sorted((m.step, m.value) for m in history) == [
            (s, pytest.approx(v, rel=1e-6)) for s, v in losses
        ]
        local = Path(client.download_artifacts(ids["mlflow"], "", str(tmp_path / "ml")))
        for step, grid in grids.items():
            stored = Image.open(local / "images" / "samples" / f"step-{step}.png")
            assert np.array_equal(np.asarray(stored.convert("RGB")), grid)
    if "wandb" in TRACKERS:
        from test_trackers import read_wandb_records

        files = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "*.wandb")))
        assert len(files) == 3 and all(
            f.endswith(f"run-{ids['wandb']}.wandb") for f in files
        )
        history, shown = [], {}
        for path in files:
            for record in read_wandb_records(path):
                if record.WhichOneof("record_type") != "history":
                    continue
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                step = record.history.step.num
                if "loss" in items:
                    history.append((step, items["loss"]))
                if "images/samples/path" in items:
                    shown[step] = (
                        Path(path).parent / "files" / items["images/samples/path"]
                    )
        assert history == [(s, pytest.approx(v, rel=1e-6)) for s, v in losses]
        assert sorted(shown) == [4, 8]
        for step, stored in shown.items():
            pixels = np.asarray(Image.open(stored).convert("RGB"))
            assert np.array_equal(pixels, grids[step])
