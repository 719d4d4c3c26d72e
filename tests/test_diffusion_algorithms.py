"""The diffusion catalog (mosaicml/diffusion's SD2 speed-ups) and recipe sd-speedup, each for
its effect: precomputed latents train exactly as the encoders do, with no encoder forward in a
training step, and a rerun reads the cache; low-precision GroupNorm and LayerNorm turn the
UNet's norms (and only the UNet's) into bf16 ones under autocast, plain ones without; EMA
averages the UNet, logs ema_val_loss and exports the average as the pipeline's UNet."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("sklearn")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from projects import (  # noqa: E402
    assert_same_series,
    checkout_env,
    project_modules,
    read_metrics,
    run_train,
    torchrun,
)
from runtime.checkpoint import export_safetensors  # noqa: E402

SMALL = [
    "--device=cpu",
    "--tiny_vae_steps=10",
    "--global_batch_size=8",
    "--device_microbatch_size=4",
    "--samples_per_prompt=1",
    "--sample_steps=2",
    "--eval_timesteps=2",
    "--eval_batches=1",
    "--max_duration=3ba",
]
# train.py with diffusers' AutoencoderKL.encode counted: each call appends the two innermost
# train.py functions on the stack ("main encode": a training step's encode(); "evaluate
# encode"; "main precompute_encodings") to vae-calls.txt in the working folder.
COUNT_VAE_ENCODES = """
import runpy, sys, traceback
from diffusers import AutoencoderKL
encode = AutoencoderKL.encode
def counted(self, *args, **kwargs):
    names = [f.name for f in traceback.extract_stack() if f.filename.endswith("train.py")]
    with open("vae-calls.txt", "a") as log:
        log.write(" ".join(names[-2:]) + "\\n")
    return encode(self, *args, **kwargs)
