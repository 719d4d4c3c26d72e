"""Train my-gpt: a GPT-2 language model (recipe `gpt2-baseline`).

    python train.py                     # CPU or one GPU, on the embedded default data
    python train.py --max_duration=2000ba --lr=1e-3 --data=corpus.txt
    python train.py --config run.toml   # keys as in Config below; flags override it
    python train.py --help              # every key, its default and meaning

Algorithms: gradient_clipping.
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

from data import Batches, load_tokens, val_batches
from model import GPT, PRESETS, GPTConfig, Preset
from runtime import checkpoint, config, dist, early_stop, fsdp, microbatch, profile
from runtime import trackers
from runtime.monitor import Monitor, RunningSum
from runtime.time import Progress, Time, as_fraction


@dataclass
class Config:
    run_name: str = "my-gpt"  # runs/<run_name>/; rerunning a name resumes it
    seed: int = 42  # a run is a function of (config, seed)
    data: str = ""  # "": stdlib source; or a text file, a folder, a .bin of uint16
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    # model (dropout is off as in modern pretraining; with it on, world sizes agree
    # only in distribution)
    model: Preset = "tiny"  # size preset, see PRESETS in model.py
    seq_len: int = 128  # tokens per training sequence
    dropout: float = 0.0
    # optimization; Time strings: 10ep, 2000ba (steps), 4096sp, 1e6tok, 0.25dur
    max_duration: Time = Time.parse("600ba")  # training length
    global_batch_size: int = 16  # samples per step, summed over ranks
    # samples per forward/backward, accumulated; auto: the largest that fits in memory
    device_microbatch_size: int | Literal["auto"] = 8
    max_device_microbatch_size: int = 0  # where auto starts; 0: the per-rank batch
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
    log_interval: Time = Time.parse("1ba")  # a metrics.jsonl line every ...
    trackers: str = ""  # also log to: tensorboard,mlflow,wandb
    # early stopping: when early_stop_metric (e.g. val_loss; "": never) has not improved
    # by more than early_stop_min_delta for early_stop_patience
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
    precision: Literal["fp32", "amp_bf16", "bf16"] = "fp32"  # bf16: FSDP policy
    activation_checkpointing: bool = False  # recompute block activations in backward
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
    )
    problem = fsdp.check(parallel, env) or microbatch.check(cfg.device_microbatch_size)
    problem = problem or trackers.check(cfg.trackers) or profile.check(cfg.profile)
    problem = problem or early_stop.check(
        cfg.early_stop_metric, cfg.early_stop_patience, cfg.early_stop_min_delta
    )
    if problem:
        config.fail(problem)
    for name in ("seq_len", "global_batch_size", "eval_batches"):
        if getattr(cfg, name) < 1:
            config.fail(f"{name}={getattr(cfg, name)} must be at least 1")
    if cfg.global_batch_size % env.world_size:
        config.fail(
            f"global_batch_size={cfg.global_batch_size} is not divisible by the world "
            f"size {env.world_size}; pick a multiple of {env.world_size}"
        )
    try:
        as_fraction(cfg.lr_warmup, cfg.max_duration)
    except ValueError as error:
        config.fail(f"lr_warmup: {error}")

    dist.init_process_group(env, timeout=timedelta(seconds=cfg.dist_timeout))
    return env, parallel


def lr_at(fraction: float, cfg: Config) -> float:
    """Learning rate after `fraction` of training: linear warmup, then cosine decay."""
    warmup = as_fraction(cfg.lr_warmup, cfg.max_duration)
    if fraction < warmup:
        return cfg.lr * fraction / warmup
    decayed = (fraction - warmup) / max(1.0 - warmup, 1e-9)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + 0.5 * (cfg.lr - min_lr) * (1.0 + math.cos(math.pi * decayed))


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list[torch.Tensor],
    cfg: Config,
    env: dist.DistEnv,
    microbatch_size: int,
) -> float:
    """Mean next-token loss over the validation batches, at the full sequence length.

    Each rank scores its share of every batch; the loss sums are added over ranks.
    """
    model.eval()
    loss_sum = torch.zeros((), device=env.device)
    for batch in batches:
        share = batch.tensor_split(env.world_size)[env.rank].to(env.device)
        for micro in share.split(microbatch_size):
            with torch.autocast(env.device.type, torch.bfloat16, enabled=is_amp(cfg)):
                logits = model(micro[:, :-1])
            loss_sum += F.cross_entropy(
                logits.flatten(0, 1).float(), micro[:, 1:].flatten(), reduction="sum"
            )
    model.train()
    num_tokens = sum(batch.shape[0] for batch in batches) * cfg.seq_len
    return dist.reduce_sum(loss_sum).item() / num_tokens


def is_amp(cfg: Config) -> bool:
    """Autocast: bf16 matmuls on fp32 weights (precision=amp_bf16)."""
    return cfg.precision == "amp_bf16"


def main() -> None:
    # event: INIT

    cfg = config.parse(Config)
    env, parallel = setup(cfg)  # one process, or one of torchrun's N
    torch.manual_seed(cfg.seed)  # the same on every rank: identical initial weights
    run_dir = Path("runs") / cfg.run_name
    try:
        tokens = load_tokens(cfg.data)
        train_batches = Batches(
            tokens.train, cfg.seq_len, cfg.global_batch_size, cfg.seed
        )
        val = val_batches(
            tokens.val, cfg.seq_len, cfg.global_batch_size, cfg.eval_batches
        )
    except (OSError, ValueError) as error:  # a missing path, too little data
        config.fail(str(error))

    model_config = GPTConfig(
        vocab_size=tokens.vocab_size,
        max_seq_len=cfg.seq_len,
        dropout=cfg.dropout,
        **PRESETS[cfg.model],
    )
    model = GPT(model_config).to(env.device)
    num_params = model.num_params()

    # event: MODEL

    # Shard or replicate for the launch: FSDP2 per block then the root, DDP, or nothing.
    model = fsdp.parallelize(model, model.blocks, env, parallel)

    # event: OPTIMIZER

    # Decay weight matrices and embeddings; biases and LayerNorm gains stay undecayed.
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {
                "params": [p for p in params if p.dim() >= 2],
                "weight_decay": cfg.weight_decay,
            },
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
    )

    # Resume: load_path, else this run's newest complete checkpoint, restores model,
    # optimizer, progress and RNG, saved on any number of ranks. The batch order is a
    # function of progress (the global sample cursor): nothing is replayed.
    progress = Progress(batches_per_epoch=train_batches.batches_per_epoch)
    save_folder = Path(cfg.save_folder or run_dir / "checkpoints")
    try:
        resumed = checkpoint.resume(
            save_folder,
            model,
            optimizer,
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
    flops_per_token = fsdp.unwrap(model).flops_per_token(cfg.seq_len)  # see model.py
    monitor.measure(env.device, env.world_size, cfg.precision, flops_per_token)
    monitor.open_trackers(cfg.trackers, config.to_toml(cfg))  # rank 0 writes them
    monitor.info(f"data: {tokens.source}")
    monitor.info(f"tokens: {len(tokens.train):,} train, {len(tokens.val):,} validation")
    monitor.info(f"model: {cfg.model}, {num_params:,} parameters")
    monitor.info(f"parallelism: {parallel.parallelism}, {env.world_size} process(es)")
    for line in resumed.describe() if resumed else []:
        monitor.info(line)
    # The microbatch size: fixed, or auto (the largest that fits, found by halving on
    # out-of-memory; a resumed run reuses the size it found before).
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

    # event: FIT_START

    while not progress.reached(cfg.max_duration) and not stopper.stopped:
        # event: EPOCH_START

        epoch = progress.epoch
        for index in range(progress.batch_in_epoch, train_batches.batches_per_epoch):
            # This rank's share of global batch `index` in the epoch's seeded order.
            batch = train_batches.get(epoch, index, env.rank, env.world_size)
            batch = batch.to(env.device, non_blocking=True)

            # event: BATCH_START

            inputs, targets = batch[:, :-1], batch[:, 1:]
            lr = lr_at(progress.fraction(cfg.max_duration), cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr

            # Gradient accumulation: each microbatch's summed token loss is divided by
            # the number of target tokens in the global batch (all ranks), so gradients
            # are the global-batch mean whatever the microbatch size and world size.
            # DDP and FSDP average gradients over ranks: hence the factor world_size.
            num_tokens = cfg.global_batch_size * targets.shape[1]
            loss_scale = env.world_size / num_tokens
            # Out of memory on any rank (while the size is still being searched): every
            # rank drops this attempt's gradients and retries the same batch at half the
            # microbatch size. Fixed or already found: a single attempt, nothing added.
            for attempt in microbatching.attempts(seq_len=inputs.shape[1]):
                with attempt:
                    loss_sum = torch.zeros((), device=env.device)
                    microbatches = list(
                        zip(inputs.split(attempt.size), targets.split(attempt.size))
                    )
                    for i, (micro_inputs, micro_targets) in enumerate(microbatches):
                        # event: MICROBATCH_START

                        # Reduce gradients over ranks once, in the last backward.
                        fsdp.sync_gradients(model, i == len(microbatches) - 1)
                        with torch.autocast(
                            env.device.type, torch.bfloat16, enabled=is_amp(cfg)
                        ):
                            logits = model(micro_inputs)

                        # event: AFTER_FORWARD

                        loss = F.cross_entropy(
                            logits.flatten(0, 1).float(),
                            micro_targets.flatten(),
                            reduction="sum",
                        )

                        # event: LOSS

                        (loss * loss_scale).backward()
                        loss_sum += loss.detach()

            # event: AFTER_BACKWARD

            # algorithm: gradient_clipping
            # Rescale all gradients together when their global L2 norm exceeds the
            # limit, so one bad batch cannot throw the weights far (logged: grad_norm).
            # fsdp.clip_grad_norm_ also handles gradients sharded by FSDP.
            grad_norm = fsdp.clip_grad_norm_(
                model.parameters(), cfg.gradient_clipping_max_norm
            )
            # end algorithm: gradient_clipping

            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            progress.advance(samples=cfg.global_batch_size, tokens=num_tokens)
            train_loss.add(loss_sum, num_tokens)  # no device sync

            # event: BATCH_END

            monitor.update(progress)
            profiler.step(progress)  # records the --profile window, writes its traces
            finished = progress.reached(cfg.max_duration)
            metrics = {}
            if progress.at_interval(cfg.eval_interval, cfg.max_duration) or finished:
                # event: EVAL

                # Evaluation time does not count against the logged throughput.
                with monitor.paused():
                    metrics["val_loss"] = evaluate(model, val, cfg, env, attempt.size)
            if metrics or progress.at_interval(cfg.log_interval, cfg.max_duration):
                metrics["loss"] = train_loss.pop()  # mean since the last log, all ranks
                metrics["lr"] = lr
                metrics["microbatch_size"] = attempt.size

                # algorithm: gradient_clipping
                metrics["grad_norm"] = grad_norm.item()
                # end algorithm: gradient_clipping

                monitor.log(progress, **metrics)
            finished = stopper.update(progress, metrics, cfg.max_duration) or finished
            if progress.at_interval(cfg.save_interval, cfg.max_duration) or finished:
                with monitor.paused():
                    checkpoint.save(
                        save_folder,
                        model,
                        optimizer,
                        progress,
                        extra=microbatching.state_dict() | stopper.state_dict(),
                        keep=cfg.save_num_checkpoints_to_keep,
                        async_save=cfg.save_async,
                    )
            if finished:
                break

        # event: EPOCH_END

    # event: FIT_END

    checkpoint.wait()  # an async save in flight: finished and marked complete
    monitor.info(
        f"done: step {progress.batch}, {progress.token:,} tokens; outputs in {run_dir}"
    )
    monitor.close()


if __name__ == "__main__":
    try:
        main()
    finally:
        dist.shutdown()  # leave the process group, also after an error
