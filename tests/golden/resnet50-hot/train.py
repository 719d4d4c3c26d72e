"""Train my-gpt: a ResNet image classifier (recipe `resnet50-hot`).

    python train.py                     # CPU or one GPU, on the embedded default data
    python train.py --data=/data/imagenet --model=resnet50 --max_duration=90ep
    python train.py --config run.toml   # keys as in Config below; flags override it
    python train.py --help              # every key, its default and meaning

Algorithms: blurpool, sam, colout, label_smoothing, mixup, progressive_resizing,
randaugment, stochastic_depth, channels_last, ema.
This loop is yours to edit. `# event: NAME` comments mark where scaffold's algorithms
hook in; each algorithm's code is fenced by `# algorithm: NAME` ... `# end algorithm:
NAME`. `scaffold upgrade` merges newer template versions in and keeps your edits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

import data
from model import (
    PRESETS,
    TORCHVISION,
    Preset,
    ResNet,
    ResNetConfig,
    TorchvisionNet,
    check_model,
    clear_step_stats,
    update_running_stats,
)
from runtime import checkpoint, config, dist, early_stop, fsdp, microbatch, preempt
from runtime import profile, runlock, trackers
from runtime.monitor import Monitor, RunningSum, training_flops
from runtime.time import Progress, Time, as_fraction

# algorithm: sam
from collections.abc import Callable

# end algorithm: sam

# algorithm: progressive_resizing
import numpy as np

# end algorithm: progressive_resizing

# algorithm: randaugment
import functools

# end algorithm: randaugment

# algorithm: ema
import copy

# end algorithm: ema


@dataclass
class Config:
    run_name: str = "my-gpt"  # runs/<run_name>/; rerunning a name resumes it
    seed: int = 42  # a run is a function of (config, seed)
    data: str = ""  # "": sklearn's digits; ImageFolder, cifar-10-batches-bin, shards
    # ImageFolder sizes (CIFAR and the digits keep their 32 and 8 pixels). Training at a
    # smaller crop than evaluation matches the apparent object size of the two (Touvron
    # et al. 2019, "FixRes"): Composer's ResNet recipes train at 176, evaluate at 224.
    image_size: int = 176  # training: random-resized crops of this size
    eval_image_size: int = 224  # evaluation: centre crop; 0: image_size
    eval_resize: int = 232  # short side resized first; 0: crop / 0.875
    num_workers: int = 8  # processes decoding images from disk (in-memory data: none)
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    # model
    # architecture: a preset (PRESETS in model.py); torchvision:NAME, any torchvision
    # classification model (needs torchvision; random weights; its BatchNorm2d layers
    # become ghost BatchNorm as below: TorchvisionNet in model.py); or auto: the
    # recipe's resnet50 with --data, `tiny` on the embedded digits (1,437 8x8
    # images: a CPU demo of minutes, where resnet50 would take much longer)
    model: Preset | Literal["auto"] | str = "auto"  # auto, a preset, torchvision:NAME
    # BatchNorm statistics are taken over groups of this many samples ("ghost"
    # BatchNorm), so a step does not depend on the microbatch size or the number of
    # ranks: both the per-rank batch and device_microbatch_size must be multiples of it
    bn_group_size: int = 256
    # optimization; Time strings: 10ep, 2000ba (steps), 4096sp, 0.25dur
    max_duration: Time = Time.parse("270ep")  # training length
    global_batch_size: int = 2048  # samples per step, summed over ranks
    # samples per forward/backward, accumulated; auto: the largest that fits in memory
    device_microbatch_size: int | Literal["auto"] = 256
    max_device_microbatch_size: int = 0  # where auto starts; 0: the per-rank batch
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = 2.048  # peak learning rate
    lr_warmup: Time = Time.parse("0.0889dur")  # linear from 0, then cosine decay
    min_lr_ratio: float = 0.0  # the cosine ends at min_lr_ratio * lr
    # decoupled weight decay on conv and linear weights (BatchNorm and biases exempt):
    # sgd shrinks weights by weight_decay * lr / peak lr per step (Composer's
    # DecoupledSGDW); adamw by weight_decay * lr (torch's AdamW)
    weight_decay: float = 0.0003
    momentum: float = 0.875  # sgd momentum (adamw: beta1)
    nesterov: bool = False  # sgd: Nesterov momentum
    beta2: float = 0.999  # adamw

    # algorithm: blurpool
    blurpool_replace_convs: bool = True  # strided convolutions
    blurpool_replace_maxpools: bool = True  # max pools
    blurpool_blur_first: bool = True  # blur, then strided conv
    blurpool_min_channels: int = 16  # fewer input channels: unchanged
    # end algorithm: blurpool

    # algorithm: sam
    sam_rho: float = 0.5  # SAM's ascent radius
    sam_interval: int = 5  # a SAM step every ... steps
    # end algorithm: sam

    # algorithm: colout
    colout_p_row: float = 0.05  # share of the rows dropped per step
    colout_p_col: float = 0.05  # share of the columns dropped per step
    # end algorithm: colout

    # algorithm: label_smoothing
    label_smoothing: float = 0.13  # mass spread over all classes
    # end algorithm: label_smoothing

    # algorithm: mixup
    mixup_alpha: float = 0.25  # lambda ~ Beta(alpha, alpha)
    mixup_prob: float = 1.0  # share of steps mixed (of one shared draw)
    # end algorithm: mixup

    # algorithm: progressive_resizing
    # progressive resizing: the image side grows from initial_scale to full size
    progressive_resizing_initial_scale: float = 0.6
    progressive_resizing_delay_fraction: float = 0.2  # first
    progressive_resizing_finetune_fraction: float = 0.2  # last
    progressive_resizing_size_increment: int = 4  # sides rounded to
    progressive_resizing_mode: Literal["resize", "crop"] = "resize"
    # end algorithm: progressive_resizing

    # algorithm: randaugment
    randaugment_depth: int = 1  # random operations per training image
    randaugment_severity: int = 10  # their strongest, 0..10
    randaugment_augmentation_set: Literal["all", "safe"] = "all"
    # end algorithm: randaugment

    # algorithm: stochastic_depth
    stochastic_depth_drop_rate: float = 0.1  # deepest block's
    # linear: block i of L drops with drop_rate * (i + 1) / L; uniform: drop_rate each
    stochastic_depth_drop_distribution: Literal["linear", "uniform"] = "linear"
    # the drop probabilities rise linearly from 0 over this long (none: no warmup)
    stochastic_depth_drop_warmup: Time | Literal["none"] = "none"
    # block: a block is skipped for the whole step; sample: per sample of
    # the global batch
    stochastic_depth_mode: Literal["block", "sample"] = "sample"
    # end algorithm: stochastic_depth

    # algorithm: ema
    # weight average: a weight's share in it halves after ema_half_life
    ema_half_life: Time = Time.parse("100ba")
    ema_update_interval: Time = Time.parse("20ba")  # every ...
    ema_export: bool = True  # scaffold export writes the average
    # end algorithm: ema

    # evaluation, logging, checkpoints
    eval_interval: Time = Time.parse("1ep")  # top-1/top-5 every ...
    eval_batches: int = 0  # validation batches per evaluation; 0: the whole split
    log_interval: Time = Time.parse("1ba")  # a metrics.jsonl line every ...
    trackers: str = ""  # also log to: tensorboard,mlflow,wandb
    # early stopping: when early_stop_metric (e.g. val_top1, with mode max; "": never)
    # has not improved by more than early_stop_min_delta for early_stop_patience
    early_stop_metric: str = ""
    early_stop_patience: Time = Time.parse("0.1dur")
    early_stop_min_delta: float = 0.0
    early_stop_mode: Literal["min", "max"] = "min"  # min: lower is better (losses)
    profile: str = ""  # START:END, e.g. 20ba:25ba: torch.profiler traces of those steps
    save_interval: Time = Time.parse("1ep")  # and at the end
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
    precision: Literal["fp32", "amp_bf16", "bf16"] = "amp_bf16"  # bf16: FSDP
    activation_checkpointing: bool = False  # recompute block activations in backward
    # torch.compile each block in place (keys unchanged); auto: on CUDA, off on the CPU
    compile: bool | Literal["auto"] = "auto"
    cpu_offload: bool = False  # FSDP parameters and optimizer step on the CPU (CUDA)
    dist_timeout: int = 600  # seconds a collective waits before the job fails


def setup(cfg: Config) -> tuple[dist.DistEnv, fsdp.ParallelConfig]:
    """Check the config against this launch, then join the process group (if any).

    Each problem is one `error:` line and exit status 2, before data or model exist.
    """
    try:
        env = dist.environment(cfg.device)  # rank, world size, device, from torchrun
    except ValueError as error:
        config.fail(str(error))
    parallel = fsdp.ParallelConfig(
        parallelism=fsdp.resolve_parallelism(cfg.parallelism, env.world_size),
        sharding_strategy=cfg.sharding_strategy,
        precision=cfg.precision,
        activation_checkpointing=cfg.activation_checkpointing,
        cpu_offload=cfg.cpu_offload,
        hybrid_shard_size=cfg.hybrid_shard_size,
        compile=fsdp.resolve_compile(cfg.compile, env.device),
    )
    # `auto` settled for this device and data: the run's config.toml records what ran.
    cfg.compile = parallel.compile
    if cfg.model == "auto":
        cfg.model = "resnet50" if cfg.data else "tiny"
    problem = fsdp.check(parallel, env) or microbatch.check(cfg.device_microbatch_size)
    problem = problem or trackers.check(cfg.trackers) or profile.check(cfg.profile)
    problem = problem or check_model(cfg.model)  # a preset, or torchvision importable
    problem = problem or early_stop.check(
        cfg.early_stop_metric, cfg.early_stop_patience, cfg.early_stop_min_delta
    )
    if problem:
        config.fail(problem)
    for name in ("global_batch_size", "bn_group_size", "image_size"):
        if getattr(cfg, name) < 1:
            config.fail(f"{name}={getattr(cfg, name)} must be at least 1")
    cfg.eval_image_size = cfg.eval_image_size or cfg.image_size  # 0: settled here
    cfg.eval_resize = cfg.eval_resize or round(cfg.eval_image_size / 0.875)
    if cfg.eval_image_size < 1 or cfg.eval_resize < cfg.eval_image_size:
        config.fail(
            f"eval_image_size={cfg.eval_image_size}, eval_resize={cfg.eval_resize}: "
            "the crop must be at least 1 pixel and at most the resized short side"
        )
    if cfg.eval_batches < 0 or cfg.num_workers < 0:
        config.fail("eval_batches and num_workers must be at least 0")
    if cfg.global_batch_size % env.world_size:
        config.fail(
            f"global_batch_size={cfg.global_batch_size} is not divisible by the world "
            f"size {env.world_size}; pick a multiple of {env.world_size}"
        )
    # Ghost BatchNorm groups must not straddle ranks or microbatches.
    per_rank = cfg.global_batch_size // env.world_size
    for name, size in (
        ("the per-rank batch (global_batch_size / world size)", per_rank),
        ("device_microbatch_size", cfg.device_microbatch_size),
        ("max_device_microbatch_size", cfg.max_device_microbatch_size),
    ):
        if isinstance(size, int) and size % cfg.bn_group_size:
            config.fail(
                f"{name}={size} is not a multiple of bn_group_size="
                f"{cfg.bn_group_size}; BatchNorm groups must not be split: change one"
            )
    try:
        as_fraction(cfg.lr_warmup, cfg.max_duration)
    except ValueError as error:
        config.fail(f"lr_warmup: {error}")

    # algorithm: blurpool
    if cfg.blurpool_min_channels < 0:
        config.fail(
            f"blurpool_min_channels={cfg.blurpool_min_channels} must be at least 0"
        )
    # end algorithm: blurpool

    # algorithm: sam
    if cfg.sam_rho <= 0 or cfg.sam_interval < 1:
        config.fail(
            f"sam_rho={cfg.sam_rho} must be > 0 and sam_interval={cfg.sam_interval} "
            "at least 1"
        )
    # end algorithm: sam

    # algorithm: colout
    if not (0.0 <= cfg.colout_p_row < 1.0 and 0.0 <= cfg.colout_p_col < 1.0):
        config.fail(
            f"colout_p_row={cfg.colout_p_row} and colout_p_col={cfg.colout_p_col} must "
            "be in [0, 1), e.g. 0.15"
        )
    # end algorithm: colout

    # algorithm: label_smoothing
    if not 0.0 <= cfg.label_smoothing < 1.0:
        config.fail(
            f"label_smoothing={cfg.label_smoothing} must be in [0, 1), e.g. 0.1"
        )
    # end algorithm: label_smoothing

    # algorithm: mixup
    if not cfg.mixup_alpha > 0.0 or not 0.0 <= cfg.mixup_prob <= 1.0:
        config.fail(
            f"mixup_alpha={cfg.mixup_alpha} must be > 0 and "
            f"mixup_prob={cfg.mixup_prob} in [0, 1]"
        )
    # end algorithm: mixup

    # algorithm: progressive_resizing
    delay = cfg.progressive_resizing_delay_fraction
    finetune = cfg.progressive_resizing_finetune_fraction
    if not (0 <= delay <= 1 and 0 <= finetune <= 1 and delay + finetune <= 1):
        config.fail(
            f"progressive_resizing_delay_fraction={delay} and _finetune_fraction="
            f"{finetune} must be within 0..1, together at most 1"
        )
    if not 0 < cfg.progressive_resizing_initial_scale <= 1:
        config.fail("progressive_resizing_initial_scale must be above 0 and at most 1")
    if cfg.progressive_resizing_size_increment < 1:
        config.fail("progressive_resizing_size_increment must be at least 1")
    # end algorithm: progressive_resizing

    # algorithm: randaugment
    if cfg.randaugment_depth < 1 or not 0 <= cfg.randaugment_severity <= 10:
        config.fail(
            f"randaugment_depth={cfg.randaugment_depth} must be at least 1 and "
            f"randaugment_severity={cfg.randaugment_severity} within 0..10"
        )
    # end algorithm: randaugment

    # algorithm: stochastic_depth
    if not 0.0 <= cfg.stochastic_depth_drop_rate <= 1.0:
        config.fail(
            f"stochastic_depth_drop_rate={cfg.stochastic_depth_drop_rate} "
            "must be in [0, 1]"
        )
    try:
        if cfg.stochastic_depth_drop_warmup != "none":
            as_fraction(cfg.stochastic_depth_drop_warmup, cfg.max_duration)
    except ValueError as error:
        config.fail(f"stochastic_depth_drop_warmup: {error}")
    if cfg.stochastic_depth_mode == "block" and parallel.parallelism == "ddp":
        config.fail(
            "stochastic_depth_mode=block skips whole blocks, whose parameters DDP then "
            "waits for; use parallelism=fsdp or stochastic_depth_mode=sample"
        )
    if cfg.model.startswith(TORCHVISION):
        config.fail(
            "stochastic_depth drops the branches of model.py's residual blocks; "
            f"model={cfg.model} has no such blocks: use a preset or remove the "
            "algorithm"
        )
    # end algorithm: stochastic_depth

    # algorithm: ema
    try:
        ema_smoothing(cfg)
    except ValueError as error:
        config.fail(f"ema: {error}")
    # end algorithm: ema

    # FSDP and DDP need a process group, on one process too (a group of one rank).
    needs_group = parallel.parallelism != "none"
    dist.init_process_group(
        env, timedelta(seconds=cfg.dist_timeout), required=needs_group
    )
    if env.device.type == "cuda":
        # TF32 tensor cores for fp32 matmuls and convolutions (10-bit mantissa
        # products, fp32 sums).
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"
    return env, parallel


def lr_at(fraction: float, cfg: Config) -> float:
    """Learning rate after `fraction` of training: linear warmup, then cosine decay."""
    warmup = as_fraction(cfg.lr_warmup, cfg.max_duration)
    if fraction < warmup:
        return cfg.lr * fraction / warmup
    decayed = (fraction - warmup) / max(1.0 - warmup, 1e-9)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * decayed))


def augmentations(cfg: Config) -> list[data.Augment]:
    """Per-sample augmentations of the training images, applied in this order after the
    crop (data.Batches.transform; in the DataLoader workers for images on disk). Each
    draws from the sample's generator, seeded by (seed, epoch, sample index)."""
    augment: list[data.Augment] = []

    # algorithm: randaugment
    # RandAugment (Cubuk et al. 2020): randaugment_depth operations chosen at
    # random, each at a random strength up to randaugment_severity (data.randaugment).
    augment.append(
        functools.partial(
            data.randaugment,
            depth=cfg.randaugment_depth,
            severity=cfg.randaugment_severity,
            operations=data.AUGMENTATION_SETS[cfg.randaugment_augmentation_set],
        )
    )
    # end algorithm: randaugment

    return augment


