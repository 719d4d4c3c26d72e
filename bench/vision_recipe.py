"""Time to accuracy on a CPU: the CIFAR ResNet speed-up recipes against cifar-resnet56-baseline.

Composer's "7x" for ResNet-50 is time to a target accuracy, so this is what the bench measures.
Every arm trains the same model preset (`--model`, default `tiny`: ResNet-56 is far too slow
for a 2-core CPU) on the embedded data (scikit-learn's 8x8 digits; its hash is printed), at the
same global batch, with its own recipe's algorithms and hyperparameters. Each recipe keeps its
duration relative to the baseline's (Composer's scale_schedule_ratio: mild trains 0.4x, medium
1.5x as long), so `--epochs` sets the baseline's budget and the others follow. Evaluation every
epoch. Accuracy is the EMA weights' where a recipe keeps an average (the weights it exports).
The target is the baseline's final validation top-1, for the same seed; for each arm the
training seconds (`train_s`: the clock stops for evaluation and checkpoints) and epochs to first
reach it, interpolated between evaluations, and the ratio of the baseline's to the arm's. Arms
run interleaved (every arm for seed 1, then every arm for seed 2, ...), so load on the machine
spreads over all of them. Medians over seeds; one `speedup: <recipe> = X` line each, and a plot
of accuracy against training time.

    python bench/vision_recipe.py [--seeds 1 2 3] [--epochs 30] [--arms cifar-resnet56-mild ...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tomllib
from pathlib import Path

from _common import (
    ALLOCATOR,
    REPO,
    bench_env,
    plot_curves,
    scratch,
    speedup_line,
    train,
)

RECIPES = REPO / "templates" / "recipes"
BASELINE = "cifar-resnet56-baseline"
SPEEDUPS = ("cifar-resnet56-mild", "cifar-resnet56-medium")


def generate(recipe: str, root: Path) -> Path:
    dest = root / recipe
    subprocess.run(
        [
            sys.executable,
            "-m",
            "scaffold",
            "new",
            str(dest),
            "--recipe",
            recipe,
            "--name",
            "bench",
        ],
        check=True,
        env=bench_env(),
        cwd=REPO,
        capture_output=True,
    )
    return dest


def epochs_of(recipe: str) -> int:
    """The recipe's max_duration in epochs."""
    duration = tomllib.loads((RECIPES / f"{recipe}.toml").read_text())["answers"][
        "max_duration"
    ]
    if not duration.endswith("ep"):
        raise SystemExit(
            f"{recipe}: max_duration {duration!r} is not in epochs; this bench scales epochs"
        )
    return int(duration.removesuffix("ep"))


def corpus_hash(project: Path) -> str:
    """sha256 of the training and validation images and labels, as the generated data.py loads them."""
    code = (
        "import hashlib; from data import load_images; d = load_images(''); "
        "h = hashlib.sha256(); [h.update(s.pixels.tobytes() + s.labels.tobytes()) for s in (d.train, d.val)]; "
        "print(h.hexdigest()[:16], len(d.train), len(d.val))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=project,
        env=bench_env(),
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or f"(not hashed: {out.stderr.strip().splitlines()[-1:]})"


def curve(records: list[dict]) -> list[tuple[int, float, float]]:
    """(step, training seconds, validation top-1) at every evaluation: of the averaged weights
    where the recipe keeps an EMA (those are the weights it exports), else of the model.
    """
    return [
        (r["step"], r["train_s"], r.get("ema_val_top1", r["val_top1"]))
        for r in records
        if "val_top1" in r
    ]


def reach(
    target: float, points: list[tuple[int, float, float]]
) -> tuple[float, float] | None:
    """(steps, seconds) when the accuracy first reaches `target`, interpolated."""
    previous = None
    for point in points:
        if point[2] >= target:
            if previous is None or point[2] == previous[2]:
                return point[0], point[1]
            w = (target - previous[2]) / (point[2] - previous[2])
            return (
                previous[0] + (point[0] - previous[0]) * w,
                previous[1] + (point[1] - previous[1]) * w,
            )
        previous = point
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument(
        "--epochs",
        type=int,
        default=30,
        help="the baseline's budget; the others scale with it",
    )
    parser.add_argument("--model", default="tiny", help="the preset every arm trains")
    parser.add_argument(
        "--batch", type=int, default=128, help="global batch size of every arm"
    )
    parser.add_argument("--arms", nargs="+", default=list(SPEEDUPS))
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="also draw the curves into this PNG file (default: no plot)",
    )
    args = parser.parse_args()
    arms = [BASELINE, *(arm for arm in args.arms if arm != BASELINE)]
    root = scratch()
    projects = {arm: generate(arm, root) for arm in arms}
    base_epochs = epochs_of(BASELINE)
    budget = {
        arm: max(1, round(args.epochs * epochs_of(arm) / base_epochs)) for arm in arms
    }
    common = [
        f"--model={args.model}",
        "--precision=fp32",
        f"--global_batch_size={args.batch}",
        f"--device_microbatch_size={args.batch}",
        "--bn_group_size=32",
        "--eval_interval=1ep",
        "--autoresume=false",
        "--num_workers=0",
    ]
    print(f"allocator: {' '.join(f'{k}={v}' for k, v in ALLOCATOR.items())}")
    print(f"data (sha256[:16], train, val images): {corpus_hash(projects[BASELINE])}")
    print(
        f"model {args.model}, global batch {args.batch}; epochs: "
        + ", ".join(f"{arm} {n}" for arm, n in budget.items())
    )
    print(
        f"{'seed':>4} {'recipe':24} {'final top-1':>11} {'target':>7} {'steps':>7} {'seconds':>8}"
    )
    curves: dict[str, list] = {arm: [] for arm in arms}
    ratios: dict[str, list[float]] = {arm: [] for arm in arms}
    bounds: dict[str, list[float]] = {arm: [] for arm in arms}
    for seed in args.seeds:
        runs = {}
        for arm, project in projects.items():
            records = train(
                project,
                root,
                f"{arm}-{seed}",
                f"--seed={seed}",
                f"--max_duration={budget[arm]}ep",
                f"--save_interval={budget[arm]}ep",
                *common,
            )
            runs[arm] = curve(records)
            curves[arm].append(runs[arm])
        target = runs[BASELINE][-1][2]
        base = reach(target, runs[BASELINE])
        for arm, points in runs.items():
            reached = reach(target, points)
            shown = (
                ("never", "")
                if reached is None
                else (f"{reached[0]:.0f}", f"{reached[1]:.1f}")
            )
            print(
                f"{seed:4d} {arm:24} {points[-1][2]:11.4f} {target:7.4f} {shown[0]:>7} {shown[1]:>8}",
                flush=True,
            )
            if reached is not None:
                ratios[arm].append(base[1] / reached[1])
            else:
                bounds[arm].append(base[1] / points[-1][1])
    seconds_and_top1 = {
        arm: [[(p[1], p[2]) for p in points] for points in runs]
        for arm, runs in curves.items()
    }
    if args.plot and plot_curves(
        seconds_and_top1,
        args.plot,
        xlabel="training time (s, CPU; evaluation excluded)",
        ylabel="validation top-1",
        title="time to accuracy: CIFAR ResNet recipes on the embedded digits",
    ):
        print(f"plot: {args.plot}")
    print(
        f"median over {len(args.seeds)} seeds of the baseline's time to its final top-1 over the recipe's:"
    )
    for arm in arms[1:]:
        print(speedup_line(arm, ratios[arm], bounds[arm]))


if __name__ == "__main__":
    main()
