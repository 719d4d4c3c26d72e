"""Train gpt2-baseline-tp: a GPT-2 language model.

    python train.py                     # CPU or one GPU, on the embedded default data
    python train.py --max_duration=2000ba --lr=1e-3 --data=corpus.txt
    python train.py --config run.toml   # keys as in Config below; flags override it
    python train.py --help              # every key, its default and meaning

Recipe `gpt2-baseline`; algorithms: gradient_clipping.
This loop is yours to edit. `# event: NAME` comments mark where scaffold's algorithms
for this task hook in; each algorithm's code is fenced by `# algorithm: NAME` ... `# end
algorithm: NAME`. `scaffold upgrade` merges newer template versions in and keeps your
edits.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

import data
import sample
from model import build_model, depth_dial
from model import tensor_parallel_plan, tensor_parallel_problem
from runtime import checkpoint, config, dist, early_stop, microbatch, parallel, preempt
from runtime import profile, runlock, trackers
from runtime.monitor import Monitor, RunningSum
from runtime.time import Progress, Time, as_fraction, check_fraction


@dataclass
class Config:
    run_name: str = "gpt2-baseline-tp"  # runs/<run_name>/; rerunning a name resumes it
    seed: int = 42  # a run is a function of (config, seed)
    data: str = ""  # "": stdlib source; a text file, a folder, uint16 .bin, shards
    vocab_size: int = 0  # 0: from the data (bytes 256; .bin: meta.pkl, else GPT-2's)
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    # model (no dropout, as in modern pretraining: with it, ranks agree in distribution)
    model: str = "tiny"  # a size preset (PRESETS in model.py) or dN: N layers
    depth: int = 0  # >0: model dN, batch and lr rescaled (model.py, depth_dial)
    seq_len: int = 128  # tokens per training sequence
    dropout: float = 0.0
    # GPT-2 weights to start from: GPT2LMHeadModel folder or hub id (not on resume)
    init_from: str = ""
    # optimization; Time strings: 10ep, 2000ba (steps), 4096sp, 1e6tok, 0.25dur
    max_duration: Time = Time.parse("600ba")  # training length
    global_batch_size: int = 16  # samples per step, summed over ranks
    # samples per forward/backward (gradient accumulation over the rank's batch)
    device_microbatch_size: int = 8
    lr: float = 0.002  # peak learning rate (AdamW)
    lr_warmup: Time = Time.parse("0.05dur")  # linear from 0, then cosine decay
    min_lr_ratio: float = 0.1  # the cosine ends at min_lr_ratio * lr
    weight_decay: float = 0.1  # on weight matrices and embeddings
    beta1: float = 0.9
    beta2: float = 0.95

    # algorithm: gradient_clipping
    gradient_clipping_max_norm: float = 1.0  # max global L2 norm
    # end algorithm: gradient_clipping

    # evaluation, logging, checkpoints
    eval_interval: Time = Time.parse("100ba")  # validation loss every ...
    eval_batches: int = 8  # validation batches per evaluation
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
    save_interval: Time = Time.parse("200ba")  # and at the end
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
    tensor_parallel: int = 1  # ranks that split each block's layers (model.py's plan)
    # auto: amp_bf16 (autocast) on CUDA, fp32 on the CPU; bf16: FSDP's policy
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
    problem = problem or data.check(cfg)  # sequence and batch sizes
    problem = problem or early_stop.check_settings(cfg)
    if problem:
        config.fail(problem)
    config.check_ranges(cfg, vocab_size="[0, inf)", depth="[0, inf)")  # 0: data, preset
    with config.failing(ValueError):  # --depth=N: model dN, batch and lr rescaled
        cfg.model, cfg.global_batch_size, cfg.lr = depth_dial(cfg)  # (model.py)
    # Each tensor-parallel group reads one share of the batch: one data-parallel rank.
    data_ranks = env.world_size // plan.tensor_parallel
    if problem := dist.check_batch(cfg.global_batch_size, data_ranks):
        config.fail(problem)
    with config.failing(ValueError, prefix="lr_warmup: "):
        check_fraction(cfg.lr_warmup, cfg.max_duration)

    # algorithm: gradient_clipping
    config.check_ranges(cfg, gradient_clipping_max_norm="(0, inf)")
    # end algorithm: gradient_clipping

    # FSDP and DDP need a process group, on one process too (a group of one rank).
    timeout = timedelta(seconds=cfg.dist_timeout)
    dist.init_process_group(env, timeout, required=plan.parallelism != "none")
    dist.use_tf32(env.device)  # CUDA: TF32 tensor cores for fp32 matmuls, convolutions
    # Tensor parallel: the (data, tensor) mesh; the loop sees data-parallel ranks.
    return parallel.data_parallel(env, plan), plan


def lr_at(fraction: float, cfg: Config, batches_per_epoch: int) -> float:
    """Learning rate after `fraction` of training: linear warmup, then cosine decay."""
    warmup = as_fraction(cfg.lr_warmup, cfg.max_duration, batches_per_epoch)
    if fraction < warmup:
        return cfg.lr * fraction / warmup
    decayed = (fraction - warmup) / max(1.0 - warmup, 1e-9)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * decayed))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of each position's next token, in fp32. Compiled with
    the model (--compile), the upcast of bf16 logits and the log-softmax fuse: the
    vocabulary-sized logits are never held in fp32."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"
    )


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list[torch.Tensor],
    cfg: Config,
    env: dist.DistEnv,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> dict[str, float]:
    """val_loss: the mean next-token loss over the validation batches, at the full
    sequence length.

    Each rank scores its share of every batch; the loss sums are added over ranks.
    Every rank runs the same number of forwards (under FSDP each one all-gathers the
    weights): a share short of rows is padded with copies of a row, left out of the sum.
    """
    model.eval()
    shares = [dist.padded_share(batch, env) for batch in batches]  # (rows, real rows)
    loss_sum = torch.zeros((), device=env.device)
    for share, real in shares:
        for start in range(0, len(share), cfg.device_microbatch_size):
            micro = share[start : start + cfg.device_microbatch_size].to(env.device)
            with autocast(cfg, env.device):
                logits = model(micro[:, :-1])
            # Padding rows come last: count the first real - start rows only.
            keep = max(real - start, 0)
            loss_sum += loss_fn(logits[:keep], micro[:keep, 1:])
    model.train()
    num_tokens = sum(batch.shape[0] for batch in batches) * cfg.seq_len
    return {"val_loss": dist.reduce_sum(loss_sum, env.group).item() / num_tokens}


def autocast(cfg: Config, device: torch.device) -> torch.autocast:
    """Autocast: bf16 compute on fp32 weights when precision=amp_bf16, else a no-op."""
    return torch.autocast(device.type, torch.bfloat16, cfg.precision == "amp_bf16")


def forward_backward(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    loss_scale: float,
    cfg: Config,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Forward and backward over this rank's batch in microbatches of
    cfg.device_microbatch_size rows, gradients adding up in .grad (reduced over ranks in
    the last backward)."""
    microbatch_size = cfg.device_microbatch_size
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

        loss = loss_fn(logits, micro_targets)

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
    with config.failing(OSError, ValueError):  # a missing path, too little data
        tokens, train_batches, val = data.load_splits(cfg, env)
    # init_from: GPT-2's weights, read and checked (sizes, vocabulary, positions) before
    # anything is written; a run that resumes takes its weights from its checkpoint.
    resumes = checkpoint.will_resume(checkpoints, cfg.load_path, cfg.autoresume)
    with config.failing(ValueError):  # init_from's weights do not fit: one line
        model = build_model(cfg, tokens.vocab_size, env.device, init=not resumes)
    num_params = model.num_params()
    if problem := tensor_parallel_problem(model, cfg.tensor_parallel):
        config.fail(problem)  # sizes the plan cannot split, an algorithm without a plan
    blocks = model.blocks  # FSDP's units, each also checkpointed and compiled alone

    # One live start per run (an OS lock that kill -9 frees), once all input is read.
    with config.failing(runlock.RunInUse):
        run_lock = runlock.acquire(run_dir)

    # event: MODEL

    # Training FLOPs per token, for MFU (GPUs only): see model.py.
    flops_per_token = model.flops_per_token(cfg.seq_len)
    # Shard or replicate for the launch: FSDP2 per block then the root, DDP, or nothing.
    # Tensor parallel first: model.py's plan on mesh "tp" (none at tensor_parallel=1).
    tensor_plan = tensor_parallel_plan(model)
    model = parallel.parallelize(model, blocks, env, plan, tensor_plan=tensor_plan)
    # The loss compiled with the model (--compile), as a graph of its own: the fp32
    # softmax over the vocabulary never holds the logits in fp32 (runtime/parallel.py).
    loss_fn = parallel.compile_loss(next_token_loss, plan)

    # Decay weight matrices and embeddings; biases and LayerNorm gains stay undecayed.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        weight_decay=cfg.weight_decay,
        # One fused kernel for the whole update instead of several per tensor, on
        # the CPU too (the offloaded step: per tensor).
        fused=not cfg.cpu_offload,
    )
    # The log, metrics.jsonl, progress bar and trackers (rank 0 writes them).
    monitor = Monitor.from_config(run_dir, cfg, env, flops_per_token=flops_per_token)
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
    monitor.info(f"data: {tokens.source}; {tokens.sizes()}")
    monitor.info(f"model: {cfg.model}, {num_params:,} parameters")
    if cfg.init_from:  # Hugging Face GPT-2 weights, read unless the run resumes
        monitor.info(f"init_from={cfg.init_from}: {'not read' if resumes else 'read'}")
    tp = f"tensor_parallel={plan.tensor_parallel}"
    monitor.info(f"parallelism: {plan.parallelism}, {tp}, {env.devices} process(es)")
    for line in resumed.describe() if resumed else []:
        monitor.info(line)

    train_loss = RunningSum(env.device, env.group)  # summed once per data-parallel rank
    profiler = profile.Profiler.from_config(cfg, run_dir, env, monitor.info)
    # SIGUSR1 (SLURM's notice), SIGTERM or torchrun gone: finish the step, save, stop.
    preemption = preempt.Preemption()

    # event: FIT_START

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

            inputs, targets = batch[:, :-1], batch[:, 1:]
            fraction = progress.fraction()
            lr = lr_at(fraction, cfg, progress.batches_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # Gradient accumulation: each microbatch's summed token loss is divided by
            # the number of target tokens in the global batch (all ranks), so gradients
            # are the global-batch mean whatever the microbatch size and world size.
            # DDP and FSDP average gradients over ranks: hence the factor world_size.
            num_tokens = env.world_size * targets.numel()  # ranks' shares are equal
            loss_scale = env.world_size / num_tokens
            # The loss over vocabulary-split logits and its backward (tensor parallel).
            with parallel.loss_parallel(plan):
                loss_sum = forward_backward(
                    model, inputs, targets, loss_scale, cfg, loss_fn
                )

            # event: AFTER_BACKWARD

            # algorithm: gradient_clipping
            # Rescale all gradients together when their global L2 norm exceeds the
            # limit, so one bad batch cannot throw the weights far (logged: grad_norm).
            # parallel.clip_grad_norm_ also handles gradients sharded by FSDP.
            grad_norm = parallel.clip_grad_norm_(
                model.parameters(), cfg.gradient_clipping_max_norm
            )
            # end algorithm: gradient_clipping

            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # The next batch, fetched while the device still works through this step:
            # before anything below waits for the device (a logged loss, an evaluation).
            if index + 1 < train_batches.batches_per_epoch:
                upcoming = train_batches.get(epoch, index + 1, env.rank, env.world_size)
                upcoming = dist.to_device(upcoming, env.device)
            progress.advance(samples=cfg.global_batch_size, tokens=num_tokens)
            train_loss.add(loss_sum, num_tokens)  # no device sync

            # event: BATCH_END

            monitor.update(progress)
            profiler.step(progress)  # records the --profile window, writes its traces
            finished = progress.reached()
            metrics = {}
            if progress.at_interval(cfg.eval_interval) or finished:
                # event: EVAL

                # Evaluation time does not count against the logged throughput.
                with monitor.paused(), parallel.loss_parallel(plan):
                    metrics |= evaluate(model, val, cfg, env, loss_fn)
            if metrics or progress.at_interval(cfg.log_interval):
                metrics["loss"] = train_loss.pop()  # mean since the last log, all ranks
                metrics["lr"] = lr

                # algorithm: gradient_clipping
                metrics["grad_norm"] = grad_norm.item()
                # end algorithm: gradient_clipping

                monitor.log(progress, **metrics)
            finished = stopper.update(progress, metrics) or finished
            finished = preemption.agreed() or finished  # any rank's signal: all stop
            if progress.at_interval(cfg.save_interval) or finished:
                with monitor.paused():
                    checkpointer.save(state)
            if finished:
                break

    checkpointer.close()  # an async save in flight: finished and marked complete
    outcome = f"done: step {progress.batch}, {progress.token:,} tokens"
    if preemption.stopped_by:  # exit status 0; under SLURM the job is requeued
        outcome = (
            f"stopped by {preemption.stopped_by} after step {progress.batch}, saved"
        )
    if env.devices == 1 and not preemption.stopped_by:  # what it learned
        monitor.info(sample.preview(parallel.unwrap(model), cfg))
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
