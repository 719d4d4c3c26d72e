"""The fault matrix: each fault injected into a short run, then what recovery cost.

    python bench/faults.py [--recipe gpt2-speedup] [--faults kill-worker,...]
                           [--setups none:1,ddp:2,fsdp:2] [--steps 12] [--at 6]

For each setup (parallelism:ranks) an uninterrupted run is the reference; then for each
fault the same command (`torchrun --standalone --nproc_per_node=N --max-restarts=1
train.py`, on the CPU) runs until step `--at`, the fault strikes, and the command is run
again when the fault ended it, as a requeued job would. One row per fault and setup:

- recovered: the run reached its last step and its metrics hold every step once;
- redone: steps trained twice (the last step logged before the restart minus the step it
  resumed from);
- lost: steps of the reference missing from the recovered run (always 0 is the claim);
- loss diff: the largest |loss - reference loss| over all steps (0 = bitwise);
- recover s: from the fault to the first step trained after it.

Faults:
- kill-worker: SIGKILL of the last rank; torchrun restarts the group (same launch).
- kill-launcher: SIGKILL of torchrun and its workers (a node lost); the command again.
- sigterm: SIGTERM to torchrun (scancel, a time limit); the ranks save and stop; again.
- sigusr1: SIGUSR1 to every worker (SLURM's --signal notice); save, stop; again.

Faults of storage (a full disk, a stopped object store, a corrupt newest checkpoint) have
their own tests (tests/test_storage.py, tests/test_elastic.py); see bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_env, generate  # noqa: E402

# The tests' helper: torchrun's workers are its children in /proc.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from projects import children  # noqa: E402

FAULTS = ("kill-worker", "kill-launcher", "sigterm", "sigusr1")
SMALL = [
    "--device=cpu",
    "--model=tiny",
    "--seq_len=32",
    "--device_microbatch_size=2",
    "--eval_batches=1",
    "--eval_interval=1000ba",
    "--dist_timeout=60",
    "--save_num_checkpoints_to_keep=0",
]


def command(project: Path, parallelism: str, nproc: int, run: str, steps: int):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "--max-restarts=1",
        str(project / "train.py"),
        *SMALL,
        f"--global_batch_size={2 * nproc}",
        f"--max_duration={steps}ba",
        "--save_interval=4ba",
        f"--parallelism={parallelism}",
        f"--run_name={run}",
    ]


def metrics(workdir: Path, run: str) -> list[dict]:
    path = workdir / "runs" / run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line being written
            pass
    return rows


def strike(fault: str, launcher: subprocess.Popen) -> None:
    pids = sorted(children(launcher.pid))  # the newest pid: the last rank started
    if fault == "kill-worker":
        os.kill(pids[-1], signal.SIGKILL)
    elif fault == "kill-launcher":
        launcher.kill()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    elif fault == "sigterm":
        launcher.send_signal(signal.SIGTERM)
    else:
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)


def resumed_from(log: str) -> int:
    marker = "checkpoints/step-"
    if "resumed from" not in log:
        return 0
    line = next(x for x in log.splitlines() if "resumed from" in x)
    return int(line.split(marker, 1)[1].split()[0])


def follow(argv, workdir: Path, run: str, log, watch) -> int:
    """Run `argv`, calling `watch(launcher, steps logged so far)` every 20 ms; its status."""
    launcher = subprocess.Popen(
        argv, cwd=workdir, env=bench_env(), stdout=log, stderr=subprocess.STDOUT
    )
    while launcher.poll() is None:
        watch(launcher, [r["step"] for r in metrics(workdir, run)])
        time.sleep(0.02)
    return launcher.wait()


def one_row(project, workdir, fault, parallelism, nproc, steps, at, reference):
    run = f"{fault}-{parallelism}-{nproc}"
    argv = command(project, parallelism, nproc, run, steps)
    # When it struck; the last step logged before the restart; the fewest steps logged
    # since (a resumed run drops those it will redo); when a step was trained again.
    seen = {"struck": None, "last": 0, "fewest": None, "back": None, "watch": False}

    def watch(launcher, done: list[int]) -> None:
        if not seen["watch"]:
            seen["last"] = max([seen["last"], *done])
        if seen["struck"] is None:
            if done and done[-1] >= at:
                seen["struck"] = time.perf_counter()
                seen["watch"] = fault == "kill-worker"  # recovers in this launch
                strike(fault, launcher)
        if not seen["watch"]:
            return
        if seen["fewest"] is None or len(done) < seen["fewest"]:
            seen["fewest"] = len(done)  # a resumed run drops the steps it will redo
        elif len(done) > seen["fewest"] and seen["back"] is None:
            seen["back"] = time.perf_counter()  # the first step trained after the fault

    logs = workdir / f"{run}.log"
    with logs.open("w") as log:
        status = follow(argv, workdir, run, log, watch)
        if status != 0 or fault != "kill-worker":
            # The fault ended the command: run it again, as a requeued job.
            seen["watch"] = True
            follow(argv, workdir, run, log, watch)
    rows = metrics(workdir, run)
    got = {r["step"]: r["loss"] for r in rows}
    want = {r["step"]: r["loss"] for r in reference}
    diffs = [abs(got[s] - want[s]) for s in want if s in got]
    back = seen["back"] or float("nan")
    return {
        "recovered": [r["step"] for r in rows] == list(range(1, steps + 1)),
        "redone": seen["last"] - resumed_from(logs.read_text()),
        "lost": len(set(want) - set(got)),
        "loss_diff": max(diffs) if diffs else float("nan"),
        "recover_s": round(back - seen["struck"], 1) if seen["struck"] else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="gpt2-speedup")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--setups", default="none:1,ddp:2,fsdp:2,fsdp:3")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--at", type=int, default=6)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="faults-"))
    project = generate(args.recipe, root)
    print(f"recipe {args.recipe}, {args.steps} steps, fault at step >= {args.at}")
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    header = "| fault | parallelism | ranks | recovered | redone | lost | loss diff | recover s |"
    print(header)
    print("|" + "---|" * 8)
    for setup in args.setups.split(","):
        parallelism, nproc = setup.split(":")
        nproc = int(nproc)
        workdir = root / setup.replace(":", "-")
        workdir.mkdir()
        ref = f"ref-{parallelism}-{nproc}"
        subprocess.run(
            command(project, parallelism, nproc, ref, args.steps),
            cwd=workdir,
            env=bench_env(),
            capture_output=True,
            check=True,
        )
        reference = metrics(workdir, ref)
        for fault in args.faults.split(","):
            row = one_row(
                project,
                workdir,
                fault,
                parallelism,
                nproc,
                args.steps,
                args.at,
                reference,
            )
            print(
                f"| {fault} | {parallelism} | {nproc} | "
                f"{'yes' if row['recovered'] else 'NO'} | {row['redone']} | "
                f"{row['lost']} | {row['loss_diff']:.3g} | {row['recover_s']} |",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
