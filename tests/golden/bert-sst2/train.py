"""Train bert-sst2: fine-tune a Hugging Face text classifier.

    python train.py                     # CPU or one GPU: tiny BERT, embedded data
    python train.py --model=bert-base-uncased --data=sst2.csv
    python train.py --config run.toml   # keys as in Config below; flags override it
    python train.py --help              # every key, its default and meaning

Recipe `bert-sst2`; algorithms: none.
This loop is yours to edit. `# event: NAME` comments mark where scaffold's algorithms
for this task hook in; each algorithm's code is fenced by `# algorithm: NAME` ... `# end
algorithm: NAME`. `scaffold upgrade` merges newer template versions in and keeps your
edits.
"""

from __future__ import annotations


from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from data import Batches, load_texts, tokenize, val_batches
from model import load_model, load_tokenizer, padding_mask, transformer_blocks
from runtime import checkpoint, config, dist, early_stop, microbatch, parallel, preempt
from runtime import profile, runlock, trackers
from runtime.monitor import Monitor, RunningSum, training_flops
from runtime.time import Progress, Time, as_fraction, check_fraction


@dataclass
class Config:
    run_name: str = "bert-sst2"  # runs/<run_name>/; rerunning a name resumes it
    seed: int = 42  # a run is a function of (config, seed)
    # data: "" the embedded default; a .csv, .jsonl or .parquet file; a datasets folder;
    # MDS shards (a folder or URL with train/ and val/)
    data: str = ""
    val_data: str = ""  # validation file; "": a seeded 10% of --data
    text_column: str = ""  # "": `text`, else `sentence`
    label_column: str = "label"
    num_labels: int = 0  # 0: from the labels in the data
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    # model: tiny (offline: a small random BERT), a hub id, or a save_pretrained folder
    model: str = "tiny"
    max_seq_len: int = 128  # longer texts are truncated
    # optimization; Time strings: 3ep, 2000ba (steps), 4096sp, 1e6tok, 0.25dur
    max_duration: Time = Time.parse("3ep")  # training length
    global_batch_size: int = 32  # samples per step, summed over ranks
    # samples per forward/backward (gradient accumulation over the rank's batch)
    device_microbatch_size: int = 16
    # peak learning rate (AdamW); auto: 2e-05 (the recipe's, for fine-tuning a
    # pretrained model), or demo_lr for model=tiny
    lr: float | Literal["auto"] = "auto"
    # The offline demo (model=tiny) is a random init trained from scratch: fine-tuning's
    # small rate barely moves it in 3 epochs, so lr=auto uses this one.
    demo_lr: float = 1e-3
    lr_warmup: Time = Time.parse("0.06dur")  # linear from 0, then linear to 0
    weight_decay: float = 0.01  # decoupled (AdamW), weight matrices only
    beta1: float = 0.9
    beta2: float = 0.98

    # evaluation, logging, checkpoints
    eval_interval: Time = Time.parse("1ep")  # validation metrics every ...
    eval_batches: int = 0  # validation batches per evaluation; 0: the whole set
    log_interval: Time = Time.parse("1ba")  # a metrics.jsonl record every ...
    console_interval: Time = Time.parse("0.05dur")  # printed (no terminal) every ...
    trackers: str = ""  # also log to: tensorboard,mlflow,wandb
    # early stopping: when early_stop_metric (e.g. accuracy, with mode max; "": never)
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
    if cfg.lr == "auto":  # the recipe's rate; the offline demo's for model=tiny
        cfg.lr = cfg.demo_lr if cfg.model == "tiny" else 2e-05
    problem = parallel.check(plan, env)
    problem = problem or microbatch.check(cfg.device_microbatch_size)
    problem = problem or trackers.check(cfg.trackers) or profile.check(cfg.profile)
    problem = problem or checkpoint.check_access(cfg.save_folder, cfg.load_path)
    problem = problem or early_stop.check_settings(cfg)
    if problem:
        config.fail(problem)
    for name in ("max_seq_len", "global_batch_size"):
        if getattr(cfg, name) < 1:
            config.fail(f"{name}={getattr(cfg, name)} must be at least 1")
    if cfg.eval_batches < 0:
        config.fail(f"eval_batches={cfg.eval_batches} must be 0 (all) or more")
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
    """Learning rate after `fraction` of training: linear warmup, linear decay to 0."""
    warmup = as_fraction(cfg.lr_warmup, cfg.max_duration, batches_per_epoch)
    if fraction < warmup:
        return cfg.lr * fraction / warmup
    return cfg.lr * max(0.0, 1.0 - fraction) / max(1.0 - warmup, 1e-9)


