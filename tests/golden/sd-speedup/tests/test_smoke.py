"""Smoke tests: CPU steps on the digits; a resumed run equals a whole one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parent.parent
# Small and fast: the tiny parts (a VAE fitted for 20 steps), a batch of 16 in two
# microbatches, one sample per prompt in 5 DDIM steps.
SMALL = [
    "--device=cpu",
    "--model=tiny",
    "--tiny_vae_steps=20",
    "--global_batch_size=16",
    "--device_microbatch_size=8",
    "--lr=1e-3",
    "--samples_per_prompt=1",
    "--sample_steps=5",
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


def test_loss_falls_and_samples(tmp_path: Path) -> None:
    result = train(
        tmp_path, "--run_name=falls", "--max_duration=30ba", "--eval_interval=15ba"
    )
    assert result.returncode == 0, result.stderr
    records = metrics(tmp_path, "falls")
    evals = [r for r in records if "val_loss" in r]
    assert len(evals) == 2 and evals[-1]["val_loss"] < evals[0]["val_loss"], evals
    first, last = [r["loss"] for r in records[:5]], [r["loss"] for r in records[-5:]]
    assert sum(last) < sum(first), (first, last)
    assert 0 <= evals[-1]["judged_accuracy"] <= 1
    run = tmp_path / "runs" / "falls"
    assert (run / "samples" / "step-30.png").is_file()
    assert (run / "pipeline" / "model_index.json").is_file()


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
            (r["step"], r["loss"], r["lr"], r.get("val_loss"), r.get("judged_accuracy"))
            for r in metrics(tmp_path, run_name)
        ]

    # Bitwise: the same data order, RNG, optimizer state and schedule after the restart.
    assert trajectory("resumed") == trajectory("whole")