# algorithm: blurpool
def blur_2d(
    x: torch.Tensor, kernel: torch.Tensor, stride: int | tuple = 1
) -> torch.Tensor:
    """Zhang 2019's anti-aliasing low-pass: each channel convolved with the 3x3
    binomial kernel [1 2 1]^T [1 2 1] / 16 (depthwise, zero-padded), then `stride`."""
    channels = x.shape[1]
    weight = kernel.to(x.dtype).expand(channels, 1, 3, 3)
    return F.conv2d(x, weight, stride=stride, padding=1, groups=channels)


def binomial_kernel(device: torch.device) -> torch.Tensor:
    row = torch.tensor([1.0, 2.0, 1.0], device=device)
    return (torch.outer(row, row) / 16).view(1, 1, 3, 3)


class BlurConv2d(torch.nn.Conv2d):
    """A strided convolution that blurs before subsampling. blur_first: blur, then the
    strided convolution; else: the convolution at stride 1, then blur with the stride.
    Same parameters and checkpoint keys as the Conv2d it was; same output shape."""

    blur_first: bool

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.blur_first:
            return super().forward(blur_2d(x, self.blur_kernel))
        y = F.conv2d(
            x, self.weight, self.bias, 1, self.padding, self.dilation, self.groups
        )
        return blur_2d(y, self.blur_kernel, self.stride)


