"""One live start per run: rank 0 holds an OS lock on `runs/<run_name>/run.lock` while it trains.

    run_lock = runlock.acquire(run_dir)  # raises RunInUse (every rank) if another start holds it

The lock is a POSIX record lock (`fcntl(F_SETLK)`, a write lock on the whole file), held by the
process: the kernel drops it when the process ends in any way, kill -9 included, so a lock is
never stale and there is nothing to clean up. Unlike `flock`, it is not shared with the
processes this one forks: DataLoader workers (and anything else forked while training) inherit
the open file but not the lock, so a worker that outlives its killed rank for a moment does not
keep the run locked against the restart. The price of POSIX locks: closing *any* descriptor of
the file in this process drops the lock, so nothing here opens `run.lock` but `acquire`.

The holder writes who it is (host, pid, SLURM job id, start time) into the file, so a refused
start can name it. A refused start changes nothing: the file is opened without truncating it,
and the caller stops before touching checkpoints or logs.

Scope: the lock guards the run folder on this filesystem. Two starts on different machines
meet only if `runs/` is on a filesystem both see with working POSIX locks (local disks, NFS,
Lustre/GPFS with locking enabled); a remote `save_folder` (object storage) has no locks of its
own, so keep every start of a run pointed at the same shared run folder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import torch.distributed as torch_dist

LOCK_FILE = "run.lock"


class RunInUse(RuntimeError):
    """Another live process holds the run folder; the message names it."""


@dataclass
class RunLock:
    path: Path
    handle: IO[str] | None  # open while held (rank 0); None on other ranks

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the file drops the lock
            self.handle = None


def holder() -> dict[str, object]:
    """Who this process is, as written into the lock file."""
    me: dict[str, object] = {"host": socket.gethostname(), "pid": os.getpid()}
    if os.environ.get("SLURM_JOB_ID"):
        me["slurm_job"] = os.environ["SLURM_JOB_ID"]
    me["since"] = time.strftime("%Y-%m-%d %H:%M:%S")
    return me


def describe(text: str) -> str:
    """A lock file's content as words: 'pid 12 on host n1 (SLURM job 7) since ...'."""
    try:
        who = json.loads(text)
        words = f"pid {who['pid']} on host {who['host']}"
    except (ValueError, KeyError, TypeError):
        return "another process (it has not written its name yet)"
    if who.get("slurm_job"):
        words += f" (SLURM job {who['slurm_job']})"
    if who.get("since"):
        words += f", running since {who['since']}"
    return words


def _try_lock(run_dir: Path) -> tuple[IO[str] | None, str | None]:
    """(the open, locked file, None) or (None, why not)."""
    path = run_dir / LOCK_FILE
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+")
    try:
        fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # F_SETLK on the whole file
    except OSError as error:
        if error.errno not in (errno.EACCES, errno.EAGAIN):  # not "held by another"
            handle.close()
            raise
        who = describe(handle.read())
        handle.close()
        return None, (
            f"run folder {run_dir} is in use by {who}; one run trains in one job at a time: "
            "wait for it to end, stop it, or start another run with --run_name=NAME"
        )
    handle.truncate(0)
    handle.write(json.dumps(holder()) + "\n")
    handle.flush()
    return handle, None


def acquire(run_dir: Path) -> RunLock:
    """Lock `run_dir` for the life of this process (rank 0 locks; every rank learns the verdict)."""
    distributed = torch_dist.is_available() and torch_dist.is_initialized()
    handle, problem = None, None
    if not distributed or torch_dist.get_rank() == 0:
        handle, problem = _try_lock(run_dir)
    if distributed:
        verdict = [problem]
        torch_dist.broadcast_object_list(verdict, src=0)
        problem = verdict[0]
    if problem:
        raise RunInUse(problem)
    return RunLock(run_dir / LOCK_FILE, handle)
