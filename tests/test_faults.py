"""The fault matrix (bench/faults.py) as assertions: every fault recovers, nothing is lost.

A slice of the matrix that holds every fault, recipe and parallelism at least once: each
case runs the recipe's tiny model under torchrun, strikes when step 5 of 8 is logged (the
storage faults at step 4, two steps before the step-6 save) (SIGKILL of a worker, SIGKILL of the launcher and its workers, SIGTERM to the launcher,
SIGUSR1 to the workers, the disk of the checkpoints filled, the object store gone, the
newest checkpoint corrupted after a SIGTERM stop), mends what the fault broke, runs the
command again where the fault ended it, and asserts: the run reached its last step with
every step logged once, no step of the uninterrupted run is missing, the losses equal it
(bitwise; on 3 ranks within one float32 ulp, as after any resume: tests/test_restarts.py),
and at most the steps since the newest usable checkpoint were trained twice. `--slow`
only: each case is two or three torchrun launches. The whole matrix: bench/README.md.
"""

from __future__ import annotations

import importlib
import shutil
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

STEPS, AT = 8, 5
# (recipe, parallelism:ranks) -> the faults struck there: every fault, recipe and
# parallelism at least once, the storage faults on one and on several ranks.
SLICE = {
    ("gpt2-speedup", "none:1"): ("kill-worker", "corrupt-newest", "store-down"),
    ("cifar-resnet56-medium", "ddp:2"): (
        "kill-launcher",
        "sigusr1",
        "disk-full",
        "corrupt-newest",
    ),
    ("bert-sst2-speedup", "fsdp:3"): (
        "sigterm",
        "kill-worker",
        "store-down",
        "disk-full",
    ),
}
CASES = [(*where, fault) for where, struck in SLICE.items() for fault in struck]
_references: dict[tuple[str, str], list[dict]] = {}


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory):
    stores = faults.Stores(tmp_path_factory.mktemp("fault-stores"))
    yield stores
    stores.close()


def needs(fault: str) -> None:
    if fault == "disk-full" and (
        not shutil.which("mount")
        or subprocess.run(["id", "-u"], capture_output=True, text=True).stdout.strip()
        != "0"
    ):
        pytest.skip("a full disk is a tmpfs mounted here: root only")
    if fault == "store-down":
        pytest.importorskip("s3fs")
        pytest.importorskip("moto.server")


@pytest.mark.slow
@pytest.mark.parametrize("recipe,setup,fault", CASES)
def test_every_fault_recovers_and_loses_nothing(
    generated: dict[str, Path],
    tmp_path: Path,
    stores,
    recipe: str,
    setup: str,
    fault: str,
) -> None:
    needs(fault)
    parallelism, nproc = setup.split(":")
    project = generated[recipe]
    if (recipe, setup) not in _references:
        refs = tmp_path.parent / f"fault-reference-{recipe}-{parallelism}-{nproc}"
        refs.mkdir(exist_ok=True)
        _references[recipe, setup] = faults.reference_run(
            project, refs, parallelism, int(nproc), STEPS, recipe
        )
    want = _references[recipe, setup]
    row = faults.one_row(
        project,
        tmp_path,
        fault,
        parallelism,
        int(nproc),
        STEPS,
        AT,
        want,
        stores,
        recipe,
    )
    report = {k: v for k, v in row.items() if k != "log"}
    print(f"\n{recipe} {fault} {setup}: {report}")  # with -s: the row, as the bench's
    assert row["recovered"], (report, row["log"][-4000:])
    assert row["lost"] == 0, report
    largest = max(abs(r["loss"]) for r in want)
    assert row["loss_diff"] <= (2**-22 * largest if nproc == "3" else 0), report
    # At most the steps since the newest usable checkpoint (a save every 3 steps; the
    # corrupt one's predecessor is one more interval back).
    most = faults.SAVE_INTERVAL * (2 if fault == "corrupt-newest" else 1)
    assert 0 <= row["redone"] <= most, report
    if fault == "corrupt-newest":
        assert "skipped the damaged checkpoint" in row["log"], row["log"][-4000:]
