"""Latent diffusion's parts, from diffusers and transformers: a UNet that predicts the
noise (or the velocity) in VAE latents, conditioned on CLIP text-encoder states (Stable
Diffusion).

`--model=path/to/folder` (a StableDiffusionPipeline folder: unet/, vae/,
text_encoder/, tokenizer/, scheduler/) or a hub id (downloaded once into the Hugging
Face cache) loads the parts for fine-tuning; `--from_scratch` keeps its VAE, text
encoder and noise schedule and starts the UNet from its config, as mosaicml/diffusion
trains SD2 from scratch. `--model=tiny` builds every part from configs, offline: a
4-layer CLIP text encoder and a CLIP BPE tokenizer over the caption words, a UNet of two
resolutions, and a small AutoencoderKL fitted for `tiny_vae_steps` on the training
images (Stable Diffusion's VAE is trained before, and apart from, the UNet), cached in
runs/.scaffold-cache/.

Only the UNet trains; the VAE and the text encoder are frozen. FSDP shards the UNet per
block: each down block, the middle block and each up block.
"""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from runtime import quiet

# Where torchao is installed, the model libraries below import it, which prints
# deprecation lines about torchao on stderr: hide those lines and nothing else.
quiet.torchao_import_warnings()

try:
    import diffusers
    import transformers
    from diffusers import (
        AutoencoderKL,
        DDIMScheduler,
        DDPMScheduler,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer
except ModuleNotFoundError as missing:
    sys.exit(
        f"error: {missing.name} is not installed; this project needs the diffusion "
        "extra: pip install 'scaffold[diffusion]' (diffusers, transformers)"
    )


# The loop's log says what happens: no progress bars, no load reports.
transformers.utils.logging.disable_progress_bar()
transformers.utils.logging.set_verbosity_error()
diffusers.utils.logging.disable_progress_bar()
diffusers.utils.logging.set_verbosity_error()

PRESETS = ["tiny"]  # built from configs; any other --model is a folder or a hub id
# The offline `tiny` parts: Stable Diffusion's architecture at a size a CPU trains.
TINY_TEXT = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4
)
TINY_UNET = dict(
    block_out_channels=(32, 64),
    layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    attention_head_dim=8,
    norm_num_groups=8,
)
TINY_VAE = dict(
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    block_out_channels=(16, 32),
    layers_per_block=1,
    latent_channels=4,
    norm_num_groups=8,
)
TINY_RESOLUTION = 16  # pixels; latents of 8 x 8
TINY_MAX_TOKENS = 16  # the text encoder's positions: prompts up to 14 tokens
# Stable Diffusion's schedule (its scheduler_config.json): 1000 steps, betas
# "scaled_linear" 0.00085..0.012, no clipping of the predicted latents, steps offset 1.
SD_SCHEDULE = dict(
    num_train_timesteps=1000,
    beta_schedule="scaled_linear",
    beta_start=0.00085,
    beta_end=0.012,
    clip_sample=False,
    steps_offset=1,
)


class ModelError(ValueError):
    """The parts cannot be loaded; the message says why and what to do."""


@dataclass
class Parts:
    tokenizer: CLIPTokenizer
    text_encoder: CLIPTextModel  # frozen
    vae: AutoencoderKL  # frozen
    unet: UNet2DConditionModel  # trained
    scheduler: DDPMScheduler  # the noise schedule of training

    @property
    def latent_scale(self) -> float:
        """Latents are multiplied by this before the UNet sees them (unit variance)."""
        return self.vae.config.scaling_factor

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        """One image's latents (channels, height, width) at `resolution` pixels."""
        side = resolution // 2 ** (len(self.vae.config.block_out_channels) - 1)
        return (self.vae.config.latent_channels, side, side)


def load_parts(name: str, from_scratch: bool, seed: int, prediction_type: str) -> Parts:
    """A pipeline folder's or hub id's parts (`tiny` is built by tiny_parts), the UNet
    predicting `prediction_type` (auto: what the folder's scheduler says)."""
    try:
        unet = UNet2DConditionModel.from_pretrained(name, subfolder="unet")
    except (OSError, ValueError) as error:
        why = str(error).splitlines()[0]
        raise ModelError(
            f"--model={name}: no UNet could be loaded ({why}); pass "
            "a StableDiffusionPipeline folder (unet/, vae/, text_encoder/, tokenizer/, "
            "scheduler/), a hub id, or tiny"
        ) from None
    try:
        parts = Parts(
            CLIPTokenizer.from_pretrained(name, subfolder="tokenizer"),
            CLIPTextModel.from_pretrained(name, subfolder="text_encoder"),
            AutoencoderKL.from_pretrained(name, subfolder="vae"),
            unet,
            predicting(
                DDPMScheduler.from_pretrained(name, subfolder="scheduler"),
                prediction_type,
            ),
        )
    except (OSError, ValueError) as error:
        why = str(error).splitlines()[0]
        raise ModelError(
            f"--model={name}: {why}; pass a complete pipeline folder"
        ) from None
    if from_scratch:  # the same architecture, new weights
        torch.manual_seed(seed)
        parts.unet = UNet2DConditionModel.from_config(unet.config)
    return freeze(parts)


def native_resolution(parts: Parts | None) -> int:
    """The image side the UNet was made for (None: the tiny parts, TINY_RESOLUTION)."""
    if parts is None:
        return TINY_RESOLUTION
    factor = 2 ** (len(parts.vae.config.block_out_channels) - 1)
    return parts.unet.config.sample_size * factor


