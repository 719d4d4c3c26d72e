"""What a run reports: a progress bar, `metrics.jsonl`, a plain-text log, and honest throughput.

Only rank 0 writes; other ranks get a Monitor whose methods do nothing. Throughput is wall time
between two logged steps, minus time spent inside `paused()` (evaluation, checkpointing), so the
tokens/s number measures training alone.
"""

from __future__ import annotations

import contextlib
import json
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from runtime.time import Progress, Time, TimeUnit


def _bar_total(max_duration: Time, batches_per_epoch: int, global_batch_size: int) -> tuple[int, str]:
    """The progress bar's length and unit: optimizer steps, except for token budgets."""
    if max_duration.unit == TimeUnit.TOKEN:
        return int(max_duration.value), "tok"
    if max_duration.unit == TimeUnit.EPOCH:
        return int(max_duration.value) * batches_per_epoch, "ba"
    if max_duration.unit == TimeUnit.SAMPLE:
        return -(-int(max_duration.value) // global_batch_size), "ba"
    return int(max_duration.value), "ba"


def _logged_step(line: str) -> float:
    """The step of a metrics.jsonl line; a torn line (crash mid-write) or blank one is dropped (inf)."""
    try:
        record = json.loads(line)
    except ValueError:
        return float("inf")
    step = record.get("step", 0) if isinstance(record, dict) else None
    return step if isinstance(step, (int, float)) else float("inf")


class Monitor:
    def __init__(
        self,
        run_dir: Path,
        progress: Progress,
        max_duration: Time,
        global_batch_size: int,
        enabled: bool = True,
    ) -> None:
        self.enabled = enabled
        self.metrics_path = run_dir / "metrics.jsonl"
        self.log_path = run_dir / "log.txt"
        self._bar: tqdm | None = None
        self._paused = 0.0
        self._train_seconds = 0.0
        self._last_time = time.perf_counter()
        self._last_samples = progress.sample
        self._last_tokens = progress.token
        self._last_batch = progress.batch
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._keep_metrics_until(progress.batch)
        total, self._unit = _bar_total(max_duration, progress.batches_per_epoch, global_batch_size)
        self._bar = tqdm(
            total=total,
            initial=min(progress.token if self._unit == "tok" else progress.batch, total),
            unit=self._unit,
            unit_scale=self._unit == "tok",
            dynamic_ncols=True,
            file=sys.stderr,
            disable=None,  # hidden when stderr is not a terminal (CI, redirected logs)
        )

    def _keep_metrics_until(self, step: int) -> None:
        """On resume, drop lines logged after the checkpoint, so no step appears twice."""
        if not self.metrics_path.exists():
            return
        kept = [line for line in self.metrics_path.read_text().splitlines() if _logged_step(line) <= step]
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.metrics_path)

    def info(self, message: str) -> None:
        """A line for the console (above the bar) and the plain-text log."""
        if not self.enabled:
            return
        stamped = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}"
        tqdm.write(message, file=sys.stdout)
        with open(self.log_path, "a") as log:
            log.write(stamped + "\n")

    def record_run(self, config_toml: str, script: Path, device: torch.device, world_size: int) -> None:
        """Write the resolved config, a copy of the exact source that runs, and the environment."""
        if not self.enabled:
            return
        run_dir = self.metrics_path.parent
        (run_dir / "config.toml").write_text(config_toml)
        (run_dir / script.name).write_text(script.read_text())
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
        self.info(
            f"python {platform.python_version()}, torch {torch.__version__}, "
            f"device {device} ({device_name}), world size {world_size}"
        )

    def update(self, progress: Progress) -> None:
        """Move the progress bar to where training is (cheap; every step)."""
        if self._bar is not None:
            position = min(progress.token if self._unit == "tok" else progress.batch, self._bar.total)
            # tqdm.update redraws at most every `mininterval` (0.1 s): cheap on every step.
            self._bar.update(position - self._bar.n)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside does not count against throughput (evaluation, checkpoints)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._paused += time.perf_counter() - start

    def log(self, progress: Progress, **metrics: float) -> None:
        """Append one JSON line: step, the given metrics, and throughput since the last log."""
        now = time.perf_counter()
        elapsed = max(now - self._last_time - self._paused, 1e-9)
        steps = progress.batch - self._last_batch
        record: dict[str, Any] = {"step": progress.batch, "epoch": progress.epoch, **metrics}
        if steps > 0:
            record["samples_per_s"] = (progress.sample - self._last_samples) / elapsed
            record["tokens_per_s"] = (progress.token - self._last_tokens) / elapsed
            record["step_ms"] = 1000 * elapsed / steps
        # Training seconds (no evaluation or checkpoint time) since this process started:
        # the x axis of time-to-quality comparisons.
        self._train_seconds += elapsed
        record["train_s"] = self._train_seconds
        self._last_time, self._paused = now, 0.0
        self._last_samples, self._last_tokens, self._last_batch = (
            progress.sample,
            progress.token,
            progress.batch,
        )
        if not self.enabled:
            return
        with open(self.metrics_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if self._bar is not None:
            shown = {k: v for k, v in record.items() if k in ("loss", "val_loss", "lr", "tokens_per_s")}
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
            self.update(progress)
        if self._bar is None or self._bar.disable:
            # No live bar (not a terminal): print the record so logs still show progress.
            self.info(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
