"""The fault matrix: each fault injected into a short run, then what recovery cost.

    python bench/faults.py [--recipes gpt2-speedup,...] [--faults kill-worker,...]
                           [--setups none:1,ddp:1,ddp:2,...] [--steps 8] [--at 5]

For each recipe and setup (parallelism:ranks) an uninterrupted run is the reference; then
for each fault the same command (`torchrun --standalone --nproc_per_node=N train.py`, on the
CPU, tiny model and batch) runs until step `--at` is logged, the fault strikes, and the
command is run again when the fault ended it, as a requeued job would. One row per fault,
setup and recipe:

- recovered: the run reached its last step and its metrics hold every step once;
- redone: steps trained twice (the last step logged before the restart minus the step it
  resumed from);
- lost: steps of the reference missing from the recovered run (always 0 is the claim);
- loss diff: the largest |loss - reference loss| over all steps (0 = bitwise);
- recover s: from the fault to the first step trained after it (wall time).

Faults (the first four under `--max-restarts=1`, as a production launch; the storage ones
under `--max-restarts=0`: restarting into a full disk or a missing store only fails again):
- kill-worker: SIGKILL of the last rank; torchrun restarts the group (same launch).
- kill-launcher: SIGKILL of torchrun and its workers (a node lost); the command again.
- sigterm: SIGTERM to torchrun (scancel, a time limit); the ranks save and stop; again.
- sigusr1: SIGUSR1 to every worker (SLURM's --signal notice); save, stop; again.
- disk-full: the checkpoints folder is a fresh 256 MB tmpfs (root only), shrunk to what it
  holds plus 64 KiB (a remount) when step `--at` - 1 is logged, so the next save runs out
  of space mid-write; it is remounted at 256 MB (space again) and the command runs again.
- store-down: the checkpoints folder is s3://ckpt/RUN on moto's S3 server (a process on
  127.0.0.1) behind a TCP relay; the relay stops (connections cut and refused) when step
  `--at` - 1 is logged, so the next save's upload fails; it starts again (the server's data
  kept, as a real store's is: moto keeps its buckets in memory, so its process is not
  killed) and the command runs again.
- corrupt-newest: SIGTERM as above, then the first shard of the newest complete checkpoint
  is overwritten with garbage (same size); the command runs again and falls back to the
  previous complete checkpoint (runtime/checkpoint, DESIGN.md §7).
A storage fault strikes one step early, two steps before the next save, so it lands before
that save however fast the steps are; a launch it did not fail (exit 0) is reported MISSED,
never as recovered.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import bench_env, generate  # noqa: E402

# The tests' helpers: torchrun's workers are its children in /proc; the S3 server.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from projects import children  # noqa: E402

SIGNALS = ("kill-worker", "kill-launcher", "sigterm", "sigusr1")
STORAGE = ("disk-full", "store-down", "corrupt-newest")
FAULTS = SIGNALS + STORAGE
RECIPES = ("gpt2-speedup", "cifar-resnet56-medium", "bert-sst2-speedup")
# Ordered so that a table cut short holds the most telling setups first.
SETUPS = ("none:1", "ddp:2", "fsdp:3", "fsdp:2", "ddp:3", "ddp:1", "fsdp:1")
COMMON = [
    "--device=cpu",
    "--device_microbatch_size=2",
    "--eval_batches=1",
    "--eval_interval=1000ba",
    "--dist_timeout=60",
    "--save_num_checkpoints_to_keep=0",
]
# Each recipe's tiny model and data: built from config classes, offline (no folders needed:
# gpt2 and bert train on Python's standard library text, cifar on the embedded digits).
TINY = {
    "gpt2-speedup": ["--model=tiny", "--seq_len=32"],
    "cifar-resnet56-medium": ["--model=tiny", "--precision=fp32", "--bn_group_size=2"],
    "bert-sst2-speedup": ["--model=tiny", "--max_seq_len=16"],
}
SAVE_INTERVAL = 3


def command(
    project: Path,
    parallelism: str,
    nproc: int,
    run: str,
    steps: int,
    *extra: str,
    restarts: int = 1,
    recipe: str = "gpt2-speedup",
):
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={restarts}",
        str(project / "train.py"),
        *COMMON,
        *TINY.get(recipe, TINY["gpt2-speedup"]),  # llm-sft: the same flags
        f"--global_batch_size={2 * nproc}",
        f"--max_duration={steps}ba",
        f"--save_interval={SAVE_INTERVAL}ba",
        f"--parallelism={parallelism}",
        f"--run_name={run}",
        *extra,
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
    return [row for row in rows if "loss" in row]


class Stores:
    """Where the storage faults strike: tmpfs disks (root only) and an S3 server behind a
    relay (moto and s3fs installed); `close()` unmounts and stops them."""

    def __init__(self, root: Path) -> None:
        self.root, self.mounted = root, []
        self._moto = self.relay = None
        self.env: dict[str, str] = {}

    def disk(self, name: str) -> Path:
        where = self.root / "disks" / name
        where.mkdir(parents=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(where)], check=True
        )
        self.mounted.append(where)
        return where

    @staticmethod
    def fill(disk: Path, full: bool = True) -> None:
        """The disk full: shrunk to what it holds plus 64 KiB (a remount: instant, so it
        lands before the next save however fast the steps are); or back to 256 MB."""
        stat = os.statvfs(disk)
        used = (stat.f_blocks - stat.f_bfree) * stat.f_frsize
        size = used + 65536 if full else 256 << 20
        subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)

    def s3(self) -> dict[str, str]:
        if self._moto is None:
            from test_storage import Relay, start_moto

            (self.root / "aws").mkdir()
            self._moto = start_moto(self.root / "aws", enforce_auth=False)
            port, env = next(self._moto)
            self.relay = Relay(port)
            self.env = {
                **env,
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.relay.port}",
            }
        return self.env

    def close(self) -> None:
        for where in reversed(self.mounted):
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
        if self._moto is not None:
            self.relay.stop()
            self._moto.close()  # terminates the server


def corrupt_newest(folder: Path) -> Path:
    """Garbage over the first 64 bytes of the newest complete checkpoint's first shard."""
    newest = max(
        (p for p in folder.glob("step-*") if (p / "COMPLETE").is_file()),
        key=lambda p: int(p.name.split("-")[1]),
    )
    shard = sorted(newest.glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(b"\0" * 64 + data[64:])
    return newest


def strike(fault: str, launcher: subprocess.Popen, stores: Stores, disk) -> None:
    pids = sorted(children(launcher.pid))  # the newest pid: the last rank started
    if fault == "kill-worker":
        os.kill(pids[-1], signal.SIGKILL)
    elif fault == "kill-launcher":
        launcher.kill()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
    elif fault in ("sigterm", "corrupt-newest"):
        launcher.send_signal(signal.SIGTERM)
    elif fault == "disk-full":
        stores.fill(disk)
    elif fault == "store-down":
        stores.relay.stop()
    else:
        for pid in pids:
            os.kill(pid, signal.SIGUSR1)


def mend(fault: str, stores: Stores, disk, checkpoints: Path) -> None:
    """What the operator does before the command runs again."""
    if fault == "disk-full":
        stores.fill(disk, full=False)
    elif fault == "store-down":
        stores.relay.start()
    elif fault == "corrupt-newest":
        corrupt_newest(checkpoints)


def resumed_from(log: str) -> int:
    found = re.search(r"resumed from \S*step-(\d+) at step", log)
    return int(found.group(1)) if found else 0


def follow(argv, workdir: Path, run: str, log, watch, env: dict) -> int:
    """Run `argv`, calling `watch(launcher, steps logged so far)` every 20 ms; its status."""
    launcher = subprocess.Popen(
        argv,
        cwd=workdir,
        env={**bench_env(), **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    while launcher.poll() is None:
        watch(launcher, [r["step"] for r in metrics(workdir, run)])
        time.sleep(0.02)
    return launcher.wait()


def one_row(
    project,
    workdir,
    fault,
    parallelism,
    nproc,
    steps,
    at,
    reference,
    stores=None,
    recipe="gpt2-speedup",
):
    run = f"{fault}-{parallelism}-{nproc}"
    stores = stores or Stores(workdir)
    disk, env, extra = None, {}, []
    if fault == "disk-full":
        disk = stores.disk(f"{workdir.name}-{run}")
        extra = [f"--save_folder={disk / 'ck'}"]
    elif fault == "store-down":
        env = stores.s3()
        extra = [f"--save_folder=s3://ckpt/{workdir.name}-{run}"]
    restarts = 1 if fault in SIGNALS else 0
    argv = command(
        project,
        parallelism,
        nproc,
        run,
        steps,
        *extra,
        restarts=restarts,
        recipe=recipe,
    )
    # When it struck; the last step logged before the restart; the fewest steps logged
    # since (a resumed run drops those it will redo); when a step was trained again.
    seen = {"struck": None, "last": 0, "fewest": None, "back": None, "watch": False}

    def watch(launcher, done: list[int]) -> None:
        if not seen["watch"]:
            seen["last"] = max([seen["last"], *done])
        if seen["struck"] is None:
            # The storage faults one step early: two steps before the next save.
            if done and done[-1] >= at - (fault in ("disk-full", "store-down")):
                seen["struck"] = time.perf_counter()
                seen["watch"] = fault == "kill-worker"  # recovers in this launch
                strike(fault, launcher, stores, disk)
        if not seen["watch"]:
            return
        if seen["fewest"] is None or len(done) < seen["fewest"]:
            seen["fewest"] = len(done)  # a resumed run drops the steps it will redo
        elif len(done) > seen["fewest"] and seen["back"] is None:
            seen["back"] = time.perf_counter()  # the first step trained after the fault

    logs = workdir / f"{run}.log"
    with logs.open("w") as log:
        status = follow(argv, workdir, run, log, watch, env)
        # A storage fault that struck fails a save: the launch exits 1.
        missed = status == 0 and fault in ("disk-full", "store-down")
        if status != 0 or fault != "kill-worker":
            # The fault ended the command: mend, run it again, as a requeued job.
            mend(fault, stores, disk, workdir / "runs" / run / "checkpoints")
            seen["watch"] = True
            status = follow(argv, workdir, run, log, watch, env)
    rows = metrics(workdir, run)
    got = {r["step"]: r["loss"] for r in rows}
    want = {r["step"]: r["loss"] for r in reference}
    diffs = [abs(got[s] - want[s]) for s in want if s in got]
    back = seen["back"] or float("nan")
    text = logs.read_text()
    return {
        "recovered": status == 0
        and not missed
        and [r["step"] for r in rows] == list(range(1, steps + 1)),
        "missed": missed,
        "redone": seen["last"] - resumed_from(text),
        "lost": len(set(want) - set(got)),
        "loss_diff": max(diffs) if diffs else float("nan"),
        "recover_s": round(back - seen["struck"], 1) if seen["struck"] else None,
        "log": text,
    }


def reference_run(project, workdir, parallelism, nproc, steps, recipe) -> list[dict]:
    run = f"ref-{parallelism}-{nproc}"
    result = subprocess.run(
        command(project, parallelism, nproc, run, steps, recipe=recipe),
        cwd=workdir,
        env=bench_env(),
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"reference run failed:\n{result.stderr[-3000:]}")
    return metrics(workdir, run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--at", type=int, default=5)
    parser.add_argument(
        "--done",
        type=Path,
        help="a table this script printed before: its rows are not run again (the "
        "whole matrix takes hours on a loaded 2-core machine: run it in parts)",
    )
    args = parser.parse_args()
    done = set()
    if args.done is not None:
        for line in args.done.read_text().splitlines():
            cells = [cell.strip() for cell in line.strip("| \n").split("|")]
            if len(cells) == 9:
                done.add(tuple(cells[:4]))
    root = Path(tempfile.mkdtemp(prefix="faults-"))
    stores = Stores(root)
    started = time.perf_counter()
    print(
        f"{args.steps} steps, a save every {SAVE_INTERVAL}, fault at step >= {args.at}"
    )
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(
        "| recipe | fault | parallelism | ranks | recovered | redone | lost "
        "| loss diff | recover s |"
    )
    print("|" + "---|" * 9)
    failed = 0
    try:
        # Setups outermost: a partial table (a run cut short) covers every recipe.
        projects = {
            recipe: generate(recipe, root) for recipe in args.recipes.split(",")
        }
        for setup in args.setups.split(","):
            parallelism, nproc = setup.split(":")
            nproc = int(nproc)
            for recipe, project in projects.items():
                todo = [
                    fault
                    for fault in args.faults.split(",")
                    if (recipe, fault, parallelism, str(nproc)) not in done
                ]
                if not todo:
                    continue
                workdir = root / f"{recipe}-{parallelism}-{nproc}"
                workdir.mkdir()
                reference = reference_run(
                    project, workdir, parallelism, nproc, args.steps, recipe
                )
                for fault in todo:
                    row = one_row(
                        project,
                        workdir,
                        fault,
                        parallelism,
                        nproc,
                        args.steps,
                        args.at,
                        reference,
                        stores,
                        recipe,
                    )
                    good = row["recovered"] and row["lost"] == 0
                    failed += not good
                    print(
                        f"| {recipe} | {fault} | {parallelism} | {nproc} | "
                        f"{'yes' if row['recovered'] else 'MISSED' if row['missed'] else 'NO'}"
                        f" | {row['redone']} | "
                        f"{row['lost']} | {row['loss_diff']:.3g} | {row['recover_s']} |",
                        flush=True,
                    )
                    if not good:
                        print(row["log"][-3000:], file=sys.stderr, flush=True)
    finally:
        stores.close()
    minutes = (time.perf_counter() - started) / 60
    print(f"load average after: {os.getloadavg()[0]:.1f}; {minutes:.1f} min")
    print(f"rows not recovered or losing steps: {failed}; files in {root}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