class BlurMaxPool2d(torch.nn.MaxPool2d):
    """Max pool at stride 1, then blur with the pool's stride (Zhang's MaxBlurPool)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(
            x,
            self.kernel_size,
            1,
            self.padding,
            self.dilation,
            ceil_mode=self.ceil_mode,
        )
        return blur_2d(y, self.blur_kernel, self.stride)


def use_blurpool(
    model: torch.nn.Module,
    replace_convs: bool,
    replace_maxpools: bool,
    blur_first: bool,
    min_channels: int,
) -> int:
    """Make strided convolutions (with at least min_channels input channels, zero
    padding) BlurConv2d and max pools BlurMaxPool2d, in place; returns how many."""
    found = 0
    device = next(model.parameters(), torch.zeros(())).device  # where the model lives
    for module in list(model.modules()):
        if type(module) is torch.nn.Conv2d:
            blur = replace_convs and max(module.stride) > 1
            blur = blur and module.in_channels >= min_channels
            blur, new_class = blur and module.padding_mode == "zeros", BlurConv2d
        elif type(module) is torch.nn.MaxPool2d:
            blur, new_class = replace_maxpools, BlurMaxPool2d
        else:
            continue
        if blur:
            module.__class__ = new_class  # same parameters, same state-dict keys
            module.blur_first = blur_first
            # Not persistent: checkpoints hold the same keys with or without BlurPool.
            kernel = binomial_kernel(device)
            module.register_buffer("blur_kernel", kernel, persistent=False)
            found += 1
    return found


# end algorithm: blurpool


# algorithm: sam
def sam_forward_backward(
    forward_backward: Callable[[int], torch.Tensor],
    attempt: microbatch.Attempt,
    model: torch.nn.Module,
    rho: float,
) -> torch.Tensor:
    """Sharpness-aware minimisation (Foret et al. 2021) for one batch: .grad ends up
    holding the gradient at w + rho * g / |g|, where g is the gradient at the weights
    w, which are restored bitwise. Returns the loss at w."""
    loss_sum = forward_backward(attempt.size)
    attempt.reduce_deferred_gradients()  # g is global (DDP defers it while searching)
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    scale = rho / (fsdp.grad_norm(params).item() + 1e-12)  # |g| over ranks and shards
    weights = [p.detach().clone() for p in params]
    # The second pass's BatchNorm statistics are dropped: the first pass's are kept.
    stats = {m: m.step_stats for m in model.modules() if hasattr(m, "step_stats")}
    try:
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=scale)  # w + rho * g / |g|
        for p in params:
            p.grad = None
        forward_backward(attempt.size)
    finally:  # also when out of memory: the retried step starts from w
        with torch.no_grad():
            for p, w in zip(params, weights):
                p.copy_(w)
        for module, step_stats in stats.items():
            module.step_stats = step_stats
    return loss_sum


# end algorithm: sam


# algorithm: colout
def colout_batch(
    inputs: torch.Tensor, p_row: float, p_col: float, seed: int, step: int
) -> torch.Tensor:
    """ColOut: the images without round(p_row * H) of their rows and round(p_col * W)
    of their columns, the same ones for every image, drawn from (seed, step); the kept
    pixels stay in order."""
    rng = data.step_rng(seed, step, "colout")
    height, width = inputs.shape[-2:]
    rows = rng.permutation(height)[round(p_row * height) :]
    cols = rng.permutation(width)[round(p_col * width) :]
    rows, cols = (
        torch.from_numpy(i).sort().values.to(inputs.device) for i in (rows, cols)
    )
    return inputs[..., rows, :][..., cols]


# end algorithm: colout


# algorithm: mixup
def mixup_batch(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    num_classes: int,
    lam: float,
    partner: torch.Tensor,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MixUp of this rank's share of the global batch (Zhang et al. 2018).

    The sample at global position g becomes lam * x[g] + (1 - lam) * x[partner[g]], its
    target likewise, as class probabilities: the cross-entropy against the mixed target
    is lam * loss(own label) + (1 - lam) * loss(partner's label). Partners may sit on
    other ranks, so inputs and targets are all-gathered (one process: nothing to do).
    """
    if targets.dim() == 1:  # class indices -> probabilities
        targets = F.one_hot(targets, num_classes).float()
    share = inputs.shape[0]
    mine = partner[rank * share : (rank + 1) * share].to(inputs.device)
    other_inputs = dist.gather_rows(inputs)[mine]
    other_targets = dist.gather_rows(targets)[mine]
    inputs = lam * inputs + (1 - lam) * other_inputs
    return inputs, lam * targets + (1 - lam) * other_targets


