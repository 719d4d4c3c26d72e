"""Recipe speed-up: time for gpt2-speedup to reach the validation loss gpt2-baseline ends at.

Both recipes train the tiny preset on the embedded data for the same number of steps, with an
evaluation every `--eval-every` steps; `train_s` in metrics.jsonl is training time without the
evaluations. For each seed the target is the baseline's final validation loss; the speed-up is
baseline time / speedup time to first reach it (linear interpolation between evaluations).
A PNG plot of validation loss against training time is written when matplotlib is installed.

    python bench/recipe.py [--seeds 1 2 3] [--steps 600] [--plot bench/recipe.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import ALLOCATOR, generate, plot_curves, scratch, speedup_line, train


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
    parser.add_argument(
        "--plot", type=Path, default=Path(__file__).resolve().parent / "recipe.png"
    )
    args = parser.parse_args()
    root = scratch()
    projects = {
        recipe: generate(recipe, root) for recipe in ("gpt2-baseline", "gpt2-speedup")
    }
    common = [
        f"--max_duration={args.steps}ba",
        f"--eval_interval={args.eval_every}ba",
        f"--save_interval={args.steps}ba",
        "--autoresume=false",
    ]
    print(f"allocator: {' '.join(f'{k}={v}' for k, v in ALLOCATOR.items())}")
    print(
        f"{'seed':>4} {'recipe':14} {'final val':>9} {'train s':>8} {'s to target':>11}"
    )
    curves: dict[str, list] = {recipe: [] for recipe in projects}
    speedups, bounds = [], []
    for seed in args.seeds:
        runs = {}
        for recipe, project in projects.items():  # alternate within a seed
            runs[recipe] = curve(
                train(project, root, f"{recipe}-{seed}", f"--seed={seed}", *common)
            )
            curves[recipe].append(runs[recipe])
        target = runs["gpt2-baseline"][-1][1]
        times = {recipe: time_to(target, points) for recipe, points in runs.items()}
        for recipe, points in runs.items():
            reached = times[recipe]
            print(
                f"{seed:4d} {recipe:14} {points[-1][1]:9.4f} {points[-1][0]:8.1f} "
                f"{'never' if reached is None else f'{reached:.1f}':>11}",
                flush=True,
            )
        if times["gpt2-speedup"] is not None:
            speedups.append(times["gpt2-baseline"] / times["gpt2-speedup"])
        else:  # never reached: its ratio is below the baseline's time over its whole run
            bounds.append(times["gpt2-baseline"] / runs["gpt2-speedup"][-1][0])
    if plot_curves(
        curves,
        args.plot,
        xlabel="training time (s, CPU)",
        ylabel="validation loss (nats/byte)",
        title="gpt2-speedup vs gpt2-baseline, tiny preset",
    ):
        print(f"plot: {args.plot}")
    print(
        f"median over {len(args.seeds)} seeds of the baseline's time to its final loss over the speedup's:"
    )
    print(speedup_line("gpt2-speedup", speedups, bounds))


if __name__ == "__main__":
    main()
