"""Microbatch size: fixed, or `auto`: the largest that fits, found by halving on out-of-memory.

In the loop, one visible construct runs a batch and retries it when memory runs out:

    for attempt in search.attempts(seq_len=inputs.shape[1]):
        with attempt:                      # an OOM on any rank ends this attempt on all
            ...microbatches of attempt.size: forward, loss, backward...

A fixed size, or a size already settled for batches this long, gives exactly one attempt
and adds nothing to the step (no hooks, no collectives). While the size is searched, an
out-of-memory error (`torch.OutOfMemoryError`, or the CPU allocator's RuntimeError) on any
rank makes every rank drop the attempt: gradients set to None, FSDP's per-iteration state
reset, no optimizer step (the loop only steps after the `for`), and the next attempt runs
the SAME batch at half the size (rounded up). The loss accumulators live inside the `with`,
so they restart too; the data cursor only moves after the step, so nothing is skipped or
repeated. The loop divides summed token losses by the global token count, so the gradients
do not depend on the size found. If even 1 does not fit, every rank exits with one clear
error before anything is saved.

The size found is stored in checkpoints (`state_dict()`: the search is an entry of the
loop's checkpointed `state`) and reused on resume without a new search (same world
size). It is settled per sequence length: a longer batch than any that has succeeded
(sequence-length warmup) is searched again, starting from the current size, so a size
found on short sequences cannot crash the run later.

Evaluation runs at the full sequence length, possibly before training has reached it:

    for attempt in search.eval_attempts(seq_len=cfg.seq_len):
        with attempt:                      # forwards only; the same agreement
            ...microbatches of attempt.size...

uses training's size where it is settled for sequences that long (forward and backward fit,
so a forward fits), and otherwise searches a size of its own the same way, starting from
training's, which it leaves alone.

Agreement without hangs (several ranks)
---------------------------------------
A rank that fails stops issuing the collectives FSDP and DDP would issue next; a peer that
enters one of those would wait forever. So while searching, every collective the training
group issues is preceded by a *sync point*, and the ranks vote at each one over a separate
gloo group (its own queue, CPU tensors: no device sync, no interleaving with NCCL/gloo
training traffic):

- sync point (a running rank): all_reduce(MAX) of [failed=0, running=1]. If the result says
  someone failed, raise `PeerOutOfMemory` here, before the collective that follows.
- `finish(failed)` (every rank, once per attempt: a rank that failed, a rank that got
  `PeerOutOfMemory`, and a rank that completed the attempt): all_reduce(MAX) of [failed, 0],
  repeated until no rank is running any more. A stopped rank thereby keeps answering the
  sync points of ranks that have not noticed yet; they notice at their next sync point and
  join. The last round is the same collective on every rank, so every rank leaves with the
  same verdict: "all succeeded" or "someone failed: retry smaller". MAX(failed) and
  MAX(running) are all_reduce(MAX) and 1 - all_reduce(MIN) of "still running".

Sync points (installed as hooks on each FSDP unit, i.e. each block and the root, or on the
DDP wrapper; removed once the size is settled):
- before each unit's forward: a forward pre-hook placed ahead of FSDP's own (which
  all-gathers the unit's parameters);
- before each unit's backward: the unit's outputs pass through an identity autograd
  function whose backward votes before FSDP's pre-backward hook (all-gather and prefetch);
- before each unit's reduce-scatter: the unit's inputs pass through an identity function
  behind FSDP's post-backward one, so it votes after the unit's gradients are computed and
  before FSDP reduce-scatters them;
- before the root's final reduce-scatter: a backward final callback queued ahead of FSDP's.
Between two sync points a rank issues the same collectives as its peers or fails before the
next sync point, so no rank waits on a collective that a failed rank will not issue. (An
allocation failing inside a collective call itself, after the vote, is not covered: the
group's timeout, `dist_timeout`, ends that job instead of a hang.)

FSDP2: after a failure, `FSDPModule.reset_iter_state()` on the root reshards and clears
FSDP's per-iteration state, but leaves partial gradients behind (sharded `.grad`, and the
unsharded ones accumulated across microbatches without sync) that would silently add into
the next attempt; they are dropped explicitly.
DDP: its reducer cannot survive a backward that stops half way, so while searching every
microbatch runs without gradient sync (`parallel.sync_gradients` is told to defer) and the
gradients are all-reduced by hand (divided by the world size, as DDP does) once every rank
agreed that the attempt succeeded. Later steps use DDP's own bucketed all-reduce.
One process: no votes; the error is caught and the batch retried.

Fault injection (tests, rehearsals)
-----------------------------------
`SCAFFOLD_INJECT_OOM='ranks=1;above=4;phase=backward'` raises `torch.OutOfMemoryError` on
ranks 1 whenever a microbatch holds more than 4 rows, in backward (after the last block's
backward, before its reduce-scatter). Keys: `ranks` (comma-separated ranks, or `all`;
default all), `above` (an integer >= 0: more rows than that fail; 0 fails every size),
`tokens` (an integer: more token positions than that fail, rows x sequence length: memory
that grows with the length, as under sequence-length warmup; either key, or both; neither
is above=0), `phase` (`forward`: after the first block's forward; or `backward`; default
forward). Sizes are read from the block's tensors, so any forward can fail (evaluation's
too), as a real one can. A malformed value is a one-line error before training starts.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist
import torch.nn as nn
from torch.autograd import Variable
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_flatten, tree_unflatten

from runtime import parallel
from runtime.dist import DistEnv

INJECT_ENV = "SCAFFOLD_INJECT_OOM"
PHASES = ("forward", "backward")


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA's (and injected) OutOfMemoryError, or the CPU allocator's RuntimeError."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and "can't allocate memory" in str(error)


def halve(size: int, multiple_of: int = 1) -> int:
    """The next size to try: half, rounded up (6 -> 3 -> 2 -> 1), never below 1; with
    `multiple_of`, rounded up to a multiple of it and never below it (96 -> 48 -> 32 by 16).
    """
    half = (size + 1) // 2
    return max(multiple_of, -(-half // multiple_of) * multiple_of)


class PeerOutOfMemory(RuntimeError):
    """Raised at a sync point on a rank that is fine when another rank ran out of memory."""


# ---------------------------------------------------------------- fault injection


@dataclass(frozen=True)
class Injection:
    ranks: frozenset[int] | None  # None: every rank
    above: int | None  # rows per microbatch
    phase: str
    tokens: int | None = None  # rows x sequence length

    @classmethod
    def parse(cls, text: str) -> Injection:
        """`ranks=1,2;above=4;phase=backward` (every key optional); ValueError names the problem."""
        values: dict[str, str] = {}
        for part in filter(None, (p.strip() for p in text.split(";"))):
            key, sep, value = (s.strip() for s in part.partition("="))
            if not sep or key not in ("ranks", "above", "tokens", "phase"):
                raise ValueError(
                    f"{INJECT_ENV}={text!r}: {part!r} is not ranks=..., above=..., "
                    "tokens=... or phase=...; e.g. 'ranks=1;above=4;phase=backward'"
                )
            if key in values:
                raise ValueError(f"{INJECT_ENV}={text!r}: {key} given twice")
            values[key] = value
        ranks: frozenset[int] | None = None
        if values.get("ranks", "all") != "all":
            try:
                ranks = frozenset(int(r) for r in values["ranks"].split(","))
            except ValueError:
                raise ValueError(
                    f"{INJECT_ENV}={text!r}: ranks must be comma-separated "
                    "integers or all"
                ) from None
        limits: dict[str, int | None] = {}
        for key in ("above", "tokens"):
            try:
                limits[key] = int(values[key]) if key in values else None
            except ValueError:
                raise ValueError(
                    f"{INJECT_ENV}={text!r}: {key} must be an integer"
                ) from None
            if (limits[key] or 0) < 0:
                raise ValueError(f"{INJECT_ENV}={text!r}: {key} must be >= 0")
        if limits["above"] is None and limits["tokens"] is None:
            limits["above"] = 0
        phase = values.get("phase", "forward")
        if phase not in PHASES:
            raise ValueError(
                f"{INJECT_ENV}={text!r}: phase must be forward or backward"
            )
        return cls(ranks, limits["above"], phase, limits["tokens"])

    @classmethod
    def from_env(cls) -> Injection | None:
        text = os.environ.get(INJECT_ENV, "").strip()
        return cls.parse(text) if text else None

    def fire(self, rank: int, shape: torch.Size, phase: str) -> None:
        """Raise for a block's tensor of `shape` (rows first, features last) if it is too big."""
        size = shape[0]
        tokens = math.prod(shape[:-1]) if len(shape) > 1 else size
        if phase != self.phase or (self.ranks is not None and rank not in self.ranks):
            return
        if self.above is not None and size > self.above:
            raise torch.OutOfMemoryError(
                f"injected by {INJECT_ENV}: rank {rank}, microbatch size "
                f"{size} > {self.above}, in {phase}"
            )
        if self.tokens is not None and tokens > self.tokens:
            raise torch.OutOfMemoryError(
                f"injected by {INJECT_ENV}: rank {rank}, {tokens} tokens "
                f"per microbatch > {self.tokens}, in {phase}"
            )


