"""scripts/slurm.sbatch on a real one-node SLURM cluster (started by the `cluster` fixture).

Skipped, with the reason shown, where SLURM is not installed (`.ci/run` installs it as root).
Each job runs the TINY 2-rank settings of tests/projects.py, so its losses can be compared
bitwise with `torchrun --standalone` on the same settings (the `two_rank_reference` fixture).
Under `--slow`: a job reaching its real time limit (`--time=1`, with and without the notice),
`scancel`, and one job on two nodes (`two_nodes`: two slurmd in network namespaces); these
slow every step with tests/slow_steps/ so that a TINY run outlasts SLURM's one-minute minimum.
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

SLOW_STEPS = Path(__file__).parent / "slow_steps"

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


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[SlurmCluster]:
    """Two nodes of one CPU, each slurmd in a network namespace of its own (slurm_cluster)."""
    for program in ("ip", "nsenter", "unshare"):
        if shutil.which(program) is None:
            pytest.skip(f"two nodes need `{program}` (iproute2, util-linux)")
    folder = Path(tempfile.mkdtemp(prefix="scaffold-slurm2-"))
    folder.chmod(0o755)
    with SlurmCluster.start(folder, cpus=1, nodes=2) as running:
        yield running
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def project(generated: dict[str, Path], project_copy) -> Path:
    return project_copy(generated["gpt2-baseline"])


def submit(
    cluster: SlurmCluster,
    project: Path,
    run_name: str,
    *sbatch: str,
    script: str = "scripts/slurm.sbatch",
    step_seconds: float = 0,
    train: tuple[str, ...] = (),
    nodes: int = 1,
) -> int:
    """Submit `script` with the TINY 2-rank run on `nodes` nodes (2 // nodes ranks each);
    `step_seconds` slows every step (tests/slow_steps/)."""
    # One thread per rank, as torchrun --standalone --nproc_per_node=2 sets (and a torchrun
    # of one process per node does not): the same float sums as the reference run.
    env = {**checkout_env(), "NPROC_PER_NODE": str(2 // nodes), "OMP_NUM_THREADS": "1"}
    if step_seconds:
        env["PYTHONPATH"] = f"{SLOW_STEPS}{os.pathsep}{env['PYTHONPATH']}"
        env["SCAFFOLD_TEST_STEP_SECONDS"] = str(step_seconds)
    return cluster.sbatch(
        [
            f"--nodes={nodes}",
            "--gpus-per-node=0",
            f"--cpus-per-task={2 // nodes}",
            *sbatch,
            script,
            *TINY,
            f"--max_duration={TINY_STEPS}ba",
            f"--run_name={run_name}",
            *train,
        ],
        cwd=project,
        env=env,
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


def trained_steps(log: str) -> list[int]:
    """Every step the run's starts trained, in order (log.txt has one line a step)."""
    return [int(s) for s in re.findall(r"\] step=(\d+) ", log)]


@pytest.mark.slow
def test_time_limit_notice_saves_and_the_requeued_job_finishes_bitwise(
    cluster: SlurmCluster, project: Path, two_rank_reference: list[dict]
) -> None:
    # slurmctld looks at time limits every 30 s and sends `--signal` up to 30 s early: with
    # --time=2 and --signal=B:USR1@40 the notice comes 50-80 s into a start. 10 steps of 8 s
    # (and ~10 s of start-up) outlast that, so the first start is stopped by the notice and
    # requeued, and the second usually finishes before its own notice (else it goes on
    # once more). A notice during a start's start-up ends workers that have no handler yet
    # (nothing to save); the job is requeued all the same.
    job = submit(
        cluster, project, "notice", "--time=2", "--signal=B:USR1@40", step_seconds=8
    )
    info = cluster.wait(job, timeout=600)
    out = (project / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, (
        info,
        out[-4000:],
    )
    log = (project / "runs" / "notice" / "log.txt").read_text()
    stopped = re.findall(r"stopped by (SIG\w+) after step (\d+)", log)
    resumed = re.findall(r"resumed from \S+ at step (\d+)", log)
    assert stopped and {name for name, _ in stopped} == {"SIGUSR1"}, log
    # Each start resumes where the previous one saved; a notice that comes just after the
    # last step may requeue a finished run once more (that start only says "done").
    assert resumed[: len(stopped)] == [step for _, step in stopped], log
    assert resumed[len(stopped) :] in ([], [str(TINY_STEPS)]), log
    assert trained_steps(log) == list(range(1, TINY_STEPS + 1)), log  # none redone
    assert losses(project, "notice") == [row["loss"] for row in two_rank_reference]


@pytest.mark.slow
def test_time_limit_sigterm_saves_within_kill_wait_and_the_job_requeues_itself(
    cluster: SlurmCluster, project: Path, two_rank_reference: list[dict]
) -> None:
    # No notice (the script without its `#SBATCH --signal` line): at the time limit SLURM
    # sends SIGTERM to every process and SIGKILL KillWait s later. The limit is seen 60-90 s
    # into the job (slurmctld looks every 30 s), so 10 steps of 10 s outlast it.
    script = project / "scripts" / "slurm.sbatch"
    lines = script.read_text().splitlines(keepends=True)
    without = [line for line in lines if not line.startswith("#SBATCH --signal")]
    assert len(without) == len(lines) - 1
    (project / "scripts" / "no-notice.sbatch").write_text("".join(without))
    job = submit(
        cluster,
        project,
        "limit",
        "--time=1",
        script="scripts/no-notice.sbatch",
        step_seconds=10,
        train=("--save_num_checkpoints_to_keep=0",),
    )
    info = cluster.wait(job, timeout=600)
    out = (project / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, (
        info,
        out[-4000:],
    )
    assert "time limit (SIGTERM)" in out and "requeueing job" in out, out[-4000:]
    run = project / "runs" / "limit"
    log = (run / "log.txt").read_text()
    stopped = re.findall(r"stopped by (SIG\w+) after step (\d+)", log)
    resumed = re.findall(r"resumed from \S+ at step (\d+)", log)
    assert stopped and {name for name, _ in stopped} == {"SIGTERM"}, log
    assert resumed[: len(stopped)] == [step for _, step in stopped], log
    assert trained_steps(log) == list(range(1, TINY_STEPS + 1)), log  # none redone
    assert losses(project, "limit") == [row["loss"] for row in two_rank_reference]

    # The first time limit: from slurmctld's SIGTERM to the save's COMPLETE marker.
    limit = cluster.log_times(f"Time limit exhausted for JobId={job}")[0]
    complete = run / "checkpoints" / f"step-{stopped[0][1]}" / "COMPLETE"
    seconds = complete.stat().st_mtime - limit
    print(f"time limit -> step-{stopped[0][1]} COMPLETE: {seconds:.1f} s")
    assert 0 < seconds < cluster.kill_wait, seconds


@pytest.mark.slow
def test_scancel_saves_and_is_not_requeued(
    cluster: SlurmCluster, project: Path
) -> None:
    # scancel sends the same SIGTERM as the time limit: the processes save, but the script
    # requeues only at the time limit (reason TimeLimit), so a cancelled job stays cancelled.
    job = submit(cluster, project, "cancel", step_seconds=2)
    metrics = project / "runs" / "cancel" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 1):
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), cluster.job(job)
        assert time.monotonic() < deadline
        time.sleep(0.1)
    cluster.cancel(job)
    info = cluster.wait(job)
    time.sleep(3)  # a requeue would show by now
    info = cluster.job(job)
    out = (project / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info, out)
    assert "time limit" not in out and "requeueing" not in out, out[-3000:]
    log = (project / "runs" / "cancel" / "log.txt").read_text()
    stopped = re.findall(r"stopped by SIGTERM after step (\d+)", log)
    assert len(stopped) == 1, log
    checkpoint = project / "runs" / "cancel" / "checkpoints" / f"step-{stopped[0]}"
    assert (checkpoint / "COMPLETE").exists()  # the same command goes on from there


@pytest.mark.slow
def test_two_nodes_one_job_preempted_requeued_and_finished_bitwise(
    two_nodes: SlurmCluster, project: Path, two_rank_reference: list[dict]
) -> None:
    # One torchrun per node (srun), c10d rendezvous on the first node, gloo between the
    # nodes' addresses: the same 2 ranks as `torchrun --standalone --nproc_per_node=2`.
    job = submit(two_nodes, project, "two", step_seconds=2, nodes=2)
    metrics = project / "runs" / "two" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        state = two_nodes.job(job)
        assert state["JobState"] in ("PENDING", "RUNNING"), state
        assert time.monotonic() < deadline, state
        time.sleep(0.1)
    two_nodes.signal_batch(job, "USR1")  # what --signal=B:USR1@grace sends
    info = two_nodes.wait(job, timeout=300)
    out = (project / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (
        info,
        out[-4000:],
    )
    assert "2 node(s) x 1 process(es), rendezvous n1:" in out, out[:2000]
    assert "world size 2" in out and "requeueing job" in out, out[-4000:]
    log = (project / "runs" / "two" / "log.txt").read_text()
    stopped = re.findall(r"stopped by SIGUSR1 after step (\d+)", log)
    resumed = re.findall(r"resumed from \S+ at step (\d+)", log)
    assert len(stopped) == 1 and resumed == stopped, log
    assert trained_steps(log) == list(range(1, TINY_STEPS + 1)), log  # none redone
    assert losses(project, "two") == [row["loss"] for row in two_rank_reference]