def save_pretrained(
    model: torch.nn.Module, tokenizer, folder: Path, env: dist.DistEnv
) -> None:
    """Model + tokenizer: a folder that AutoModelForSequenceClassification loads.

    Under FSDP every rank holds a shard: the full weights are gathered to rank 0's CPU.
    """
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)  # a collective: every rank
    if env.is_main:
        parallel.unwrap(model).save_pretrained(folder, state_dict=weights)
        tokenizer.save_pretrained(folder)
    dist.barrier()


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    cfg: Config,
    env: dist.DistEnv,
) -> dict[str, float]:
    """Loss, accuracy and F1 over the whole validation set (F1: of label 1 for two
    labels, else the mean over labels).

    Each rank scores its share of every batch and counts a confusion matrix; the counts
    are added over ranks. Every rank runs the same number of forwards (under FSDP each
    one all-gathers the weights): a short share is padded, and the padding not counted.
    """
    model.eval()
    loss_sum = torch.zeros((), device=env.device, dtype=torch.float64)
    # (true, predicted) label counts
    num_labels = cfg.num_labels  # settled from the data before training
    confusion = torch.zeros(num_labels, num_labels, device=env.device)
    for batch in batches:
        shares = {k: dist.padded_share(v, env) for k, v in batch.items()}
        real = shares["labels"][1]
        share = {k: v.to(env.device) for k, (v, _) in shares.items()}
        for start in range(0, len(share["labels"]), cfg.device_microbatch_size):
            micro = {
                k: v[start : start + cfg.device_microbatch_size]
                for k, v in share.items()
            }
            with autocast(cfg, env.device):
                logits = model(
                    input_ids=micro["input_ids"],
                    attention_mask=padding_mask(
                        parallel.unwrap(model), micro["attention_mask"] == 1
                    ),
                ).logits.float()
            keep = max(real - start, 0)  # padding rows come last: not counted
            labels = micro["labels"][:keep]
            loss_sum += F.cross_entropy(logits[:keep], labels, reduction="sum")
            flat = labels * num_labels + logits[:keep].argmax(-1)
            confusion += torch.bincount(flat, minlength=num_labels**2).view_as(
                confusion
            )
    model.train()
    confusion = dist.reduce_sum(confusion)
    true_positive = confusion.diag()
    precision = true_positive / confusion.sum(0).clamp(min=1)
    recall = true_positive / confusion.sum(1).clamp(min=1)
    f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
    return {
        "val_loss": dist.reduce_sum(loss_sum).item() / confusion.sum().item(),
        "accuracy": (true_positive.sum() / confusion.sum()).item(),
        "f1": (f1[1] if num_labels == 2 else f1.mean()).item(),
    }


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
        # event: MICROBATCH_START

        # Reduce gradients over ranks once, in the last backward.
        parallel.sync_gradients(model, i == len(microbatches) - 1)
        with autocast(cfg, targets.device):
            logits = model(
                input_ids=micro_inputs["input_ids"],
                # 4-D for sdpa and eager: transformers would read the 2-D one (a sync).
                attention_mask=padding_mask(
                    parallel.unwrap(model), micro_inputs["attention_mask"] == 1
                ),
            ).logits

        loss = F.cross_entropy(logits.float(), micro_targets, reduction="sum")

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
    # A missing path, a bad column, no such model (model.ModelError is a ValueError).
    with config.failing(OSError, ValueError):
        texts = load_texts(
            cfg.data,
            cfg.val_data,
            cfg.text_column,
            cfg.label_column,
            cfg.num_labels,
            cfg.seed,
        )
        tokenizer = load_tokenizer(cfg.model, texts.train.texts)
        cfg.num_labels = texts.num_labels  # 0 settled: the run's config.toml records it
        model = load_model(cfg.model, cfg.num_labels, tokenizer, cfg.max_seq_len)
        # Tokenised once, cached beside the data (the key: data, tokenizer, max length).
        train_tokens, val_tokens = (
            tokenize(
                split,
                tokenizer,
                cfg.max_seq_len,
                texts.cache_dir,
                [texts.fingerprint, name],
            )
            for name, split in (("train", texts.train), ("val", texts.val))
        )
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        train_batches = Batches(train_tokens, cfg.global_batch_size, cfg.seed, pad_id)
        val = val_batches(val_tokens, cfg.global_batch_size, pad_id)[
            : cfg.eval_batches or None
        ]
    model.config.id2label = dict(enumerate(texts.label_names))
    model.config.label2id = {name: i for i, name in enumerate(texts.label_names)}
    model = model.to(env.device)
    num_params = sum(p.numel() for p in model.parameters())
    # FSDP's units, each also checkpointed and compiled alone: the transformer
    # layers, the model's own `_no_split_modules` (model.py).
    blocks = transformer_blocks(model)

    # One live start per run (an OS lock that kill -9 frees), once all input is read.
    with config.failing(runlock.RunInUse):
        run_lock = runlock.acquire(run_dir)

    # event: MODEL

    # Training FLOPs per token, for MFU (GPUs only): the forward of one max_seq_len
    # sequence, counted by torch, x3 for the backward, over its tokens. Shorter texts
    # do less attention work per token than this, so their MFU reads slightly high; the
    # weights' part, most of the work, is exact.
    example = torch.ones(1, cfg.max_seq_len, dtype=torch.long, device=env.device)
    flops_per_token = training_flops(model, {"input_ids": example}) / cfg.max_seq_len
    # Shard or replicate for the launch: FSDP2 per layer then the root, DDP, or nothing.
    model = parallel.parallelize(model, blocks, env, plan)

    # Decoupled weight decay on weight matrices; biases and LayerNorm gains have none.
    params = [p for p in model.parameters() if p.requires_grad]
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
    monitor.info(f"data: {texts.source}")
    monitor.info(
        f"texts: {len(train_tokens):,} train, {len(val_tokens):,} validation; "
        f"labels: {', '.join(texts.label_names)}"
    )
    monitor.info(
        f"model: {cfg.model}, {num_params:,} parameters, {len(blocks)} FSDP units"
    )
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
            # Padded to the longest text in the global batch.
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
            targets = batch["labels"]

            # event: BATCH_START

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

            # event: AFTER_BACKWARD

            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # The next batch, fetched while the device still works through this step:
            # before anything below waits for the device (a logged loss, an evaluation).
            if index + 1 < train_batches.batches_per_epoch:
                upcoming = train_batches.get(epoch, index + 1, env.rank, env.world_size)
                upcoming = dist.to_device(upcoming, env.device)
            num_tokens = train_batches.num_tokens(epoch, index)  # real ones, all ranks
            progress.advance(samples=cfg.global_batch_size, tokens=num_tokens)
            train_loss.add(loss_sum, cfg.global_batch_size)  # no device sync

            monitor.update(progress)
            profiler.step(progress)  # records the --profile window, writes its traces
            finished = progress.reached()
            metrics = {}
            if progress.at_interval(cfg.eval_interval) or finished:

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
    else:  # model + tokenizer for transformers' from_pretrained (evaluation, serving)
        save_pretrained(model, tokenizer, run_dir / "hf", env)
        outcome += f", model in {run_dir}/hf"
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
