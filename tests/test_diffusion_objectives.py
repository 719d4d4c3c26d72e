"""The diffusion task's training objectives, each for its effect: the prediction type
(epsilon or v_prediction: the target, the sampler and the exported pipeline agree),
zero_terminal_snr (the rescaled schedule ends at alpha_bar 0, sampled from there, and
refuses epsilon), min_snr (the weights are diffusers' compute_snr ones and the loss is
their weighted sum), offset_noise (a per-image, per-channel constant from its own seeded
stream, world-size invariant) and EMA's start (the average is the weights until then).
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("diffusers")
pytest.importorskip("transformers")
pytest.importorskip("sklearn")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import scaffold_cli  # noqa: E402
from diffusers import (  # noqa: E402
    DDIMScheduler,
    DDPMScheduler,
    StableDiffusionPipeline,
)
from diffusers.training_utils import compute_snr  # noqa: E402
from PIL import Image  # noqa: E402

from projects import project_modules, read_metrics, run_train  # noqa: E402

# sd-baseline's answers at test size, v prediction, the three objective algorithms and an
# EMA (half life 1 step) that starts after step 2 of 4.
RECIPE = """
description = "sd-baseline + v prediction, zero terminal SNR, min-SNR, offset noise, EMA from step 2"
[answers]
task = "diffusion"
model_family = "sd"
model = "tiny"
global_batch_size = 8
device_microbatch_size = 4
lr = 1e-3
weight_decay = 0.01
lr_warmup = "0.05dur"
max_duration = "4ba"
eval_interval = "2ba"
save_interval = "500ba"
prediction_type = "v_prediction"
[algorithms.offset_noise]
[algorithms.min_snr]
[algorithms.zero_terminal_snr]
[algorithms.ema]
half_life = "1ba"
start = 0.5
"""
SMALL = [
    "--tiny_vae_steps=10",
    "--samples_per_prompt=1",
    "--sample_steps=3",
    "--eval_timesteps=2",
    "--eval_batches=1",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, isolated_home: Path) -> Path:
    root = tmp_path_factory.mktemp("objectives")
    (root / "objectives.toml").write_text(RECIPE)
    dest = root / "objectives"
    result = scaffold_cli("new", "--recipe", str(root / "objectives.toml"), str(dest))
    assert result.returncode == 0, result.stderr
    return dest


def tiny(model, tmp_path: Path, prediction_type: str):
    """The project's tiny parts over four random 16-pixel images (a 1-step VAE)."""
    captions = ["a handwritten digit one", "a handwritten digit two"]
    images = np.random.default_rng(0).integers(0, 256, (4, 16, 16, 3), np.uint8)
    tokenizer = model.tiny_tokenizer(captions)
    return model.tiny_parts(tokenizer, images, 1, tmp_path, 0, prediction_type)


