"""Pre-emption: SIGUSR1 or SIGTERM makes every rank finish its step, save, and stop.

Clusters announce the end of an allocation with a signal: SLURM sends `--signal=B:USR1@<grace>`
to the batch script (scripts/slurm.sbatch passes it on to every training process through srun
and torchrun), and SIGTERM at the time limit or on `scancel`. The handler only records which
signal arrived. At the end of every step the ranks agree whether to stop:

    preemption = preempt.Preemption()  # installs the handlers (every rank, same place)
    ...
    stopping = preemption.agreed()     # every step, every rank: one tiny all-reduce

`agreed()` is an all-reduce(MAX) of one int on the CPU, over a gloo group of its own: it never
waits for the GPU (no device sync) and never interleaves with the training group's collectives.
A signal that reaches any one rank, at any moment of step N, stops every rank after step N, so
the checkpoint saved there loses nothing and the ranks cannot disagree about where they stopped.
The handlers are restored by `close()`.

A launcher that dies counts as a signal. torchrun starts each rank in a session of its own, so
`kill -9` of torchrun (its agent) leaves the ranks training on alone, orphaned, to the end,
writing the run folder and holding its lock, with nobody to restart them. Under torchrun, a rank
therefore also compares its parent (the agent, noted when the handler is made) with the one it
has at each agreement: once it changed, that rank stops the run as a signal would (the step
finished, saved, exit 0). The agent's store may be gone by then; the agreement and the save use
the gloo and training groups' own connections. A plain `python train.py` or a rank that
`srun` started directly watches nothing: a shell or a SLURM step ending is not a launcher dying
(their ends signal the processes themselves).
"""

from __future__ import annotations

import os
import signal
from types import FrameType

import torch
import torch.distributed as torch_dist

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
# What a rank records when its launcher is gone: above every signal number, so the ranks'
# MAX agrees on it.
LAUNCHER_GONE = 1000


class Preemption:
    """Records SIGUSR1/SIGTERM on this rank; `agreed()` tells every rank whether any rank got one."""

    def __init__(self, signals: tuple[signal.Signals, ...] = SIGNALS) -> None:
        self.received = 0  # the signal this rank got (its number), 0 if none
        self.stopped_by: str | None = (
            None  # the signal's name, once the ranks agreed to stop
        )
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._group = None
        if torch_dist.is_available() and torch_dist.is_initialized():
            self._group = torch_dist.new_group(
                backend="gloo"
            )  # a collective every rank makes
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in signals}
        # torchrun's agent, which started this process (torchrun sets TORCHELASTIC_RUN_ID).
        self._launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = max(self.received, signum)

    def agreed(self) -> bool:
        """True on every rank once any rank received a signal or lost its launcher (call it on
        every rank, every step)."""
        if self._launcher is not None and os.getppid() != self._launcher:
            self.received = max(self.received, LAUNCHER_GONE)
        self._flag.fill_(self.received)
        if self._group is not None:
            torch_dist.all_reduce(
                self._flag, op=torch_dist.ReduceOp.MAX, group=self._group
            )
        signum = int(self._flag.item())
        if signum and self.stopped_by is None:
            self.stopped_by = (
                "the end of a rank's launcher (torchrun's agent)"
                if signum == LAUNCHER_GONE
                else signal.Signals(signum).name
            )
        return bool(signum)

    def close(self) -> None:
        """Put the previous handlers back."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
