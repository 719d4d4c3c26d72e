"""Train resnet50-baseline: a ResNet image classifier.

    python train.py                     # CPU or one GPU, on the embedded default data
    python train.py --data=/data/imagenet --model=resnet50 --max_duration=90ep
    python train.py --config run.toml   # keys as in Config below; flags override it
    python train.py --help              # every key, its default and meaning

Recipe `resnet50-baseline`; algorithms: none.
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

import data
from model import (
    Preset,
    build_model,
    check_model,
    check_weights,
    clear_step_stats,
    update_running_stats,
    weight_decay_groups,
)
from runtime import checkpoint, config, dist, early_stop, microbatch, parallel, preempt
from runtime import profile, runlock, trackers
from runtime.monitor import Monitor, RunningSum, training_flops
from runtime.time import Progress, Time, as_fraction, check_fraction


@dataclass
class Config:
    run_name: str = "resnet50-baseline"  # runs/<run_name>/; rerunning a name resumes it
    seed: int = 42  # a run is a function of (config, seed)
    data: str = ""  # "": sklearn's digits; ImageFolder, cifar-10-batches-bin, shards
    # ImageFolder sizes (CIFAR and the digits keep their 32 and 8 pixels). Training at a
    # smaller crop than evaluation matches the apparent object size of the two (Touvron
    # et al. 2019, "FixRes"): Composer's ResNet recipes train at 176, evaluate at 224.
    image_size: int = 224  # training crops (inception), whole images (pad)
    # inception: ImageNet's random-resized crops and flips, evaluated resized and
    # centre-cropped; pad: CIFAR's (Composer's CIFAR recipe), the whole image at
    # image_size padded by 4, cropped back and flipped, evaluated whole
    train_crop: Literal["inception", "pad"] = "inception"
    eval_image_size: int = 0  # evaluation: centre crop; 0: image_size
    eval_resize: int = 0  # short side resized first; 0: crop / 0.875
    num_workers: int = 8  # processes decoding images from disk (in-memory data: none)
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    # model: a preset (PRESETS in model.py); torchvision:NAME, timm:NAME or hf:FOLDER,
    # any classifier of those libraries (BatchNorm made ghost: HubNet in model.py);
    # auto: resnet50 with --data, `tiny` on the embedded digits (a CPU demo)
    model: Preset | Literal["auto"] | str = "auto"  # or torchvision:NAME, timm:NAME
    weights: str = ""  # torchvision:/timm: a pretrained state dict file; "": random
    # BatchNorm statistics are taken over groups of this many samples ("ghost"
    # BatchNorm), so a step does not depend on the microbatch size or the number of
    # ranks: both the per-rank batch and device_microbatch_size must be multiples of it
    bn_group_size: int = 256
    # optimization; Time strings: 10ep, 2000ba (steps), 4096sp, 0.25dur
    max_duration: Time = Time.parse("90ep")  # training length
    global_batch_size: int = 2048  # samples per step, summed over ranks
    # samples per forward/backward (gradient accumulation over the rank's batch)
    device_microbatch_size: int = 256
    optimizer: Literal["sgd", "adamw"] = "sgd"
    lr: float = 2.048  # peak learning rate
    lr_warmup: Time = Time.parse("8ep")  # linear from 0, then cosine decay
    min_lr_ratio: float = 0.0  # the cosine ends at min_lr_ratio * lr
    # decoupled weight decay on conv and linear weights (BatchNorm and biases exempt):
    # sgd shrinks weights by weight_decay * lr / peak lr per step (Composer's
    # DecoupledSGDW); adamw by weight_decay * lr (torch's AdamW)
    weight_decay: float = 0.0005
    momentum: float = 0.875  # sgd momentum (adamw: beta1)
    nesterov: bool = False  # sgd: Nesterov momentum
    beta2: float = 0.999  # adamw

    # evaluation, logging, checkpoints
    eval_interval: Time = Time.parse("1ep")  # top-1/top-5 every ...
    eval_batches: int = 0  # validation batches per evaluation; 0: the whole split
    log_interval: Time = Time.parse("1ba")  # a metrics.jsonl record every ...
    console_interval: Time = Time.parse("0.05dur")  # printed (no terminal) every ...
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
    # `auto` and 0 settled for the data: config.toml records these too.
    if cfg.model == "auto":
        cfg.model = "resnet50" if cfg.data else "tiny"
    cfg.eval_image_size = cfg.eval_image_size or cfg.image_size  # 0: settled here
    cfg.eval_resize = cfg.eval_resize or round(cfg.eval_image_size / 0.875)
    problem = parallel.check(plan, env)
    problem = problem or microbatch.check(cfg.device_microbatch_size)
    problem = problem or trackers.check(cfg.trackers) or profile.check(cfg.profile)
    problem = problem or checkpoint.check_access(cfg.save_folder, cfg.load_path)
    problem = problem or check_model(cfg.model)  # a preset, or a hub model importable
    problem = problem or check_weights(cfg.model, cfg.weights)
    problem = problem or data.check(cfg, env.world_size)  # sizes, BatchNorm groups
    problem = problem or early_stop.check_settings(cfg)
    if problem:
        config.fail(problem)
    if problem := dist.check_batch(cfg.global_batch_size, env.world_size):
        config.fail(problem)
    with config.failing(ValueError, prefix="lr_warmup: "):
        check_fraction(cfg.lr_warmup, cfg.max_duration)

    # FSDP and DDP need a process group, on one process too (a group of one rank).
    timeout = timedelta(seconds=cfg.dist_timeout)
    dist.init_process_group(env, timeout, required=plan.parallelism != "none")
    dist.use_tf32(env.device)  # CUDA: TF32 tensor cores for fp32 matmuls, convolutions
    return env, plan


def lr_at(fraction: float, cfg: Config, batches_per_epoch: int) -> float:
    """Learning rate after `fraction` of training: linear warmup, then cosine decay."""
    warmup = as_fraction(cfg.lr_warmup, cfg.max_duration, batches_per_epoch)
    if fraction < warmup:
        return cfg.lr * fraction / warmup
    decayed = (fraction - warmup) / max(1.0 - warmup, 1e-9)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * decayed))


def build_optimizer(
    model: torch.nn.Module, cfg: Config
) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """SGD or AdamW over the model's parameters. Returns it and the weights it decays
    (sgd: by hand, before each step in the loop)."""
    # Decay conv and linear weights; BatchNorm parameters and biases stay undecayed.
    groups = weight_decay_groups(model, cfg.weight_decay)
    if cfg.optimizer == "sgd":
        for group in groups:  # decoupled: applied by hand before each step (main)
            group["weight_decay"] = 0.0
        optimizer = torch.optim.SGD(
            groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov
        )
    else:
        optimizer = torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            betas=(cfg.momentum, cfg.beta2),
            # One fused kernel for the whole update instead of several per tensor, on
            # the CPU too (the offloaded step: per tensor).
            fused=not cfg.cpu_offload,
        )
    return optimizer, groups[0]["params"]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    val: data.Batches,
    cfg: Config,
    env: dist.DistEnv,
) -> dict[str, float]:
    """Cross-entropy, top-1 and top-5 accuracy on the validation split (BatchNorm in
    evaluation mode: running statistics). Every rank scores its share of each batch,
    the same number of forwards (under FSDP each one all-gathers the weights): the
    last batch is padded, with weight 0; the sums are added over ranks."""
    model.eval()
    k = min(5, len(val.data.classes))
    num_batches = min(cfg.eval_batches or len(val), len(val))
    sums = torch.zeros(4, device=env.device)  # loss, top-1, top-5 hits, samples
    for batch in range(num_batches):
        pixels, labels, weight = (t.to(env.device) for t in val[batch])
        for x, y, w in zip(
            pixels.split(cfg.device_microbatch_size),
            labels.split(cfg.device_microbatch_size),
            weight.split(cfg.device_microbatch_size),
        ):
            with autocast(cfg, env.device):
                logits = model(data.normalize(x, val.data)).float()
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


def autocast(cfg: Config, device: torch.device) -> torch.autocast:
    """Autocast: bf16 compute on fp32 weights when precision=amp_bf16, else a no-op."""
    return torch.autocast(device.type, torch.bfloat16, cfg.precision == "amp_bf16")


def forward_backward(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_scale: float,
    cfg: Config,
) -> torch.Tensor:
    """Forward and backward over this rank's batch in microbatches of
    cfg.device_microbatch_size rows, gradients adding up in .grad (reduced over ranks in
    the last backward)."""
    microbatch_size = cfg.device_microbatch_size
    clear_step_stats(model)  # ghost BatchNorm: this step's stats start empty
    loss_sum = torch.zeros((), device=targets.device)
    microbatches = list(
        zip(inputs.split(microbatch_size), targets.split(microbatch_size))
    )
    for i, (micro_inputs, micro_targets) in enumerate(microbatches):
        # event: MICROBATCH_START

        # Reduce gradients over ranks once, in the last backward.
        parallel.sync_gradients(model, i == len(microbatches) - 1)
        with autocast(cfg, targets.device):
            logits = model(micro_inputs)

        # event: AFTER_FORWARD

        loss = F.cross_entropy(logits.float(), micro_targets, reduction="sum")

        # event: LOSS

        (loss * loss_scale).backward()
        loss_sum += loss.detach()
    return loss_sum


def main() -> None:
    # event: INIT

    cfg = config.parse(
        Config, refusals={"device_microbatch_size": {"auto": microbatch.NO_SEARCH}}
    )
    env, plan = setup(cfg)  # one process, or one of torchrun's N
    torch.manual_seed(cfg.seed)  # the same on every rank: identical initial weights
    run_dir = Path("runs") / cfg.run_name
    checkpoints = cfg.save_folder or run_dir / "checkpoints"  # a folder or a URL
    # A missing path, a bad file, too few images: one line, exit status 2.
    with config.failing(OSError, ValueError):
        images, train_batches, val = data.load_splits(cfg, env)
    # A preset ResNet, or a hub model fitted to this loop (HubNet) that takes every side
    # fed; refused in one line: BatchNorm it cannot make ghost, bad weights, sizes.
    sides = [train_batches.image_side, val.image_side]

    with config.failing(ValueError, OSError, RuntimeError):
        model = build_model(cfg, images.classes, images.channels, sides, env.device)
    num_params = model.num_params()
    blocks = model.blocks  # FSDP's units, each also checkpointed and compiled alone

    # One live start per run (an OS lock that kill -9 frees), once all input is read.
    with config.failing(runlock.RunInUse):
        run_lock = runlock.acquire(run_dir)

    # event: MODEL

    # Training FLOPs per image, for MFU (GPUs only): one forward at the training size
    # (ImageFolder crops to image_size; CIFAR and the digits keep their own), counted by
    # torch, x3 for the backward. Counted here, after any model surgery.
    size = train_batches.image_side
    example = torch.zeros(1, images.channels, size, size, device=env.device)
    flops_per_sample = training_flops(model, example)
    # Shard or replicate for the launch: FSDP2 per block then the root, DDP, or nothing.
    model = parallel.parallelize(model, blocks, env, plan)

    optimizer, decayed = build_optimizer(model, cfg)  # decayed: conv, linear weights
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

    # Resume: load_path, else this run's newest complete checkpoint, restores all of
    # `state` and the RNG, saved on any number of ranks. The batch order is a function
    # of progress (the global sample cursor): nothing is replayed.
    with config.failing(checkpoint.CheckpointError):  # names the file or the keys
        resumed = checkpointer.resume(state)  # load_path, autoresume: as cfg says
    # From where the run stands: config.toml, this script's copy, metrics and the bar.
    monitor.begin(progress, Path(__file__))
    for line in images.describe():  # where from, how many
        monitor.info(line)
    monitor.info(f"model: {cfg.model}, {num_params:,} parameters")
    monitor.info(f"parallelism: {plan.parallelism}, {env.world_size} process(es)")
    for line in resumed.describe() if resumed else []:
        monitor.info(line)

    train_loss = RunningSum(env.device)  # summed on the device, read at logged steps
    profiler = profile.Profiler.from_config(cfg, run_dir, env, monitor.info)
    # SIGUSR1 (SLURM's notice), SIGTERM or torchrun gone: finish the step, save, stop.
    preemption = preempt.Preemption()

    # event: FIT_START

    # The one flag that ends training (a resumed run may already have finished).
    finished = progress.reached() or stopper.stopped
    while not finished:
        # This rank's shares of the epoch's global batches, in the epoch's seeded order,
        # from where training stands (a resumed run starts mid-epoch). Each is on its
        # way to the device before its step (data.loader: the copy does not make the
        # host wait).
        train_batches = train_batches.at_epoch(progress.epoch)
        start = progress.batch_in_epoch
        loader = data.loader(train_batches, start, cfg.num_workers, env.device)
        upcoming = next(loader)
        for index in range(start, len(train_batches)):
            pixels, labels, _ = upcoming
            inputs = data.normalize(pixels, images)
            # What the loss compares the logits with: class indices, or (once an
            # algorithm at BATCH_START rewrites them) class probabilities, a row per
            # sample; cross-entropy takes either. Evaluation scores the hard labels.
            targets = labels
            samples = cfg.global_batch_size  # trained on this step, summed over ranks

            # event: BATCH_START

            fraction = progress.fraction()
            lr = lr_at(fraction, cfg, progress.batches_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # Gradient accumulation: each microbatch's summed loss is divided by the
            # samples trained on in this step over all ranks (the global batch size,
            # unless an algorithm cut the batch), so gradients are their mean whatever
            # the microbatch size and world size. DDP and FSDP average gradients over
            # ranks: hence the factor world_size.
            loss_scale = env.world_size / samples
            loss_sum = forward_backward(model, inputs, targets, loss_scale, cfg)

            # event: AFTER_BACKWARD

            if cfg.optimizer == "sgd":
                # Decoupled weight decay (Loshchilov & Hutter 2019), scaled by the
                # schedule as Composer's DecoupledSGDW: independent of the gradient.
                with torch.no_grad():
                    torch._foreach_mul_(decayed, 1 - cfg.weight_decay * lr / cfg.lr)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # The next batch, fetched while the device still works through this step:
            # before anything below waits for the device (a logged loss, an evaluation).
            if index + 1 < len(train_batches):
                upcoming = next(loader)
            # BatchNorm running statistics: once per step, from the whole global batch.
            update_running_stats(model, dist.reduce_sum)
            progress.advance(samples=cfg.global_batch_size, tokens=0)
            train_loss.add(loss_sum, samples)  # no device sync

            # event: BATCH_END

            monitor.update(progress)
            profiler.step(progress)  # records the --profile window, writes its traces
            finished = progress.reached()
            metrics = {}
            if progress.at_interval(cfg.eval_interval) or finished:
                # event: EVAL

                # Evaluation time does not count against the logged throughput.
                with monitor.paused():
                    metrics |= evaluate(model, val, cfg, env)
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
