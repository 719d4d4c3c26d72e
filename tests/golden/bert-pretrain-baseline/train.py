"""Train bert-pretrain-baseline: BERT masked-LM pretraining.

    python train.py                     # CPU or one GPU: Python's docs, WordPiece
    python train.py --model=bert-base --data=corpus.txt --max_duration=70000ba
    python train.py --config run.toml   # keys as in Config below; flags override it
    python train.py --help              # every key, its default and meaning

Recipe `bert-pretrain-baseline`; algorithms: none.
This loop is yours to edit. `# event: NAME` comments mark where scaffold's algorithms
for this task hook in; each algorithm's code is fenced by `# algorithm: NAME` ... `# end
algorithm: NAME`. `scaffold upgrade` merges newer template versions in and keeps your
edits.
"""

from __future__ import annotations


from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

from data import IGNORE, Batches, Masking, load_corpus, load_tokenizer, sequences
from data import train_tokenizer, val_batches
from model import PRESETS, Encoder, EncoderConfig, Preset
from runtime import checkpoint, config, dist, early_stop, microbatch, parallel, preempt
from runtime import profile, runlock, trackers
from runtime.monitor import Monitor, RunningSum
from runtime.time import Progress, Time, as_fraction, check_fraction


@dataclass
class Config:
    run_name: str = (
        "bert-pretrain-baseline"  # runs/<run_name>/; rerunning a name resumes it
    )
    seed: int = 42  # a run is a function of (config, seed)
    # data: "" Python's documentation topics; a .txt/.jsonl file, a folder, litdata
    data: str = ""
    # a folder or hub id; "": WordPiece trained on the data
    tokenizer: str = ""
    vocab_size: int = 4096  # the trained WordPiece tokenizer's vocabulary
    # embedding rows: the vocabulary rounded up to a multiple of this (1: none)
    vocab_multiple: int = 1
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    # model (no dropout by default: with it, ranks agree only in distribution)
    model: Preset = "tiny"  # size preset, see PRESETS in model.py
    seq_len: int = 128  # tokens per sequence, [CLS] and [SEP] included
    dropout: float = 0.0
    mask_rate: float = 0.15  # share of real tokens predicted
    eval_mask_rate: float = 0.15  # validation masks at BERT's rate, whatever mask_rate
    # optimization; Time strings: 10ep, 2000ba (steps), 4096sp, 1e6tok, 0.25dur
    max_duration: Time = Time.parse("300ba")  # training length
    global_batch_size: int = 32  # samples per step, summed over ranks
    # samples per forward/backward (gradient accumulation over the rank's batch)
    device_microbatch_size: int = 16
    lr: float = 0.002  # peak learning rate (AdamW)
    lr_warmup: Time = Time.parse("0.06dur")  # linear from 0, then linear decay
    min_lr_ratio: float = 0.02  # the decay ends at min_lr_ratio * lr
    weight_decay: float = 0.02  # decoupled, weight matrices only
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6

    # evaluation, logging, checkpoints
    eval_interval: Time = Time.parse("100ba")  # validation loss every ...
    eval_batches: int = 8  # validation batches per evaluation; 0: all
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
    save_interval: Time = Time.parse("100ba")  # and at the end
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
    activation_checkpointing: bool = False  # recompute layer activations in backward
    # torch.compile in place (keys unchanged): true each layer, model the whole model as
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
    for name in ("global_batch_size", "vocab_size", "vocab_multiple"):
        if getattr(cfg, name) < 1:
            config.fail(f"{name}={getattr(cfg, name)} must be at least 1")
    if cfg.seq_len < 3:
        config.fail(
            f"seq_len={cfg.seq_len}: needs [CLS], a token and [SEP]; use 3 or more"
        )
    if cfg.eval_batches < 0:
        config.fail(f"eval_batches={cfg.eval_batches} must be 0 (all) or more")
    config.check_ranges(cfg, mask_rate="(0, 1)", eval_mask_rate="(0, 1)")
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
    """Learning rate after `fraction` of training: linear warmup, then linear decay to
    min_lr_ratio * lr (Composer's linear_decay_with_warmup, MosaicBERT's schedule)."""
    warmup = as_fraction(cfg.lr_warmup, cfg.max_duration, batches_per_epoch)
    if fraction < warmup:
        return cfg.lr * fraction / warmup
    decayed = min(1.0, (fraction - warmup) / max(1.0 - warmup, 1e-9))
    return cfg.lr * (1.0 - (1.0 - cfg.min_lr_ratio) * decayed)


