"""Processes and devices: one process, or one of many under torchrun.

`environment()` reads torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE) and
picks this rank's device; without them the script is a single process. `init_process_group()`
then joins the job (nccl on CUDA, gloo on CPU; on one process only when FSDP or DDP needs a
group) with a timeout, so a rank that died makes the
others fail instead of waiting forever. `shutdown()` leaves the group on the way out, also
after an error. `end_with_parent` makes a DataLoader worker die with the rank that started it.
`to_device()` copies a batch to this rank's device without making the host wait for the copy
or for the device.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as torch_dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

Batch = TypeVar("Batch")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int  # processes on this node (torchrun --nproc_per_node)
    device: torch.device
    # Tensor parallelism's (data, tensor) mesh, dims ("dp", "tp"), in the data-parallel
    # view (runtime.parallel.data_parallel): rank and world_size then count data-parallel
    # ranks (the ranks of one tensor-parallel group read the same batch) and `group`
    # sums over them. None: every process is a data-parallel rank of its own.
    mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, shows progress and writes run files."""
        return self.rank == 0 and (self.mesh is None or self.mesh.get_rank() == 0)

    @property
    def devices(self) -> int:
        """The job's processes: data-parallel ranks x tensor-parallel degree."""
        return self.world_size if self.mesh is None else self.mesh.size()

    @property
    def group(self) -> torch_dist.ProcessGroup | None:
        """The process group that sums data-parallel quantities (losses, counts) once
        per data-parallel rank; None: the whole job."""
        return None if self.mesh is None else self.mesh.get_group("dp")


def check_batch(global_batch_size: int, world_size: int) -> str | None:
    """Whether a global batch splits evenly over the ranks: a one-line problem, or None."""
    if global_batch_size % world_size:
        return (
            f"global_batch_size={global_batch_size} is not divisible by the world "
            f"size {world_size}; pick a multiple of {world_size}"
        )
    return None


def use_tf32(device: torch.device) -> None:
    """On CUDA, fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa
    products, fp32 sums): the speed of tensor cores for fp32 weights, as PyTorch
    recommends for training. Elsewhere nothing changes."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.fp32_precision = "tf32"
        torch.backends.cudnn.conv.fp32_precision = "tf32"


def select_device(requested: str, local_rank: int) -> torch.device:
    """`auto` picks this rank's GPU when CUDA is available, else the CPU."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError as error:
        raise ValueError(
            f"device={requested!r} is not a torch device; use auto, cpu, cuda or cuda:N"
        ) from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={requested!r} but CUDA is not available here (the nccl backend "
                "needs it); use --device=cpu or --device=auto"
            )
        if device.index is None:
            device = torch.device("cuda", local_rank)
        if device.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device} does not exist: this machine has "
                f"{torch.cuda.device_count()} GPUs; launch fewer processes per node"
            )
    elif device.type != "cpu":
        raise ValueError(
            f"device={requested!r} is not supported; use auto, cpu, cuda or cuda:N"
        )
    return device


