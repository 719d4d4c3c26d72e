"""A profiler window: `--profile=START:END` records the steps after START up to END with torch.profiler.

START and END are Time strings (`20ba:25ba`, `0.5dur:0.51dur`, `1ep:1000000tok`). Every rank
records its own window and writes `runs/<name>/profile/rank<R>.trace.json`, a Chrome trace
(open it in https://ui.perfetto.dev or chrome://tracing); on CUDA also
`rank<R>.memory.json.gz`, the memory timeline (`torch.profiler` `export_memory_timeline`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch.profiler import ProfilerActivity, profile

from runtime.dist import DistEnv
from runtime.dist import rank as job_rank
from runtime.time import Progress, Time, TimeError


def parse(text: str) -> tuple[Time, Time] | None:
    """`"20ba:25ba"` -> (20ba, 25ba); `""` -> None. Raises ValueError naming the fix."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    if not sep:
        raise ValueError(
            f"profile={text!r}: give a window START:END of Time strings, e.g. 20ba:25ba"
        )
    try:
        return Time.parse(start.strip()), Time.parse(end.strip())
    except TimeError as error:
        raise ValueError(f"profile={text!r}: {error}") from None


def check(text: str) -> str | None:
    """A one-line problem with the `profile` setting, or None."""
    try:
        window = parse(text)
    except ValueError as error:
        return str(error)
    if (
        window
        and window[0].unit is window[1].unit
        and window[0].value >= window[1].value
    ):
        return f"profile={text!r}: START must come before END, e.g. 20ba:25ba"
    return None


def _reached(progress: Progress, when: Time, max_duration: Time) -> bool:
    resolved = progress.resolve(when, max_duration)
    return progress.count(resolved.unit) >= resolved.value


class ProfileSettings(Protocol):
    """The fields of a training script's Config that `Profiler.from_config` reads."""

    profile: str  # START:END, the window of steps to trace ("": none)
    max_duration: Time  # what `dur` in the window is a fraction of


class Profiler:
    """Call `step(progress)` after every optimizer step; it starts and stops the window itself."""

    @classmethod
    def from_config(
        cls,
        cfg: ProfileSettings,
        run_dir: Path,
        env: DistEnv,
        log: Callable[[str], None] = print,
    ) -> Profiler:
        """The profiler of the config's `profile` window, writing under run_dir (a
        trace per process: the job's rank, not the data-parallel one under tensor
        parallelism)."""
        return cls(cfg.profile, run_dir, job_rank(), env.device, cfg.max_duration, log)

    def __init__(
        self,
        window: str,
        run_dir: Path,
        rank: int,
        device: torch.device,
        max_duration: Time,
        log: Callable[[str], None] = print,
    ) -> None:
        self.window = parse(window)
        self.folder = run_dir / "profile"
        self.rank, self.device, self.max_duration, self.log = (
            rank,
            device,
            max_duration,
            log,
        )
        self._profile: profile | None = None
        self._done = False

    def step(self, progress: Progress) -> None:
        if self.window is None or self._done:
            return
        start, end = self.window
        if self._profile is None and _reached(progress, start, self.max_duration):
            if _reached(progress, end, self.max_duration):  # resumed past the window
                self._done = True
                return
            cuda = self.device.type == "cuda"
            activities = [ProfilerActivity.CPU] + (
                [ProfilerActivity.CUDA] if cuda else []
            )
            # Shapes, memory and stacks feed the CUDA memory timeline; on CPU, shapes are enough.
            self._profile = profile(
                activities=activities,
                record_shapes=True,
                profile_memory=cuda,
                with_stack=cuda,
            )
            self._profile.start()
            self._start_step = progress.batch
        elif self._profile is not None and _reached(progress, end, self.max_duration):
            self._profile.stop()
            self.folder.mkdir(parents=True, exist_ok=True)
            trace = self.folder / f"rank{self.rank}.trace.json"
            self._profile.export_chrome_trace(str(trace))
            if self.device.type == "cuda":
                memory = self.folder / f"rank{self.rank}.memory.json.gz"
                self._profile.export_memory_timeline(
                    str(memory), device=str(self.device)
                )
            self.log(
                f"profile: steps {self._start_step + 1}-{progress.batch} recorded in {trace}"
            )
            self._profile, self._done = None, True