def test_v_prediction_and_zero_terminal_snr_schedule(
    project: Path, tmp_path: Path
) -> None:
    with project_modules(project) as modules:
        model, train = modules["model"], modules["train"]
        parts = tiny(model, tmp_path, "v_prediction")
        schedule = parts.scheduler
        plain = DDPMScheduler(**model.SD_SCHEDULE)
        # Lin et al.'s rescale: alpha_bar ends at exactly 0, starts where it did.
        assert schedule.alphas_cumprod[-1].item() == 0.0
        assert plain.alphas_cumprod[-1].item() > 0.004
        assert torch.allclose(schedule.alphas_cumprod[0], plain.alphas_cumprod[0])
        assert schedule.config.prediction_type == "v_prediction"
        # The sampler (the grid's and the export's) reads the same config: trailing
        # steps start at the last timestep, where alpha_bar is 0.
        sampler = DDIMScheduler.from_config(schedule.config)
        sampler.set_timesteps(3)
        assert sampler.timesteps.tolist()[0] == 999
        assert sampler.alphas_cumprod[-1].item() == 0.0

        # The v target: alpha * noise - sigma * latents, alpha = sqrt(alpha_bar).
        latents, noise = torch.randn(3, 4, 8, 8), torch.randn(3, 4, 8, 8)
        timesteps = torch.tensor([10, 500, 999])
        states = torch.randn(3, 16, 32)
        inputs, target = train.noised(parts, latents, states, noise, timesteps)
        alpha = schedule.alphas_cumprod[timesteps].sqrt().view(-1, 1, 1, 1)
        sigma = (1 - schedule.alphas_cumprod[timesteps]).sqrt().view(-1, 1, 1, 1)
        assert torch.allclose(target, alpha * noise - sigma * latents, atol=1e-6)
        assert torch.allclose(
            inputs["noisy"], alpha * latents + sigma * noise, atol=1e-6
        )
        # at zero SNR the input is the noise alone and the target the negated latents
        assert torch.equal(inputs["noisy"][2], noise[2])
        assert torch.equal(target[2], -latents[2])
        # epsilon prediction: the target is the noise
        epsilon = SimpleNamespace(scheduler=plain)
        assert torch.equal(
            train.noised(epsilon, latents, states, noise, timesteps)[1], noise
        )

        # zero_terminal_snr refuses epsilon prediction (auto is epsilon for tiny)
        for prediction_type in ("epsilon", "auto"):
            with pytest.raises(model.ModelError, match="prediction_type=v_prediction"):
                tiny(model, tmp_path, prediction_type)


def test_min_snr_weights_are_diffusers_and_weight_the_loss(
    project: Path, tmp_path: Path
) -> None:
    with project_modules(project) as modules:
        model, train = modules["model"], modules["train"]
        timesteps = torch.tensor([0, 1, 50, 200, 500, 800, 999])
        gamma = 5.0
        plain = DDPMScheduler(**model.SD_SCHEDULE)
        snr = compute_snr(plain, timesteps)
        weights = train.min_snr_weights(
            SimpleNamespace(scheduler=plain), timesteps, gamma
        )
        assert torch.allclose(
            weights, torch.minimum(snr, torch.tensor(gamma)) / snr, rtol=1e-5
        )
        # low noise (high SNR) is weighted down, high noise keeps weight 1
        assert weights[0] < 0.01 and weights[-1] == 1.0
        parts = tiny(model, tmp_path, "v_prediction")  # zero terminal SNR, v
        snr = compute_snr(parts.scheduler, timesteps)
        weights = train.min_snr_weights(parts, timesteps, gamma)
        expected = torch.minimum(snr, torch.tensor(gamma)) / (snr + 1)
        assert torch.allclose(weights, expected, rtol=1e-5)
        assert weights[-1].item() == 0.0  # zero SNR: no weight, not NaN

        # forward_backward's loss (replaced by min_snr): the weighted sum of each
        # sample's mean squared error, whatever the microbatch size.
        cfg = train.Config()
        rows = 4
        inputs = {
            "noisy": torch.randn(rows, 4, 8, 8),
            "timesteps": timesteps[[1, 2, 4, 6]],
            "states": torch.randn(rows, 16, 32),
        }
        inputs["snr_weight"] = train.min_snr_weights(parts, inputs["timesteps"], gamma)
        targets = torch.randn(rows, 4, 8, 8)
        unet = parts.unet
        with torch.no_grad():
            errors = F.mse_loss(
                unet(inputs["noisy"], inputs["timesteps"], inputs["states"]).sample,
                targets,
                reduction="none",
            ).mean((1, 2, 3))
        for size in (4, 2):
            cfg.device_microbatch_size = size  # what forward_backward splits by
            loss_sum = train.forward_backward(unet, inputs, targets, 1.0, cfg)
            expected = (errors * inputs["snr_weight"]).sum()
            assert torch.allclose(loss_sum, expected, rtol=1e-5), size
            assert not torch.allclose(loss_sum, errors.sum(), rtol=1e-2)