# end algorithm: mixup


# algorithm: progressive_resizing
def progressive_resizing_size(
    fraction: float, height: int, width: int, cfg: Config
) -> tuple[int, int]:
    """Image size after `fraction` of training (Composer's ProgressiveResizing): the
    scale is initial_scale for delay_fraction of training, then grows linearly to 1
    where the last finetune_fraction begins. The width is rounded to a multiple of
    size_increment (at least one), the height scaled alike."""
    delay = cfg.progressive_resizing_delay_fraction
    ramp = 1 - delay - cfg.progressive_resizing_finetune_fraction
    if fraction < delay:
        grown = 0.0
    elif fraction >= delay + ramp:
        grown = 1.0
    else:
        grown = (fraction - delay) / ramp
    scale = cfg.progressive_resizing_initial_scale
    scale += (1 - scale) * grown
    step = cfg.progressive_resizing_size_increment
    rounded = min(width, max(step, round(width * scale / step) * step))
    if scale >= 1 or rounded >= width:  # full size (also when width % step != 0)
        return height, width
    return int(height * rounded / width), rounded


def progressive_resize(
    images: torch.Tensor, size: tuple[int, int], mode: str, seed: list[int]
) -> torch.Tensor:
    """Images (..., C, H, W) at `size`: nearest-neighbour resized, or cropped at one
    offset for the batch drawn from `seed` (the same on every rank). channels_last
    memory stays channels_last."""
    if tuple(images.shape[-2:]) == size:
        return images
    channels_last = images.dim() == 4 and not images.is_contiguous()
    channels_last = channels_last and images.is_contiguous(
        memory_format=torch.channels_last
    )
    if mode == "crop":
        top, left = (
            np.random.default_rng(seed).integers(full - new + 1)
            for full, new in zip(images.shape[-2:], size)
        )
        images = images[..., top : top + size[0], left : left + size[1]]
    else:  # leading dimensions (AugMix's views) folded into the batch
        flat = F.interpolate(images.flatten(0, -4), size=size, mode="nearest")
        images = flat.reshape(*images.shape[:-2], *size)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return images.contiguous(memory_format=layout)


def progressive_resizing_static_compile(
    side: int, num_blocks: int, cfg: Config
) -> None:
    """torch.compile under progressive resizing: one static graph per image size.

    On the first new size dynamo would build a size-generic graph (automatic dynamic
    shapes), which Inductor fails to compile for these ResNets (measured: CPU, torch
    2.13, "cannot determine truth value of Relational"). The sizes are multiples of
    size_increment, at most side / increment + 1 of them: the recompile limits are
    raised to hold a few graphs (training, evaluation) per block and size."""
    sizes = side // cfg.progressive_resizing_size_increment + 1
    limit = 4 * sizes * num_blocks
    dynamo = torch._dynamo.config
    dynamo.automatic_dynamic_shapes = False
    dynamo.recompile_limit = max(dynamo.recompile_limit, limit)
    dynamo.accumulated_recompile_limit = max(dynamo.accumulated_recompile_limit, limit)


