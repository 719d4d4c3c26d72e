"""Train gpt2-modern: a GPT-2 language model.

    python train.py                     # CPU or one GPU, on the embedded default data
    python train.py --max_duration=2000ba --lr=1e-3 --data=corpus.txt
    python train.py --config run.toml   # keys as in Config below; flags override it
    python train.py --help              # every key, its default and meaning

Recipe `gpt2-modern`; algorithms: logit_softcap, muon, qk_norm, relu_squared, rotary,
gradient_clipping, zero_init.
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
from runtime import checkpoint, config, dist, early_stop, microbatch, parallel, preempt
from runtime import profile, runlock, trackers
from runtime.monitor import Monitor, RunningSum
from runtime.time import Progress, Time, as_fraction, check_fraction

# algorithm: muon
from runtime import muon

# end algorithm: muon


@dataclass
class Config:
    run_name: str = "gpt2-modern"  # runs/<run_name>/; rerunning a name resumes it
    seed: int = 42  # a run is a function of (config, seed)
    data: str = ""  # "": stdlib source; a text file, a folder, uint16 .bin, shards
    vocab_size: int = 0  # 0: from the data (bytes 256; .bin: meta.pkl, else GPT-2's)
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    # model (no dropout, as in modern pretraining: with it, ranks agree in distribution)
    model: str = "tiny"  # a size preset (PRESETS in model.py) or dN: N layers
    depth: int = 0  # >0: model dN, batch and lr rescaled (model.py, depth_dial)
    seq_len: int = 128  # tokens per training sequence
    dropout: float = 0.0
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

    # algorithm: muon
    muon_lr: float = 0.02  # Muon's peak lr (blocks' weight matrices)
    muon_momentum: float = 0.95  # after the momentum warmup
    muon_momentum_warmup: Time = Time.parse("0.1dur")  # from 0.85
    muon_weight_decay: float = 0.0
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    # polar_express: per-step coefficients, nearer orthogonal (modded-nanogpt record 38)
    muon_orthogonalizer: Literal["newton_schulz", "polar_express"] = "newton_schulz"
    # decay only the entries whose update has the weight's sign (record 43)
    muon_cautious_weight_decay: bool = False
    # NorMuon: each neuron's step divided by its running RMS, norm kept (record 41)
    muon_normuon: bool = False
    muon_beta2: float = 0.9  # NorMuon's second-moment decay
    # end algorithm: muon

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
    if problem := dist.check_batch(cfg.global_batch_size, env.world_size):
        config.fail(problem)
    with config.failing(ValueError, prefix="lr_warmup: "):
        check_fraction(cfg.lr_warmup, cfg.max_duration)

    # algorithm: muon
    config.check_ranges(
        cfg, muon_momentum="[0, 1)", muon_ns_steps="[1, inf)", muon_beta2="[0, 1)"
    )
    with config.failing(ValueError, prefix="muon_momentum_warmup: "):
        check_fraction(cfg.muon_momentum_warmup, cfg.max_duration)
    if cfg.lr <= 0:
        # Muon's learning rate is lr's schedule rescaled to peak at muon_lr.
        config.fail(
            f"lr={cfg.lr} must be above 0: muon's rate is lr's schedule, rescaled"
        )
    # end algorithm: muon

    # algorithm: gradient_clipping
    config.check_ranges(cfg, gradient_clipping_max_norm="(0, inf)")
    # end algorithm: gradient_clipping

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


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of each position's next token, in fp32. Compiled with
    the model (--compile), the upcast of bf16 logits and the log-softmax fuse: the
    vocabulary-sized logits are never held in fp32."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), targets.flatten(), reduction="sum"
    )


# algorithm: muon
def newton_schulz(update: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """About U V^T for update = U S V^T (its nearest semi-orthogonal matrix).

    Scaled to Frobenius norm 1 (every singular value <= 1), X is iterated as
    X <- a X + (b A + c A^2) X with A = X X^T: a quintic in the singular values whose
    coefficients push small ones up fast, leaving all in about [0.7, 1.2], which trains
    as well as the exact U V^T (Jordan et al. 2024; torch.optim.Muon's defaults).
    In bf16 on a GPU, as the speedrun and torch.optim.Muon do; in fp32 on a CPU, where
    bf16 matrix products without native support run ~30x slower (measured).
    """
    a, b, c = 3.4445, -4.775, 2.0315
    x = update.bfloat16() if update.is_cuda else update.float()
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the wide side: A is the smaller Gram matrix
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


# Polar Express's (a, b, c) per step, from modded-nanogpt's train_gpt.py.
POLAR_EXPRESS = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def polar_express(update: torch.Tensor) -> torch.Tensor:
    """About U V^T for update = U S V^T, by Polar Express (Amsel et al. 2025).

    Like the Newton-Schulz quintic, X <- a X + (b A + c A^2) X with A = X X^T, but each
    of 5 steps has its own (a, b, c), chosen so the worst singular value is as close to
    1 as a quintic can bring it (modded-nanogpt record 38 and train_gpt.py: num_iters=5,
    safety_factor=2e-2, cushion=2). X starts at spectral norm < 1: Frobenius / 1.02.
    """
    x = update.bfloat16() if update.is_cuda else update.float()
    tall = x.shape[0] > x.shape[1]
    if tall:  # iterate on the wide side: A is the smaller Gram matrix
        x = x.T
    x = x / (x.norm() * (1 + 2e-2) + 1e-6)
    for a, b, c in POLAR_EXPRESS:
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def muon_orthogonalize(update: torch.Tensor, cfg: Config) -> torch.Tensor:
    """Muon's orthogonalisation of one update: the one muon_orthogonalizer names."""
    if cfg.muon_orthogonalizer == "polar_express":
        return polar_express(update)
    return newton_schulz(update, cfg.muon_ns_steps)


def muon_split(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(Muon's parameters, AdamW's): the blocks' 2-D weight matrices, and the rest.

    Embedding rows are looked up rather than multiplied, and the head maps to the
    vocabulary: both, with biases and norm gains, stay on AdamW (as in the speedrun).
    """
    hidden = [p for p in parallel.unwrap(model).blocks.parameters() if p.dim() == 2]
    taken = {id(p) for p in hidden}
    return hidden, [p for p in model.parameters() if id(p) not in taken]


def muon_momentum_at(fraction: float, cfg: Config, batches_per_epoch: int) -> float:
    """Muon's momentum after `fraction` of training: 0.85 rising to muon_momentum."""
    warmup = as_fraction(cfg.muon_momentum_warmup, cfg.max_duration, batches_per_epoch)
    done = min(1.0, fraction / warmup) if warmup > 0 else 1.0
    return 0.85 + (cfg.muon_momentum - 0.85) * done


def muon_and_adamw(model: torch.nn.Module, cfg: Config) -> tuple[muon.Muon, muon.Chain]:
    """Muon for the blocks' weight matrices (muon_split) and AdamW for the rest (with
    the task's settings), and the optimizer that steps both: (Muon, both)."""
    hidden, rest = muon_split(model)
    muon_optimizer = muon.Muon(
        hidden,
        lambda update: muon_orthogonalize(update, cfg),
        lr=cfg.muon_lr,
        weight_decay=cfg.muon_weight_decay,
        momentum=cfg.muon_momentum,
        cautious=cfg.muon_cautious_weight_decay,
        beta2=cfg.muon_beta2 if cfg.muon_normuon else None,
    )
    adamw = torch.optim.AdamW(
        [
            {
                "params": [p for p in rest if p.dim() >= 2],
                "weight_decay": cfg.weight_decay,
            },
            {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        fused=not cfg.cpu_offload,  # one kernel for the update, as the task's AdamW
    )
    return muon_optimizer, muon.Chain(muon_optimizer, adamw)  # checkpointed together


# end algorithm: muon


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
    return {"val_loss": dist.reduce_sum(loss_sum).item() / num_tokens}


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
    model = build_model(cfg, tokens.vocab_size, env.device)
    num_params = model.num_params()
    blocks = model.blocks  # FSDP's units, each also checkpointed and compiled alone

    # One live start per run (an OS lock that kill -9 frees), once all input is read.
    with config.failing(runlock.RunInUse):
        run_lock = runlock.acquire(run_dir)

    # event: MODEL

    # Training FLOPs per token, for MFU (GPUs only): see model.py.
    flops_per_token = model.flops_per_token(cfg.seq_len)
    # Shard or replicate for the launch: FSDP2 per block then the root, DDP, or nothing.
    model = parallel.parallelize(model, blocks, env, plan)
    # The loss compiled with the model (--compile), as a graph of its own: the fp32
    # softmax over the vocabulary never holds the logits in fp32 (runtime/parallel.py).
    loss_fn = parallel.compile_loss(next_token_loss, plan)

    # algorithm: muon
    # Muon (Jordan et al. 2024) for the blocks' weight matrices: Nesterov momentum,
    # orthogonalised (muon_orthogonalize), so every direction of a matrix moves at the
    # same rate; NorMuon (muon_normuon) then evens out the neurons' step sizes. Under
    # FSDP2, runtime.muon orthogonalises each matrix once, on one rank, instead of on
    # every rank. AdamW keeps embeddings, head, biases, gains.
    muon_optimizer, optimizer = muon_and_adamw(model, cfg)  # Chain: steps both
    # end algorithm: muon

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
            loss_sum = forward_backward(
                model, inputs, targets, loss_scale, cfg, loss_fn
            )

            # event: AFTER_BACKWARD

            # algorithm: muon
            # Muon's matrices follow the same schedule from their own peak,
            # muon_lr; their momentum warms up from 0.85 (as in the speedrun).
            for group in muon_optimizer.param_groups:
                group["lr"] = lr * cfg.muon_lr / cfg.lr
                group["momentum"] = muon_momentum_at(
                    progress.fraction(), cfg, progress.batches_per_epoch
                )
            # end algorithm: muon

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
                with monitor.paused():
                    metrics |= evaluate(model, val, cfg, env, loss_fn)
            if metrics or progress.at_interval(cfg.log_interval):
                metrics["loss"] = train_loss.pop()  # mean since the last log, all ranks
                metrics["lr"] = lr

                # algorithm: muon
                metrics["muon_momentum"] = muon_optimizer.param_groups[0]["momentum"]
                # end algorithm: muon

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
    if env.world_size == 1 and not preemption.stopped_by:  # what it learned
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