# Why a fixed-size project refuses device_microbatch_size=auto, and the fix.
NO_SEARCH = (
    "this project was generated with a fixed microbatch size and has no out-of-memory "
    "search; add it with `scaffold set auto_microbatching=true` (your edits are kept), "
    "or give a size"
)


def check(device_microbatch_size: int | str, auto: bool = True) -> str | None:
    """Why this size (or SCAFFOLD_INJECT_OOM) cannot be used, or None. `auto`: whether
    the project was generated with the search (a plain accumulation loop has none)."""
    if device_microbatch_size == "auto" and not auto:
        return f"device_microbatch_size=auto: {NO_SEARCH}"
    if device_microbatch_size != "auto" and (
        not isinstance(device_microbatch_size, int) or device_microbatch_size < 1
    ):
        return f"device_microbatch_size={device_microbatch_size} must be at least 1 or auto"
    try:
        Injection.from_env()
    except ValueError as error:
        return str(error)
    return None


# ---------------------------------------------------------------- the vote


class _Vote:
    """The agreement protocol of the module docstring, over its own gloo group."""

    def __init__(self, timeout: timedelta) -> None:
        self.group = torch_dist.new_group(backend="gloo", timeout=timeout)

    def _all_reduce(self, failed: int, running: int) -> tuple[bool, bool]:
        flags = torch.tensor([failed, running], dtype=torch.int32)
        torch_dist.all_reduce(flags, op=torch_dist.ReduceOp.MAX, group=self.group)
        return bool(flags[0]), bool(flags[1])

    def sync(self) -> None:
        someone_failed, _ = self._all_reduce(0, 1)
        if someone_failed:
            raise PeerOutOfMemory("another rank ran out of memory")

    def finish(self, failed: bool) -> bool:
        """Keep voting until no rank runs; True when any rank failed (the same on every rank)."""
        while True:
            someone_failed, someone_running = self._all_reduce(int(failed), 0)
            failed = failed or someone_failed
            if not someone_running:
                return someone_failed


