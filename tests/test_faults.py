"""The fault matrix (bench/faults.py) as assertions: every fault recovers, nothing is lost.

Each case runs gpt2-speedup under `torchrun --max-restarts=1`, strikes at step 5 of 10
(SIGKILL of a worker, SIGKILL of the launcher and its workers, SIGTERM to the launcher,
SIGUSR1 to the workers), runs the command again where the fault ended it, and asserts:
the run reached its last step with every step logged once, no step of the uninterrupted
run is missing, the losses equal it bitwise, and at most the steps since the newest
complete checkpoint (4 per save interval) were trained twice. `--slow` only: each case is
two or three torchrun launches.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from projects import checkout_env


def bench_module(name: str) -> ModuleType:
    """bench/NAME.py, imported with bench/ on the path only meanwhile: a bench script's
    name (bench/streaming.py once) must not shadow a library for the rest of the session.
    """
    saved = list(sys.path)  # the bench scripts put bench/ and tests/ on it themselves
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


faults = bench_module("faults")

STEPS, AT = 10, 5
_references: dict[str, list[dict]] = {}


def reference(project: Path, workdir: Path, parallelism: str, nproc: int) -> list[dict]:
    key = f"{parallelism}:{nproc}"
    if key not in _references:
        run = f"ref-{parallelism}-{nproc}"
        argv = faults.command(project, parallelism, nproc, run, STEPS)
        result = subprocess.run(
            argv, cwd=workdir, env=checkout_env(), capture_output=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
        _references[key] = faults.metrics(workdir, run)
    return _references[key]


@pytest.mark.slow
@pytest.mark.parametrize("fault", faults.FAULTS)
@pytest.mark.parametrize("setup", ["none:1", "ddp:2", "fsdp:2"])
def test_every_fault_recovers_and_loses_nothing(
    generated: dict[str, Path], tmp_path: Path, fault: str, setup: str
) -> None:
    parallelism, nproc = setup.split(":")
    project = generated["gpt2-speedup"]
    refs = tmp_path.parent / "fault-references"
    refs.mkdir(exist_ok=True)
    want = reference(project, refs, parallelism, int(nproc))
    row = faults.one_row(
        project, tmp_path, fault, parallelism, int(nproc), STEPS, AT, want
    )
    assert row["recovered"], row
    assert row["lost"] == 0 and row["loss_diff"] == 0, row
    assert 0 <= row["redone"] <= 4, row  # at most the steps since the last save
