"""The price of each vision algorithm: step time with it / step time without it.

For every algorithm of the catalog that applies to image_classification on the resnet family
(read from scaffold.catalog, so algorithms added later are priced too), a project is generated
from the baseline recipe (cifar-resnet56-baseline) plus that one algorithm at its defaults,
and one without any. All projects train the same CIFAR-style ResNet on the embedded digits, in
this one process (no interpreter start-up in the timings), interleaved: each round runs the
baseline, then every algorithm, then the baseline again; an algorithm's ratio in a round is
its median step time over the mean of the two baselines' around it, and the printed price is
the median of the rounds' ratios. Evaluation and checkpoints are outside the timed steps (the
loop pauses its clock for them); the first WARMUP_STEPS steps of each run are not counted.

    python bench/vision_algorithms.py            # a couple of minutes: tiny, 3 rounds
    python bench/vision_algorithms.py --long     # cifar-resnet20, 5 rounds, more steps
    python bench/vision_algorithms.py --only blurpool,channels_last

Prints one line per algorithm: `price: <name> = <step-time ratio vs baseline>` (above 1:
slower steps), the ratio of CPU time per step (torch single-threaded: robust on a machine
shared with other jobs), with the wall-clock ratio beside it. A price says nothing about accuracy: it is the per-step cost, for judging
recipes by time to accuracy.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

from _common import ALLOCATOR, REPO, scratch

sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from projects import project_modules  # noqa: E402
from scaffold.catalog import load_algorithms  # noqa: E402
from scaffold.paths import template_dir  # noqa: E402
from scaffold.recipes import load_recipe  # noqa: E402
from scaffold.render import new_project  # noqa: E402

BASELINE = "cifar-resnet56-baseline"
WARMUP_STEPS = 3
# Settings under which an algorithm acts on the benchmark's small ResNet at all: at
# Composer's defaults squeeze_excite gates only convolutions with >= 128 channels (the CIFAR
# ResNets have at most 64), so its price would be that of nothing.
ACTING = {"squeeze_excite": {"min_channels": 16, "latent_channels": 0.25}}


def applicable() -> list[str]:
    """The catalog's algorithms for image_classification on resnet models."""
    return [
        name
        for name, spec in load_algorithms(template_dir()).items()
        if "image_classification" in spec.tasks
        and (not spec.models or "resnet" in spec.models)
    ]


def generate(root: Path, name: str, algorithm: str | None) -> Path:
    """The baseline recipe, plus one algorithm (the ACTING settings, else its defaults)."""
    recipe = load_recipe(BASELINE, template_dir())
    lines = ["[answers]"] + [
        f"{key} = {json.dumps(value)}" for key, value in recipe.answers.items()
    ]
    if algorithm:
        lines.append(f"[algorithms.{algorithm}]")
        lines += [
            f"{key} = {json.dumps(value)}"
            for key, value in ACTING.get(algorithm, {}).items()
        ]
    path = root / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    with redirect_stdout(io.StringIO()):
        new_project(str(path), root / name, [], "bench")
    return root / name


