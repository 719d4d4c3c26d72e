"""Train sd-speedup: text-to-image latent diffusion.

    python train.py                     # CPU or one GPU: tiny parts, captioned digits
    python train.py --model=./sd2-base --data=captions.jsonl --resolution=512
    python train.py --config run.toml   # keys as in Config below; flags override it
    python train.py --help              # every key, its default and meaning

Recipe `sd-speedup`; algorithms: low_precision_groupnorm, low_precision_layernorm,
precomputed_latents, ema.
This loop is yours to edit. `# event: NAME` comments mark where scaffold's algorithms
for this task hook in; each algorithm's code is fenced by `# algorithm: NAME` ... `# end
algorithm: NAME`. `scaffold upgrade` merges newer template versions in and keeps your
edits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from diffusers import DDIMScheduler
from PIL import Image
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

import data
from model import (
    Parts,
    load_parts,
    native_resolution,
    save_pipeline,
    tiny_parts,
    tiny_tokenizer,
    train_judge,
    unet_blocks,
)
from runtime import checkpoint, config, dist, early_stop, microbatch, parallel, preempt
from runtime import profile, runlock, trackers
from runtime.monitor import Monitor, RunningSum, training_flops
from runtime.time import Progress, Time, as_fraction, check_fraction

# algorithm: precomputed_latents
import hashlib

import numpy as np

# end algorithm: precomputed_latents

# algorithm: ema
import copy

# end algorithm: ema


@dataclass
class Config:
    run_name: str = "sd-speedup"  # runs/<run_name>/; rerunning a name resumes it
    seed: int = 42  # a run is a function of (config, seed)
    # data: "" sklearn's digits, captioned; JSON Lines of {"file", "caption"}; a
    # datasets folder (image and text columns)
    data: str = ""
    val_data: str = ""  # a .jsonl validation file; "": a seeded 10% of --data
    resolution: int = 0  # image side in pixels; 0: the model's (tiny: 16)
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    # model: tiny (offline parts built from configs), a StableDiffusionPipeline folder
    # or a hub id (its UNet fine-tuned; VAE and text encoder frozen)
    model: str = "tiny"
    from_scratch: bool = False  # the model's UNet architecture with new weights
    tiny_vae_steps: int = (
        300  # model=tiny: steps fitting its VAE to the images (cached)
    )
    # the share of training captions replaced by the empty one, so the UNet also learns
    # the unconditional prediction classifier-free guidance needs (mosaicml/diffusion's
    # caption_drop_prob, 0.1 in its SD2 recipes)
    caption_drop_prob: float = 0.1
    # what the UNet learns to predict: epsilon (the noise) or v_prediction (the velocity
    # alpha * noise - sigma * latents; Salimans & Ho 2022); auto: the model folder's
    # scheduler's (tiny: epsilon). Validation, the samples and the pipeline follow it.
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = "auto"
    # optimization; Time strings: 10ep, 2000ba (steps), 4096sp, 0.25dur
    max_duration: Time = Time.parse("1500ba")  # training length
    global_batch_size: int = 32  # samples per step, summed over ranks
    # samples per forward/backward (gradient accumulation over the rank's batch)
    device_microbatch_size: int = 16
    lr: float = 0.001  # peak learning rate (AdamW)
    lr_warmup: Time = Time.parse("0.05dur")  # linear from 0, then constant
    weight_decay: float = 0.01  # decoupled (AdamW), every parameter
    beta1: float = 0.9
    beta2: float = 0.999

    # algorithm: ema
    # weight average: a weight's share in it halves after ema_half_life
    ema_half_life: Time = Time.parse("0.01dur")
    ema_update_interval: Time = Time.parse("1ba")  # every ...
    # fraction of training until which the "average" is the weights themselves
    ema_start: float = 0.0
    ema_export: bool = True  # scaffold export writes the average
    # end algorithm: ema

    # evaluation, logging, checkpoints
    eval_interval: Time = Time.parse("500ba")  # validation and samples every ...
    eval_timesteps: int = 10  # validation loss at this many evenly spaced timesteps
    eval_batches: int = 0  # validation batches per evaluation (the first); 0: all
    samples_per_prompt: int = 4  # sample grid: rows (seeds) of the prompts (columns)
    sample_steps: int = 25  # DDIM steps per sample
    guidance_scale: float = 1.0  # classifier-free guidance (1: none)
    # CFG rescale of the grid's sampler (Lin et al. 2023 §3.4; diffusers'
    # guidance_rescale; 0: none, the paper: 0.7)
    guidance_rescale: float = 0.0
    log_interval: Time = Time.parse("1ba")  # a metrics.jsonl record every ...
    console_interval: Time = Time.parse("0.05dur")  # printed (no terminal) every ...
    trackers: str = ""  # also log to: tensorboard,mlflow,wandb
    # early stopping: when early_stop_metric (e.g. val_loss; "": never)
    # has not improved by more than early_stop_min_delta for early_stop_patience
    early_stop_metric: str = ""
    early_stop_patience: Time = Time.parse("0.1dur")
    early_stop_min_delta: float = 0.0
    early_stop_mode: Literal["min", "max"] = "min"  # min: lower is better (losses)
    profile: str = ""  # START:END, e.g. 20ba:25ba: torch.profiler traces of those steps
    save_interval: Time = Time.parse("500ba")  # and at the end
    save_num_checkpoints_to_keep: int = 2  # older ones are deleted; 0 keeps all
    save_folder: str = ""  # "": runs/<run_name>/checkpoints
    save_async: bool = False  # write checkpoints while training goes on
    autoresume: bool = True  # continue from the newest checkpoint of this run
    load_path: str = ""  # start from this checkpoint (or run folder); any world size
    load_weights_only: bool = False  # load_path's model weights only (fine-tuning)
    # parallelism: `torchrun --nproc_per_node=N train.py` runs this script on N ranks
    parallelism: Literal["auto", "none", "ddp", "fsdp"] = "auto"  # auto: fsdp if N > 1
    sharding_strategy: Literal[
        "FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"
    ] = "FULL_SHARD"
    hybrid_shard_size: int = 0  # HYBRID_SHARD group size; 0: processes per node
    # auto: amp_bf16 (autocast; mosaicml/diffusion trains under amp) on CUDA, fp32 on
    # the CPU; bf16: FSDP's mixed-precision policy
    precision: Literal["auto", "fp32", "amp_bf16", "bf16"] = "auto"
    activation_checkpointing: bool = False  # recompute block activations in backward
    # torch.compile in place (keys unchanged): true each block, model the whole model as
    # one graph (one process); auto: true on CUDA, off on the CPU
    compile: bool | Literal["auto", "model"] = "auto"
    cpu_offload: bool = False  # FSDP parameters and optimizer step on the CPU (CUDA)
    dist_timeout: int = 600  # seconds a collective waits before the job fails


def setup(cfg: Config) -> tuple[dist.DistEnv, parallel.ParallelConfig]:
    """Check the config against this launch, then join the process group (if any);
    each problem is one `error:` line and exit status 2, before anything is read."""
    with config.failing(ValueError):
        env = dist.environment(cfg.device)  # rank, world size, device, from torchrun
    # Parallelism, precision and compilation for this launch (`auto` settled), written
    # back so that the run's config.toml records what ran.
    plan = parallel.ParallelConfig.from_config(cfg, env)
    cfg.precision, cfg.compile = plan.precision, plan.compile
    problem = parallel.check(plan, env)
    problem = problem or microbatch.check(cfg.device_microbatch_size)
    problem = problem or trackers.check(cfg.trackers) or profile.check(cfg.profile)
    problem = problem or checkpoint.check_access(cfg.save_folder, cfg.load_path)
    problem = problem or early_stop.check_settings(cfg)
    if problem:
        config.fail(problem)
    if not 0 <= cfg.caption_drop_prob < 1:
        config.fail(f"caption_drop_prob={cfg.caption_drop_prob} must be in [0, 1)")
    for name in (
        "eval_timesteps",
        "samples_per_prompt",
        "sample_steps",
        "global_batch_size",
    ):
        if getattr(cfg, name) < 1:
            config.fail(f"{name}={getattr(cfg, name)} must be at least 1")
    if cfg.eval_batches < 0:
        config.fail(f"eval_batches={cfg.eval_batches} must be 0 (all) or more")
    if cfg.resolution < 0 or cfg.resolution % 8:
        config.fail(
            f"resolution={cfg.resolution} must be 0 (the model's) or a multiple of 8"
        )
    if problem := dist.check_batch(cfg.global_batch_size, env.world_size):
        config.fail(problem)
    with config.failing(ValueError, prefix="lr_warmup: "):
        check_fraction(cfg.lr_warmup, cfg.max_duration)

    # algorithm: ema
    config.check_ranges(cfg, ema_start="[0, 1]")
    with config.failing(ValueError, prefix="ema: "):
        ema_smoothing(cfg)
    # end algorithm: ema

    # FSDP and DDP need a process group, on one process too (a group of one rank).
    timeout = timedelta(seconds=cfg.dist_timeout)
    dist.init_process_group(env, timeout, required=plan.parallelism != "none")
    dist.use_tf32(env.device)  # CUDA: TF32 tensor cores for fp32 matmuls, convolutions
    return env, plan


def lr_at(fraction: float, cfg: Config, batches_per_epoch: int) -> float:
    """Learning rate after `fraction` of training: linear warmup, then constant
    (mosaicml/diffusion's LinearWithWarmupScheduler with alpha_f=1.0)."""
    warmup = as_fraction(cfg.lr_warmup, cfg.max_duration, batches_per_epoch)
    return cfg.lr * min(1.0, fraction / warmup) if warmup > 0 else cfg.lr


def step_noise(
    cfg: Config, step: int, shape: tuple[int, ...], env: dist.DistEnv
) -> tuple[torch.Tensor, ...]:
    """The step's random draws for the whole global batch, seeded by (seed, step), this
    rank's rows kept: the same samples get the same noise on any world size and after
    any resume. Latent noise (the VAE posterior's sample), the noise added, timesteps,
    and which captions are dropped."""
    generator = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    count = cfg.global_batch_size
    latent_noise = torch.randn((count, *shape), generator=generator)
    noise = torch.randn((count, *shape), generator=generator)
    timesteps = torch.randint(0, 1000, (count,), generator=generator)
    dropped = torch.rand(count, generator=generator) < cfg.caption_drop_prob
    share = count // env.world_size
    rows = slice(env.rank * share, (env.rank + 1) * share)
    # On their way to the device at once (dist.to_device: the host does not wait).
    return dist.to_device(
        tuple(t[rows] for t in (latent_noise, noise, timesteps, dropped)), env.device
    )


@torch.no_grad()
def encode(
    parts: Parts,
    batch: dict[str, torch.Tensor],
    latent_noise: torch.Tensor | None,
    cfg: Config,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen encoders: images to scaled VAE latents (a posterior sample; its mean
    where latent_noise is None), caption token ids to text-encoder states."""
    device = batch["pixels"].device
    with autocast(cfg, device):
        posterior = parts.vae.encode(batch["pixels"]).latent_dist
        latents = (
            posterior.mean
            if latent_noise is None
            else posterior.mean + posterior.std * latent_noise
        )
        states = parts.text_encoder(batch["input_ids"])[0]
    return latents.float() * parts.latent_scale, states


def noised(
    parts: Parts,
    latents: torch.Tensor,
    states: torch.Tensor,
    noise: torch.Tensor,
    timesteps: torch.Tensor,
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The UNet's inputs (latents noised to `timesteps`, text states) and its target:
    the noise (epsilon prediction) or the velocity (v prediction), by the schedule."""
    noisy = parts.scheduler.add_noise(latents, noise, timesteps)
    if parts.scheduler.config.prediction_type == "v_prediction":
        target = parts.scheduler.get_velocity(latents, noise, timesteps)
    else:
        target = noise
    return {"noisy": noisy, "timesteps": timesteps, "states": states}, target


@torch.no_grad()
def sample(
    model: torch.nn.Module,
    parts: Parts,
    prompt_ids: torch.Tensor,
    shape: tuple[int, ...],
    cfg: Config,
    env: dist.DistEnv,
) -> torch.Tensor:
    """Images for the prompts (token ids), from noise seeded by `seed`: DDIM steps with
    classifier-free guidance (the empty caption's prediction pushed towards the
    prompt's). Every rank runs the same forwards (FSDP gathers the weights in each)."""
    model.eval()
    sampler = DDIMScheduler.from_config(parts.scheduler.config)
    sampler.set_timesteps(cfg.sample_steps)
    generator = torch.Generator().manual_seed(cfg.seed)
    latents = torch.randn((len(prompt_ids), *shape), generator=generator).to(env.device)
    empty = parts.tokenizer([""], padding="max_length", return_tensors="pt").input_ids
    with autocast(cfg, env.device):
        states = parts.text_encoder(prompt_ids.to(env.device))[0]
        states = torch.cat(
            [parts.text_encoder(empty.to(env.device))[0].expand_as(states), states]
        )
        for t in sampler.timesteps:
            unconditional, conditional = (
                model(torch.cat([latents] * 2), t, states).sample.float().chunk(2)
            )
            guided = unconditional + cfg.guidance_scale * (conditional - unconditional)
            if cfg.guidance_rescale:  # CFG rescale: the guided prediction's std pulled
                # back towards the conditional one's (guidance overexposes otherwise)
                dims = tuple(range(1, guided.dim()))
                wanted = conditional.std(dims, keepdim=True)
                scaled = guided * wanted / guided.std(dims, keepdim=True)
                guided = torch.lerp(guided, scaled, cfg.guidance_rescale)
            latents = sampler.step(guided, t, latents).prev_sample
        images = parts.vae.decode(latents / parts.latent_scale).sample
    model.train()
    return images.float().clamp(-1, 1).cpu()


def save_grid(images: torch.Tensor, rows: int, path: Path) -> None:
    """A PNG of the images, `rows` rows, each image scaled up to at least 64 pixels."""
    count, _, height, width = images.shape
    columns = count // rows
    grid = images.view(rows, columns, 3, height, width).permute(0, 3, 1, 4, 2)
    pixels = (
        ((grid.reshape(rows * height, columns * width, 3) + 1) * 127.5).round().byte()
    )
    image = Image.fromarray(pixels.numpy())
    scale = max(1, math.ceil(64 / height))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.resize(
        (image.width * scale, image.height * scale), Image.Resampling.NEAREST
    ).save(path)


def show(
    images: torch.Tensor,
    judge: torch.nn.Module | None,
    grid: Path,
    cfg: Config,
    env: dist.DistEnv,
) -> dict[str, float]:
    """The samples as a grid (rank 0 writes it); with a judge, the share of samples it
    sees showing the class their prompt names (`judged_accuracy`)."""
    if env.is_main:
        save_grid(images, cfg.samples_per_prompt, grid)
    if judge is None:
        return {}
    wanted = torch.arange(len(images)) % (len(images) // cfg.samples_per_prompt)
    return {
        "judged_accuracy": (judge(images).argmax(-1) == wanted).float().mean().item()
    }


def save_pretrained(
    model: torch.nn.Module, parts: Parts, folder: Path, env: dist.DistEnv
) -> None:
    """The pipeline for diffusers' StableDiffusionPipeline.from_pretrained. Under FSDP
    every rank holds a shard: the full UNet weights are gathered to rank 0's CPU."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)  # a collective: every rank
    if env.is_main:
        save_pipeline(parts, weights, folder)
    dist.barrier()


# algorithm: precomputed_latents
@torch.no_grad()
def precompute_encodings(
    parts: Parts,
    split: data.Captioned,
    token_ids: torch.Tensor,
    empty_ids: torch.Tensor,
    cfg: Config,
    env: dist.DistEnv,
) -> dict[str, torch.Tensor]:
    """The frozen encoders' outputs for the whole split, on the CPU: each image's VAE
    posterior (`mean`, `std`, scaled as encode() scales latents), the text states of
    each distinct caption (`states`; `caption`: which one each image has) and of the
    empty caption (`empty`). Cached in runs/.scaffold-cache under a key of the encoders'
    weights, the images, the token ids and the precision: a rerun reads it."""
    key = hashlib.sha256(split.images.tobytes() + token_ids.numpy().tobytes())
    key.update(repr((cfg.precision == "amp_bf16", parts.latent_scale)).encode())
    for module in (parts.vae, parts.text_encoder):
        for name, tensor in module.state_dict().items():
            raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
            key.update(name.encode() + raw.numpy().tobytes())
    path = Path("runs") / ".scaffold-cache" / f"encodings-{key.hexdigest()[:16]}.pt"
    if path.is_file():
        return torch.load(path)
    captions, caption = torch.unique(token_ids, dim=0, return_inverse=True)
    mean, std, states = [], [], []
    size = cfg.global_batch_size // env.world_size  # what a step's encode() takes
    with autocast(cfg, env.device):
        for start in range(0, len(split), size):
            ids = np.arange(start, min(start + size, len(split)))
            pixels = data.rows(split, token_ids, ids)["pixels"].to(env.device)
            posterior = parts.vae.encode(pixels).latent_dist
            mean.append((posterior.mean.float() * parts.latent_scale).cpu())
            std.append((posterior.std.float() * parts.latent_scale).cpu())
        for start in range(0, len(captions), size):
            ids = captions[start : start + size].to(env.device)
            states.append(parts.text_encoder(ids)[0].float().cpu())
        empty = parts.text_encoder(empty_ids[None])[0][0].float().cpu()
    encodings = dict(mean=torch.cat(mean), std=torch.cat(std), caption=caption)
    encodings.update(states=torch.cat(states), empty=empty)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f"{path.name}.{np.random.default_rng().integers(1 << 30)}")
    torch.save(encodings, staging)
    staging.replace(path)  # whole or not at all; every rank writes the same
    return encodings


def looked_up_encodings(
    encodings: dict[str, torch.Tensor],
    rows: torch.Tensor,
    latent_noise: torch.Tensor,
    dropped: torch.Tensor,
    env: dist.DistEnv,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's latents and text states from the precomputed encodings of its
    `rows`, as encode() would give them: the posterior sampled with the step's latent
    noise, a dropped caption given the empty caption's states (caption dropout).
    Looked up on the host (the batch's rows are host data), then sent to the device."""
    mean, std, states, empty = dist.to_device(
        (
            encodings["mean"][rows],
            encodings["std"][rows],
            encodings["states"][encodings["caption"][rows]],
            encodings["empty"],
        ),
        env.device,
    )
    latents = mean + std * latent_noise
    return latents, torch.where(dropped[:, None, None], empty, states)


# end algorithm: precomputed_latents


# algorithm: ema
def ema_smoothing(cfg: Config) -> float:
    """The share of the average each update keeps: 2^(-update_interval / half_life)
    (Composer's parameterisation). ValueError if the two cannot be compared."""
    progress = Progress(1, max_duration=cfg.max_duration)  # resolves `dur` against it
    interval = progress.resolve(cfg.ema_update_interval)
    half_life = progress.resolve(cfg.ema_half_life)
    if interval.unit != half_life.unit:
        raise ValueError(
            f"half_life={cfg.ema_half_life} and update_interval="
            f"{cfg.ema_update_interval} must be in the same unit (or dur)"
        )
    return 2.0 ** (-interval.value / half_life.value)


@torch.no_grad()
def update_ema(
    ema_model: torch.nn.Module, model: torch.nn.Module, smoothing: float
) -> None:
    """average = smoothing * average + (1 - smoothing) * current, for every parameter
    and floating-point buffer (BatchNorm running statistics); integer buffers (the
    BatchNorm step counter) are copied. Under FSDP2 both are sharded alike: rank-local.
    """
    average = [*ema_model.parameters(), *ema_model.buffers()]
    model = parallel.unwrap(model)  # DDP's wrapper holds the same tensors
    current = [*model.parameters(), *model.buffers()]
    for ema, now in zip(average, current, strict=True):
        if ema.is_floating_point():
            ema.lerp_(now, 1.0 - smoothing)
        else:
            ema.copy_(now)


# end algorithm: ema


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    parts: Parts,
    val: dict[str, torch.Tensor],
    cfg: Config,
    env: dist.DistEnv,
) -> dict[str, float]:
    """Validation denoising loss: each validation image (or the first eval_batches
    global batches of them) at a fixed timestep (cycling through eval_timesteps evenly
    spaced ones) with fixed noise (seed 0), so
    every evaluation measures the same thing. Each rank scores its share of every global
    batch; a short share is padded and the padding not counted (§6.4 of scaffold's
    design)."""
    model.eval()
    count = len(val["pixels"])
    if cfg.eval_batches:  # the same first images at every evaluation
        count = min(count, cfg.eval_batches * cfg.global_batch_size)
    shape = parts.latent_shape(val["pixels"].shape[-1])
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn((count, *shape), generator=generator)
    spacing = parts.scheduler.config.num_train_timesteps // cfg.eval_timesteps
    timesteps = torch.arange(count) % cfg.eval_timesteps * spacing + spacing // 2
    loss_sum = torch.zeros((), device=env.device, dtype=torch.float64)
    for start in range(0, count, cfg.global_batch_size):
        ids, real = dist.padded_share(
            torch.arange(start, min(start + cfg.global_batch_size, count)), env
        )
        batch = dist.to_device({k: v[ids] for k, v in val.items()}, env.device)
        latents, states = encode(parts, batch, None, cfg)
        inputs, target = noised(
            parts,
            latents,
            states,
            noise[ids].to(env.device),
            timesteps[ids].to(env.device),
        )
        for first in range(0, len(ids), cfg.device_microbatch_size):
            micro = {
                k: v[first : first + cfg.device_microbatch_size]
                for k, v in inputs.items()
            }
            with autocast(cfg, env.device):
                prediction = model(
                    micro["noisy"], micro["timesteps"], micro["states"]
                ).sample
            keep = max(real - first, 0)  # padding rows come last: not counted
            error = (prediction.float() - target[first : first + len(prediction)]) ** 2
            loss_sum += error.mean((1, 2, 3))[:keep].sum()
    model.train()
    return {"val_loss": dist.reduce_sum(loss_sum).item() / count}


def autocast(cfg: Config, device: torch.device) -> torch.autocast:
    """Autocast: bf16 compute on fp32 weights when precision=amp_bf16, else a no-op."""
    return torch.autocast(device.type, torch.bfloat16, cfg.precision == "amp_bf16")


def split_rows(
    inputs: dict[str, torch.Tensor], size: int
) -> list[dict[str, torch.Tensor]]:
    """Microbatches of `size` rows of every tensor of the batch."""
    rows = len(next(iter(inputs.values())))
    return [
        {k: v[i : i + size] for k, v in inputs.items()} for i in range(0, rows, size)
    ]


def forward_backward(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    targets: torch.Tensor,
    loss_scale: float,
    cfg: Config,
) -> torch.Tensor:
    """Forward and backward over this rank's batch in microbatches of
    cfg.device_microbatch_size rows, gradients adding up in .grad (reduced over ranks in
    the last backward)."""
    microbatch_size = cfg.device_microbatch_size
    loss_sum = torch.zeros((), device=targets.device)
    microbatches = list(
        zip(split_rows(inputs, microbatch_size), targets.split(microbatch_size))
    )
    for i, (micro_inputs, micro_targets) in enumerate(microbatches):

        # Reduce gradients over ranks once, in the last backward.
        parallel.sync_gradients(model, i == len(microbatches) - 1)
        with autocast(cfg, targets.device):
            logits = model(
                micro_inputs["noisy"], micro_inputs["timesteps"], micro_inputs["states"]
            ).sample

        loss = (
            F.mse_loss(logits.float(), micro_targets, reduction="none")
            .mean((1, 2, 3))
            .sum()
        )

        # event: LOSS

        (loss * loss_scale).backward()
        loss_sum += loss.detach()
    return loss_sum


def main() -> None:
    cfg = config.parse(
        Config, refusals={"device_microbatch_size": {"auto": microbatch.NO_SEARCH}}
    )
    env, plan = setup(cfg)  # one process, or one of torchrun's N
    torch.manual_seed(cfg.seed)  # the same on every rank: identical initial weights
    run_dir = Path("runs") / cfg.run_name
    checkpoints = cfg.save_folder or run_dir / "checkpoints"  # a folder or a URL
    # A missing path, an undecodable image, no UNet in --model, a caption too long.
    with config.failing(OSError, ValueError):
        parts = (
            None
            if cfg.model == "tiny"
            else load_parts(cfg.model, cfg.from_scratch, cfg.seed, cfg.prediction_type)
        )
        resolution = cfg.resolution or native_resolution(parts)
        captioned = data.load_captioned(cfg.data, cfg.val_data, resolution, cfg.seed)
        captions = captioned.train.captions + captioned.val.captions
        tokenizer = parts.tokenizer if parts else tiny_tokenizer(captions)
        train_ids, val_ids = (
            data.token_ids(tokenizer, split.captions)
            for split in (captioned.train, captioned.val)
        )
        if parts is None:  # the VAE fitted once, cached
            cache = Path("runs") / ".scaffold-cache"
            parts = tiny_parts(
                tokenizer,
                captioned.train.images,
                cfg.tiny_vae_steps,
                cache,
                cfg.seed,
                cfg.prediction_type,
            )
        train_batches = data.Batches(
            captioned.train, train_ids, cfg.global_batch_size, cfg.seed
        )
    val = data.rows(captioned.val, val_ids)  # all of it
    # The sample grid: each prompt (a column) from samples_per_prompt seeds (rows); the
    # digits' prompts are their ten captions, other data's its first ten validation
    # captions.
    prompts = captioned.classes or list(dict.fromkeys(captioned.val.captions))[:10]
    prompt_ids = data.token_ids(parts.tokenizer, prompts * cfg.samples_per_prompt)
    empty_ids = data.token_ids(parts.tokenizer, [""])[0].to(env.device)
    # The judge: a classifier of the labelled training images says which digit each
    # sample shows; the share that matches its prompt is logged (chance: 1 / classes).
    judge = None
    if captioned.classes:
        judge = train_judge(
            captioned.train.images, captioned.train.labels, len(prompts), cfg.seed
        )
    for frozen in (parts.vae, parts.text_encoder):
        frozen.to(env.device)
    model = parts.unet.to(env.device)
    latent_shape = parts.latent_shape(resolution)
    num_params = sum(p.numel() for p in model.parameters())
    # FSDP's units, each also checkpointed and compiled alone: the UNet's blocks.
    # The frozen VAE and text encoder stay whole on every rank.
    blocks = unet_blocks(model)

    # One live start per run (an OS lock that kill -9 frees), once all input is read.
    with config.failing(runlock.RunInUse):
        run_lock = runlock.acquire(run_dir)

    # event: MODEL

    # algorithm: precomputed_latents
    # Precomputed latents: the frozen encoders run over the training set once here (or
    # the cache of an earlier run with the same encoders and images is read), so a
    # training step runs only the UNet (BATCH_START looks its batch up).
    encodings = precompute_encodings(
        parts, captioned.train, train_ids, empty_ids, cfg, env
    )
    # end algorithm: precomputed_latents

    # algorithm: ema
    # The weight average: a copy of the model and its blocks, never trained.
    ema_model, ema_blocks = copy.deepcopy((model, blocks))
    ema_model.requires_grad_(False)
    # end algorithm: ema

    # Training FLOPs per sample, for MFU (GPUs only): the UNet's forward counted by
    # torch, x3 for the backward (the frozen encoders' forwards are not counted).
    example = {
        "sample": torch.zeros(1, *latent_shape, device=env.device),
        "timestep": torch.zeros(1, dtype=torch.long, device=env.device),
        "encoder_hidden_states": parts.text_encoder(
            val["input_ids"][:1].to(env.device)
        )[0],
    }
    flops_per_sample = training_flops(model, example)
    # Shard or replicate for the launch: FSDP2 per block then the root, DDP, or nothing.
    model = parallel.parallelize(model, blocks, env, plan)

    # AdamW over every UNet parameter, decay included, as mosaicml/diffusion's
    # torch.optim.AdamW(unet.parameters(), ...) (no exempt biases or norms).
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        weight_decay=cfg.weight_decay,
        # One fused kernel for the whole update instead of several per tensor, on
        # the CPU too (the offloaded step: per tensor).
        fused=not cfg.cpu_offload,
    )
    # The log, metrics.jsonl, progress bar and trackers (rank 0 writes them).
    monitor = Monitor.from_config(run_dir, cfg, env, flops_per_sample=flops_per_sample)
    progress = Progress(train_batches.batches_per_epoch, max_duration=cfg.max_duration)
    stopper = early_stop.EarlyStopper.from_config(cfg, log=monitor.info)
    # What a checkpoint holds: entries with state_dict() and load_state_dict(). An
    # algorithm with state of its own adds one at OPTIMIZER, and may name the entry
    # `scaffold export` writes out for inference (by default "model").
    state = dict(model=model, optimizer=optimizer, progress=progress, stopper=stopper)
    checkpointer = checkpoint.Checkpointer.from_config(checkpoints, cfg)

    # event: OPTIMIZER

    # algorithm: ema
    # Sharded like the model (each rank averages its own shards) and checkpointed with
    # it, so a resume on any number of ranks restores the average.
    ema_model = parallel.parallelize_copy(ema_model, ema_blocks, env, plan)
    state["ema"] = ema_model
    if cfg.ema_export:
        checkpointer.export = "ema"  # scaffold export writes the averaged weights
    # end algorithm: ema

    # Resume: load_path, else this run's newest complete checkpoint, restores all of
    # `state` and the RNG, saved on any number of ranks. The batch order is a function
    # of progress (the global sample cursor): nothing is replayed.
    with config.failing(checkpoint.CheckpointError):  # names the file or the keys
        resumed = checkpointer.resume(state)  # load_path, autoresume: as cfg says
    # From where the run stands: config.toml, this script's copy, metrics and the bar.
    monitor.begin(progress, Path(__file__))
    monitor.info(f"data: {captioned.source}")
    train_count, val_count = len(captioned.train), len(captioned.val)
    monitor.info(
        f"images: {train_count:,} train, {val_count:,} validation, {resolution}px"
    )
    monitor.info(
        f"model: {cfg.model}, UNet {num_params:,} parameters, {len(blocks)} FSDP units"
    )
    monitor.info(f"parallelism: {plan.parallelism}, {env.world_size} process(es)")
    for line in resumed.describe() if resumed else []:
        monitor.info(line)

    train_loss = RunningSum(env.device)  # summed on the device, read at logged steps
    profiler = profile.Profiler.from_config(cfg, run_dir, env, monitor.info)
    # SIGUSR1 (SLURM's notice), SIGTERM or torchrun gone: finish the step, save, stop.
    preemption = preempt.Preemption()

    # The one flag that ends training (a resumed run may already have finished).
    finished = progress.reached() or stopper.stopped
    while not finished:
        epoch = progress.epoch
        # This rank's share of global batch `index` in the epoch's seeded order.
        # Each is on its way to the device before its step (dist.to_device: the copy
        # does not make the host wait).
        upcoming = train_batches.get(
            epoch, progress.batch_in_epoch, env.rank, env.world_size
        )
        upcoming = dist.to_device(upcoming, env.device)
        for index in range(progress.batch_in_epoch, train_batches.batches_per_epoch):
            batch = upcoming

            # event: BATCH_START

            # The batch: images in [-1, 1] and caption token ids. The frozen encoders
            # (no gradients), then the noise: the UNet learns to predict it (or the
            # velocity) from the latents noised to random timesteps.
            latent_noise, noise, timesteps, dropped = step_noise(
                cfg, progress.batch, latent_shape, env
            )

            # algorithm: precomputed_latents
            # Precomputed latents: the batch's encodings looked up, no encoder forward.
            latents, states = looked_up_encodings(
                encodings, batch["index"], latent_noise, dropped, env
            )
            # end algorithm: precomputed_latents

            inputs, targets = noised(parts, latents, states, noise, timesteps)
            fraction = progress.fraction()
            lr = lr_at(fraction, cfg, progress.batches_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # Gradient accumulation: each microbatch's summed loss is divided by the
            # global batch size, so gradients are the global-batch mean whatever the
            # microbatch size and world size. DDP and FSDP average gradients over
            # ranks: hence the factor world_size.
            loss_scale = env.world_size / cfg.global_batch_size
            loss_sum = forward_backward(model, inputs, targets, loss_scale, cfg)

            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # The next batch, fetched while the device still works through this step:
            # before anything below waits for the device (a logged loss, an evaluation).
            if index + 1 < train_batches.batches_per_epoch:
                upcoming = train_batches.get(epoch, index + 1, env.rank, env.world_size)
                upcoming = dist.to_device(upcoming, env.device)
            progress.advance(samples=cfg.global_batch_size, tokens=0)
            train_loss.add(loss_sum, cfg.global_batch_size)  # no device sync

            # event: BATCH_END

            # algorithm: ema
            # Fold the weights just stepped into their moving average; up to ema_start
            # (a fraction of training) the "average" is the weights themselves.
            if progress.fraction() <= cfg.ema_start:
                update_ema(ema_model, model, 0.0)
            elif progress.at_interval(cfg.ema_update_interval):
                update_ema(ema_model, model, ema_smoothing(cfg))
            # end algorithm: ema

            monitor.update(progress)
            profiler.step(progress)  # records the --profile window, writes its traces
            finished = progress.reached()
            metrics = {}
            if progress.at_interval(cfg.eval_interval) or finished:
                # event: EVAL

                # algorithm: ema
                # The averaged weights, same evaluation: ema_val_loss
                with monitor.paused():
                    scores = evaluate(ema_model, parts, val, cfg, env)
                metrics.update({f"ema_{name}": value for name, value in scores.items()})
                # end algorithm: ema

                # Evaluation time does not count against the logged throughput.
                with monitor.paused():
                    metrics |= evaluate(model, parts, val, cfg, env)
                    samples = sample(model, parts, prompt_ids, latent_shape, cfg, env)
                    grid = run_dir / "samples" / f"step-{progress.batch}.png"
                    metrics.update(show(samples, judge, grid, cfg, env))
                    monitor.log_image("images/samples", grid, progress.batch)
            if metrics or progress.at_interval(cfg.log_interval):
                metrics["loss"] = train_loss.pop()  # mean since the last log, all ranks
                metrics["lr"] = lr

                monitor.log(progress, **metrics)
            finished = stopper.update(progress, metrics) or finished
            finished = preemption.agreed() or finished  # any rank's signal: all stop
            if progress.at_interval(cfg.save_interval) or finished:
                with monitor.paused():
                    checkpointer.save(state)
            if finished:
                break

    checkpointer.close()  # an async save in flight: finished and marked complete
    outcome = f"done: step {progress.batch}, {progress.sample:,} samples"
    if preemption.stopped_by:  # exit status 0; under SLURM the job is requeued
        outcome = (
            f"stopped by {preemption.stopped_by} after step {progress.batch}, saved"
        )
    else:  # the pipeline for diffusers' StableDiffusionPipeline.from_pretrained, with
        # the UNet weights `scaffold export` writes (the model's, or an entry of `state`
        # an algorithm named at OPTIMIZER)
        save_pretrained(state[checkpointer.export], parts, run_dir / "pipeline", env)
        outcome += f", samples in {run_dir}/samples, pipeline in {run_dir}/pipeline"
    monitor.info(f"{outcome}; outputs in {run_dir}")
    monitor.close()
    preemption.close()  # the previous signal handlers again
    run_lock.release()  # the next start of this run may begin


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as error:
        dist.exit_if_peer_lost(error)  # another rank died or hangs: one line, status 1
        if isinstance(error, checkpoint.StorageError):  # a full disk, a refusing store
            config.fail(str(error), status=1)
        raise
    finally:
        dist.shutdown()  # leave the process group, also after an error
