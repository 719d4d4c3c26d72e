"""`scaffold plot`: one PNG of the given runs' curves, each run named in the legend."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from conftest import scaffold_cli


def write_run(folder: Path, slope: float, val_every: int = 5) -> Path:
    folder.mkdir(parents=True)
    lines = []
    for step in range(1, 21):
        record = {
            "step": step,
            "epoch": 0,
            "loss": 5 - slope * step,
            "lr": 1e-3 * min(1, step / 5),
            "samples": 8 * step,
            "tokens": 1024 * step,
            "tokens_per_s": 1e4 + step,
            "train_s": 0.1 * step,
        }
        if step % val_every == 0:
            record["val_loss"] = 5.1 - slope * step
        lines.append(json.dumps(record))
    (folder / "metrics.jsonl").write_text(
        "\n".join(lines) + '\n{"step": 21, "lo'
    )  # torn last line
    return folder


def test_plot_overlays_two_runs_by_name(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from scaffold.plot import plot_runs

    baseline = write_run(tmp_path / "runs" / "gpt2-baseline", slope=0.1)
    speedup = write_run(tmp_path / "runs" / "gpt2-speedup", slope=0.2)
    figure = plot_runs([baseline, speedup], "tokens")
    loss, lr, throughput = figure.axes
    assert [t.get_text() for t in loss.get_legend().get_texts()] == [
        "gpt2-baseline loss",
        "gpt2-baseline val_loss",
        "gpt2-speedup loss",
        "gpt2-speedup val_loss",
    ]
    assert [t.get_text() for t in lr.get_legend().get_texts()] == [
        "gpt2-baseline",
        "gpt2-speedup",
    ]
    assert list(loss.lines[0].get_xdata()) == [
        1024 * s for s in range(1, 21)
    ]  # x: tokens
    assert list(loss.lines[3].get_ydata()) == [5.1 - 0.2 * s for s in (5, 10, 15, 20)]
    assert throughput.get_ylabel() == "tokens_per_s" and loss.get_xlabel() == "tokens"

    out = tmp_path / "compare.png"
    result = scaffold_cli("plot", str(baseline), str(speedup), "-o", str(out))
    assert result.returncode == 0, result.stderr
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])  # the IHDR chunk
    assert (width, height) == (1500, 400)  # three 5x4 inch panels at 100 dpi
    assert len(data) > 20_000  # curves, not an empty canvas


def test_plot_rejects_a_folder_without_metrics(tmp_path: Path) -> None:
    result = scaffold_cli("plot", str(tmp_path / "nope"), "-o", str(tmp_path / "x.png"))
    assert result.returncode == 2 and "no metrics.jsonl" in result.stderr
    assert result.stderr.count("\n") == 1 and not (tmp_path / "x.png").exists()
    bad_axis = scaffold_cli(
        "plot",
        str(write_run(tmp_path / "r", 0.1)),
        "--x",
        "epochs",
        "-o",
        str(tmp_path / "x.png"),
    )
    assert (
        bad_axis.returncode == 2
        and "choose one of step, tokens, samples, time" in bad_axis.stderr
    )
