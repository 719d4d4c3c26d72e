"""`scaffold plot`: the curves of one or more runs in one PNG, runs overlaid by name.

Reads each run's `metrics.jsonl` and draws, against the chosen x axis, the training and
validation loss, the learning rate and the throughput (and MFU where it was logged).
matplotlib is an optional extra (`pip install 'scaffold[plot]'`), imported only here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# x axis name -> the metrics.jsonl field it reads
X_AXES = {"step": "step", "tokens": "tokens", "samples": "samples", "time": "train_s"}


class PlotError(ValueError):
    """Bad input to `scaffold plot`: one line naming the problem and the fix."""


def read_run(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """A run folder (or its metrics.jsonl) -> (run name, records); torn lines are skipped."""
    metrics = path if path.is_file() else path / "metrics.jsonl"
    if not metrics.is_file():
        raise PlotError(
            f"{path}: no metrics.jsonl; pass a run folder such as runs/NAME"
        )
    records = []
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line torn by a crash mid-write
        if isinstance(record, dict) and "step" in record:
            records.append(record)
    if not records:
        raise PlotError(f"{metrics}: no records yet; plot a run that has logged a step")
    name = metrics.parent.name if metrics.name == "metrics.jsonl" else metrics.stem
    return name, records


def _series(
    records: list[dict[str, Any]], x: str, y: str
) -> tuple[list[float], list[float]]:
    pairs = [
        (r[x], r[y])
        for r in records
        if isinstance(r.get(x), (int, float)) and isinstance(r.get(y), (int, float))
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_runs(runs: list[Path], x_axis: str = "step"):  # -> matplotlib Figure
    """The figure: one panel per quantity, one line (colour) per run."""
    if x_axis not in X_AXES:
        raise PlotError(f"--x={x_axis}: choose one of {', '.join(X_AXES)}")
    loaded = [read_run(path) for path in runs]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError(
            "scaffold plot needs matplotlib: pip install 'scaffold[plot]'"
        ) from None
    x = X_AXES[x_axis]
    panels = [
        ("loss", ["loss", "val_loss"]),
        ("learning rate", ["lr"]),
        (
            "throughput",
            [
                (
                    "tokens_per_s"
                    if any("tokens_per_s" in r for _, rs in loaded for r in rs)
                    else "samples_per_s"
                )
            ],
        ),
    ]
    if any("mfu" in r for _, records in loaded for r in records):
        panels.append(("MFU", ["mfu"]))
    figure, axes = plt.subplots(
        1, len(panels), figsize=(5 * len(panels), 4), dpi=100, squeeze=False
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, (title, keys) in zip(axes[0], panels):
        for index, (name, records) in enumerate(loaded):
            for key in keys:
                xs, ys = _series(records, x, key)
                if xs:
                    dashed = key.startswith("val_")
                    label = f"{name} {key}" if len(keys) > 1 else name
                    axis.plot(
                        xs,
                        ys,
                        color=colours[index % len(colours)],
                        linestyle="--" if dashed else "-",
                        marker="o" if dashed else None,
                        markersize=3,
                        label=label,
                    )
        axis.set_title(title)
        axis.set_xlabel(
            {
                "step": "step",
                "tokens": "tokens",
                "samples": "samples",
                "time": "training seconds",
            }[x_axis]
        )
        axis.set_ylabel(keys[0] if len(keys) == 1 else title)
        axis.grid(alpha=0.3)
        if axis.lines:
            axis.legend(fontsize=8)
    figure.tight_layout()
    return figure


def write_plot(runs: list[Path], output: Path, x_axis: str = "step") -> Path:
    figure = plot_runs(runs, x_axis)
    output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(output)
    return output
