"""sd-speedup against sd-baseline in one invocation: the tiny parts on the captioned digits.

Both recipes train the same steps with the same seed; each evaluates every `--eval-every`
steps. The target is sd-baseline's validation loss at its last evaluation; for each arm: the
training seconds (`train_s`, the clock stops for evaluation) to first reach it (interpolated
between evaluations), the median step time, the last val_loss and judged_accuracy, and for
sd-speedup the EMA's (`ema_val_loss`) as a second arm. On the CPU (fp32) the low-precision
norms do nothing and EMA does not change training: the difference is the encoders' forward
that precomputed latents remove from each step. `wall_s` is each run's whole time: the
precomputing counts there (and the tiny VAE's fitting in the first arm only: the second
reads it from the shared cache). Set OMP_NUM_THREADS=1 on a shared machine.

    python bench/diffusion_recipe.py [--steps 300] [--eval-every 100] [--seeds 1 2]

CPU only (bench/_common.train runs `--device=cpu`); no GPU numbers yet.
"""

from __future__ import annotations

import argparse
import time

from _common import generate, median, scratch, speedup_line, train

ARMS = ("sd-baseline", "sd-speedup")


def time_to(records: list[dict], target: float, metric: str) -> float | None:
    """Training seconds until `metric` first reaches `target` (up to a relative 1e-5:
    the same training reaches it up to rounding), interpolated linearly between the
    evaluation before and the one that reaches it; None: never."""
    target *= 1 + 1e-5
    previous = (0.0, float("inf"))
    for record in (r for r in records if metric in r):
        seconds, value = record["train_s"], record[metric]
        if value <= target:
            start, before = previous
            if before == float("inf"):
                return seconds
            return start + (seconds - start) * (before - target) / (before - value)
        previous = (seconds, value)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    args = parser.parse_args()
    root = scratch()
    projects = {arm: generate(arm, root) for arm in ARMS}
    common = [
        f"--max_duration={args.steps}ba",
        f"--eval_interval={args.eval_every}ba",
        f"--save_interval={args.steps}ba",
    ]
    ratios: dict[str, list[float]] = {"sd-speedup": [], "sd-speedup (ema)": []}
    for seed in args.seeds:
        runs = {}
        for arm in ARMS:
            started = time.perf_counter()
            records = train(
                projects[arm], root, f"{arm}-{seed}", *common, f"--seed={seed}"
            )
            wall = time.perf_counter() - started
            runs[arm] = records
            last = [r for r in records if "val_loss" in r][-1]
            steps = [r["step_ms"] for r in records if "step_ms" in r]
            print(
                f"seed {seed} {arm}: step_ms {median(steps):.1f}, train_s "
                f"{records[-1]['train_s']:.1f}, wall_s {wall:.1f}, val_loss "
                f"{last['val_loss']:.4f}, ema_val_loss {last.get('ema_val_loss', '-')}, "
                f"judged_accuracy {last.get('judged_accuracy', '-')}"
            )
        base = runs["sd-baseline"]
        target = [r["val_loss"] for r in base if "val_loss" in r][-1]
        reference = time_to(base, target, "val_loss")
        for arm, metric in (
            ("sd-speedup", "val_loss"),
            ("sd-speedup (ema)", "ema_val_loss"),
        ):
            reached = time_to(runs["sd-speedup"], target, metric)
            if reached is not None:
                ratios[arm].append(reference / reached)
            print(
                f"seed {seed} {arm}: {metric} reaches {target:.4f} at train_s {reached}"
            )
    for arm, values in ratios.items():
        if values:
            print(speedup_line(arm, values, []))
        else:
            print(f"speedup: {arm}: target not reached")


if __name__ == "__main__":
    main()
