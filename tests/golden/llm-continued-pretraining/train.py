"""Train llm-continued-pretraining: fine-tune a causal LM.

    python train.py                     # CPU or one GPU: tiny Llama, embedded data
    python train.py --model=Qwen/Qwen2.5-0.5B --data=chats.jsonl --data_format=chat
    python train.py --config run.toml   # keys as in Config below; flags override it
    python train.py --help              # every key, its default and meaning

Recipe `llm-continued-pretraining`; algorithms: none.
This loop is yours to edit. `# event: NAME` comments mark where scaffold's algorithms
for this task hook in; each algorithm's code is fenced by `# algorithm: NAME` ... `# end
algorithm: NAME`. `scaffold upgrade` merges newer template versions in and keeps your
edits.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule

from data import IGNORE, Batches, load_texts, pack, tokenize, val_batches
from model import (
    load_model,
    load_tokenizer,
    packed_mask,
    respond,
    training_bytes,
    transformer_blocks,
)
from runtime import checkpoint, config, dist, early_stop, hf, microbatch, parallel
from runtime import preempt, profile, runlock, trackers
from runtime.monitor import Monitor, RunningSum, training_flops
from runtime.time import Progress, Time, as_fraction, check_fraction


@dataclass
class Config:
    run_name: str = (
        "llm-continued-pretraining"  # runs/<run_name>/; rerunning a name resumes it
    )
    seed: int = 42  # a run is a function of (config, seed)
    # data: "" Python's documentation (offline); text: a text file or folder of them;
    # chat: JSON Lines of {"messages": [...]} or {"prompt": ..., "response": ...}
    data: str = ""
    val_data: str = ""  # validation file; "": a seeded 10% of --data
    data_format: Literal["text", "chat"] = "text"  # text: every token
    # a Jinja chat template file for a tokenizer without one ("": the tokenizer's own)
    chat_template: str = ""
    packing: bool = True  # several documents per row (each attends only to itself)
    device: str = "auto"  # auto (cuda if available, else cpu), cpu, cuda, cuda:N
    # model: tiny (offline: a small random Llama), a hub id, or a save_pretrained folder
    model: str = "tiny"
    seq_len: int = 256  # tokens per row; longer documents are cut
    # transformers' attention kernel; auto keeps the model's own (sdpa where it has
    # one, else eager). Each keeps packed documents apart (position_ids): sdpa and
    # eager mask the others, flex_attention and flash_attention_2 (CUDA) skip them
    attention: Literal[
        "auto", "sdpa", "eager", "flex_attention", "flash_attention_2"
    ] = "auto"
    # optimization; Time strings: 3ep, 2000ba (steps), 4096sp, 1e6tok, 0.25dur
    max_duration: Time = Time.parse("200ba")  # training length
    global_batch_size: int = 16  # samples per step, summed over ranks
    # samples per forward/backward (gradient accumulation over the rank's batch)
    device_microbatch_size: int = 8
    lr: float = 0.003  # peak learning rate (AdamW)
    lr_warmup: Time = Time.parse("0.05dur")  # linear from 0, then cosine
    min_lr_ratio: float = 0.1  # the cosine decays to min_lr_ratio * lr
    weight_decay: float = 0.1  # decoupled, weight matrices only
    beta1: float = 0.9
    beta2: float = 0.95

    # evaluation, logging, checkpoints
    eval_interval: Time = Time.parse("50ba")  # validation loss every ...
    eval_batches: int = 4  # validation batches per evaluation
    samples: int = 2  # chat: held-out questions answered at each evaluation (logged)
    sample_tokens: int = 48  # at most this many tokens per answer (greedy)
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
    # auto: amp_bf16 (autocast, fp32 weights) on CUDA, fp32 on the CPU
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
    for name in ("seq_len", "global_batch_size", "eval_batches", "sample_tokens"):
        if getattr(cfg, name) < 1:
            config.fail(f"{name}={getattr(cfg, name)} must be at least 1")
    if cfg.samples < 0:
        config.fail(f"samples={cfg.samples} must be 0 (none) or more")
    if cfg.attention.startswith(("flex", "flash")) and env.device.type != "cuda":
        # FlexAttention has no backward on a CPU; flash-attn has no CPU kernel.
        config.fail(
            f"attention={cfg.attention} trains on CUDA only, this run is on "
            f"{env.device.type}; use --attention=auto"
        )
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


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of each target token (IGNORE marks none), in fp32.
    Compiled with the model (--compile), the upcast of bf16 logits and the log-softmax
    fuse: the vocabulary-sized logits are never held in fp32."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(),
        targets.flatten(),
        ignore_index=IGNORE,
        reduction="sum",
    )


def fits(
    needed: int, cfg: Config, env: dist.DistEnv, plan: parallel.ParallelConfig
) -> str | None:
    """None, or why `needed` bytes of training state (activations come on top) do not
    fit this device's memory once FSDP shards them over the ranks."""
    ranks = env.world_size if plan.parallelism == "fsdp" else 1
    ranks = 1 if cfg.sharding_strategy == "NO_SHARD" else ranks
    if env.device.type == "cuda" and not cfg.cpu_offload:
        memory = torch.cuda.get_device_properties(env.device).total_memory
    else:  # the CPU's memory
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed / ranks <= memory:
        return None
    return (
        f"--model={cfg.model} needs about {needed / ranks / 2**30:,.1f} GiB per rank "
        f"for its fp32 weights, gradients and AdamW state over {ranks} rank(s), but a "
        f"{env.device.type} here has "
        f"{memory / 2**30:,.1f} GiB; shard it over more ranks (torchrun "
        "--nproc_per_node=N, FSDP) or offload to the CPU (--cpu_offload)"
        ", or train LoRA adapters (scaffold set lora=true)"
    )


