"""What a run reports: a progress bar, `metrics.jsonl`, a plain-text log, and honest throughput.

Only rank 0 writes; other ranks get a Monitor whose methods do nothing. Throughput is wall time
between two logged steps, minus time spent inside `paused()` (evaluation, checkpointing), so the
tokens/s number measures training alone. Logged steps are the only ones that wait for the device
(`RunningSum.pop`), so the time between two of them is the device's time, not the launch time.

Each record also carries, where the hardware allows:
- `mfu`: model FLOPs utilization, the model's own FLOPs formula times the measured rate, over
  the peak of every device in the run at the run's precision (`PEAK_FLOPS`, by device name).
  On the CPU, or on a GPU missing from the table, it is left out rather than guessed.
- memory: `cuda_max_allocated_gb` / `cuda_max_reserved_gb` (peaks since the last record, this
  rank's device) and `rss_gb` (this process's resident memory).
- `eta_s`: wall-clock seconds to `max_duration` at the rate measured since this process started
  (evaluation and checkpoints included: it is a wall clock).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as torch_dist
from tqdm import tqdm

from runtime import config, dist
from runtime.trackers import Trackers
from runtime.time import Progress, Time, TimeUnit

# Dense peak FLOP/s per device, from the vendors' data sheets (sparsity not counted), keyed by
# a pattern searched in `torch.cuda.get_device_name()`, first match wins (so the more specific
# names come first). Columns: fp32 (CUDA cores), tf32 (tensor cores, used for fp32 matmuls when
# `tf32_matmuls()`), bf16.
# A GPU missing here logs no MFU and says so; add a row (a pull request is welcome).
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H200", {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12}),
    (r"H100.*(PCIe)", {"fp32": 51.2e12, "tf32": 378e12, "bf16": 756e12}),
    (r"H100.*NVL", {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835e12}),
    (r"H100|GH200", {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12}),  # SXM
    (r"A100", {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12}),
    (r"L40S", {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12}),
    (r"\bL4\b", {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12}),
    (r"\bA10\b", {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12}),
    (r"RTX 4090", {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12}),
    (r"V100", {"fp32": 15.7e12, "tf32": 15.7e12, "bf16": 0.0}),  # no bf16 tensor cores
)


# The key every task's evaluation reports: a record holding it is always printed.
EVALUATED = "val_loss"


def tf32_matmuls() -> bool:
    """Whether fp32 matmuls run on TF32 tensor cores. Read through the backend API of torch
    2.9+, which also reflects the legacy settings; the legacy getters raise once a script has
    used the new API (as the generated loops do)."""
    return torch.backends.cuda.matmul.fp32_precision == "tf32"


def peak_flops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """The peak FLOP/s of one device for a run's precision; None when unknown.

    `precision` is the Config's: fp32 (tf32 peak when `tf32` matmuls are allowed), amp_bf16 or
    bf16 (the bf16 tensor-core peak).
    """
    column = "bf16" if "bf16" in precision else ("tf32" if tf32 else "fp32")
    for pattern, peaks in PEAK_FLOPS:
        if re.search(pattern, device_name):
            return peaks[column] or None
    return None


def training_flops(
    model: torch.nn.Module, example: torch.Tensor | dict[str, torch.Tensor]
) -> float:
    """Training FLOPs (forward + backward) of one forward on `example`, counted by torch.

    For models without a closed-form count (convolutions, Hugging Face models): torch's
    `FlopCounterMode` counts the matmuls and convolutions of one forward in evaluation mode
    (no dropout, no BatchNorm statistics updated, no gradients), and the backward is taken as
    twice the forward, the usual 3x (each weight's product forward, two products backward).
    `example` is a batch (a tensor, or a dict of keyword tensors); divide by what it holds.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.eval()
    try:
        # Attention through the math kernel: its matmuls are counted on every device (the
        # counter knows CUDA's fused kernels but not the CPU's flash kernel).
        with (
            torch.no_grad(),
            sdpa_kernel(SDPBackend.MATH),
            FlopCounterMode(display=False) as counter,
        ):
            if isinstance(example, dict):
                model(**example)
            else:
                model(example)
    finally:
        model.train(was_training)
    return 3.0 * counter.get_total_flops()


def rss_gb() -> float:
    """This process's resident memory (GB): /proc on Linux, else the peak so far."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e9
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(
            resource.RUSAGE_SELF
        ).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / 1e9 if sys.platform == "darwin" else peak * 1024 / 1e9


class RunningSum:
    """A sum kept on the device between logged steps, so unlogged steps never wait for it.

    `add` is an in-place device add (no sync); `pop` sums over ranks, reads the value once
    (one all-reduce, one device sync) and starts over.
    """

    def __init__(
        self, device: torch.device, group: torch_dist.ProcessGroup | None = None
    ) -> None:
        self.total = torch.zeros((), device=device)
        self.count = 0
        self.group = group  # the ranks summed (DistEnv.group); None: all

    def add(self, value: torch.Tensor, count: int) -> None:
        self.total += value.detach()
        self.count += count

    def pop(self) -> float:
        """The sum over ranks divided by the count since the last pop (0 counted: nan)."""
        mean = (
            dist.reduce_sum(self.total, self.group).item() / self.count
            if self.count
            else float("nan")
        )
        self.total.zero_()
        self.count = 0
        return mean


def _bar_total(
    max_duration: Time, batches_per_epoch: int, global_batch_size: int
) -> tuple[int, str]:
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


class RunSettings(Protocol):
    """The fields of a training script's Config that `Monitor.from_config` reads."""

    max_duration: Time  # the progress bar's end and the ETA's
    global_batch_size: int  # samples per step: throughput and the bar's unit
    console_interval: Time  # how often a record is printed when there is no terminal
    precision: str  # the peak FLOP/s MFU divides by
    trackers: str  # tensorboard,mlflow,wandb ("": none)


class Monitor:
    def __init__(
        self,
        run_dir: Path,
        max_duration: Time,
        global_batch_size: int,
        enabled: bool = True,
        *legacy: Any,
    ) -> None:
        """The run's log, metrics and progress bar; `info` works at once, `log` and the
        bar after `start(progress)` (called once the run has resumed, so a resumed run's
        metrics.jsonl and bar continue from where it stands). A training script makes
        its monitor with `from_config` and starts it with `begin`; projects generated by
        scaffold 0.3.0 call this, `start`, `record_run`, `measure` and `open_trackers`.

        Projects generated by scaffold 0.1.0 and 0.2.0 call `Monitor(run_dir, progress,
        max_duration, global_batch_size, enabled)` after their resume: that form starts
        at once, so they train unchanged until `scaffold upgrade`.
        """
        progress = None
        if isinstance(max_duration, Progress):  # the 0.1.0/0.2.0 form
            progress = max_duration
            max_duration, global_batch_size = global_batch_size, enabled  # type: ignore
            enabled = legacy[0] if legacy else True
        self.enabled = enabled
        self.metrics_path = run_dir / "metrics.jsonl"
        self.log_path = run_dir / "log.txt"
        self._bar: tqdm | None = None
        self._paused = 0.0
        self._train_seconds = 0.0
        self._max_duration = max_duration
        self._global_batch_size = global_batch_size
        self._flops_per_token = 0.0
        self._flops_per_sample = 0.0
        self._peak = 0.0  # FLOP/s of all devices together; 0: no MFU
        self._cuda: torch.device | None = None
        self._trackers: Trackers | None = None
        self._settings: tuple[RunSettings, dist.DistEnv, float, float] | None = None
        self.start(Progress(batches_per_epoch=1), keep_metrics=False)
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
        if progress is not None:
            self.start(progress)

    @classmethod
    def from_config(
        cls,
        run_dir: Path,
        cfg: RunSettings,
        env: dist.DistEnv,
        *,
        flops_per_token: float = 0.0,
        flops_per_sample: float = 0.0,
    ) -> Monitor:
        """The monitor of a run: `info` works at once; `begin(progress, script)`, once
        the run has resumed, writes the run's record and starts metrics and the bar.
        Only rank 0's writes anything. The model's training FLOPs per token (or per
        sample) give MFU on GPUs with a known peak."""
        monitor = cls(run_dir, cfg.max_duration, cfg.global_batch_size, env.is_main)
        monitor._settings = (cfg, env, flops_per_token, flops_per_sample)
        return monitor

    def begin(self, progress: Progress, script: Path) -> None:
        """Start from where the run stands (`start`), then record it: config.toml with
        every value that ran, a copy of `script`, the versions and the device
        (`record_run`), MFU's peak and the FLOPs (`measure`), and the trackers."""
        if self._settings is None:
            raise TypeError("begin() needs a Monitor made by Monitor.from_config")
        cfg, env, flops_per_token, flops_per_sample = self._settings
        self.start(progress, cfg.console_interval)
        config_toml = config.to_toml(cfg)
        self.record_run(config_toml, script, env.device, env.devices)
        self.measure(
            env.device,
            env.devices,
            cfg.precision,
            flops_per_token=flops_per_token,
            flops_per_sample=flops_per_sample,
        )
        self.open_trackers(cfg.trackers, config_toml)

    def start(
        self,
        progress: Progress,
        console_interval: Time | None = None,
        keep_metrics: bool = True,
    ) -> None:
        """Measure from where training stands; drop metrics.jsonl lines logged after it
        (a resumed run logs those steps again) and show the progress bar.

        Without a terminal there is no bar: records are printed (and go to log.txt)
        instead, at most one per `console_interval` (None: every one), the first of
        this start and every evaluation's included; metrics.jsonl keeps them all.
        """
        self._console_interval = console_interval
        self._console_slot: int | None = None  # the interval of the last printed record
        self._last_time = time.perf_counter()
        self._last_samples = progress.sample
        self._last_tokens = progress.token
        self._last_batch = progress.batch
        self._start_time = self._last_time
        self._start_fraction = progress.fraction(self._max_duration)
        if not (self.enabled and keep_metrics):
            return
        self._keep_metrics_until(progress.batch)
        total, self._unit = _bar_total(
            self._max_duration, progress.batches_per_epoch, self._global_batch_size
        )
        self._bar = tqdm(
            total=total,
            initial=min(
                progress.token if self._unit == "tok" else progress.batch, total
            ),
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
        kept = [
            line
            for line in self.metrics_path.read_text().splitlines()
            if _logged_step(line) <= step
        ]
        tmp = self.metrics_path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        tmp.replace(self.metrics_path)

    def logged(self, key: str) -> list[tuple[int, float]]:
        """(step, value) of every record in metrics.jsonl that holds `key`, oldest first:
        the run's history over all its starts (rank 0; empty on the other ranks)."""
        if not (self.enabled and self.metrics_path.exists()):
            return []
        lines = self.metrics_path.read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        return [(record["step"], record[key]) for record in records if key in record]

    def info(self, message: str) -> None:
        """A line for the console (above the bar) and the plain-text log."""
        if not self.enabled:
            return
        stamped = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}"
        tqdm.write(message, file=sys.stdout)
        with open(self.log_path, "a") as log:
            log.write(stamped + "\n")

    def record_run(
        self, config_toml: str, script: Path, device: torch.device, world_size: int
    ) -> None:
        """Write the resolved config, a copy of the exact source that runs, and the environment."""
        if not self.enabled:
            return
        run_dir = self.metrics_path.parent
        (run_dir / "config.toml").write_text(config_toml)
        (run_dir / script.name).write_text(script.read_text())
        device_name = (
            torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or "cpu"
        )
        self.info(
            f"python {platform.python_version()}, torch {torch.__version__}, "
            f"device {device} ({device_name}), world size {world_size}"
        )

    def measure(
        self,
        device: torch.device,
        world_size: int,
        precision: str,
        flops_per_token: float = 0.0,
        flops_per_sample: float = 0.0,
        peak: float | None = None,
    ) -> None:
        """Log MFU (given the model's training FLOPs per token or per sample) and memory.

        Every rank calls it (it is cheap). `peak` is one device's FLOP/s; by default it comes
        from `PEAK_FLOPS` for this GPU at this precision. MFU divides by peak x world size
        (every rank is assumed to run the same device). On the CPU, MFU is left out.
        """
        self._flops_per_token, self._flops_per_sample = (
            flops_per_token,
            flops_per_sample,
        )
        for flops, unit in ((flops_per_token, "token"), (flops_per_sample, "sample")):
            if flops:
                self.info(f"model: {flops:.4g} training FLOPs per {unit}")
        if device.type == "cuda":
            self._cuda = device
            torch.cuda.reset_peak_memory_stats(device)
            name = torch.cuda.get_device_name(device)
            peak = peak or peak_flops(name, precision, tf32_matmuls())
        elif peak is None:
            self.info(
                f"mfu: not measured on {device.type} (no peak FLOP/s to compare with)"
            )
            return
        else:
            name = device.type
        if peak is None:
            self.info(
                f"mfu: not measured: no peak FLOP/s for {name!r} at {precision} in runtime.monitor.PEAK_FLOPS"
            )
            return
        self._peak = peak * world_size
        self.info(
            f"mfu: against {peak / 1e12:.1f} TFLOP/s per device ({name}, {precision}) x {world_size}"
        )

    def open_trackers(self, names: str, config_toml: str) -> None:
        """Send every record to these trackers too (`runtime.trackers`; rank 0 only)."""
        if self.enabled and names:
            self._trackers = Trackers(
                names, self.metrics_path.parent, config_toml, step=self._last_batch
            )
            self.info(f"trackers: {names}")

    def update(self, progress: Progress) -> None:
        """Move the progress bar to where training is (cheap; every step)."""
        if self._bar is not None:
            position = min(
                progress.token if self._unit == "tok" else progress.batch,
                self._bar.total,
            )
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
        record: dict[str, Any] = {
            "step": progress.batch,
            "epoch": progress.epoch,
            **metrics,
        }
        counts_tokens = (
            progress.token > 0
        )  # language tasks; images have no tokens to count
        record["samples"] = progress.sample  # x axes for plots
        if counts_tokens:
            record["tokens"] = progress.token
        if steps > 0:
            record["samples_per_s"] = (progress.sample - self._last_samples) / elapsed
            if counts_tokens:
                record["tokens_per_s"] = (progress.token - self._last_tokens) / elapsed
            record["step_ms"] = 1000 * elapsed / steps
            flops = (progress.token - self._last_tokens) * self._flops_per_token + (
                progress.sample - self._last_samples
            ) * self._flops_per_sample
            if self._peak and flops:
                record["mfu"] = flops / elapsed / self._peak
        if self._cuda is not None:
            record["cuda_max_allocated_gb"] = (
                torch.cuda.max_memory_allocated(self._cuda) / 1e9
            )
            record["cuda_max_reserved_gb"] = (
                torch.cuda.max_memory_reserved(self._cuda) / 1e9
            )
            torch.cuda.reset_peak_memory_stats(self._cuda)
        record["rss_gb"] = rss_gb()
        done = progress.fraction(self._max_duration) - self._start_fraction
        if done > 0:
            left = max(1.0 - progress.fraction(self._max_duration), 0.0)
            record["eta_s"] = (now - self._start_time) / done * left
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
        if self._trackers is not None:
            self._trackers.log(record, progress.batch)
        if self._bar is not None:
            shown = {
                k: v
                for k, v in record.items()
                if k in ("loss", "val_loss", "lr", "tokens_per_s", "mfu")
            }
            self._bar.set_postfix(
                {k: f"{v:.4g}" for k, v in shown.items()}, refresh=False
            )
            self.update(progress)
        if (self._bar is None or self._bar.disable) and self._console_due(
            progress, record
        ):
            # No live bar (not a terminal): print the record so logs still show progress;
            # grouped metrics ("l2_norm/grad/wte.weight": one per layer) only in the files.
            self.info(
                " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in record.items()
                    if "/" not in k
                )
            )

    def _console_due(self, progress: Progress, record: dict[str, Any]) -> bool:
        """Whether to print this record: the first one of a new console interval (by the
        fraction of the run for a dur interval, so an epoch-long run prints within its
        epoch), and every one holding an evaluation."""
        interval = self._console_interval
        if interval is None:
            slot = progress.batch
        elif interval.unit is TimeUnit.DURATION:  # 1e-9: 0.05dur at step 30 of 600
            slot = int(progress.fraction(self._max_duration) / interval.value + 1e-9)
        else:
            slot = progress.count(interval.unit) // int(interval.value)
        due = slot != self._console_slot or EVALUATED in record
        self._console_slot = slot
        return due

    def log_image(self, key: str, path: Path, step: int) -> None:
        """Send an image file written under the run folder to the trackers (rank 0)."""
        if self.enabled and self._trackers is not None:
            self._trackers.image(key, path, step)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._trackers is not None:
            self._trackers.close()