class _Identity(torch.autograd.Function):
    """Passes tensors through; calls `callback` when their gradients arrive in backward."""

    @staticmethod
    def forward(ctx: Any, callback: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.callback = callback
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.callback()
        return (None, *grads)


def _through(value: Any, callback: Callable[[], None]) -> Any:
    """`value` (a tensor or a structure of them) with the grad-requiring tensors hooked."""
    leaves, spec = tree_flatten(value)
    index = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor) and x.requires_grad
    ]
    if not index or not torch.is_grad_enabled():
        return value
    hooked = _Identity.apply(callback, *(leaves[i] for i in index))
    for i, tensor in zip(index, hooked):
        leaves[i] = tensor
    return tree_unflatten(leaves, spec)


# ---------------------------------------------------------------- the search


class Attempt:
    """One try at a batch with `size` samples per microbatch (a context manager)."""

    def __init__(self, search: Search, size: int, searching: bool) -> None:
        self.size = size
        self.searching = searching
        self.ok = False
        self._search = search

    def __enter__(self) -> Attempt:
        self._search._attempt = self
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        search = self._search
        search._attempt = None
        out_of_memory = error is not None and (
            is_out_of_memory(error) or isinstance(error, PeerOutOfMemory)
        )
        if error is not None and not out_of_memory:
            return False  # a real error: let it end the job
        if not self.searching:
            if error is not None:
                error.add_note(search._advice())
            return False
        failed = error is not None
        if search._vote is not None:
            failed = search._vote.finish(failed)
        if failed:
            search._clean(self.size)
        self.ok = not failed
        return True  # swallowed: `attempts` retries the batch at a smaller size

    def reduce_deferred_gradients(self) -> None:
        """Make the gradients so far global inside an attempt, for a loop that needs them
        before the attempt ends (SAM's ascent direction). Only DDP while searching defers
        gradient sync (see the module docstring): every rank votes here (a failed peer
        ends this attempt on all), then the gradients are all-reduced as DDP would.
        Otherwise they are global already (FSDP reduces in the last microbatch) and this
        does nothing."""
        search = self._search
        if self.searching and isinstance(search.model, DistributedDataParallel):
            search._sync()
            search._all_reduce_gradients()


