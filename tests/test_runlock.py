"""runtime.runlock: one live start per run folder; the kernel drops the lock when the holder
dies, also while processes it forked (DataLoader workers) live on."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from projects import checkout_env, children
from runtime import runlock

HOLD = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from runtime import runlock
    lock = runlock.acquire(Path(sys.argv[1]))
    if len(sys.argv) > 2 and os.fork() == 0:  # a child, as a DataLoader worker is forked
        time.sleep(120)
        os._exit(0)
    print("locked", flush=True)
    time.sleep(120)
    """)


def hold(run_dir: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    """Another process that takes the lock and keeps it (until killed); with "fork", it
    also forks a child that sleeps."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir), *args],
        stdout=subprocess.PIPE,
        text=True,
        env={**checkout_env(), **env},
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "locked"
    return process


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_second_start_is_refused_naming_the_holder_and_touching_nothing(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "runs" / "demo"
    holder = hold(run_dir, SLURM_JOB_ID="4242")
    try:
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        before = snapshot(run_dir)
        with pytest.raises(runlock.RunInUse) as refused:
            runlock.acquire(run_dir)
        message = str(refused.value)
        assert f"pid {holder.pid}" in message and "SLURM job 4242" in message
        assert "host " in message and "--run_name" in message and "\n" not in message
        assert (
            snapshot(run_dir) == before
        )  # the lock file and the run's files are untouched
    finally:
        holder.kill()
        holder.wait()


def test_kill_9_leaves_no_stale_lock(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "demo"
    holder = hold(run_dir)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    runlock.acquire(run_dir).release()  # the kernel dropped the dead holder's lock
    # (read after the release: closing another descriptor of the file would drop the lock)
    assert json.loads((run_dir / runlock.LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_child_of_a_killed_holder_does_not_keep_the_lock(tmp_path: Path) -> None:
    """A data worker forked from rank 0 shares its open lock file; rank 0 killed, the
    worker still alive: the next start gets the lock at once."""
    run_dir = tmp_path / "runs" / "demo"
    holder = hold(run_dir, "fork")
    child = children(holder.pid)
    assert len(child) == 1
    try:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        os.kill(child[0], 0)  # alive, the lock file open
        runlock.acquire(run_dir).release()
    finally:
        os.kill(child[0], signal.SIGKILL)


def test_release_lets_the_next_start_in(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "demo"
    first = runlock.acquire(run_dir)
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from pathlib import Path; from runtime import runlock;"
            "runlock.acquire(Path(sys.argv[1]))",
            str(run_dir),
        ],
        capture_output=True,
        text=True,
        env=checkout_env(),
    )
    assert probe.returncode != 0 and "RunInUse" in probe.stderr
    first.release()
    runlock.acquire(run_dir).release()


def test_describe_copes_with_an_empty_or_foreign_lock_file() -> None:
    assert "another process" in runlock.describe("")
    assert "another process" in runlock.describe("not json")
    assert runlock.describe(json.dumps({"host": "n1", "pid": 7})) == "pid 7 on host n1"
