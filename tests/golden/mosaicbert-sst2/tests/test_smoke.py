"""Smoke tests: CPU steps on a separable toy set; a resumed run equals a whole one."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
# Small and fast: the offline tiny model, short texts, two microbatches per batch.
SMALL = [
    "--device=cpu",
    "--model=tiny",
    "--max_seq_len=16",
    "--global_batch_size=8",
    "--device_microbatch_size=4",
    "--lr=3e-3",
]

# Runs train.py, but dies like a preempted job right after saving the step-4 checkpoint.
CRASH_AFTER_STEP_4 = """
import os, runpy, sys
sys.path.insert(0, sys.argv[1])
import runtime.checkpoint as checkpoint
save = checkpoint.Checkpointer.save
def save_then_die(self, *args, **kwargs):
    path = save(self, *args, **kwargs)
    if path.name == "step-4":
        os._exit(17)
    return path
checkpoint.Checkpointer.save = save_then_die
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def toy_data(folder: Path) -> Path:
    """Reviews whose label is in their words: 'good ...' is 1, 'bad ...' is 0."""
    words = ["movie", "plot", "actors", "music", "story", "ending", "film", "scenes"]
    path = folder / "toy.csv"
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["sentence", "label"])
        for i in range(240):
            label = i % 2
            mood = ["bad awful dull", "good great fine"][label].split()[i % 3]
            writer.writerow(
                [f"{words[i % 8]} {mood} {words[(i * 5) % 8]} {mood}", label]
            )
    return path


def train(
    workdir: Path, *args: str, crash: bool = False
) -> subprocess.CompletedProcess:
    script = str(PROJECT / "train.py")
    data = f"--data={toy_data(workdir)}"
    command = [sys.executable, script, *SMALL, data, *args]
    if crash:
        command = [
            sys.executable,
            "-c",
            CRASH_AFTER_STEP_4,
            str(PROJECT),
            script,
            *SMALL,
            data,
            *args,
        ]
    return subprocess.run(
        command, cwd=workdir, capture_output=True, text=True, timeout=600
    )


def metrics(workdir: Path, run_name: str) -> list[dict]:
    lines = (workdir / "runs" / run_name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_accuracy_rises(tmp_path: Path) -> None:
    result = train(
        tmp_path, "--run_name=rises", "--max_duration=24ba", "--eval_interval=12ba"
    )
    assert result.returncode == 0, result.stderr
    records = metrics(tmp_path, "rises")
    evals = [r for r in records if "accuracy" in r]
    assert len(evals) == 2 and evals[-1]["accuracy"] > 0.75, evals


def test_resume_equals_uninterrupted(tmp_path: Path) -> None:
    common = ["--max_duration=8ba", "--save_interval=4ba", "--eval_interval=4ba"]
    whole = train(tmp_path, "--run_name=whole", *common)
    assert whole.returncode == 0, whole.stderr
    crashed = train(tmp_path, "--run_name=resumed", *common, crash=True)
    assert crashed.returncode == 17, crashed.stderr
    resumed = train(tmp_path, "--run_name=resumed", *common)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout

    def trajectory(run_name: str) -> list[tuple]:
        return [
            (r["step"], r["loss"], r["lr"], r.get("accuracy"))
            for r in metrics(tmp_path, run_name)
        ]

    # Bitwise: the same data order, RNG, optimizer state and schedule after the restart.
    assert trajectory("resumed") == trajectory("whole")
