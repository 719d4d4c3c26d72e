"""scripts/slurm.sbatch on a real one-node SLURM cluster (started by the `cluster` fixture).

Skipped, with the reason shown, where SLURM is not installed (`.ci/run` installs it as root).
Each job runs the TINY 2-rank settings of tests/projects.py, so its losses can be compared
bitwise with `torchrun --standalone` on the same settings (the `two_rank_reference` fixture).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from projects import (
    TINY,
    TINY_STEPS,
    checkout_env,
    pending_signals,
    read_metrics,
    train_workers,
)
from slurm_cluster import SlurmCluster, missing

pytestmark = pytest.mark.skipif(missing() is not None, reason=missing() or "")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    # Not under pytest's tmp_path: its folders are private (0700) and munge's socket needs
    # every folder above it searchable by all.
    folder = Path(tempfile.mkdtemp(prefix="scaffold-slurm-"))
    folder.chmod(0o755)
    with SlurmCluster.start(folder) as running:
        yield running
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def project(generated: dict[str, Path], project_copy) -> Path:
    return project_copy(generated["gpt2-baseline"])


def submit(cluster: SlurmCluster, project: Path, run_name: str) -> int:
    return cluster.sbatch(
        [
            "--nodes=1",
            "--gpus-per-node=0",
            "--cpus-per-task=2",
            "scripts/slurm.sbatch",
            *TINY,
            f"--max_duration={TINY_STEPS}ba",
            f"--run_name={run_name}",
        ],
        cwd=project,
        env={**checkout_env(), "NPROC_PER_NODE": "2"},
    )


def losses(project: Path, run_name: str) -> list[float]:
    return [row["loss"] for row in read_metrics(project, run_name)]


def test_sbatch_on_two_ranks_equals_torchrun_standalone(
    cluster: SlurmCluster, project: Path, two_rank_reference: list[dict]
) -> None:
    job = submit(cluster, project, "plain")
    info = cluster.wait(job)
    out = (project / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out[-3000:]
    assert "1 node(s) x 2 process(es)" in out
    assert losses(project, "plain") == [row["loss"] for row in two_rank_reference]


def test_preemption_notice_requeues_and_the_job_finishes_bitwise(
    cluster: SlurmCluster, project: Path, two_rank_reference: list[dict]
) -> None:
    job = submit(cluster, project, "pre")
    metrics = project / "runs" / "pre" / "metrics.jsonl"
    at_row = random.Random().randint(
        2, TINY_STEPS - 3
    )  # a random step, reproducible from the log
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= at_row):
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), cluster.job(job)
        assert time.monotonic() < deadline
        time.sleep(0.05)

    # Pause the job's training processes: the checks below then happen mid-run however fast
    # the steps are here (10 steps can take under a second).
    workers = train_workers(project, "pre")
    assert len(workers) == 2, workers
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)

    # The same run started a second time while the job trains: refused, one line, exit 2.
    second = subprocess.run(
        [sys.executable, "train.py", *TINY, "--run_name=pre", "--max_duration=1ba"],
        cwd=project,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 2, second.stderr
    assert re.fullmatch(
        r"error: run folder runs/pre is in use by pid \d+ on host \S+ "
        rf"\(SLURM job {job}\), .*--run_name=NAME\n",
        second.stderr,
    ), second.stderr

    cluster.signal_batch(
        job, "USR1"
    )  # what --signal=B:USR1@grace sends before pre-emption
    # The batch script passes it through srun and torchrun to both (still paused) workers.
    deadline = time.monotonic() + 60
    while not all(pending_signals(pid) & 1 << (signal.SIGUSR1 - 1) for pid in workers):
        assert (
            time.monotonic() < deadline
        ), "the notice did not reach the training processes"
        time.sleep(0.02)
    for pid in workers:
        os.kill(pid, signal.SIGCONT)
    info = cluster.wait(job, timeout=300)
    out = (project / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (
        info,
        out[-4000:],
    )
    assert "requeueing job" in out and "restart 1" in out

    log = (project / "runs" / "pre" / "log.txt").read_text()
    stopped = re.findall(r"stopped by SIGUSR1 after step (\d+)", log)
    resumed = re.findall(r"resumed from \S+ at step (\d+)", log)
    assert len(stopped) == 1 and resumed == stopped, log
    # Every step the two starts trained, from the job's output (rank 0 prints one line a step):
    steps = [int(s) for s in re.findall(r"^step=(\d+) ", out, flags=re.MULTILINE)]
    redone = len(steps) - TINY_STEPS
    assert 0 <= redone <= 1 and steps[-1] == TINY_STEPS, steps
    assert losses(project, "pre") == [row["loss"] for row in two_rank_reference]