AutoencoderKL.encode = counted
sys.argv = sys.argv[1:]
sys.path.insert(0, sys.argv[0].rsplit("/", 1)[0])  # the project's modules, as python does
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def counted_run(project: Path, workdir: Path, run: str, *args: str) -> list[str]:
    """A small run of the project in `workdir`; the VAE encodes it made, by caller."""
    calls = workdir / "vae-calls.txt"
    calls.unlink(missing_ok=True)
    result = subprocess.run(
        [sys.executable, "-c", COUNT_VAE_ENCODES, str(project / "train.py")]
        + [*SMALL, f"--run_name={run}", *args],
        cwd=workdir,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    return calls.read_text().splitlines()


def test_sd_speedup_trains_as_the_baseline_with_no_encoder_forward_in_a_step(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """sd-speedup = sd-baseline + precomputed_latents, the low-precision norms and EMA. On
    the CPU (fp32: the norms act only under autocast; EMA never touches training) it takes
    the same steps, up to rounding, while no training step runs the VAE."""
    baseline_calls = counted_run(generated["sd-baseline"], tmp_path, "base")
    # an EMA half life of 2 of the 3 steps: an average unlike the last weights
    ema = "--ema_half_life=2ba"
    speedup_calls = counted_run(generated["sd-speedup"], tmp_path, "fast", ema)
    assert baseline_calls.count("main encode") == 3  # one per step
    assert "main encode" not in speedup_calls
    # the training split (1,437 digits) encoded once, 8 images (a step's) at a time
    assert speedup_calls.count("main precompute_encodings") == 180
    # one validation batch at the end, for the model and for its EMA
    evaluations = ["evaluate encode"] * 2
    assert [c for c in speedup_calls if c.startswith("evaluate")] == evaluations
    base, fast = read_metrics(tmp_path, "base"), read_metrics(tmp_path, "fast")
    for name in ("loss", "val_loss"):
        assert np.allclose(
            [r[name] for r in fast if name in r],
            [r[name] for r in base if name in r],
            rtol=1e-5,
        ), name
    cached = list((tmp_path / "runs" / ".scaffold-cache").glob("encodings-*.pt"))
    assert len(cached) == 1
    # A rerun with the same encoders and images reads the cache: no precomputing.
    again = counted_run(generated["sd-speedup"], tmp_path, "again", ema)
    assert [c for c in again if "precompute" in c] == []
    assert [r["loss"] for r in read_metrics(tmp_path, "again")] == [
        r["loss"] for r in fast
    ]
    # Other encoders (a VAE fitted for more steps) are another key: a second file.
    other = subprocess.run(
        [sys.executable, str(generated["sd-speedup"] / "train.py")]
        + [arg for arg in SMALL if not arg.startswith("--tiny_vae_steps")]
        + ["--run_name=other", "--tiny_vae_steps=11"],
        cwd=tmp_path,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert other.returncode == 0, other.stderr
    assert len(list((tmp_path / "runs" / ".scaffold-cache").glob("encodings-*"))) == 2

    # EMA: the average is evaluated beside the model, and the pipeline holds it.
    last = fast[-1]
    assert "ema_val_loss" in last and last["ema_val_loss"] != last["val_loss"]
    run = tmp_path / "runs" / "fast"
    pipeline = load_file(
        run / "pipeline" / "unet" / "diffusion_pytorch_model.safetensors"
    )
    checkpoint = run / "checkpoints" / "step-3"
    export_safetensors(checkpoint, tmp_path / "ema.safetensors", "ema")
    export_safetensors(checkpoint, tmp_path / "model.safetensors", "model")
    average = load_file(tmp_path / "ema.safetensors")
    live = load_file(tmp_path / "model.safetensors")
    assert pipeline.keys() == average.keys()
    assert all(torch.equal(pipeline[k], average[k]) for k in pipeline)
    assert not all(torch.equal(pipeline[k], live[k]) for k in pipeline)


def test_low_precision_norms_make_the_unets_norms_bf16_under_autocast_only(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    with project_modules(generated["sd-speedup"]) as modules:
        model = modules["model"]
        captions = ["a handwritten digit one", "a handwritten digit two"]
        images = np.random.default_rng(0).integers(0, 256, (4, 16, 16, 3), np.uint8)
        tokenizer = model.tiny_tokenizer(captions)
        parts = model.tiny_parts(tokenizer, images, 1, tmp_path, 0, "auto")
        # The UNet's 21 GroupNorms and 12 LayerNorms (its transformer blocks') are the
        # low-precision kind; the frozen VAE and text encoder keep theirs.
        unet_norms = [
            type(m).__name__
            for m in parts.unet.modules()
            if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm))
        ]
        assert unet_norms.count("LowPrecisionGroupNorm") == 21
        assert unet_norms.count("LowPrecisionLayerNorm") == 12
        assert len(unet_norms) == 33
        for frozen in (parts.vae, parts.text_encoder):
            assert all(
                type(m) in (torch.nn.GroupNorm, torch.nn.LayerNorm)
                for m in frozen.modules()
                if isinstance(m, (torch.nn.GroupNorm, torch.nn.LayerNorm))
            )
        # Same parameters and keys: a plain UNet loads them and computes the same
        # without autocast.
        plain = type(parts.unet).from_config(parts.unet.config)
        plain.load_state_dict(parts.unet.state_dict())
        inputs = (
            torch.randn(2, 4, 8, 8),
            torch.tensor([10, 900]),
            torch.randn(2, 16, 32),
        )
        with torch.no_grad():
            assert torch.equal(parts.unet(*inputs).sample, plain(*inputs).sample)

        # Under autocast: fp32 input (the upcast CUDA's autocast makes) is normalized in
        # bf16, as F.group_norm of the bf16 input and weights computes it.
        norm = torch.nn.GroupNorm(2, 8)
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
        x = torch.randn(2, 8, 4, 4) * 3 + 1
        with torch.autocast("cpu", torch.bfloat16):
            before = norm(x)
        assert model.use_low_precision_groupnorm(norm) == 1
        with torch.autocast("cpu", torch.bfloat16):
            after = norm(x)
        assert before.dtype == torch.float32 and after.dtype == torch.bfloat16
        expected = F.group_norm(
            x.bfloat16(), 2, norm.weight.bfloat16(), norm.bias.bfloat16()
        )
        assert torch.equal(after, expected)
        assert torch.allclose(after.float(), before, atol=5e-2)
        assert not torch.equal(after.float(), before)
        assert torch.equal(norm(x), F.group_norm(x, 2, norm.weight, norm.bias))


# ---------------------------------------------------------------- several processes

STOP_AFTER = Path(__file__).resolve().parent / "stop_after.py"
DIFFERENT = ("--max_duration", "--device", "--global_batch_size")
# Losses of several ranks and of one process differ by the order of floating-point
# reductions (DDP's and FSDP's gradient reductions, the loss all-reduce). Measured here:
# at most 7.8e-8 relative over the 6 steps; rel 1e-5 is far above that and far below
# the change of the loss between two steps (asserted below).
REL = 1e-5


def test_sd_speedup_elastic_2_ddp_3_fsdp_1_with_auto_microbatching(
    generated_auto: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One run over three launches logs what one process trained uninterrupted logs
    (losses, validation and EMA validation losses, within reduction-order rounding):
    DDP on 2 ranks with `--device_microbatch_size=auto` and rank 1 out of memory in
    backward above 2 rows (both ranks retry at 3, then 2 of their 6 rows), cut off after
    the step-2 checkpoint; that checkpoint resumed by FSDP2 on 3 ranks (the UNet per
    block, its EMA sharded alike), cut off after step 4; that one resumed on one process
    to step 6. Every rank of every launch reads or writes the one encodings cache."""
    train = generated_auto["sd-speedup"] / "train.py"
    common = [
        *[a for a in SMALL if not a.startswith(DIFFERENT)],
        "--global_batch_size=12",  # 6, 4 or 12 rows a rank
        "--max_duration=6ba",
        "--save_interval=2ba",
        "--eval_interval=3ba",  # in the 3-rank and the one-process launches
        "--save_num_checkpoints_to_keep=0",
        "--dist_timeout=120",
        "--ema_half_life=2ba",
    ]
    fixed = "--device_microbatch_size=2"
    reference = run_train(train.parent, tmp_path, *common, fixed, "--run_name=ref")
    assert reference.returncode == 0, reference.stderr
    with monkeypatch.context() as patch:
        patch.setenv("SCAFFOLD_INJECT_OOM", "ranks=1;above=2;phase=backward")
        ddp = torchrun(
            tmp_path, 2, STOP_AFTER, 2, train, "--device=cpu", *common,
            "--parallelism=ddp", "--device_microbatch_size=auto", "--run_name=elastic",
        )  # fmt: skip
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    assert "retrying the batch at 3" in ddp.stdout
    assert "retrying the batch at 2" in ddp.stdout
    three = torchrun(
        tmp_path, 3, STOP_AFTER, 4, train, "--device=cpu", *common,
        "--parallelism=fsdp", fixed, "--run_name=elastic",
    )  # fmt: skip
    assert three.returncode == 0, three.stdout + three.stderr
    assert "at step 2 (saved on 2 rank(s), now 3)" in three.stdout
    one = run_train(train.parent, tmp_path, *common, fixed, "--run_name=elastic")
    assert one.returncode == 0, one.stderr
    assert "at step 4 (saved on 3 rank(s), now 1)" in one.stdout
    elastic, ref = read_metrics(tmp_path, "elastic"), read_metrics(tmp_path, "ref")
    assert [r["step"] for r in elastic] == [r["step"] for r in ref] == [*range(1, 7)]
    assert [r["microbatch_size"] for r in elastic] == [2] * 6
    for name in ("loss", "val_loss", "ema_val_loss"):
        assert_same_series(
            [r.get(name) for r in elastic], [r.get(name) for r in ref], REL, name
        )
    steps = [r["loss"] for r in ref]
    assert min(abs(a - b) / b for a, b in zip(steps, steps[1:])) > 100 * REL
