"""Early stopping: triggers on a plateau after exactly `patience`, not before; min_delta and
mode; a stopped run's state survives a checkpoint."""

from __future__ import annotations

from runtime.early_stop import EarlyStopper, check
from runtime.time import Progress, Time

MAX = Time.parse("100ba")


def run(
    stopper: EarlyStopper, values: list[float | None], progress: Progress | None = None
) -> int | None:
    """Feed one value per step (None: not logged that step); the step it stopped at, or None."""
    progress = progress or Progress(batches_per_epoch=1000)
    for value in values:
        progress.advance(samples=4, tokens=64)
        metrics = {} if value is None else {"val_loss": value}
        if stopper.update(progress, metrics, MAX):
            return progress.batch
    return None


def test_stops_after_patience_on_a_plateau_and_not_before() -> None:
    lines: list[str] = []
    stopper = EarlyStopper("val_loss", Time.parse("3ba"), log=lines.append)
    # Improves until step 4 (best 1.0), then flat: 3 batches later (step 7) it stops.
    assert run(stopper, [4.0, 3.0, 2.0, 1.0, 1.0, 1.5, 1.0, 0.5]) == 7
    assert stopper.stopped and stopper.best == 1.0 and stopper.best_step == 4
    assert (
        "early stopping at step 7: val_loss has not improved" in lines[-1]
        and "at step 4" in lines[-1]
    )
    # Still improving, slowly: never stops.
    assert (
        run(
            EarlyStopper("val_loss", Time.parse("3ba"), log=lines.append),
            [5 - i / 10 for i in range(20)],
        )
        is None
    )


def test_patience_counts_steps_not_evaluations_and_min_delta_and_mode() -> None:
    quiet = {"log": lambda line: None}
    # Logged every 2nd step: patience 5ba passes between step 2 (best) and step 8.
    assert (
        run(
            EarlyStopper("val_loss", Time.parse("5ba"), **quiet),
            [None, 2.0, None, 2.0, None, 2.0, None, 2.0],
        )
        == 8
    )
    # Improvements of 0.01 are not more than min_delta 0.05: step 1 stays the best.
    assert (
        run(
            EarlyStopper("val_loss", Time.parse("2ba"), 0.05, **quiet),
            [1.0, 0.99, 0.98, 0.97],
        )
        == 3
    )
    # mode=max: a rising accuracy keeps going; a falling one stops. 0.1dur of 100ba = 10ba.
    assert (
        run(
            EarlyStopper("val_loss", Time.parse("0.1dur"), mode="max", **quiet),
            [i / 30 for i in range(30)],
        )
        is None
    )
    assert (
        run(
            EarlyStopper("val_loss", Time.parse("0.1dur"), mode="max", **quiet),
            [0.5] + [0.4] * 20,
        )
        == 11
    )
    # Off: never stops, saves nothing.
    off = EarlyStopper("", Time.parse("1ba"), **quiet)
    assert run(off, [1.0] * 10) is None and off.state_dict() == {}


def test_state_survives_a_checkpoint() -> None:
    lines: list[str] = []
    first = EarlyStopper("val_loss", Time.parse("4ba"), log=lines.append)
    progress = Progress(batches_per_epoch=1000)
    assert (
        run(first, [2.0, 1.0, 1.0], progress) is None
    )  # best at step 2, 1 step of patience used
    resumed = EarlyStopper("val_loss", Time.parse("4ba"), log=lines.append)
    resumed.load_state_dict(first.state_dict())
    assert run(resumed, [1.0, 1.0, 1.0], progress) == 6  # keeps counting from step 2
    stopped = EarlyStopper("val_loss", Time.parse("4ba"), log=lines.append)
    stopped.load_state_dict(resumed.state_dict())
    assert stopped.stopped and "nothing to train" in lines[-1]
    assert run(stopped, [0.1], progress) == 7  # stays stopped, even on an improvement
    # Early stopping switched off on resume: the run trains on.
    off = EarlyStopper("", Time.parse("4ba"), log=lines.append)
    off.load_state_dict(resumed.state_dict())
    assert not off.stopped and run(off, [1.0], progress) is None
    # 0.2.0 saved it merged with the microbatch search's state: other keys are ignored.
    merged = EarlyStopper("val_loss", Time.parse("4ba"), log=lines.append)
    merged.load_state_dict({"microbatch_size": 3, **first.state_dict()})
    assert (merged.best, merged.best_step, merged.stopped) == (1.0, 2, False)
    # Saved with early stopping off (an empty state): a fresh start.
    fresh = EarlyStopper("val_loss", Time.parse("4ba"), log=lines.append)
    fresh.load_state_dict({})
    assert fresh.best is None and not fresh.stopped


def test_check() -> None:
    assert check("", Time.parse("1ba"), 0.0) is None
    assert "early_stop_min_delta" in check("val_loss", Time.parse("1ba"), -1.0)


def test_an_algorithms_stop_is_saved_with_its_reason_without_a_metric() -> None:
    lines: list[str] = []
    quiet = EarlyStopper("", Time.parse("3ba"), log=lines.append)  # no early stopping
    assert quiet.state_dict() == {}  # nothing to save: checkpoints as before
    assert quiet.stop("threshold_stopper: val_loss 2.9 < 3 at step 5; stopping")
    assert quiet.stopped and lines == [
        "threshold_stopper: val_loss 2.9 < 3 at step 5; stopping"
    ]
    resumed = EarlyStopper("", Time.parse("3ba"), log=lines.append)
    resumed.load_state_dict(quiet.state_dict())
    assert resumed.stopped and resumed.reason == quiet.reason
    assert run(resumed, [1.0]) == 1  # update() keeps saying stop
    assert lines[-1] == (
        "this run stopped at its checkpoint (threshold_stopper: val_loss 2.9 < 3 at step 5; "
        "stopping); nothing to train (start a new run_name to train more)"
    )