class SearchSettings(Protocol):
    """The fields of a training script's Config that `Search.from_config` reads."""

    device_microbatch_size: int | str  # a size, or "auto": search for it
    max_device_microbatch_size: int  # where the search starts (0: the rank's batch)
    global_batch_size: int  # samples per step over all ranks
    dist_timeout: int  # seconds a vote among the ranks may wait


class Search:
    """The microbatch size for the loop: fixed, or found by halving (see the module docstring)."""

    @classmethod
    def from_config(
        cls,
        model: nn.Module,
        blocks: list[nn.Module] | nn.ModuleList,
        env: DistEnv,
        cfg: SearchSettings,
        log: Callable[[str], None] = print,
        multiple_of: int = 1,
    ) -> Search:
        """The search the config's microbatch fields describe, for this rank's share of
        the global batch."""
        return cls(
            model,
            blocks,
            env,
            cfg.device_microbatch_size,
            per_rank_batch=cfg.global_batch_size // env.world_size,
            max_size=cfg.max_device_microbatch_size,
            log=log,
            timeout=timedelta(seconds=cfg.dist_timeout),
            multiple_of=multiple_of,
        )

    def __init__(
        self,
        model: nn.Module,
        blocks: list[nn.Module] | nn.ModuleList,
        env: DistEnv,
        device_microbatch_size: int | str,
        per_rank_batch: int,
        max_size: int = 0,
        log: Callable[[str], None] = print,
        timeout: timedelta = timedelta(minutes=10),
        multiple_of: int = 1,
        *,
        resumed: Mapping[str, Any] | None = None,
    ) -> None:
        self.model, self.env, self._log = model, env, log
        # Sizes tried are multiples of this (e.g. BatchNorm groups that must not be split).
        self.multiple_of = multiple_of
        self.blocks = list(blocks)
        self.auto = device_microbatch_size == "auto"
        self.injection = Injection.from_env()
        self.settled_len = 0  # longest sequence that succeeded at self.size
        self.eval_size, self.eval_settled_len = (
            0,
            0,
        )  # evaluation's own, where training's is not settled
        self._attempt: Attempt | None = None
        self._handles: list[Any] = []
        # The largest size searched; a resume may set a smaller one (`load_state_dict`).
        self.size = (
            int(device_microbatch_size)
            if not self.auto
            else (min(per_rank_batch, max_size) if max_size > 0 else per_rank_batch)
        )
        self._announced = False  # "starting at" is logged by the first search, if any
        distributed = torch_dist.is_available() and torch_dist.is_initialized()
        self._vote = (
            _Vote(timeout) if self.auto and distributed and env.world_size > 1 else None
        )
        self._fsdp_units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        if self.injection is not None:
            self._install()  # injection needs its hooks on every step
        if resumed:
            # Only a train.py of scaffold 0.1.0 passes this (the `extra` of its
            # checkpoint.resume), until `scaffold upgrade`; now the checkpoint's resume
            # calls load_state_dict.
            self.load_state_dict(resumed)

    # ------------------------------------------------------------ loop API

    def attempts(self, seq_len: int = 0, rows: int = 0) -> Iterator[Attempt]:
        """Attempts at one batch: one if the size is settled for `seq_len`, else until one fits.

        `rows`: the samples in this rank's batch, if known. A batch with fewer rows than the
        size that succeeded (cut short, e.g. by selective backprop) does not prove that size
        fits a full batch: the size is kept but not settled, and the next batch searches on.
        """
        if not self.auto or seq_len <= self.settled_len:
            yield Attempt(self, self.size, searching=False)
            return
        if not self._announced and self.settled_len == 0:
            self._log(f"microbatch size: auto, starting at {self.size}")
        self._announced = True
        # DDP: the gradients are reduced by hand once the batch fits
        parallel.defer_gradient_sync(self.model, True)
        try:
            for attempt in self._search(self.size, seq_len, "the batch"):
                yield attempt
                if attempt.ok:
                    self.size = attempt.size
                    self._settle(seq_len, proven=not 0 < rows < attempt.size)
        finally:
            parallel.defer_gradient_sync(self.model, False)

    def eval_attempts(self, seq_len: int) -> Iterator[Attempt]:
        """Attempts at one evaluation pass (forwards only) over sequences of `seq_len`.

        Training's size where it is settled for sequences this long; else (sequence-length
        warmup found it on shorter ones) evaluation's own, searched from training's.
        """
        if not self.auto or seq_len <= self.settled_len:
            yield Attempt(self, self.size, searching=False)
        elif seq_len <= self.eval_settled_len:
            yield Attempt(self, self.eval_size, searching=False)
        else:
            start = min(self.size, self.eval_size or self.size)
            for attempt in self._search(start, seq_len, "the evaluation"):
                yield attempt
                if attempt.ok:
                    self.eval_size, self.eval_settled_len = attempt.size, seq_len
                    if attempt.size != self.size:
                        self._log(
                            f"microbatch size: {attempt.size} for evaluation (sequence "
                            f"length {seq_len}), {self.size} for training"
                        )

    def state_dict(self) -> dict[str, int]:
        """For checkpoints: the size found, for which sequence length and world size.
        (The keys are those 0.2.0 merged into its checkpoints' `extra`, which
        `load_state_dict` therefore also reads.)"""
        if not self.auto:
            return {}
        return {
            "microbatch_size": self.size,
            "microbatch_seq_len": self.settled_len,
            "microbatch_world_size": self.env.world_size,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Reuse a size found before (`state_dict`) without searching again, when it was
        found on as many ranks as now (a rank's share of the batch, hence the memory it
        needs, depends on the world size) and the size is `auto`. Other keys are
        ignored: a checkpoint of 0.2.0 holds the early stopper's beside these."""
        found = int(state.get("microbatch_size") or 0)
        same_world = state.get("microbatch_world_size") == self.env.world_size
        if not (self.auto and found and same_world):
            return
        self.size = min(self.size, found)
        self.settled_len = int(state.get("microbatch_seq_len", 0))
        self._log(f"microbatch size: {self.size} (found before, from the checkpoint)")

    # ------------------------------------------------------------ internals

    def _search(
        self, size: int, seq_len: int, what: str
    ) -> Generator[Attempt, None, None]:
        """Searching attempts from `size`, halved after each failure, until one succeeds."""
        self._install()
        try:
            while True:
                attempt = Attempt(self, size, searching=True)
                yield attempt
                if attempt.ok:
                    return
                if size <= self.multiple_of:
                    self._give_up(seq_len)
                size = halve(size, self.multiple_of)
                self._log(f"microbatch size: out of memory, retrying {what} at {size}")
        finally:
            if self.injection is None:
                self._remove()

    def _settle(self, seq_len: int, proven: bool = True) -> None:
        if isinstance(self.model, DistributedDataParallel):
            # Deferred during the search (see the module docstring): reduce by hand, as DDP does.
            self._all_reduce_gradients()
        if not proven:
            return
        if self.settled_len == 0:
            self._log(f"microbatch size: {self.size} fits (sequence length {seq_len})")
        self.settled_len = seq_len

    def _all_reduce_gradients(self) -> None:
        world = self.env.world_size
        for param in self.model.module.parameters():
            if param.grad is not None:
                torch_dist.all_reduce(param.grad.div_(world))

    def _give_up(self, seq_len: int) -> None:
        message = (
            f"out of memory at every device_microbatch_size down to {self.multiple_of} (sequence length "
            f"{seq_len}); nothing was saved. Use a smaller model or --seq_len, "
            "--activation_checkpointing, --precision=bf16, or more ranks to shard over"
        )
        raise SystemExit(f"error: {message}" if self.env.is_main else 1)

    def _advice(self) -> str:
        if self.auto:
            return (
                f"device_microbatch_size settled at {self.size} for sequences of length "
                f"{self.settled_len}; memory ran out later: set it lower by hand"
            )
        return "set a lower --device_microbatch_size, or --device_microbatch_size=auto"

    def _clean(self, size: int) -> None:
        """Undo a failed attempt on this rank: FSDP state and every partial gradient."""
        root = self.model
        if isinstance(root, FSDPModule) and root._get_fsdp_state()._is_root:
            root.reset_iter_state()  # (before the first forward there is nothing to reset)
        for unit in self._fsdp_units:
            # reset_iter_state() keeps gradients accumulated without sync: drop them.
            for group in unit._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    unsharded = getattr(param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None
        for param in self.model.parameters():
            param.grad = None
        if self.env.device.type == "cuda":
            torch.cuda.empty_cache()

    # ------------------------------------------------------------ hooks

    def _armed(self) -> Attempt | None:
        attempt = self._attempt
        return attempt if attempt is not None and attempt.searching else None

    def _sync(self) -> None:
        if self._vote is not None and self._armed() is not None:
            self._vote.sync()

    def _inject(self, phase: str, value: Any) -> None:
        tensors = [x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor)]
        if self.injection is not None and tensors:
            self.injection.fire(self.env.rank, tensors[0].shape, phase)

    def _install(self) -> None:
        if self._handles:
            return
        units = self._fsdp_units or [self.model]
        for unit in units if self._vote is not None else []:
            is_root = unit is self.model
            self._handles += [
                unit.register_forward_pre_hook(lambda m, a: self._sync(), prepend=True),
                unit.register_forward_pre_hook(self._hook_inputs, with_kwargs=True),
                unit.register_forward_hook(self._output_hook(is_root)),
            ]
        if self.injection is not None and self.blocks:
            first, last = self.blocks[0], self.blocks[-1]
            self._handles += [
                first.register_forward_hook(lambda m, a, o: self._inject("forward", o)),
                last.register_forward_pre_hook(self._inject_inputs, with_kwargs=True),
            ]

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        # Behind FSDP's post-backward function: votes before this unit's reduce-scatter.
        if self._armed() is None:
            return None
        return _through((args, kwargs), self._sync)

    def _inject_inputs(self, module: nn.Module, args: Any, kwargs: Any) -> Any:
        return _through(
            (args, kwargs), lambda: self._inject("backward", (args, kwargs))
        )

    def _output_hook(self, is_root: bool) -> Callable[..., Any]:
        def before_backward() -> None:
            self._sync()  # before FSDP's pre-backward all-gathers
            if is_root and self._armed() is not None:
                Variable._execution_engine.queue_callback(
                    self._sync
                )  # before the root's RS

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if self._armed() is None:
                return None
            return _through(output, before_backward)

        return hook
