"""The diffusion task with the sd model pack: the tiny parts train offline on the captioned
digits; the exported folder loads and samples through diffusers' own StableDiffusionPipeline
and fine-tunes again as `--model`; JSON Lines data; bad input is one line, exit 2, nothing
written. Nothing is downloaded (HF_HUB_OFFLINE=1 in every subprocess)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("sklearn")

import torch  # noqa: E402
from PIL import Image  # noqa: E402

from projects import read_metrics, run_train  # noqa: E402

RECIPE = "sd-baseline"
SMALL = [
    "--tiny_vae_steps=10",
    "--global_batch_size=8",
    "--device_microbatch_size=4",
    "--samples_per_prompt=1",
    "--sample_steps=3",
    "--eval_timesteps=2",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def exported(
    generated: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A 4-step run of the tiny parts: its exported pipeline folder."""
    workdir = tmp_path_factory.mktemp("sd-export")
    result = run_train(
        generated[RECIPE], workdir, *SMALL, "--run_name=short", "--max_duration=4ba"
    )
    assert result.returncode == 0, result.stderr
    records = read_metrics(workdir, "short")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert 0 <= records[-1]["judged_accuracy"] <= 1 and records[-1]["val_loss"] > 0
    grid = Image.open(workdir / "runs" / "short" / "samples" / "step-4.png")
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
    for name, (args, expected) in cases.items():
        workdir = tmp_path / name
        workdir.mkdir()
        result = run_train(generated[RECIPE], workdir, *SMALL, *args)
        assert result.returncode == 2, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert (
            len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
        ), (name, lines)
        assert not (workdir / "runs").exists(), name
