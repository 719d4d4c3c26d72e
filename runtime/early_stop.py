"""Early stopping: end training when a logged metric has stopped improving.

The loop hands every step's logged metrics to `update`; the watched metric is compared only on
steps where it was logged (e.g. `val_loss` at evaluations). Training stops once `patience` (a
Time string: `500ba`, `2ep`, `0.1dur`) has passed since the last improvement by more than
`min_delta`. The best value, when it was reached and whether the run stopped are saved in the
checkpoint (`state_dict`), so a resumed run keeps counting, and a stopped run stays stopped.
An algorithm that ends training for a reason of its own (threshold_stopper) calls `stop`: the
same saved verdict, with its reason.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from runtime.time import Progress, Time


def check(metric: str, patience: Time, min_delta: float) -> str | None:
    """A one-line problem with the early-stopping settings, or None."""
    if metric and patience.value <= 0:
        return (
            f"early_stop_patience={patience} must be more than 0 (e.g. 500ba or 0.1dur)"
        )
    if min_delta < 0:
        return f"early_stop_min_delta={min_delta} must be >= 0"
    return None


def check_settings(cfg: EarlyStopSettings) -> str | None:
    """`check` of a training script's early_stop_* fields."""
    return check(
        cfg.early_stop_metric, cfg.early_stop_patience, cfg.early_stop_min_delta
    )


class EarlyStopSettings(Protocol):
    """The fields of a training script's Config that `EarlyStopper.from_config` reads."""

    early_stop_metric: str  # the logged metric watched ("": never stop)
    early_stop_patience: Time  # how long without improvement
    early_stop_min_delta: float  # the least change that counts as an improvement
    early_stop_mode: str  # min: lower is better; max: higher is better


class EarlyStopper:
    """Watches `metric` (none: never stops). An entry of the loop's checkpointed
    `state`: the resume calls `load_state_dict`, so a stopped run stays stopped."""

    def __init__(
        self,
        metric: str,
        patience: Time,
        min_delta: float = 0.0,
        mode: str = "min",
        log: Callable[[str], None] = print,
    ) -> None:
        self.metric, self.patience, self.min_delta, self.mode = (
            metric,
            patience,
            min_delta,
            mode,
        )
        self.log = log
        self.best: float | None = None
        self.best_step: int = 0
        self.best_at: int = 0  # when, in patience's unit
        self.stopped: bool = False
        self.reason: str = ""  # why stop() ended training ("": not stopped by stop())
        if metric:
            log(
                f"early stopping: on {metric} ({mode}imize, min_delta {min_delta:g}, patience {patience})"
            )

    @classmethod
    def from_config(
        cls, cfg: EarlyStopSettings, log: Callable[[str], None] = print
    ) -> EarlyStopper:
        """The stopper the config's early_stop_* fields describe."""
        return cls(
            cfg.early_stop_metric,
            cfg.early_stop_patience,
            cfg.early_stop_min_delta,
            cfg.early_stop_mode,
            log=log,
        )

    def _improved(self, value: float) -> bool:
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def update(
        self,
        progress: Progress,
        metrics: Mapping[str, float],
        max_duration: Time | None = None,
    ) -> bool:
        """True when training should stop now (and from now on)."""
        if not self.metric or self.metric not in metrics:
            return self.stopped
        patience = progress.resolve(
            self.patience, max_duration
        )  # dur -> max_duration's unit
        now = progress.count(patience.unit)
        value = float(metrics[self.metric])
        if self._improved(value):
            self.best, self.best_step, self.best_at = value, progress.batch, now
        elif now - self.best_at >= patience.value:
            self.stopped = True
            self.log(
                f"early stopping at step {progress.batch}: {self.metric} has not improved by more "
                f"than {self.min_delta:g} on its best, {self.best:.6g} at step {self.best_step}, "
                f"for {patience} (now {value:.6g})"
            )
        return self.stopped

    def stop(self, reason: str) -> bool:
        """End training after this step and on every resume of this run (the verdict is
        saved); logs `reason`. Returns True, for `finished = stopper.stop(...)`."""
        self.stopped, self.reason = True, reason
        self.log(reason)
        return True

    def state_dict(self) -> dict[str, Any]:
        """For checkpoints (JSON). Under the key 0.2.0 merged into its checkpoints'
        `extra`, which `load_state_dict` therefore also reads."""
        if not self.metric and not self.reason:
            return {}
        saved = {
            "best": self.best,
            "best_step": self.best_step,
            "best_at": self.best_at,
            "stopped": self.stopped,
        }
        return {"early_stop": saved | ({"reason": self.reason} if self.reason else {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from `state_dict`: the best so far and when, and whether the run
        stopped (it stays stopped while a metric is watched, or where `stop` ended it).
        Other keys are ignored: a checkpoint of 0.2.0 holds the microbatch search's beside
        these."""
        saved = state.get("early_stop") or {}
        self.best = saved.get("best")
        self.best_step = int(saved.get("best_step", 0))
        self.best_at = int(saved.get("best_at", 0))
        self.reason = str(saved.get("reason", ""))
        stopped = bool(saved.get("stopped", False))
        self.stopped = stopped and bool(self.metric or self.reason)
        if self.reason:
            self.log(
                f"this run stopped at its checkpoint ({self.reason}); nothing to train "
                "(start a new run_name to train more)"
            )
        elif self.stopped:
            self.log(
                f"early stopping: this run stopped at its checkpoint ({self.metric} "
                f"best {self.best:.6g} at step {self.best_step}); nothing to train "
                "(start a new run_name to train more)"
            )