def environment(device: str = "auto") -> DistEnv:
    """This process's place in the job, from torchrun's variables (no process group yet)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return DistEnv(
        rank=int(os.environ.get("RANK", "0")),
        local_rank=local_rank,
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        device=select_device(device, local_rank),
    )


def init_process_group(
    env: DistEnv, timeout: timedelta = timedelta(minutes=10), required: bool = False
) -> None:
    """Join torchrun's process group.

    A single process has none, unless `required`: FSDP and DDP need a group also on one
    process (FSDP over a mesh of one rank is how one GPU fits a bigger model with CPU
    offload, and how a job saved on N ranks resumes on one with the same command line).
    That group of one lives in memory (a HashStore): no port, no file, no torchrun.
    """
    if torch_dist.is_initialized() or (env.world_size == 1 and not required):
        return
    backend = "nccl" if env.device.type == "cuda" else "gloo"
    options: dict[str, object] = {"timeout": timeout}
    if env.device.type == "cuda":
        torch.cuda.set_device(env.device)
        options["device_id"] = env.device
    if env.world_size == 1:
        options.update(store=torch_dist.HashStore(), rank=0, world_size=1)
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        options.update(store=round_store(env, timeout), rank=env.rank)
        options.update(world_size=env.world_size)
    torch_dist.init_process_group(backend, **options)  # type: ignore[arg-type]


# Seconds between two looks at torchrun's store while the ranks agree on their round.
POLL_S = 0.05


def round_store(env: DistEnv, timeout: timedelta) -> torch_dist.Store:
    """torchrun's store, seen through a prefix of its own for this round of workers.

    torchrun (torch >= 2.5) hosts one store for the whole job and hands every round of
    workers, restarts included, the same address. The keys a round leaves there stay:
    gloo's and nccl's peer addresses among them. A restarted rank that read its peer's
    address before the peer's new process wrote it connected to the dead process's port
    ("Gloo connectFullMesh failed ... Connection refused", measured in 4 of 6 restarts)
    and the new group never formed (pytorch/pytorch#135712). So the ranks agree on a
    round number no earlier round used, and keep their keys under it.

    TORCHELASTIC_RESTART_COUNT is no such number: each node's agent counts its own
    restarts, and a node whose peer failed restarts without counting. Instead every rank
    counts its own starts in the store (a number no earlier process of that rank had);
    rank 0's count is the round; rank 0 writes it under each rank's newest count until
    every rank has read it. Every worker of the previous round is dead before torchrun
    starts the next, so no stale process takes part.
    """
    store = torch_dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        env.world_size,
        is_master=False,
        timeout=timeout,
    )
    start = store.add(f"scaffold/starts/{env.rank}", 1)
    if env.rank == 0:
        round_number = start
        waiting = set(range(1, env.world_size))
        deadline = time.monotonic() + timeout.total_seconds()
        while waiting:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"ranks {sorted(waiting)} did not join round {round_number} within "
                    f"{timeout.total_seconds():.0f} s"
                )
            for peer in sorted(waiting):
                newest = store.add(f"scaffold/starts/{peer}", 0)
                store.set(f"scaffold/round/{peer}/{newest}", str(round_number))
                if store.check([f"scaffold/round-{round_number}/joined/{peer}"]):
                    waiting.remove(peer)
            time.sleep(POLL_S)
    else:
        round_number = int(store.get(f"scaffold/round/{env.rank}/{start}"))
        store.set(f"scaffold/round-{round_number}/joined/{env.rank}", "1")
    return torch_dist.PrefixStore(f"scaffold/round-{round_number}", store)


def is_distributed() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def rank() -> int:
    """This process's rank in the job (0 for a single process)."""
    return torch_dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    """The number of processes in the job (1 for a single process)."""
    return torch_dist.get_world_size() if is_distributed() else 1


def reduce_sum(
    tensor: torch.Tensor, group: torch_dist.ProcessGroup | None = None
) -> torch.Tensor:
    """The sum of `tensor` over all ranks, or over `group`'s (DistEnv.group: once per
    data-parallel rank); a copy, the input is left alone."""
    total = tensor.detach().clone()
    if is_distributed():
        torch_dist.all_reduce(total, op=torch_dist.ReduceOp.SUM, group=group)
    return total


def gather_rows(tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's `tensor` (the same shape on each) concatenated along rows, in rank order:
    the global batch when each rank holds a contiguous share of it (a copy on one process).
    """
    if not is_distributed():
        return tensor.clone()
    parts = [torch.empty_like(tensor) for _ in range(world_size())]
    torch_dist.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


def padded_share(batch: torch.Tensor, env: DistEnv) -> tuple[torch.Tensor, int]:
    """This rank's rows of `batch`, padded so every rank gets as many; and how many are real.

    The rows are split in contiguous shares of ceil(rows / world_size); a short share (the
    last ranks', when the rows do not divide evenly) is padded at its end with copies of the
    batch's first row. Every rank then runs the same number of forwards, which FSDP needs
    (each forward all-gathers parameters: a rank with one forward fewer leaves the others
    waiting until the timeout). Count only the first `real` rows' losses.
    """
    per_rank = -(-batch.shape[0] // env.world_size)
    share = batch[env.rank * per_rank : (env.rank + 1) * per_rank]
    real = share.shape[0]
    if real < per_rank:
        padding = batch[:1].expand(per_rank - real, *batch.shape[1:])
        share = torch.cat([share, padding])
    return share, real


def to_device(batch: Batch, device: torch.device) -> Batch:
    """`batch` (a tensor, or a dict, list or tuple of them) on `device`, copied without
    making the host wait: on CUDA from page-locked memory (pinned here unless it is
    already), with `non_blocking=True`, so the copy runs in stream order while the host
    goes on queueing work. A copy without `non_blocking` ends in a stream sync, and one
    from ordinary (pageable) memory may wait for the device's queue while CUDA stages it.
    Elsewhere (the CPU) the tensors are returned as they are. An object with a `to`
    method of its own (a task's batch class, transformers' BatchEncoding) moves itself:
    `batch.to(device)`. Anything else (a number, a numpy array: host data) stays as it
    is."""
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(value, device) for value in batch)
    if not isinstance(batch, torch.Tensor):
        return batch.to(device) if callable(getattr(batch, "to", None)) else batch
    if device.type == "cuda" and batch.device.type == "cpu" and not batch.is_pinned():
        batch = batch.pin_memory()
    return batch.to(device, non_blocking=True)


def barrier() -> None:
    if is_distributed():
        torch_dist.barrier()


def any_rank(flag: bool, group: torch_dist.ProcessGroup | None = None) -> bool:
    """True on every rank if `flag` is true on any rank (also a barrier over `group`)."""
    if not is_distributed():
        return flag
    device = "cuda" if torch_dist.get_backend(group) == "nccl" else "cpu"
    value = torch.tensor([float(flag)], device=device)
    torch_dist.all_reduce(value, op=torch_dist.ReduceOp.MAX, group=group)
    return bool(value.item())


def lost_peer(error: BaseException) -> str | None:
    """Why this rank stops, in one line, when `error` is a collective that failed because
    another rank died or hangs (gloo's errors, nccl's and the store's DistError); else None.
    """
    seen = error
    while seen is not None:
        text = str(seen)
        if isinstance(seen, torch_dist.DistError) or "/gloo/" in text:
            detail = text.split("] ", 1)[-1].splitlines()[0].split(". ")[0][:200]
            return (
                f"rank {rank()} stopped: a collective failed because another rank died "
                f"or hangs ({detail}); nothing was saved after the newest complete "
                "checkpoint, where the restarted job (torchrun --max-restarts) or a rerun "
                "resumes"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def exit_if_peer_lost(error: BaseException) -> None:
    """One `error:` line from this rank and exit status 1, if `error` is a lost peer.

    Every surviving rank says it (rank 0 may be the one that died). The ranks agree on
    every save (a collective), so a rank whose peer died never writes a checkpoint
    alone: it leaves, and torchrun restarts the group from the newest complete one.
    """
    why = lost_peer(error)
    if why is not None:
        print(f"error: {why}", file=sys.stderr, flush=True)
        raise SystemExit(1)


# prctl(2) option: the signal this process gets when the thread that forked it ends.
PR_SET_PDEATHSIG = 1


def end_with_parent(worker_id: int = 0) -> None:
    """Have the kernel kill this process the moment its parent ends (a DataLoader's
    `worker_init_fn`; Linux's prctl, nothing elsewhere).

    torch's workers look for their parent only between batches (every 5 s at most), so a
    worker busy with a batch (a slow decode, a download) when its rank is killed lives on
    until it is done, holding memory and files of a run that is gone. SIGKILL is right for
    a worker: it holds nothing to save. The signal follows the thread that forked the worker
    (the loop's, which iterates the loader); a parent that died before this call is left
    to torch's own check.
    """
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def print0(*args: object, **kwargs: object) -> None:
    """print() on rank 0 only."""
    if not is_distributed() or torch_dist.get_rank() == 0:
        print(*args, **kwargs)  # type: ignore[call-overload]


# Seconds the ranks wait for each other on the way out after an error (see shutdown).
ERROR_EXIT_WAIT_S = 10


def shutdown() -> None:
    """Leave the process group (on the way out, also after an error).

    The ranks first meet at a barrier, so they tear their groups down together: a rank
    that destroyed its gloo groups while a peer still used them made that peer abort
    ("terminate called without an active exception") about once in six 2-rank runs with
    asynchronous saves, and in 2 of 6 runs after a checkpoint that failed in storage on
    every rank (measured). After an error the barrier waits a few seconds at most: the
    peers may be stuck or gone (it then fails at once), and nobody waits for them.
    """
    if is_distributed():
        if sys.exc_info()[0] is None:
            torch_dist.barrier()
        else:
            try:
                work = torch_dist.barrier(async_op=True)
                work.wait(timeout=timedelta(seconds=ERROR_EXIT_WAIT_S))
            except Exception:  # noqa: BLE001 - a peer gone or stuck: leave anyway
                pass
        torch_dist.destroy_process_group()
    sys.stdout.flush()