def step_times(
    project: Path, workdir: Path, run: str, args: list[str]
) -> tuple[float, float]:
    """Median (CPU ms, wall ms) per step of one run of the project's main(), in this process.

    CPU time is this thread's (torch runs single-threaded here, the data in-process): on a
    machine shared with other jobs it counts the work, not the waiting for a core. Taken
    between the loop's once-per-step Monitor.update calls."""
    from runtime.monitor import Monitor

    stamps: list[tuple[float, float]] = []
    update = Monitor.update

    def timed_update(self, *a, **k):
        stamps.append((time.thread_time(), time.perf_counter()))
        return update(self, *a, **k)

    workdir.mkdir(exist_ok=True)
    os.chdir(workdir)
    Monitor.update = timed_update
    with project_modules(project) as modules:
        sys.argv = ["train.py", f"--run_name={run}", *args]
        try:
            with redirect_stdout(io.StringIO()):
                modules["train"].main()
        finally:
            Monitor.update = update
            from runtime import dist

            dist.shutdown()
    steps = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(stamps, stamps[1:])][
        WARMUP_STEPS:
    ]
    return (
        1000 * statistics.median(cpu for cpu, _ in steps),
        1000 * statistics.median(wall for _, wall in steps),
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--long", action="store_true", help="cifar-resnet20, 5 rounds, 20 steps per run"
    )
    parser.add_argument("--rounds", type=int, help="rounds (default 3, --long 5)")
    parser.add_argument(
        "--steps", type=int, help="steps per run (default 10, --long 20)"
    )
    parser.add_argument("--model", help="preset (default tiny, --long cifar-resnet20)")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated algorithm names (default: all that apply)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (0: torch's default)",
    )
    args = parser.parse_args()
    if any(os.environ.get(key) != value for key, value in ALLOCATOR.items()):
        # glibc reads its malloc settings at start-up: run again with _common's (DESIGN.md §12.8).
        os.execve(
            sys.executable, [sys.executable, *sys.argv], {**os.environ, **ALLOCATOR}
        )
    rounds = args.rounds or (5 if args.long else 3)
    steps = args.steps or (20 if args.long else 10)
    model = args.model or ("cifar-resnet20" if args.long else "tiny")
    names = applicable()
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            sys.exit(
                f"error: {', '.join(unknown)} not among the applicable algorithms: {', '.join(names)}"
            )
        names = [name for name in names if name in wanted]
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    allocator = " ".join(f"{key}={os.environ[key]}" for key in ALLOCATOR)
    root = scratch()
    started = time.perf_counter()
    projects = {"baseline": generate(root, "baseline", None)}
    for name in names:
        projects[name] = generate(root, name, name)
    # Batch 64 of 8x8 digits, one microbatch in BatchNorm groups of 32 (no evaluation or
    # checkpoint inside the timed steps: both happen at the end only).
    run = [
        f"--model={model}",
        "--device=cpu",
        "--precision=fp32",
        "--global_batch_size=64",
        "--device_microbatch_size=64",
        "--bn_group_size=32",
        "--lr=0.4",
        "--lr_warmup=0.2dur",
        f"--max_duration={steps}ba",
        f"--eval_interval={steps}ba",
        f"--save_interval={steps}ba",
        "--eval_batches=1",
        "--autoresume=false",
        "--num_workers=0",
    ]
    print(
        f"model {model}, {steps} steps per run ({WARMUP_STEPS} not timed), {rounds} rounds, "
        f"threads {args.threads or 'default'}, allocator {allocator}, load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
        flush=True,
    )
    cpu_ratios: dict[str, list[float]] = {name: [] for name in names}
    wall_ratios: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        before = step_times(
            projects["baseline"], root / "work", f"base-{round_}-a", run
        )
        times = {
            name: step_times(projects[name], root / "work", f"{name}-{round_}", run)
            for name in names
        }
        after = step_times(projects["baseline"], root / "work", f"base-{round_}-b", run)
        for name in names:
            cpu_ratios[name].append(2 * times[name][0] / (before[0] + after[0]))
            wall_ratios[name].append(2 * times[name][1] / (before[1] + after[1]))
        shown = " ".join(
            f"{name}={cpu:.1f}/{wall:.1f}" for name, (cpu, wall) in times.items()
        )
        print(
            f"round {round_} (CPU/wall ms per step): baseline {before[0]:.1f}/{before[1]:.1f} "
            f"{after[0]:.1f}/{after[1]:.1f}; {shown}",
            flush=True,
        )
    for name in names:
        note = (
            f"; at {', '.join(f'{k}={v}' for k, v in ACTING[name].items())}"
            if name in ACTING
            else ""
        )
        print(
            f"price: {name} = {statistics.median(cpu_ratios[name]):.3f}  "
            f"(CPU time; wall clock {statistics.median(wall_ratios[name]):.3f}{note})"
        )
    print(
        f"({time.perf_counter() - started:.0f} s; load average now {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
