"""Smoke tests: a few CPU training steps; a resumed run equals an uninterrupted one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
# Small and fast: a short sequence, a small batch split into two microbatches.
SMALL = [
    "--device=cpu",
    "--seq_len=32",
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--eval_batches=1",
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


def train(
    workdir: Path, *args: str, crash: bool = False
) -> subprocess.CompletedProcess:
    script = str(PROJECT / "train.py")
    command = [sys.executable, script, *SMALL, *args]
    if crash:
        command = [
            sys.executable,
            "-c",
            CRASH_AFTER_STEP_4,
            str(PROJECT),
            script,
            *SMALL,
            *args,
        ]
    return subprocess.run(
        command, cwd=workdir, capture_output=True, text=True, timeout=600
    )


def metrics(workdir: Path, run_name: str) -> list[dict]:
    lines = (workdir / "runs" / run_name / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_loss_falls(tmp_path: Path) -> None:
    result = train(
        tmp_path, "--run_name=falls", "--max_duration=30ba", "--eval_interval=10ba"
    )
    assert result.returncode == 0, result.stderr
    records = metrics(tmp_path, "falls")
    assert [r["step"] for r in records] == list(range(1, 31))
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert len(val) == 3 and val[-1] < val[0], val
    assert records[-1]["loss"] < records[0]["loss"]
    assert all(r["tokens_per_s"] > 0 for r in records)
    assert (
        tmp_path / "runs" / "falls" / "checkpoints" / "step-30" / "COMPLETE"
    ).is_file()


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
            (r["step"], r["loss"], r["lr"], r.get("val_loss"))
            for r in metrics(tmp_path, run_name)
        ]

    # Bitwise: the same data order, RNG, optimizer state and schedule after the restart.
    assert trajectory("resumed") == trajectory("whole")
