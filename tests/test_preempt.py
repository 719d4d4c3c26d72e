"""runtime.preempt: a signal on one rank stops every rank after the same step; SIGTERM under torchrun saves."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from projects import (
    TINY_STEPS,
    checkout_env,
    children,
    read_metrics,
    running,
    torchrun_command,
)
from runtime.preempt import Preemption

HERE = Path(__file__).resolve().parent


def test_a_signal_is_recorded_and_agreed_in_one_process() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    preemption = Preemption()
    try:
        assert not preemption.agreed() and preemption.stopped_by is None
        os.kill(os.getpid(), signal.SIGUSR1)  # handled, not fatal
        assert preemption.agreed() and preemption.stopped_by == "SIGUSR1"
        os.kill(os.getpid(), signal.SIGTERM)
        assert (
            preemption.agreed() and preemption.stopped_by == "SIGUSR1"
        )  # the first reason stays
    finally:
        preemption.close()
    assert signal.getsignal(signal.SIGUSR1) is before


@pytest.mark.parametrize("sig", ["SIGUSR1", "SIGTERM"])
def test_ranks_agree_to_stop_after_the_same_step(sig: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(HERE / "preempt_worker.py"),
            sig,
        ],
        cwd=tmp_path,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [(tmp_path / f"rank{rank}.txt").read_text() for rank in (0, 1)]
    number = int(getattr(signal, sig))
    assert lines == [
        f"rank 0 stopped at 3 by {sig} received 0",
        f"rank 1 stopped at 3 by {sig} received {number}",
    ]


# ---------------------------------------------------------------- SIGTERM to a generated project under torchrun


def torchrun_train(project: Path, workdir: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        torchrun_command(project, 2, *args),
        cwd=workdir,
        env=checkout_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_rows(
    workdir: Path, run_name: str, rows: int, process: subprocess.Popen[str]
) -> None:
    path = workdir / "runs" / run_name / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (path.exists() and len(path.read_text().splitlines()) >= rows):
        assert process.poll() is None, "training ended before the signal"
        assert time.monotonic() < deadline, "no metrics"
        time.sleep(0.05)


def test_sigterm_under_torchrun_saves_and_a_rerun_continues_bitwise(
    generated: dict[str, Path], two_rank_reference: list[dict], tmp_path: Path
) -> None:
    project = generated["gpt2-baseline"]
    first = torchrun_train(project, tmp_path, "--run_name=pre")
    wait_for_rows(tmp_path, "pre", 3, first)
    workers = children(first.pid)
    assert len(workers) == 2
    # Paused, so that the signal lands mid-run however fast the steps are here; SIGTERM goes
    # to one worker only, and is delivered when the workers go on.
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)
    os.kill(workers[-1], signal.SIGTERM)
    for pid in workers:
        os.kill(pid, signal.SIGCONT)
    output, _ = first.communicate(timeout=240)
    assert first.returncode == 0, output[
        -3000:
    ]  # a clean stop: torchrun sees two exits 0
    log = (tmp_path / "runs" / "pre" / "log.txt").read_text()
    stopped = [
        line for line in log.splitlines() if "stopped by SIGTERM after step" in line
    ]
    assert stopped, log[-2000:]
    step = int(stopped[0].split("after step ")[1].split(",")[0])
    assert 3 <= step < TINY_STEPS
    assert (
        tmp_path / "runs" / "pre" / "checkpoints" / f"step-{step}" / "COMPLETE"
    ).exists()

    second = torchrun_train(project, tmp_path, "--run_name=pre")
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 0, output[-3000:]
    assert "resumed from" in (tmp_path / "runs" / "pre" / "log.txt").read_text()
    losses = [row["loss"] for row in read_metrics(tmp_path, "pre")]
    assert losses == [
        row["loss"] for row in two_rank_reference
    ]  # bitwise: nothing lost or redone


def test_a_killed_launcher_leaves_no_rank_running_and_the_rerun_continues_bitwise(
    generated: dict[str, Path], two_rank_reference: list[dict], tmp_path: Path
) -> None:
    """`kill -9` of torchrun (the agent, its workers in sessions of their own): each rank
    sees its parent change at the next agreement, so every rank finishes that step, saves
    and exits; a rerun continues from there, bitwise."""
    project = generated["gpt2-baseline"]
    first = torchrun_train(project, tmp_path, "--run_name=orphan")
    wait_for_rows(tmp_path, "orphan", 3, first)
    workers = children(first.pid)
    assert len(workers) == 2
    for (
        pid
    ) in workers:  # paused, so that the kill lands mid-run however fast the steps are
        os.kill(pid, signal.SIGSTOP)
    os.kill(first.pid, signal.SIGKILL)
    first.wait()
    for pid in workers:
        os.kill(pid, signal.SIGCONT)
    try:
        deadline = time.monotonic() + 120
        while [pid for pid in workers if running(pid)]:
            assert time.monotonic() < deadline, "ranks still running without torchrun"
            time.sleep(0.1)
    finally:
        for pid in workers:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
    log = (tmp_path / "runs" / "orphan" / "log.txt").read_text()
    stopped = re.findall(
        r"stopped by the end of a rank's launcher \(torchrun's agent\) after step (\d+), "
        "saved",
        log,
    )
    assert len(stopped) == 1, log[-2000:]
    step = int(stopped[0])
    assert 3 <= step < TINY_STEPS
    assert (tmp_path / "runs/orphan/checkpoints" / f"step-{step}" / "COMPLETE").exists()

    second = torchrun_train(project, tmp_path, "--run_name=orphan")
    output, _ = second.communicate(timeout=300)
    assert second.returncode == 0, output[-3000:]
    assert f"resumed from runs/orphan/checkpoints/step-{step} at step {step}" in output
    losses = [row["loss"] for row in read_metrics(tmp_path, "orphan")]
    assert losses == [row["loss"] for row in two_rank_reference]
