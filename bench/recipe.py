"""Recipe speed-up: time for gpt2-speedup to reach the validation loss gpt2-baseline ends at.

Both recipes train the tiny preset on the embedded data for the same number of steps, with an
evaluation every `--eval-every` steps; `train_s` in metrics.jsonl is training time without the
evaluations. For each seed the target is the baseline's final validation loss; the speed-up is
baseline time / speedup time to first reach it (linear interpolation between evaluations).
`--clock cpu` (the default) counts each run's training seconds as its process's CPU time with
OMP_NUM_THREADS=1 (one core's work: steady on a shared machine); `--clock wall` is the wall
clock with torch's default threads (the numbers before issue 44). `--scalings 1 0.25` runs
gpt2-speedup once per ALiBi train_sequence_length_scaling (each against the same baseline
run); `--train-args "--seq_len=512 --global_batch_size=4"` passes flags to every run. A PNG
plot of validation loss against training time is written when matplotlib is installed.

    python bench/recipe.py [--seeds 1 2 3] [--steps 600] [--clock cpu] [--scalings 1 0.25]
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from _common import (
    add_clock,
    apply_clock,
    budget_args,
    generate,
    plot_curves,
    print_conditions,
    scratch,
    speedup_line,
    train,
)


def curve(records: list[dict]) -> list[tuple[float, float]]:
    """(training seconds, validation loss) at every evaluation."""
    return [(r["train_s"], r["val_loss"]) for r in records if "val_loss" in r]


def time_to(target: float, points: list[tuple[float, float]]) -> float | None:
    """First time the curve reaches `target`, interpolated between evaluations; None if never."""
    previous = None
    for seconds, loss in points:
        if loss <= target:
            if previous is None:
                return seconds
            (s0, l0), (s1, l1) = previous, (seconds, loss)
            return s0 + (s1 - s0) * (l0 - target) / (l0 - l1)
        previous = (seconds, loss)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=25)
    add_clock(parser)
    parser.add_argument(
        "--scalings",
        type=float,
        nargs="+",
        default=[],
        help="gpt2-speedup arms at these ALiBi train_sequence_length_scaling values "
        "(default: the recipe's own, one arm)",
    )
    parser.add_argument(
        "--train-args",
        default="",
        help="train.py flags for every run, one string (e.g. '--seq_len=512')",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="also draw the curves into this PNG file (default: no plot)",
    )
    args = parser.parse_args()
    apply_clock(args.clock)
    root = scratch()
    baseline, speedup = (generate(r, root) for r in ("gpt2-baseline", "gpt2-speedup"))
    arms = {"gpt2-baseline": (baseline, [])}
    for scaling in args.scalings:
        flag = f"--alibi_train_sequence_length_scaling={scaling}"
        arms[f"gpt2-speedup@{scaling:g}"] = (speedup, [flag])
    if not args.scalings:
        arms["gpt2-speedup"] = (speedup, [])
    common = [
        *budget_args(args.steps, args.eval_every),
        *shlex.split(args.train_args),
    ]
    print_conditions()
    threads = os.environ.get("OMP_NUM_THREADS", "torch's default")
    print(f"clock: {args.clock} (training seconds); OMP_NUM_THREADS={threads}")
    print(f"train.py flags: {' '.join(common)}")
    print(f"{'seed':>4} {'arm':18} {'final val':>9} {'train s':>8} {'s to target':>11}")
    curves: dict[str, list] = {arm: [] for arm in arms}
    speedups: dict[str, list[float]] = {arm: [] for arm in arms}
    bounds: dict[str, list[float]] = {arm: [] for arm in arms}
    for seed in args.seeds:
        runs = {}
        for arm, (project, flags) in arms.items():  # alternate within a seed
            name = f"{arm.replace('@', '-')}-{seed}"
            records = train(
                project,
                root,
                name,
                f"--seed={seed}",
                *common,
                *flags,
                cpu_clock=args.clock == "cpu",
            )
            runs[arm] = curve(records)
            curves[arm].append(runs[arm])
        target = runs["gpt2-baseline"][-1][1]
        times = {arm: time_to(target, points) for arm, points in runs.items()}
        for arm, points in runs.items():
            reached = times[arm]
            print(
                f"{seed:4d} {arm:18} {points[-1][1]:9.4f} {points[-1][0]:8.1f} "
                f"{'never' if reached is None else f'{reached:.1f}':>11}",
                flush=True,
            )
            if reached is not None:
                speedups[arm].append(times["gpt2-baseline"] / reached)
            else:  # never reached: its ratio is below the baseline's time over its whole run
                bounds[arm].append(times["gpt2-baseline"] / points[-1][0])
    if args.plot and plot_curves(
        curves,
        args.plot,
        xlabel=f"training time (s, {args.clock} clock)",
        ylabel="validation loss (nats/byte)",
        title="gpt2-speedup vs gpt2-baseline, tiny preset",
    ):
        print(f"plot: {args.plot}")
    print(f"load average at the end (1, 5, 15 min): {os.getloadavg()}")
    print(
        f"median over {len(args.seeds)} seeds of the baseline's time to its final loss over "
        "the arm's:"
    )
    for arm in list(arms)[1:]:
        detail = f" (per seed {', '.join(f'{r:.2f}' for r in speedups[arm])})"
        print(speedup_line(arm, speedups[arm], bounds[arm], detail))


if __name__ == "__main__":
    main()