def microbatch_inputs(
    inputs: dict[str, torch.Tensor], size: int
) -> list[dict[str, torch.Tensor]]:
    """This rank's rows, `size` at a time, as the model takes them: the token ids and
    the flat (row-major) positions of the tokens to predict.
    The positions are found on the host, from data.py's marks, and copied without
    waiting (dist.to_device): found on the device (a boolean mask, nonzero) they would
    make the host wait for the device to say how many there are."""
    ids = inputs["input_ids"]
    return [
        {
            "input_ids": ids[start : start + size],
            "predict": positions(inputs["predicted"][start : start + size], ids.device),
        }
        for start in range(0, len(ids), size)
    ]


def positions(marked: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The flat positions of the True entries of `marked` (on the host), on `device`."""
    return dist.to_device(marked.flatten().nonzero()[:, 0], device)


def masked_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of the masked tokens (logits (masked tokens, vocab) and
    their token ids), in fp32. Compiled with the model (--compile), the upcast of bf16
    logits and the log-softmax fuse: the logits are never held in fp32."""
    return F.cross_entropy(logits.float(), targets, reduction="sum")


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list[torch.Tensor],  # (rows, 2, seq_len): inputs and targets
    cfg: Config,
    env: dist.DistEnv,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> dict[str, float]:
    """Masked-LM loss and accuracy over the masked tokens of the validation batches.

    Each rank scores its share of every batch; the sums are added over ranks. Every
    rank runs the same number of forwards (under FSDP each one all-gathers the
    weights): a share short of rows is padded with copies of a row, left out.
    """
    model.eval()
    shares = [dist.padded_share(batch, env) for batch in batches]  # (rows, real rows)
    # loss sum, correct predictions, masked tokens
    sums = torch.zeros(3, device=env.device, dtype=torch.float64)
    for share, real in shares:
        for start in range(0, real, cfg.device_microbatch_size):
            micro = share[start : min(start + cfg.device_microbatch_size, real)]
            inputs = {
                "input_ids": micro[:, 0].to(env.device),
                "predicted": micro[:, 1] != IGNORE,  # on the host, as in training
            }
            (micro_inputs,) = microbatch_inputs(inputs, len(micro))
            # Logits (masked tokens, vocab): at the masked tokens only.
            with autocast(cfg, env.device):
                logits = model(**micro_inputs)
            targets = micro[:, 1].to(env.device).flatten()[micro_inputs["predict"]]
            sums[0] += loss_fn(logits, targets)
            sums[1] += (logits.argmax(-1) == targets).sum()
            sums[2] += len(targets)
    model.train()
    loss_sum, correct, count = dist.reduce_sum(sums).tolist()
    return {
        "val_loss": loss_sum / max(count, 1),
        "mlm_accuracy": correct / max(count, 1),
    }


def autocast(cfg: Config, device: torch.device) -> torch.autocast:
    """Autocast: bf16 compute on fp32 weights when precision=amp_bf16, else a no-op."""
    return torch.autocast(device.type, torch.bfloat16, cfg.precision == "amp_bf16")


def forward_backward(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
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
        zip(microbatch_inputs(inputs, microbatch_size), targets.split(microbatch_size))
    )
    for i, (micro_inputs, micro_targets) in enumerate(microbatches):
        # event: MICROBATCH_START

        # Reduce gradients over ranks once, in the last backward.
        parallel.sync_gradients(model, i == len(microbatches) - 1)
        with autocast(cfg, targets.device):
            logits = model(**micro_inputs)

        loss = loss_fn(
            logits,  # (masked tokens, vocab): the only tokens predicted
            micro_targets.flatten()[micro_inputs["predict"]],
        )

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
    # A missing path, no text, a tokenizer without [MASK], too little data.
    with config.failing(OSError, ValueError):
        corpus = load_corpus(cfg.data)
        tokenizer_name = cfg.tokenizer
        if not tokenizer_name and env.is_main:  # once, by one rank (see data.py)
            train_tokenizer(corpus, cfg.vocab_size)
        dist.barrier()
        tokenizer = load_tokenizer(tokenizer_name, corpus, cfg.vocab_size)
        train_seqs, val_seqs = sequences(corpus, tokenizer, cfg.seq_len, cfg.seed)
        masking = Masking.of(tokenizer, cfg.mask_rate)
        train_batches = Batches(
            train_seqs, cfg.seq_len, cfg.global_batch_size, masking, cfg.seed
        )
        eval_masking = Masking.of(tokenizer, cfg.eval_mask_rate)
        val = val_batches(
            val_seqs,
            cfg.seq_len,
            cfg.global_batch_size,
            eval_masking,
            cfg.seed,
            cfg.eval_batches,
        )
    # Embedding rows: the vocabulary padded to a multiple of vocab_multiple (rows past
    # the tokenizer's are never input nor predicted: their logits only learn to fall).
    rows = -(-len(tokenizer) // cfg.vocab_multiple) * cfg.vocab_multiple
    model_config = EncoderConfig(
        vocab_size=rows,
        max_seq_len=cfg.seq_len,
        pad_id=tokenizer.pad_token_id,
        dropout=cfg.dropout,
        **PRESETS[cfg.model],
    )
    model = Encoder(model_config).to(env.device)
    num_params = sum(p.numel() for p in model.parameters())
    blocks = model.blocks  # FSDP's units, each also checkpointed and compiled alone

    # One live start per run (an OS lock that kill -9 frees), once all input is read.
    with config.failing(runlock.RunInUse):
        run_lock = runlock.acquire(run_dir)

    # event: MODEL

    # Training FLOPs per token, for MFU (GPUs only): see model.py.
    flops_per_token = model.flops_per_token(cfg.seq_len, cfg.mask_rate)
    # Shard or replicate for the launch: FSDP2 per layer then the root, DDP, or nothing.
    model = parallel.parallelize(model, blocks, env, plan)
    # The loss compiled with the model (--compile), as a graph of its own: the fp32
    # softmax over the vocabulary never holds the logits in fp32 (runtime/parallel.py).
    loss_fn = parallel.compile_loss(masked_token_loss, plan)

    # Decoupled weight decay (AdamW) on weight matrices and embeddings; biases and
    # LayerNorm gains have none.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
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

    # Resume: load_path, else this run's newest complete checkpoint, restores all of
    # `state` and the RNG, saved on any number of ranks. The batch order is a function
    # of progress (the global sample cursor): nothing is replayed.
    with config.failing(checkpoint.CheckpointError):  # names the file or the keys
        resumed = checkpointer.resume(state)  # load_path, autoresume: as cfg says
    # From where the run stands: config.toml, this script's copy, metrics and the bar.
    monitor.begin(progress, Path(__file__))
    if env.is_main:  # beside the run: the tokenizer a fine-tuning project needs
        tokenizer.save_pretrained(run_dir / "tokenizer")
    monitor.info(f"data: {corpus.source}")
    monitor.info(
        f"sequences: {len(train_seqs):,} train, {len(val_seqs):,} validation; "
        f"vocabulary {len(tokenizer):,} ({rows:,} embedding rows)"
    )
    monitor.info(f"model: {cfg.model}, {num_params:,} parameters")
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
            # Masked as a whole (the masks do not depend on the world size); which of
            # its tokens are real and which are predicted stays marked on the host.
            inputs = {
                "input_ids": batch.inputs,
                "predicted": batch.predicted,
            }
            targets = batch.targets

            fraction = progress.fraction()
            lr = lr_at(fraction, cfg, progress.batches_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # Gradient accumulation: each microbatch's summed loss over its masked
            # tokens is divided by the number of masked tokens in the global batch (all
            # ranks), so gradients are the global-batch mean whatever the microbatch
            # size and world size. DDP and FSDP average gradients over ranks: hence
            # the factor world_size.
            loss_scale = env.world_size / max(batch.num_masked, 1)
            loss_sum = forward_backward(
                model, inputs, targets, loss_scale, cfg, loss_fn
            )

            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # The next batch, fetched while the device still works through this step:
            # before anything below waits for the device (a logged loss, an evaluation).
            if index + 1 < train_batches.batches_per_epoch:
                upcoming = train_batches.get(epoch, index + 1, env.rank, env.world_size)
                upcoming = dist.to_device(upcoming, env.device)
            progress.advance(samples=cfg.global_batch_size, tokens=batch.num_tokens)
            train_loss.add(loss_sum, max(batch.num_masked, 1))  # no device sync

            monitor.update(progress)
            profiler.step(progress)  # records the --profile window, writes its traces
            finished = progress.reached()
            metrics = {}
            if progress.at_interval(cfg.eval_interval) or finished:

                # Evaluation time does not count against the logged throughput.
                with monitor.paused():
                    metrics |= evaluate(model, val, cfg, env, loss_fn)
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
    outcome = f"done: step {progress.batch}, {progress.token:,} tokens"
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