# end algorithm: progressive_resizing


# algorithm: stochastic_depth
class StochasticDepth:
    """Stochastic depth (Huang et al. 2016) over a list of residual blocks.

    Set as each block's `branch` hook: in training, block i's residual branch is dropped
    with probability rates[i] (block mode: skipped for the whole step; sample mode:
    zeroed for the samples that drew a drop), and kept branches are scaled by
    1 / (1 - rate), so the expected output is the plain block's. Evaluation runs the
    plain blocks (Huang et al. scale by 1 - rate at test time instead: the same in
    expectation).
    """

    def __init__(
        self,
        blocks: torch.nn.ModuleList,
        drop_rate: float,
        distribution: str,
        mode: str,
    ) -> None:
        count = len(blocks)
        linear = distribution == "linear"
        self.max_rates = [
            drop_rate * ((i + 1) / count if linear else 1.0) for i in range(count)
        ]
        self.mode = mode
        self.rates = [0.0] * count  # this step's drop probabilities
        self.scales = torch.ones(count, 1)  # (blocks, rank's samples): 0 dropped
        self.keep = [True] * count  # block mode: this step's decision per block
        self.rows = slice(0, None)  # sample mode: this microbatch's rows
        for index, block in enumerate(blocks):
            block.stochastic_depth_index = index
            block.branch = self.branch

    @staticmethod
    def draws(seed: int, step: int, block: int, samples: int) -> torch.Tensor:
        """`samples` uniform draws in [0, 1), sample s of the global batch draw s: a
        pure function of (seed, step, block), never of a rank's RNG stream."""
        key = ((seed * 1_000_003 + step) * 1_000_003 + block) % 2**63
        return torch.rand(samples, generator=torch.Generator().manual_seed(key))

    def start_step(
        self,
        seed: int,
        step: int,
        ramp: float,
        global_batch: int,
        first: int,
        samples: int,
        device: torch.device,
    ) -> None:
        """Draw step `step`'s drops on the CPU: one per block (block mode) or one per
        block and sample of the global batch, of which this rank keeps `samples` from
        global index `first` on. `ramp` (0..1) scales the rates (drop_warmup)."""
        self.rates = [rate * ramp for rate in self.max_rates]
        n = global_batch if self.mode == "sample" else 1
        draws = torch.stack(
            [self.draws(seed, step, b, n) for b in range(len(self.rates))]
        )
        rates = torch.tensor(self.rates)[:, None]
        kept = draws >= rates  # a rate of 0 keeps all, of 1 drops all
        self.keep = kept[:, 0].tolist()
        scales = kept / (1 - rates).clamp(min=1e-12)
        if self.mode == "sample":
            scales = scales[:, first : first + samples]
        self.scales = scales.to(device)

    def start_microbatch(self, start: int, size: int) -> None:
        self.rows = slice(start, start + size)

    def branch(self, block: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | float:
        """The residual branch's output for this forward (see the class docstring)."""
        index = block.stochastic_depth_index
        if not block.training or self.rates[index] == 0.0:
            return block.residual(x)  # evaluation (or nothing to drop): the plain block
        if self.mode == "block":
            if not self.keep[index]:
                return 0.0  # skipped, not computed: the block is its shortcut
            return block.residual(x) * self.scales[index, 0].to(x.dtype)
        scale = self.scales[index, self.rows].to(x.dtype)
        return block.residual(x) * scale[:, None, None, None]


# end algorithm: stochastic_depth


# algorithm: ema
def ema_smoothing(cfg: Config) -> float:
    """The share of the average each update keeps: 2^(-update_interval / half_life)
    (Composer's parameterisation). ValueError if the two cannot be compared."""
    progress = Progress(batches_per_epoch=1)  # resolves `dur` against max_duration
    interval = progress.resolve(cfg.ema_update_interval, cfg.max_duration)
    half_life = progress.resolve(cfg.ema_half_life, cfg.max_duration)
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
    model = fsdp.unwrap(model)  # DDP's wrapper holds the same tensors
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
    val: data.Batches,
    images: data.ImageData,
    cfg: Config,
    env: dist.DistEnv,
    microbatching: microbatch.Search,
) -> dict[str, float]:
    """Cross-entropy, top-1 and top-5 accuracy on the validation split (BatchNorm in
    evaluation mode: running statistics). Every rank scores its share of each batch,
    the same number of forwards (under FSDP each one all-gathers the weights): the
    last batch is padded, with weight 0; the sums are added over ranks."""
    model.eval()
    k = min(5, len(images.classes))
    num_batches = min(cfg.eval_batches or len(val), len(val))
    # auto: out of memory on any rank halves evaluation's size on every rank.
    for attempt in microbatching.eval_attempts(seq_len=cfg.eval_image_size):
        with attempt:
            sums = torch.zeros(4, device=env.device)  # loss, top-1, top-5 hits, samples
            for batch in range(num_batches):
                pixels, labels, weight = (t.to(env.device) for t in val[batch])
                for x, y, w in zip(
                    pixels.split(attempt.size),
                    labels.split(attempt.size),
                    weight.split(attempt.size),
                ):
                    with torch.autocast(
                        env.device.type, torch.bfloat16, enabled=is_amp(cfg)
                    ):
                        logits = model(data.normalize(x, images)).float()
                    top = logits.topk(k, dim=1).indices == y[:, None]
                    sums += torch.stack(
                        [
                            (F.cross_entropy(logits, y, reduction="none") * w).sum(),
                            (top[:, 0] * w).sum(),
                            (top.any(dim=1) * w).sum(),
                            w.sum(),
                        ]
                    )
    model.train()
    loss, top1, top5, count = dist.reduce_sum(sums).tolist()
    return {
        "val_loss": loss / count,
        "val_top1": top1 / count,
        f"val_top{k}": top5 / count,
    }


def is_amp(cfg: Config) -> bool:
    """Autocast: bf16 convolutions and matmuls on fp32 weights (precision=amp_bf16)."""
    return cfg.precision == "amp_bf16"