def tiny_parts(
    tokenizer: CLIPTokenizer,
    images: np.ndarray,
    vae_steps: int,
    cache: Path,
    seed: int,
    prediction_type: str,
) -> Parts:
    """The offline parts: `tokenizer` (tiny_tokenizer), a random text encoder and UNet,
    and a VAE fitted to `images` (cached under a key of images, config, steps); the UNet
    predicts `prediction_type` (auto: epsilon, as Stable Diffusion's schedule)."""
    torch.manual_seed(seed)
    text_config = CLIPTextConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=TINY_MAX_TOKENS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **TINY_TEXT,
    )
    text_encoder = CLIPTextModel(text_config)
    size = images.shape[1]
    unet = UNet2DConditionModel(
        sample_size=size // 2,
        in_channels=4,
        out_channels=4,
        cross_attention_dim=TINY_TEXT["hidden_size"],
        **TINY_UNET,
    )
    key = hashlib.sha256(
        images.tobytes() + repr((TINY_VAE, vae_steps, seed)).encode()
    ).hexdigest()[:16]
    folder = cache / f"tiny-vae-{key}"
    if not (folder / "config.json").is_file():
        vae = AutoencoderKL(sample_size=size, **TINY_VAE)
        fit_vae(vae, images, vae_steps, seed)
        staging = folder.with_name(
            f"{folder.name}.{np.random.default_rng().integers(1 << 30)}"
        )
        vae.save_pretrained(staging)
        try:
            staging.rename(folder)  # whole or not at all; a racing rank's copy may win
        except OSError:
            pass
    vae = AutoencoderKL.from_pretrained(folder)  # every rank: the same weights
    scheduler = predicting(DDPMScheduler(**SD_SCHEDULE), prediction_type)
    return freeze(Parts(tokenizer, text_encoder, vae, unet, scheduler))


def predicting(scheduler: DDPMScheduler, prediction_type: str) -> DDPMScheduler:
    """The schedule with the UNet's target in its config (`prediction_type`: epsilon or
    v_prediction; auto keeps the schedule's), which training, validation, the sampler
    and the exported pipeline's scheduler all read."""
    if prediction_type == "auto":
        return scheduler
    return DDPMScheduler.from_config(scheduler.config, prediction_type=prediction_type)


def tiny_tokenizer(captions: list[str]) -> CLIPTokenizer:
    """CLIP's byte-pair tokenizer with a vocabulary of every caption character and word
    (merges left to right), built deterministically: the same ids on every start."""
    words = sorted({word for caption in captions for word in caption.lower().split()})
    chars = sorted({char for word in words for char in word})
    vocab = {char: i for i, char in enumerate(chars)}
    vocab.update({f"{char}</w>": len(chars) + i for i, char in enumerate(chars)})
    merges = []
    for word in words:
        symbols = list(word[:-1]) + [word[-1] + "</w>"]
        joined = symbols[0]
        for symbol in symbols[1:]:
            if (joined, symbol) not in merges:
                merges.append((joined, symbol))
            joined += symbol
            vocab.setdefault(joined, len(vocab))
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=TINY_MAX_TOKENS)


def fit_vae(vae: AutoencoderKL, images: np.ndarray, steps: int, seed: int) -> None:
    """Train the autoencoder to reconstruct `images` (MSE plus a small KL term, as
    Stable Diffusion's KL-f8 VAE minus its perceptual and adversarial losses); then set
    its scaling_factor so the latents have unit variance, as SD's 0.18215 does."""
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=2e-3)
    for _ in range(steps):
        batch = pixels[torch.randint(len(pixels), (32,), generator=generator)]
        posterior = vae.encode(batch).latent_dist
        latents = posterior.mean + posterior.std * torch.randn(
            posterior.mean.shape, generator=generator
        )
        loss = (
            F.mse_loss(vae.decode(latents).sample, batch) + 1e-6 * posterior.kl().mean()
        )
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        std = vae.encode(pixels[:512]).latent_dist.mean.std().item()
    vae.register_to_config(scaling_factor=1.0 / std)


def freeze(parts: Parts) -> Parts:
    """The parts as training uses them: the encoders frozen (and any change an
    algorithm makes to the built or loaded parts, in place)."""
    for frozen in (parts.text_encoder, parts.vae):
        frozen.requires_grad_(False).eval()

    return parts


def unet_blocks(unet: UNet2DConditionModel) -> list[torch.nn.Module]:
    """The UNet's FSDP units: its down blocks, middle block and up blocks."""
    return [
        *unet.down_blocks,
        *([unet.mid_block] if unet.mid_block is not None else []),
        *unet.up_blocks,
    ]


def save_pipeline(
    parts: Parts, unet_weights: dict[str, torch.Tensor], folder: Path
) -> None:
    """A folder diffusers' StableDiffusionPipeline.from_pretrained loads: the trained
    UNet (full weights), the frozen parts, and a DDIM sampler of the training schedule.
    """
    unet = UNet2DConditionModel.from_config(parts.unet.config)
    unet.load_state_dict(unet_weights)
    pipeline = diffusers.StableDiffusionPipeline(
        vae=parts.vae,
        text_encoder=parts.text_encoder,
        tokenizer=parts.tokenizer,
        unet=unet,
        scheduler=DDIMScheduler.from_config(parts.scheduler.config),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipeline.save_pretrained(folder)


def train_judge(
    images: np.ndarray, labels: np.ndarray, classes: int, seed: int
) -> torch.nn.Module:
    """A classifier of the labelled training images (softmax regression on pixels),
    to say which class a generated image shows."""
    torch.manual_seed(seed)
    judge = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(images[0].size, classes)
    )
    pixels = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1
    targets = torch.from_numpy(labels)
    optimizer = torch.optim.Adam(judge.parameters(), lr=1e-2)
    for _ in range(300):
        loss = F.cross_entropy(judge(pixels), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return judge.requires_grad_(False).eval()
