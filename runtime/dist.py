"""Processes and devices: one process, or one of many under torchrun.

`init()` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK); without it the script runs
as a single process and no process group is created. The backend follows the device: nccl on
CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as torch_dist


@dataclass(frozen=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, shows progress and writes run files."""
        return self.rank == 0


def select_device(requested: str, local_rank: int) -> torch.device:
    """`auto` picks this rank's GPU when CUDA is available, else the CPU."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(requested)
    except RuntimeError as error:
        raise ValueError(f"device '{requested}' is not a torch device; use auto, cpu or cuda") from error
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' was requested but CUDA is not available; use --device=cpu")
        if device.index is None:
            device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    return device


def init(device: str = "auto", timeout: timedelta | None = None) -> DistEnv:
    """Join torchrun's process group if launched by torchrun, and choose this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    chosen = select_device(device, local_rank)
    if world_size > 1 and not torch_dist.is_initialized():
        backend = "nccl" if chosen.type == "cuda" else "gloo"
        kwargs = {"timeout": timeout} if timeout is not None else {}
        if chosen.type == "cuda":
            kwargs["device_id"] = chosen
        torch_dist.init_process_group(backend=backend, rank=rank, world_size=world_size, **kwargs)
    return DistEnv(rank=rank, local_rank=local_rank, world_size=world_size, device=chosen)


def is_distributed() -> bool:
    return torch_dist.is_available() and torch_dist.is_initialized()


def barrier() -> None:
    if is_distributed():
        torch_dist.barrier()


def print0(*args: object, **kwargs: object) -> None:
    """print() on rank 0 only."""
    if not is_distributed() or torch_dist.get_rank() == 0:
        print(*args, **kwargs)  # type: ignore[call-overload]


def shutdown() -> None:
    """Leave the process group (call on the way out, also after an error)."""
    if is_distributed():
        torch_dist.destroy_process_group()
    sys.stdout.flush()