def main() -> None:
    # event: INIT

    cfg = config.parse(Config)
    env, parallel = setup(cfg)  # one process, or one of torchrun's N
    torch.manual_seed(cfg.seed)  # the same on every rank: identical initial weights
    run_dir = Path("runs") / cfg.run_name
    try:
        images = data.load_images(cfg.data)
        batches = dict(
            batch_size=cfg.global_batch_size,
            seed=cfg.seed,
            image_size=cfg.image_size,
            rank=env.rank,
            world_size=env.world_size,
            augment=augmentations(cfg),
        )
        train_batches = data.Batches(images, "train", **batches)
        val_sizes = dict(image_size=cfg.eval_image_size, resize=cfg.eval_resize)
        val = data.Batches(images, "val", **(batches | val_sizes))
    except (OSError, ValueError) as error:  # a missing path, a bad file, too few images
        config.fail(str(error))

    if cfg.model.startswith(TORCHVISION):
        try:  # a torchvision model, fitted to this loop (see TorchvisionNet)
            name = cfg.model.removeprefix(TORCHVISION)
            model = TorchvisionNet(name, len(images.classes), cfg.bn_group_size)
        except ValueError as error:  # BatchNorm layers that cannot be made ghost
            config.fail(str(error))
    else:
        model_config = ResNetConfig(
            num_classes=len(images.classes),
            in_channels=images.channels,
            bn_group_size=cfg.bn_group_size,
            **PRESETS[cfg.model],
        )
        model = ResNet(model_config)
    model = model.to(env.device)
    num_params = model.num_params()

    # One live start per run: a second (a requeue racing a dying job) is refused. The
    # OS lock is held until this process ends; the kernel drops it even after kill -9.
    # Taken after the data is read and the model built: a bad input leaves no run
    # folder behind.
    try:
        run_lock = runlock.acquire(run_dir)
    except runlock.RunInUse as error:
        config.fail(str(error))
    # Decoding images from disk happens in worker processes while the model trains.
    num_workers = cfg.num_workers if images.on_disk else 0

    # event: MODEL

    # algorithm: blurpool
    # BlurPool (Zhang 2019): strided convolutions and max pools blur before they
    # subsample, so high frequencies do not alias. Weights and checkpoint keys are
    # unchanged (the filter is a fixed, unsaved buffer); before sharding.
    blurred = use_blurpool(
        model,
        cfg.blurpool_replace_convs,
        cfg.blurpool_replace_maxpools,
        cfg.blurpool_blur_first,
        cfg.blurpool_min_channels,
    )
    dist.print0(f"blurpool: {blurred} layer(s) blur before subsampling")
    # end algorithm: blurpool

    # algorithm: stochastic_depth
    # Stochastic depth (Huang et al. 2016): in training, residual branches are
    # skipped with a probability growing with depth (blocks' `branch` hook);
    # evaluation runs every block. No parameters or checkpoint keys change.
    depth = StochasticDepth(
        model.blocks,
        cfg.stochastic_depth_drop_rate,
        cfg.stochastic_depth_drop_distribution,
        cfg.stochastic_depth_mode,
    )
    # end algorithm: stochastic_depth

    # algorithm: channels_last
    # Channels last (NHWC): convolution weights stored channel-innermost, the layout
    # cuDNN's bf16/fp16 tensor-core kernels use without transposing. FSDP2 shards
    # only contiguous parameters: under fsdp the weights stay NCHW, and the NHWC
    # inputs (BATCH_START) alone select the NHWC kernels.
    if parallel.parallelism != "fsdp":
        model = model.to(memory_format=torch.channels_last)
    # end algorithm: channels_last

    # algorithm: ema
    # The weight average: a copy of the model, never trained (no gradients).
    ema_model = copy.deepcopy(model).requires_grad_(False)
    # end algorithm: ema

    # Training FLOPs per image, for MFU (GPUs only): one forward at the training size
    # (ImageFolder crops to image_size; CIFAR and the digits keep their own), counted by
    # torch, x3 for the backward. Counted here, after any model surgery.
    size = cfg.image_size if images.kind == "folder" else len(images.val.sample(0)[0])
    example = torch.zeros(1, images.channels, size, size, device=env.device)
    flops_per_sample = training_flops(model, example)
    # Shard or replicate for the launch: FSDP2 per residual block then the root, DDP,
    # or nothing.
    model = fsdp.parallelize(model, model.blocks, env, parallel)

    # Decay conv and linear weights; BatchNorm parameters and biases stay undecayed.
    params = list(model.parameters())
    decayed = [p for p in params if p.dim() >= 2]
    groups = [
        {"params": decayed, "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if cfg.optimizer == "sgd":
        for group in groups:  # decoupled: applied by hand before each step (below)
            group["weight_decay"] = 0.0
        optimizer = torch.optim.SGD(
            groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov
        )
    else:
        optimizer = torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=(cfg.momentum, cfg.beta2),
            # CUDA: one fused kernel for the whole update instead of several per tensor.
            fused=env.device.type == "cuda" and not cfg.cpu_offload,
        )
    # What a checkpoint holds; an algorithm with state of its own (EMA weights, say)
    # adds an entry at OPTIMIZER, before the resume below restores all of it.
    state = {"model": model, "optimizer": optimizer}
    # The state entry whose weights `scaffold export` writes out for inference.
    export_entry = "model"

    # event: OPTIMIZER

    # algorithm: ema
    # Sharded like the model (each rank averages its own shards) and checkpointed with
    # it, so a resume on any number of ranks restores the average.
    ema_model = fsdp.parallelize_copy(ema_model, ema_model.blocks, env, parallel)
    state["ema"] = ema_model
    if cfg.ema_export:
        export_entry = "ema"  # scaffold export writes the averaged weights
    # end algorithm: ema

    # Resume: load_path, else this run's newest complete checkpoint, restores model
    # (with BatchNorm running statistics), optimizer, progress and RNG, saved on any
    # number of ranks. The batch order is a function of progress: nothing is replayed.
    progress = Progress(batches_per_epoch=train_batches.batches_per_epoch)
    checkpointer = checkpoint.Checkpointer(
        cfg.save_folder or run_dir / "checkpoints",
        keep=cfg.save_num_checkpoints_to_keep,
        async_save=cfg.save_async,
        export=export_entry,
    )
    try:
        resumed = checkpointer.resume(
            state,
            progress,
            load_path=cfg.load_path,
            weights_only=cfg.load_weights_only,
            autoresume=cfg.autoresume,
            seed=cfg.seed,
        )
    except checkpoint.CheckpointError as error:  # names the file or the mismatched keys
        config.fail(str(error))
    monitor = Monitor(
        run_dir, progress, cfg.max_duration, cfg.global_batch_size, env.is_main
    )
    monitor.record_run(config.to_toml(cfg), Path(__file__), env.device, env.world_size)
    # MFU, memory, ETA
    monitor.measure(
        env.device, env.world_size, cfg.precision, flops_per_sample=flops_per_sample
    )
    monitor.open_trackers(
        cfg.trackers, config.to_toml(cfg)
    )  # rank 0; resumes their runs
    monitor.info(f"data: {images.source}")
    monitor.info(
        f"images: {len(images.train):,} train, {len(images.val):,} validation, "
        f"{len(images.classes)} classes"
    )
    monitor.info(f"model: {cfg.model}, {num_params:,} parameters")
    monitor.info(f"parallelism: {parallel.parallelism}, {env.world_size} process(es)")
    for line in resumed.describe() if resumed else []:
        monitor.info(line)
    # The microbatch size: fixed, or auto (the largest multiple of bn_group_size that
    # fits, found by halving on out-of-memory; a resumed run reuses the size it found).
    microbatching = microbatch.Search(
        model,
        fsdp.unwrap(model).blocks,
        env,
        cfg.device_microbatch_size,
        per_rank_batch=cfg.global_batch_size // env.world_size,
        max_size=cfg.max_device_microbatch_size,
        resumed=resumed.extra if resumed else None,
        log=monitor.info,
        timeout=timedelta(seconds=cfg.dist_timeout),
        multiple_of=cfg.bn_group_size,
    )

    train_loss = RunningSum(env.device)  # summed on the device, read at logged steps
    stopper = early_stop.EarlyStopper(
        cfg.early_stop_metric,
        cfg.early_stop_patience,
        cfg.early_stop_min_delta,
        cfg.early_stop_mode,
        resumed=resumed.extra if resumed else None,  # a stopped run stays stopped
        log=monitor.info,
    )
    profiler = profile.Profiler(
        cfg.profile, run_dir, env.rank, env.device, cfg.max_duration, monitor.info
    )
    # SIGUSR1 (SLURM's pre-emption notice) or SIGTERM: finish the step, save, stop.
    preemption = preempt.Preemption()

    # event: FIT_START

    stopping = False
    while not (progress.reached(cfg.max_duration) or stopping or stopper.stopped):
        # event: EPOCH_START

        epoch = progress.epoch
        # This rank's shares of the epoch's global batches, in the epoch's seeded order,
        # from where training stands (a resumed run starts mid-epoch).
        train_batches = data.Batches(images, "train", epoch=epoch, **batches)
        start = progress.batch_in_epoch
        pin_memory = env.device.type == "cuda"
        loader = data.loader(train_batches, start, num_workers, pin_memory)
        for pixels, labels, _ in loader:
            pixels = pixels.to(env.device, non_blocking=True)
            labels = labels.to(env.device, non_blocking=True)
            inputs = data.normalize(pixels, images)
            # What the loss compares the logits with: class indices, or (once an
            # algorithm at BATCH_START rewrites them) class probabilities, a row per
            # sample; cross-entropy takes either. Evaluation scores the hard labels.
            targets = labels
            samples = cfg.global_batch_size  # trained on this step, summed over ranks

            # event: BATCH_START

            # algorithm: colout
            # ColOut (Composer): drop a random share of the rows and of the columns of
            # every image of the step: smaller images, cheaper steps. Drawn from (seed,
            # step): every rank drops the same ones.
            inputs = colout_batch(
                inputs, cfg.colout_p_row, cfg.colout_p_col, cfg.seed, progress.batch
            )
            # end algorithm: colout

            # algorithm: label_smoothing
            # Soft targets (Szegedy et al. 2016): (1 - s) * one-hot + s / K, so the
            # classifier is never pushed to infinite confidence. Before any mixing.
            num_classes, smoothing = len(images.classes), cfg.label_smoothing
            if targets.dim() == 1:  # class indices -> probabilities
                targets = F.one_hot(targets, num_classes).float()
            targets = (1 - smoothing) * targets + smoothing / num_classes
            # end algorithm: label_smoothing

            # algorithm: mixup
            # MixUp (Zhang et al. 2018): mix each sample and its target with a partner
            # from the global batch, before the microbatch split. lam and the partners
            # come from (seed, step): the same pairs on any world size, after a resume.
            # The "batch mixer" draw is shared with other mixers: one mixer per step.
            mixup_lambda = 1.0
            if (
                data.step_rng(cfg.seed, progress.batch, "batch mixer").random()
                < cfg.mixup_prob
            ):
                rng = data.step_rng(cfg.seed, progress.batch, "mixup")
                mixup_lambda = float(rng.beta(cfg.mixup_alpha, cfg.mixup_alpha))
                partner = torch.from_numpy(rng.permutation(cfg.global_batch_size))
                inputs, targets = mixup_batch(
                    inputs,
                    targets,
                    len(images.classes),
                    mixup_lambda,
                    partner,
                    env.rank,
                )
            # end algorithm: mixup

            # algorithm: progressive_resizing
            # Progressive resizing (Composer's): small images early, while coarse
            # features are learned; full size for the last finetune fraction. The size
            # is a function of progress: a resumed run continues the same schedule.
            # Crop mode's offset is drawn from (seed, step): the same on every rank.
            if parallel.compile:  # a static graph per size (the sizes are few)
                blocks = len(fsdp.unwrap(model).blocks)
                progressive_resizing_static_compile(inputs.shape[-1], blocks, cfg)
            progressive_size = progressive_resizing_size(
                progress.fraction(cfg.max_duration), *inputs.shape[-2:], cfg
            )
            inputs = progressive_resize(
                inputs,
                progressive_size,
                cfg.progressive_resizing_mode,
                [cfg.seed, progress.batch],
            )
            # end algorithm: progressive_resizing

            # algorithm: stochastic_depth
            # This step's drops: a pure function of (seed, step, block, global
            # sample), so a resumed run, on any number of ranks or microbatch size,
            # drops the same ones.
            # The share of the drop rates in force: below 1 during drop_warmup.
            ramp = 1.0
            if cfg.stochastic_depth_drop_warmup != "none":
                warmup = as_fraction(cfg.stochastic_depth_drop_warmup, cfg.max_duration)
                ramp = min(progress.fraction(cfg.max_duration) / warmup, 1.0)
            # This rank's first sample in the global batch.
            first_sample = env.rank * (cfg.global_batch_size // env.world_size)
            depth.start_step(
                cfg.seed,
                progress.batch,
                ramp,
                cfg.global_batch_size,
                first_sample,
                inputs.shape[0],
                env.device,
            )
            # end algorithm: stochastic_depth

            # algorithm: channels_last
            # The batch in NHWC too, so the first convolution needs no layout
            # change; the microbatches (slices along the batch dimension) stay NHWC.
            inputs = inputs.contiguous(memory_format=torch.channels_last)
            # end algorithm: channels_last

            lr = lr_at(progress.fraction(cfg.max_duration), cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr

            # Gradient accumulation: each microbatch's summed loss is divided by the
            # samples trained on in this step over all ranks (the global batch size,
            # unless an algorithm cut the batch), so gradients are their mean whatever
            # the microbatch size and world size. DDP and FSDP average gradients over
            # ranks: hence the factor world_size.
            loss_scale = env.world_size / samples

            def forward_backward(size: int) -> torch.Tensor:
                """Forward and backward over this rank's batch in microbatches of `size`
                samples; gradients add up in .grad. Returns the summed loss."""
                loss_sum = torch.zeros((), device=env.device)
                microbatches = list(zip(inputs.split(size), targets.split(size)))
                for i, (micro_inputs, micro_targets) in enumerate(microbatches):
                    # event: MICROBATCH_START

                    # algorithm: stochastic_depth
                    # Sample mode: which rows of the rank's share this microbatch holds.
                    depth.start_microbatch(i * size, micro_inputs.shape[0])
                    # end algorithm: stochastic_depth

                    # Reduce gradients over ranks once, in the last backward.
                    fsdp.sync_gradients(model, i == len(microbatches) - 1)
                    with torch.autocast(
                        env.device.type, torch.bfloat16, enabled=is_amp(cfg)
                    ):
                        logits = model(micro_inputs)

                    # event: AFTER_FORWARD

                    loss = F.cross_entropy(
                        logits.float(), micro_targets, reduction="sum"
                    )

                    # event: LOSS

                    (loss * loss_scale).backward()
                    loss_sum += loss.detach()
                return loss_sum

            # Out of memory on any rank (while the size is still being searched): every
            # rank drops this attempt's gradients (and BatchNorm statistics) and retries
            # the same batch at half the microbatch size.
            rows = inputs.shape[0]  # a cut batch does not prove a size fits a full one
            for attempt in microbatching.attempts(seq_len=inputs.shape[-1], rows=rows):
                with attempt:
                    clear_step_stats(model)

                    # algorithm: sam
                    # SAM every sam_interval steps: the gradient at the weights pushed
                    # uphill by sam_rho along the normalised gradient, taken back to the
                    # original weights. Out of memory in either pass retries the step.
                    if progress.batch % cfg.sam_interval == 0:
                        loss_sum = sam_forward_backward(
                            forward_backward, attempt, model, cfg.sam_rho
                        )
                    else:
                        loss_sum = forward_backward(attempt.size)
                    # end algorithm: sam

            # event: AFTER_BACKWARD

            if cfg.optimizer == "sgd":
                # Decoupled weight decay (Loshchilov & Hutter 2019), scaled by the
                # schedule as Composer's DecoupledSGDW: independent of the gradient.
                with torch.no_grad():
                    torch._foreach_mul_(decayed, 1 - cfg.weight_decay * lr / cfg.lr)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # BatchNorm running statistics: once per step, from the whole global batch.
            update_running_stats(model, dist.reduce_sum)
            progress.advance(samples=cfg.global_batch_size, tokens=0)
            train_loss.add(loss_sum, samples)  # no device sync

            # event: BATCH_END

            # algorithm: ema
            # Fold the weights just stepped into their moving average.
            if progress.at_interval(cfg.ema_update_interval, cfg.max_duration):
                update_ema(ema_model, model, ema_smoothing(cfg))
            # end algorithm: ema

            monitor.update(progress)
            profiler.step(progress)  # records the --profile window, writes its traces
            finished = progress.reached(cfg.max_duration)
            # SIGUSR1/SIGTERM on any rank: every rank saves and stops after this step.
            stopping = preemption.agreed()
            metrics = {}
            if progress.at_interval(cfg.eval_interval, cfg.max_duration) or finished:
                # event: EVAL

                # algorithm: ema
                # The averaged weights, same evaluation: ema_val_loss, ema_val_top1, ...
                with monitor.paused():
                    ema_metrics = evaluate(
                        ema_model, val, images, cfg, env, microbatching
                    )
                metrics.update(
                    {f"ema_{name}": value for name, value in ema_metrics.items()}
                )
                # end algorithm: ema

                # Evaluation time does not count against the logged throughput.
                with monitor.paused():
                    metrics.update(
                        evaluate(model, val, images, cfg, env, microbatching)
                    )
            if metrics or progress.at_interval(cfg.log_interval, cfg.max_duration):
                metrics["loss"] = train_loss.pop()  # mean since the last log, all ranks
                metrics["lr"] = lr
                metrics["microbatch_size"] = attempt.size

                # algorithm: sam
                # SAM steps so far, each two forward/backward passes
                metrics["sam_steps"] = math.ceil(progress.batch / cfg.sam_interval)
                # end algorithm: sam

                # algorithm: mixup
                metrics["mixup_lambda"] = mixup_lambda  # this step's; 1.0: not mixed
                # end algorithm: mixup

                # algorithm: progressive_resizing
                metrics["image_width"] = inputs.shape[
                    -1
                ]  # progressive resizing's current size
                # end algorithm: progressive_resizing

                # algorithm: stochastic_depth
                metrics["drop_rate"] = depth.rates[-1]  # the deepest block's, this step
                # end algorithm: stochastic_depth

                monitor.log(progress, **metrics)
            finished = stopper.update(progress, metrics, cfg.max_duration) or finished
            if (
                progress.at_interval(cfg.save_interval, cfg.max_duration)
                or finished
                or stopping
            ):
                with monitor.paused():
                    checkpointer.save(
                        state,
                        progress,
                        extra=microbatching.state_dict() | stopper.state_dict(),
                    )
            if finished or stopping:
                break

        # event: EPOCH_END

    # event: FIT_END

    checkpointer.close()  # an async save in flight: finished and marked complete
    outcome = f"done: step {progress.batch}, {progress.sample:,} samples"
    if stopping:  # exit status 0; under SLURM the batch script requeues the job
        outcome = (
            f"stopped by {preemption.stopped_by} after step {progress.batch}, saved"
        )
    monitor.info(f"{outcome}; outputs in {run_dir}")
    monitor.close()
    preemption.close()  # the previous signal handlers again
    run_lock.release()  # the next start of this run may begin


if __name__ == "__main__":
    try:
        main()
    finally:
        dist.shutdown()  # leave the process group, also after an error
