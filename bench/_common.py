"""Shared by the benchmarks: generate a project, run its train.py, read its metrics."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The same allocator settings for both sides of every ratio (DESIGN.md §12.8: glibc's defaults cost
# a small loop hundreds of page faults per step). Set here so runs are comparable; printed.
ALLOCATOR = {
    "MALLOC_MMAP_THRESHOLD_": "33554432",
    "MALLOC_TRIM_THRESHOLD_": "1073741824",
}


def bench_env() -> dict[str, str]:
    path = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    return {**os.environ, **ALLOCATOR, "PYTHONPATH": path}


def generate(recipe: str, root: Path, *overrides: str) -> Path:
    """`scaffold new` through the CLI of this checkout."""
    dest = root / Path(recipe).stem  # a recipe name, or a .toml file of its own
    command = [
        sys.executable,
        "-m",
        "scaffold",
        "new",
        str(dest),
        "--recipe",
        recipe,
        "--name",
        "bench",
    ]
    for override in overrides:
        command += ["--set", override]
    subprocess.run(command, check=True, env=bench_env(), cwd=REPO, capture_output=True)
    return dest


# Runs a train.py with the monitor's clock swapped for the process's CPU time, so its
# `train_s` (evaluation and checkpoints still excluded) counts the work, not the waiting for
# a core on a shared machine. argv: the train.py, then its arguments.
CPU_CLOCK = """
import runpy, sys, time, types
import runtime.monitor as monitor
clock = types.SimpleNamespace(**vars(time))
clock.perf_counter = time.process_time
monitor.time = clock
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, script.rsplit("/", 1)[0])
runpy.run_path(script, run_name="__main__")
"""


def train(
    project: Path, workdir: Path, run_name: str, *args: str, cpu_clock: bool = False
) -> list[dict]:
    """Run the generated train.py (on the CPU unless `args` name a --device); return its
    metrics records. `cpu_clock`: train_s and step_ms in CPU seconds of the process
    (CPU_CLOCK), torch on one thread unless OMP_NUM_THREADS says otherwise."""
    named = any(arg.startswith("--device=") for arg in args)
    env = bench_env()
    if cpu_clock:
        env.setdefault("OMP_NUM_THREADS", "1")
    result = subprocess.run(
        [
            sys.executable,
            *(["-c", CPU_CLOCK] if cpu_clock else []),
            str(project / "train.py"),
            *([] if named else ["--device=cpu"]),
            f"--run_name={run_name}",
            *args,
        ],
        cwd=workdir,
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"train.py failed:\n{result.stderr[-3000:]}")
    path = workdir / "runs" / run_name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def add_clock(parser: argparse.ArgumentParser) -> None:
    """`--clock cpu` (the default: training seconds as the process's CPU time, torch on one
    thread, steady on a shared machine) or `--clock wall`. Call `apply_clock` after parsing.
    """
    parser.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="training seconds as the process's CPU time (1 thread) or the wall clock",
    )


def apply_clock(clock: str) -> None:
    """One thread for every training process the CPU clock times."""
    if clock == "cpu":
        os.environ["OMP_NUM_THREADS"] = "1"


def budget_args(steps: int, eval_every: int) -> list[str]:
    """train.py arguments of a time-to-quality arm: `steps` batches, an evaluation every
    `eval_every`, one checkpoint at the end, a fresh run whatever runs/ holds."""
    return [
        f"--max_duration={steps}ba",
        f"--eval_interval={eval_every}ba",
        f"--save_interval={steps}ba",
        "--autoresume=false",
    ]


def print_conditions() -> None:
    """The allocator settings and the machine's load, printed before the numbers."""
    print(f"allocator: {' '.join(f'{k}={v}' for k, v in ALLOCATOR.items())}")
    print(f"load average at the start (1, 5, 15 min): {os.getloadavg()}")


def median(values: list[float]) -> float:
    return statistics.median(values)


def speedup_line(
    arm: str, ratios: list[float], bounds: list[float], detail: str = ""
) -> str:
    """`speedup: <arm> = X`, the median over seeds of the baseline's time to the target over the
    arm's. A seed whose arm never reached the target gives only a bound: its time to the target
    is longer than its whole training time, so its ratio is below the baseline's time over that.
    The median of exact ratios and such bounds bounds the true median, so with any bound the
    line says `<` and how many seeds missed."""
    if not bounds:
        return f"speedup: {arm} = {median(ratios):.2f}{detail}"
    missed = f"target not reached in {len(bounds)} of {len(ratios) + len(bounds)} seeds"
    return f"speedup: {arm} < {median(ratios + bounds):.2f} ({missed}: an upper bound)"


def scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="scaffold-bench-"))


def plot_curves(
    curves: dict[str, list[list[tuple[float, float]]]],
    path: Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str,
) -> bool:
    """One PNG: each arm's runs as (x, y) lines in the arm's colour, labelled once. False
    (and nothing written) without matplotlib, which the numbers do not need."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    figure, axes = plt.subplots(figsize=(8, 5))
    for (arm, runs), colour in zip(curves.items(), plt.cm.tab10.colors):
        for i, points in enumerate(runs):
            axes.plot(
                [x for x, _ in points],
                [y for _, y in points],
                color=colour,
                alpha=0.8,
                label=arm if i == 0 else None,
            )
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return True
