"""Checkpoint benchmark: runtime.checkpoint (DCP) against torch.save/torch.load, on this disk.

    python bench/checkpoint.py                 # ~100M parameters + AdamW state (~1.2 GB)
    python bench/checkpoint.py --params 20e6   # smaller, quicker

Measures, in one run and on the same folder:
1. save and load of the same model + AdamW state with runtime.checkpoint vs torch.save /
   torch.load(weights_only=True) of the state dicts (one process);
2. resharded load: saved on 2 ranks (FSDP2, torchrun), loaded on 1 and on 3 ranks, vs the
   same-size load on 2 ranks (wall time of the load call, slowest rank);
3. the training loop's stall: how long `save()` blocks with `async_save=True` vs a sync save.
Prints a table and a final summary line. glibc malloc settings are left at their defaults on
both sides of every ratio. Files are written under --dir (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from runtime import checkpoint, dist, parallel  # noqa: E402
from runtime.time import Progress  # noqa: E402


class Model(nn.Module):
    """A GPT-2-like stack of MLP blocks with an embedding: `params` parameters in total."""

    def __init__(self, params: float) -> None:
        super().__init__()
        width, vocab = 768, 50304
        per_block = 2 * width * 4 * width + 5 * width
        layers = max(1, int((params - vocab * width) // per_block))
        self.wte = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
            )
            for _ in range(layers)
        )

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.blocks:
            x = x + block(x)
        return x


def build(
    params: float, env: dist.DistEnv | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Model(params)
    if env is not None and env.world_size > 1:
        model = parallel.parallelize(
            model, model.blocks, env, parallel.ParallelConfig(parallelism="fsdp")
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randint(0, 50304, (1, 8))).float().pow(
        2
    ).mean().backward()  # AdamW state exists
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def alternating(a, b, repeat: int) -> tuple[float, float]:
    """Median times of `a` and `b` run A B A B ...: the disk's write-back state drifts a lot
    here (the same torch.save took 1.0 to 3.8 s), so both sides must see the same drift.
    """
    times_a, times_b = [], []
    for _ in range(repeat):
        for fn, times in ((a, times_a), (b, times_b)):
            os.sync()  # start from a clean write-back state
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)


def single_process(args: argparse.Namespace, root: Path) -> dict[str, float]:
    model, optimizer = build(args.params)
    n = sum(p.numel() for p in model.parameters())
    progress = Progress(batches_per_epoch=1000)
    results: dict[str, float] = {"params": n}
    step = [0]
    state = {"model": model, "optimizer": optimizer, "progress": progress}
    checkpointer = checkpoint.Checkpointer(root / "dcp", keep=1)

    def dcp_save() -> None:
        step[0] += 1
        progress.batch = step[0]
        checkpointer.save(state)

    def torch_save() -> None:
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
            root / "plain.pt",
        )
        os.sync()

    def sync_after(fn):
        return lambda: (fn(), os.sync())

    # Both include os.sync(): the time until the bytes are on disk.
    results["dcp_save"], results["torch_save"] = alternating(
        sync_after(dcp_save), torch_save, args.saves
    )
    fresh, fresh_optimizer = build(args.params)
    path = checkpoint.latest(root / "dcp")
    fresh_state = {
        "model": fresh,
        "optimizer": fresh_optimizer,
        "progress": Progress(batches_per_epoch=1000),
    }
    results["dcp_load"] = best(lambda: checkpoint.load(path, fresh_state), args.repeat)

    def torch_load() -> None:
        state = torch.load(root / "plain.pt", weights_only=True)
        fresh.load_state_dict(state["model"])
        fresh_optimizer.load_state_dict(state["optimizer"])

    results["torch_load"] = best(torch_load, args.repeat)
    results["bytes"] = sum(f.stat().st_size for f in path.iterdir())

    # Loop stall: how long save() keeps the training loop waiting.
    def stall(async_save: bool) -> float:
        step[0] += 1
        progress.batch = step[0]
        saver = checkpoint.Checkpointer(root / "dcp", keep=1, async_save=async_save)
        start = time.perf_counter()
        saver.save(state)
        blocked = time.perf_counter() - start
        saver.close()
        return blocked

    results["stall_sync"] = min(stall(False) for _ in range(args.repeat))
    results["stall_async"] = min(stall(True) for _ in range(args.repeat))
    (root / "plain.pt").unlink()
    return results


def worker(args: argparse.Namespace) -> None:
    """Under torchrun: `save` on this world size, or `load` the saved checkpoint and time it."""
    env = dist.environment("cpu")
    dist.init_process_group(env)
    try:
        root = Path(args.dir)
        model, optimizer = build(args.params, env)
        progress = Progress(batches_per_epoch=1000)
        state = {"model": model, "optimizer": optimizer, "progress": progress}
        if args.worker == "save":
            progress.batch = 1
            checkpoint.Checkpointer(root / "sharded").save(state)
        else:
            dist.barrier()
            start = time.perf_counter()
            checkpoint.load(root / "sharded" / "step-1", state)
            elapsed = torch.tensor([time.perf_counter() - start])
            if dist.is_distributed():  # the slowest rank's time
                torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
            if env.rank == 0:
                print(json.dumps({"load": elapsed.item()}))
    finally:
        dist.shutdown()


def resharded(args: argparse.Namespace, root: Path) -> dict[str, float]:
    def launch(nproc: int, mode: str) -> dict:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            __file__,
            "--worker",
            mode,
            "--dir",
            str(root),
            "--params",
            str(args.params),
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        result = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=900
        )
        if result.returncode:
            raise SystemExit(result.stderr[-3000:])
        lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else {}

    launch(2, "save")
    return {f"load_on_{n}": launch(n, "load")["load"] for n in (2, 1, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6)
    parser.add_argument(
        "--repeat", type=int, default=2, help="best of N for loads and stalls"
    )
    parser.add_argument(
        "--saves", type=int, default=5, help="alternating save pairs (median)"
    )
    parser.add_argument("--dir", default="")
    parser.add_argument("--skip-resharded", action="store_true")
    parser.add_argument("--worker", choices=("save", "load"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    root = Path(args.dir or tempfile.mkdtemp(prefix="bench-checkpoint-"))
    try:
        r = single_process(args, root)
        if not args.skip_resharded:
            r.update(resharded(args, root))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    gb = r["bytes"] / 1e9
    rows = [
        (
            "save: runtime.checkpoint (DCP)",
            r["dcp_save"],
            r["dcp_save"] / r["torch_save"],
        ),
        ("save: torch.save", r["torch_save"], 1.0),
        (
            "load: runtime.checkpoint (DCP)",
            r["dcp_load"],
            r["dcp_load"] / r["torch_load"],
        ),
        ("load: torch.load(weights_only)", r["torch_load"], 1.0),
    ]
    if "load_on_2" in r:
        rows += [
            (
                f"load saved on 2 ranks, on {n}",
                r[f"load_on_{n}"],
                r[f"load_on_{n}"] / r["load_on_2"],
            )
            for n in (2, 1, 3)
        ]
    rows += [
        ("loop stall: sync save", r["stall_sync"], 1.0),
        (
            "loop stall: async save",
            r["stall_async"],
            r["stall_async"] / r["stall_sync"],
        ),
    ]
    print(
        f"{r['params'] / 1e6:.1f}M parameters + AdamW state, {gb:.2f} GB checkpoint, "
        f"torch {torch.__version__}, {os.cpu_count()} CPUs; saves: median of {args.saves} "
        f"alternating pairs; loads, stalls: best of {args.repeat}"
    )
    print(f"{'what':<34} {'seconds':>8} {'ratio':>7}")
    for name, seconds, ratio in rows:
        print(f"{name:<34} {seconds:>8.2f} {ratio:>6.2f}x")
    summary = (
        f"summary: DCP save {r['dcp_save'] / r['torch_save']:.2f}x and load "
        f"{r['dcp_load'] / r['torch_load']:.2f}x torch.save/load time"
    )
    if "load_on_2" in r:
        summary += (
            f"; resharded load 2->1 {r['load_on_1'] / r['load_on_2']:.2f}x, "
            f"2->3 {r['load_on_3'] / r['load_on_2']:.2f}x same-size"
        )
    summary += f"; async save stalls the loop {r['stall_async']:.2f}s vs {r['stall_sync']:.2f}s sync"
    print(summary)


if __name__ == "__main__":
    main()