def test_offset_noise_is_a_per_channel_constant_drawn_world_size_invariant(
    project: Path,
) -> None:
    with project_modules(project) as modules:
        train = modules["train"]
        cfg = train.Config(global_batch_size=4096)

        def env(rank: int, world_size: int) -> SimpleNamespace:
            return SimpleNamespace(
                rank=rank, world_size=world_size, device=torch.device("cpu")
            )

        size = torch.Size([4096, 4, 8, 8])
        offsets = train.step_offsets(cfg, 7, size, env(0, 1))
        assert offsets.shape == (4096, 4, 1, 1)
        # standard normal: the plain noise's per-channel mean has std 1/8 at 8x8
        assert (
            abs(offsets.std().item() - 1) < 0.03 and abs(offsets.mean().item()) < 0.03
        )
        halves = [train.step_offsets(cfg, 7, size[:2], env(r, 2)) for r in (0, 1)]
        assert torch.equal(torch.cat(halves), offsets)  # any world size, same offsets
        assert torch.equal(train.step_offsets(cfg, 7, size, env(0, 1)), offsets)
        assert not torch.allclose(train.step_offsets(cfg, 8, size, env(0, 1)), offsets)
        # Added to the step's noise (the loop's line), each image's channel mean moves
        # by exactly scale * offset and nothing else changes: a constant per channel.
        small = train.Config(global_batch_size=8)
        latent_noise, noise, _, _ = train.step_noise(small, 7, (4, 8, 8), env(0, 1))
        offset = train.step_offsets(small, 7, noise.shape[:2], env(0, 1))
        shifted = noise + small.offset_noise_scale * offset
        moved = shifted.mean((2, 3)) - noise.mean((2, 3))
        assert torch.allclose(
            moved, small.offset_noise_scale * offset[:, :, 0, 0], atol=1e-6
        )
        assert torch.allclose(
            (shifted - noise).std((2, 3)), torch.zeros(8, 4), atol=1e-6
        )
        # its own stream: not the step's other draws
        assert not torch.allclose(offset.flatten(), latent_noise.flatten()[:32])
        assert not torch.allclose(offset.flatten(), noise.flatten()[:32])


def grid_images(path: Path, count: int, side: int) -> np.ndarray:
    """The first row of a sample grid PNG, as (count, side, side, 3) pixel values."""
    grid = np.asarray(Image.open(path).convert("RGB"))
    scale = grid.shape[0] // side  # the grid is scaled up by whole pixels
    row = grid[::scale, ::scale][:side]
    return row.reshape(side, count, side, 3).transpose(1, 0, 2, 3).astype(int)


def test_a_v_prediction_run_exports_a_pipeline_that_samples_as_it_did(
    project: Path, tmp_path: Path
) -> None:
    """The run trains with all three objectives and the EMA start; its pipeline/ folder's
    scheduler predicts v on the zero-terminal-SNR schedule, and diffusers'
    StableDiffusionPipeline loaded from it draws the run's own last sample grid (the
    same latents); told epsilon instead, it draws something else."""
    result = run_train(project, tmp_path, *SMALL, "--ema_export=false", "--run_name=v")
    assert result.returncode == 0, result.stderr
    rows = read_metrics(tmp_path, "v")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) for r in rows)
    # EMA from step 2: the average is the weights at step 2, then averages
    assert rows[1]["ema_val_loss"] == rows[1]["val_loss"]
    assert rows[3]["ema_val_loss"] != rows[3]["val_loss"]

    folder = tmp_path / "runs" / "v" / "pipeline"
    pipeline = StableDiffusionPipeline.from_pretrained(folder)
    config = pipeline.scheduler.config
    assert isinstance(pipeline.scheduler, DDIMScheduler)
    assert config.prediction_type == "v_prediction"
    assert config.rescale_betas_zero_snr and config.timestep_spacing == "trailing"
    assert pipeline.scheduler.alphas_cumprod[-1].item() == 0.0

    prompts = [
        f"a handwritten digit {word}"
        for word in "zero one two three four five six seven eight nine".split()
    ]
    # train.sample's latents: seeded by the run's seed (42), one per prompt
    latents = torch.randn((10, 4, 8, 8), generator=torch.Generator().manual_seed(42))

    def draw(scheduler) -> np.ndarray:
        pipeline.scheduler = scheduler
        images = pipeline(
            prompts,
            height=16,
            width=16,
            num_inference_steps=3,
            guidance_scale=1.0,
            latents=latents.clone(),
            output_type="pt",
        ).images
        return (images.permute(0, 2, 3, 1) * 255).round().numpy()

    ours = grid_images(tmp_path / "runs" / "v" / "samples" / "step-4.png", 10, 16)
    theirs = draw(pipeline.scheduler)
    assert np.abs(theirs - ours).max() <= 1  # 8-bit rounding
    # Told epsilon, the sampler divides by alpha = 0 at the first step; on the plain
    # schedule (leading steps) it draws other images (after 4 steps, faintly so).
    epsilon = draw(DDIMScheduler.from_config(config, prediction_type="epsilon"))
    assert not np.isfinite(epsilon).all()
    plain = DDIMScheduler.from_config(
        config, rescale_betas_zero_snr=False, timestep_spacing="leading"
    )
    assert np.abs(draw(plain) - ours).max() > 4