def log_samples(
    model, tokenizer, prompts: list, cfg: Config, monitor: Monitor
) -> dict[str, str]:
    """The model's answers to held-out questions, in the log and as metrics
    `sample/<i>` for metrics.jsonl and the trackers (every rank generates: under FSDP
    each layer's forward gathers its weights)."""
    # generate() may call inner modules rather than the root's forward (peft does), so
    # under FSDP the root's own weights (embeddings, head) are gathered here by hand.
    gathered = isinstance(model, FSDPModule)
    if gathered:
        model.unshard()
    answers = {}
    for i, messages in enumerate(prompts):
        answer = respond(parallel.unwrap(model), tokenizer, messages, cfg.sample_tokens)
        monitor.info(f"sample: {messages[-1]['content']!r} -> {answer!r}")
        answers[f"sample/{i}"] = answer
    if gathered:
        model.reshard()
    return answers


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    batches: list[dict[str, torch.Tensor]],
    cfg: Config,
    env: dist.DistEnv,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> dict[str, float]:
    """val_loss: the mean loss per target token (chat: per answer token) over the
    validation batches.

    Each rank scores its share of every batch; the loss sums are added over ranks.
    Every rank runs the same number of forwards (under FSDP each one all-gathers the
    weights): a share short of rows is padded with copies of a row, left out of the sum.
    """
    model.eval()
    loss_sum = torch.zeros((), device=env.device, dtype=torch.float64)
    for batch in batches:
        shares = {name: dist.padded_share(rows, env) for name, rows in batch.items()}
        real = shares["labels"][1]
        share = {name: rows.to(env.device) for name, (rows, _) in shares.items()}
        for start in range(
            0, real and len(share["labels"]), cfg.device_microbatch_size
        ):
            micro = {
                name: rows[start : start + cfg.device_microbatch_size]
                for name, rows in share.items()
            }
            labels = micro.pop("labels")[: max(real - start, 0)]  # padding rows last
            with autocast(cfg, env.device):
                mask = packed_mask(parallel.unwrap(model), micro["position_ids"])
                logits = model(**micro, attention_mask=mask, use_cache=False).logits
                logits = logits[: len(labels)]
            loss_sum += loss_fn(logits, labels)
    model.train()
    num_targets = sum(int((batch["labels"] != IGNORE).sum()) for batch in batches)
    return {"val_loss": dist.reduce_sum(loss_sum).item() / num_targets}


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
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
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
                **micro_inputs,
                # sdpa and eager: the documents' mask, which transformers would find
                # by reading position_ids on the host (a sync).
                attention_mask=packed_mask(
                    parallel.unwrap(model), micro_inputs["position_ids"]
                ),
                use_cache=False,
            ).logits

        loss = loss_fn(logits, micro_targets)  # IGNORE targets: questions, padding

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
    # A missing path, a bad line, no such model (model.ModelError is a ValueError).
    with config.failing(OSError, ValueError):
        texts = load_texts(cfg.data, cfg.val_data, cfg.data_format, cfg.seed)
        tokenizer = load_tokenizer(cfg.model, texts.words())
        if cfg.chat_template:
            tokenizer.chat_template = Path(cfg.chat_template).read_text()
        if cfg.data_format == "chat" and not tokenizer.chat_template:
            raise ValueError(
                f"--model={cfg.model}: its tokenizer has no chat template; pass one "
                "with --chat_template=FILE (a Jinja template, e.g. the chat_template "
                "of an instruct model of its family), or train on plain text with "
                "--data_format=text"
            )
        # Before loading: the weights, gradients and AdamW state must fit on a device.
        problem = fits(training_bytes(cfg.model), cfg, env, plan)
        if problem:
            raise ValueError(problem)
        model = load_model(cfg.model, tokenizer, cfg.seq_len, cfg.attention)
        pad_id = tokenizer.pad_token_id
        pad_id = tokenizer.eos_token_id if pad_id is None else pad_id
        train_rows, val_rows = (
            pack(
                tokenize(items, tokenizer, cfg.data_format),
                cfg.seq_len,
                pad_id,
                cfg.packing,
            )
            for items in (texts.train, texts.val)
        )
        train_batches = Batches(
            train_rows,
            cfg.global_batch_size,
            cfg.seed,
            pin_memory=env.device.type == "cuda",
        )
        val = val_batches(val_rows, cfg.global_batch_size, cfg.eval_batches)
    # Chat: held-out conversations up to their last answer, answered at each evaluation.
    prompts = []
    if cfg.data_format == "chat":
        prompts = [messages[:-1] for messages in texts.val[: cfg.samples]]
    model = model.to(env.device)
    num_params = sum(p.numel() for p in model.parameters())
    # FSDP's units, each also checkpointed and compiled alone: the decoder layers,
    # the model's own `_no_split_modules` (model.py).
    blocks = transformer_blocks(model)

    # One live start per run (an OS lock that kill -9 frees), once all input is read.
    with config.failing(runlock.RunInUse):
        run_lock = runlock.acquire(run_dir)

    # Training FLOPs per token, for MFU (GPUs only): one row's forward, counted by
    # torch, x3 for the backward, over its tokens.
    example = torch.zeros(1, cfg.seq_len, dtype=torch.long, device=env.device)
    flops_per_token = training_flops(model, {"input_ids": example}) / cfg.seq_len
    # Shard or replicate for the launch: FSDP2 per layer then the root, DDP, or nothing.
    model = parallel.parallelize(model, blocks, env, plan)
    # The loss compiled with the model (--compile), as a graph of its own: the fp32
    # softmax over the vocabulary never holds the logits in fp32 (runtime/parallel.py).
    loss_fn = parallel.compile_loss(next_token_loss, plan)

    # AdamW over the trainable parameters; decoupled weight decay on weight matrices
    # only (norms' gains and biases have none).
    trainable = [p for p in model.parameters() if p.requires_grad]
    no_decay = [p for p in trainable if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in trainable if p.dim() >= 2]},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        weight_decay=cfg.weight_decay,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        fused=not cfg.cpu_offload,  # one kernel for the update (CPU and CUDA)
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
        f"rows of {cfg.seq_len} tokens ({'packed' if cfg.packing else 'padded'}): "
        f"{len(train_rows):,} train, {len(val_rows):,} validation"
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
            # The batch: input_ids, position_ids and the labels (the targets).
            inputs = {name: rows for name, rows in batch.items() if name != "labels"}
            targets = batch["labels"]

            fraction = progress.fraction()
            lr = lr_at(fraction, cfg, progress.batches_per_epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr
            # Gradient accumulation: each microbatch's summed loss over its target
            # tokens is divided by the target tokens of the whole global batch (all
            # ranks, counted from the data), so the gradient is the mean over the global
            # batch's targets, exactly, whatever the microbatch size, world size and
            # packing. DDP and FSDP average gradients over ranks: hence world_size.
            num_targets = train_batches.num_targets(epoch, index)
            loss_scale = env.world_size / num_targets
            loss_sum = forward_backward(
                model, inputs, targets, loss_scale, cfg, loss_fn
            )

            # event: AFTER_BACKWARD

            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            # The next batch, fetched while the device still works through this step:
            # before anything below waits for the device (a logged loss, an evaluation).
            if index + 1 < train_batches.batches_per_epoch:
                upcoming = train_batches.get(epoch, index + 1, env.rank, env.world_size)
                upcoming = dist.to_device(upcoming, env.device)
            progress.advance(
                samples=cfg.global_batch_size,
                tokens=train_batches.num_tokens(epoch, index),
            )
            train_loss.add(loss_sum, num_targets)  # no device sync

            monitor.update(progress)
            profiler.step(progress)  # records the --profile window, writes its traces
            finished = progress.reached()
            metrics = {}
            if progress.at_interval(cfg.eval_interval) or finished:

                # Evaluation time does not count against the logged throughput.
                with monitor.paused():
                    metrics |= evaluate(model, val, cfg, env, loss_fn)
                    metrics |= log_samples(model, tokenizer, prompts, cfg, monitor)
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
    else:  # model + tokenizer for transformers' from_pretrained (evaluation, serving)
        hf.save_pretrained(model, tokenizer, run_dir / "hf")
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