def test_zero_terminal_snr_with_epsilon_is_one_line(
    project: Path, tmp_path: Path
) -> None:
    result = run_train(project, tmp_path, *SMALL, "--prediction_type=epsilon")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: zero_terminal_snr needs prediction_type=v_prediction (at zero SNR the "
        "noise is the input: predicting it says nothing of the image); pass "
        "--prediction_type=v_prediction"
    ]
    assert not (tmp_path / "runs").exists() or not any(
        p for p in (tmp_path / "runs").iterdir() if p.name != ".scaffold-cache"
    )


def test_cfg_rescale_samples_as_diffusers_guidance_rescale(
    project: Path, tmp_path: Path
) -> None:
    """The grid's sampler with guidance 3 and CFG rescale 0.7 (Lin et al. 2023 §3.4) on
    the v-prediction, zero-terminal-SNR parts draws what diffusers' StableDiffusionPipeline
    draws from the same parts and latents with `guidance_rescale=0.7`; without the
    rescale, other images."""
    from runtime.dist import DistEnv

    prompts = ["a handwritten digit one", "a handwritten digit two"]
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"))
    with project_modules(project) as modules:
        train, model, data = modules["train"], modules["model"], modules["data"]
        parts = tiny(model, tmp_path, "v_prediction")
        ids = data.token_ids(parts.tokenizer, prompts)

        def ours(rescale: float) -> torch.Tensor:
            cfg = train.Config(
                guidance_scale=3.0, guidance_rescale=rescale, sample_steps=3
            )
            return train.sample(parts.unet, parts, ids, (4, 8, 8), cfg, env)

        rescaled, plain = ours(0.7), ours(0.0)
        pipeline = StableDiffusionPipeline(
            vae=parts.vae,
            text_encoder=parts.text_encoder,
            tokenizer=parts.tokenizer,
            unet=parts.unet,
            scheduler=DDIMScheduler.from_config(parts.scheduler.config),
            safety_checker=None,
            feature_extractor=None,
            requires_safety_checker=False,
        )
        seed = train.Config().seed
        latents = torch.randn(
            (2, 4, 8, 8), generator=torch.Generator().manual_seed(seed)
        )
        theirs = pipeline(
            prompts,
            height=16,
            width=16,
            num_inference_steps=3,
            guidance_scale=3.0,
            guidance_rescale=0.7,
            latents=latents.clone(),
            output_type="pt",
        ).images
    expected = (theirs * 2 - 1).clamp(-1, 1)  # ours: [-1, 1]
    assert torch.allclose(rescaled, expected, atol=1e-5)
    assert (rescaled - plain).abs().max() > 1e-2
