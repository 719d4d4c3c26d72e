"""The speedrun on a CPU: time to a target validation loss for gpt2-baseline, gpt2-speedup,
gpt2-modern, gpt2-speedrun, each modern algorithm alone on top of the baseline (an
ablation), ALiBi alone with and without Composer's train_sequence_length_scaling (`+alibi`:
0.25, quarter rows; `+alibi-full`: 1.0, full-length rows), and each speedrun entry alone on
top of gpt2-modern (`modern+<name>`, compared with gpt2-modern, seed by seed, at
gpt2-modern's loss at `--target-at` of its budget).

Every arm trains the same tiny model size on the same data (the embedded standard-library
source as bytes, split by file; its hash is printed) for the same number of steps, with an
evaluation every `--eval-every` steps. The target is gpt2-baseline's validation loss at
`--target-at` (85%) of its budget, for the same seed, interpolated between evaluations. For
each arm: the steps, tokens and training seconds (`train_s`: the clock stops for evaluation;
nothing is compiled) to first reach the target, and the ratio of the baseline's to the arm's.
`--clock cpu` (the default) makes those seconds the training process's CPU time, with
OMP_NUM_THREADS=1 (one core's work, insensitive to other jobs on a shared machine); each
run's whole wall and CPU seconds (start-up and evaluation included) are printed beside it.
`--clock wall` is the wall clock with torch's default threads (the numbers before issue 31).
Arms run interleaved (every arm for seed 1, then every arm for seed 2, ...), so load on the
machine spreads over all of them. Medians over seeds; one `speedup: <arm> = X` line each.

    python bench/lm_recipe.py [--seeds 1 2 3] [--steps 600] [--arms gpt2-modern muon ...]
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from _common import (
    add_clock,
    apply_clock,
    REPO,
    bench_env,
    budget_args,
    median,
    plot_curves,
    print_conditions,
    scratch,
    speedup_line,
    train,
)

RECIPES = REPO / "templates" / "recipes"
SHIPPED = ("gpt2-baseline", "gpt2-speedup", "gpt2-modern", "gpt2-speedrun")
# Each on top of gpt2-baseline, with the hyperparameters gpt2-modern uses.
ALONE = (
    "rotary",
    "qk_norm",
    "relu_squared",
    "gated_linear_units",
    "zero_init",
    "logit_softcap",
    "muon",
    "value_embeddings",
)
# Each speedrun entry alone on top of gpt2-modern (`modern+<name>`), with gpt2-speedrun's
# settings for it: a table added to gpt2-modern's recipe, `scaffold new --set` arguments.
ON_MODERN: dict[str, tuple[str, list[str]]] = {
    "bigram_hash_embedding": (
        "[algorithms.bigram_hash_embedding]\ntable_factor = 5\n",
        [],
    ),
    "polar_express": ("", ["--set", "muon.orthogonalizer=polar_express"]),
    "normuon": ("", [*("--set", "muon.normuon=true"), *("--set", "muon.beta2=0.9")]),
    "cautious_weight_decay": (
        "",
        [
            *("--set", "muon.cautious_weight_decay=true"),
            *("--set", "muon.weight_decay=1.2"),
        ],
    ),
    "logit_cap_15": ("", ["--set", "logit_softcap.cap=15.0"]),
    "unet_skips": ("[algorithms.unet_skips]\n", []),
}


# ALiBi with Composer's default train_sequence_length_scaling (0.25: quarter rows) and
# without it (full-length rows), each alone on top of gpt2-baseline.
ALIBI = ("alibi", "alibi-full")
# An arm that is one algorithm with other hyperparameters: (algorithm, its table's lines).
VARIANTS = {"alibi-full": ("alibi", "\ntrain_sequence_length_scaling = 1.0")}


def generate(arm: str, root: Path) -> Path:
    """A shipped recipe, gpt2-baseline plus one algorithm (`+<name>`, or a variant), or
    gpt2-modern plus one speedrun entry (`modern+<name>`, ON_MODERN)."""
    extra: list[str] = []
    if arm in SHIPPED:
        recipe = str(RECIPES / f"{arm}.toml")
    elif arm.startswith("modern+"):
        table, extra = ON_MODERN[arm.removeprefix("modern+")]
        path = root / f"{arm.replace('+', '-')}.toml"
        path.write_text((RECIPES / "gpt2-modern.toml").read_text() + "\n" + table)
        recipe = str(path)
    else:
        name, params = VARIANTS.get(arm.removeprefix("+"), (arm.removeprefix("+"), ""))
        if not params:
            modern = (RECIPES / "gpt2-modern.toml").read_text()
            table = modern.split(f"[algorithms.{name}]", 1)
            params = table[1].split("\n[", 1)[0] if len(table) == 2 else "\n"
        path = root / f"{arm.removeprefix('+')}.toml"
        path.write_text(
            (RECIPES / "gpt2-baseline.toml").read_text()
            + f"\n[algorithms.{name}]{params}\n"
        )
        recipe = str(path)
    dest = root / arm.replace("+", "plus-")
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
            *extra,
        ],
        check=True,
        env=bench_env(),
        cwd=REPO,
        capture_output=True,
    )
    return dest


def corpus_hash(project: Path) -> str:
    """sha256 of the training and validation tokens, as the generated data.py loads them."""
    code = (
        "import hashlib; from data import load_tokens; t = load_tokens(''); "
        "print(hashlib.sha256(t.train.tobytes() + t.val.tobytes()).hexdigest()[:16], "
        "len(t.train), len(t.val))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=project,
        env=bench_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def children_cpu() -> float:
    """User + system CPU seconds of this process's finished children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def curve(
    records: list[dict], batch: int, seq_len: int
) -> list[tuple[int, int, float, float]]:
    """(step, tokens, training seconds, validation loss) at every evaluation; tokens count the
    truncated lengths of sequence-length warmup (its `seq_len` metric) where logged."""
    points, tokens = [], 0
    for r in records:
        if "loss" in r:
            tokens += batch * r.get("seq_len", seq_len)
        if "val_loss" in r:
            points.append((r["step"], tokens, r["train_s"], r["val_loss"]))
    return points


def at_fraction(points: list[tuple[int, int, float, float]], step: float) -> float:
    """The validation loss at `step`, interpolated between evaluations."""
    for (s0, _, _, l0), (s1, _, _, l1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return points[-1][3]


def reach(
    target: float, points: list[tuple[int, int, float, float]]
) -> tuple[float, float, float] | None:
    """(steps, tokens, seconds) when the curve first reaches `target`, interpolated."""
    previous = None
    for point in points:
        if point[3] <= target:
            if previous is None:
                return point[0], point[1], point[2]
            w = (previous[3] - target) / (previous[3] - point[3])
            return tuple(a + (b - a) * w for a, b in zip(previous[:3], point[:3]))  # type: ignore[return-value]
        previous = point
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument(
        "--target-at",
        type=float,
        default=0.85,
        help="fraction of the baseline's budget",
    )
    parser.add_argument(
        "--arms",
        nargs="+",
        default=[
            *SHIPPED,
            *(f"+{name}" for name in (*ALONE, *ALIBI)),
            *(f"modern+{name}" for name in ON_MODERN),
        ],
    )
    add_clock(parser)
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        help="also draw the curves into this PNG file (default: no plot)",
    )
    args = parser.parse_args()
    apply_clock(args.clock)
    arms = ["gpt2-baseline", *(arm for arm in args.arms if arm != "gpt2-baseline")]
    root = scratch()
    projects = {arm: generate(arm, root) for arm in arms}
    batch, seq_len = 16, 128  # the recipes' global_batch_size and seq_len
    common = budget_args(args.steps, args.eval_every)
    print_conditions()
    threads = os.environ.get("OMP_NUM_THREADS", "torch's default")
    print(f"clock: {args.clock} (training seconds); OMP_NUM_THREADS={threads}")
    print(
        f"corpus (sha256[:16], train bytes, val bytes): {corpus_hash(projects['gpt2-baseline'])}"
    )
    print(
        f"{args.steps} steps of {batch} x {seq_len} tokens, tiny preset; target: the baseline's "
        f"validation loss at {args.target_at:.0%} of its steps"
    )
    print(
        f"{'seed':>4} {'arm':22} {'final val':>9} {'target':>7} {'steps':>7} {'tokens':>9} "
        f"{'seconds':>8} {'run wall':>8} {'run cpu':>8}"
    )
    curves: dict[str, list] = {arm: [] for arm in arms}
    ratios: dict[str, dict[str, list[float]]] = {
        arm: {"steps": [], "tokens": [], "time": []} for arm in arms
    }
    bounds: dict[str, list[float]] = {arm: [] for arm in arms}
    runs_by_seed: dict[int, dict[str, list]] = {}
    for seed in args.seeds:
        runs = runs_by_seed.setdefault(seed, {})
        whole: dict[str, tuple[float, float]] = {}
        for arm, project in projects.items():
            wall, cpu = time.perf_counter(), children_cpu()
            records = train(
                project,
                root,
                f"{arm.replace('+', 'plus-')}-{seed}",
                f"--seed={seed}",
                *common,
                cpu_clock=args.clock == "cpu",
            )
            whole[arm] = (time.perf_counter() - wall, children_cpu() - cpu)
            runs[arm] = curve(records, batch, seq_len)
            curves[arm].append(runs[arm])
        target = at_fraction(runs["gpt2-baseline"], args.target_at * args.steps)
        base = reach(target, runs["gpt2-baseline"])
        for arm, points in runs.items():
            reached = reach(target, points)
            shown = (
                ("never", "", "")
                if reached is None
                else (f"{reached[0]:.0f}", f"{reached[1]:.0f}", f"{reached[2]:.1f}")
            )
            print(
                f"{seed:4d} {arm:22} {points[-1][3]:9.4f} {target:7.4f} {shown[0]:>7} {shown[1]:>9} "
                f"{shown[2]:>8} {whole[arm][0]:8.1f} {whole[arm][1]:8.1f}",
                flush=True,
            )
            if reached is not None:
                for key, b, a in zip(("steps", "tokens", "time"), base, reached):
                    ratios[arm][key].append(b / a)
            else:
                bounds[arm].append(base[2] / points[-1][2])
    seconds_and_loss = {
        arm: [[(p[2], p[3]) for p in points] for points in runs]
        for arm, runs in curves.items()
    }
    if args.plot and plot_curves(
        seconds_and_loss,
        args.plot,
        xlabel=f"training time (s, {args.clock} clock; evaluation excluded)",
        ylabel="validation loss (nats/byte)",
        title="time to loss: gpt2 recipes, algorithms alone (tiny preset)",
    ):
        print(f"plot: {args.plot}")
    print(f"load average at the end (1, 5, 15 min): {os.getloadavg()}")
    print(
        f"median over {len(args.seeds)} seeds of baseline/arm to the target (steps, tokens, time):"
    )
    for arm in arms[1:]:
        r = ratios[arm]
        detail = (
            ""
            if bounds[arm]
            else f" (time; steps {median(r['steps']):.2f}, tokens {median(r['tokens']):.2f})"
        )
        print(speedup_line(arm, r["time"], bounds[arm], detail))
    paired_with_modern(args, runs_by_seed, arms)


def paired_with_modern(
    args: argparse.Namespace, runs_by_seed: dict[int, dict[str, list]], arms: list[str]
) -> None:
    """gpt2-speedrun and each `modern+` arm against gpt2-modern, paired per seed: the
    target is gpt2-modern's validation loss at --target-at of its budget."""
    paired = [a for a in arms if a == "gpt2-speedrun" or a.startswith("modern+")]
    if "gpt2-modern" not in arms or not paired:
        return
    print(
        f"median over {len(args.seeds)} seeds of gpt2-modern/arm to gpt2-modern's loss at "
        f"{args.target_at:.0%} of its steps (time; steps, tokens):"
    )
    for arm in paired:
        ratios: dict[str, list[float]] = {"steps": [], "tokens": [], "time": []}
        bounds: list[float] = []
        for runs in runs_by_seed.values():
            modern = runs["gpt2-modern"]
            target = at_fraction(modern, args.target_at * args.steps)
            base, reached = reach(target, modern), reach(target, runs[arm])
            if reached is None:
                bounds.append(base[2] / runs[arm][-1][2])
                continue
            for key, b, a in zip(("steps", "tokens", "time"), base, reached):
                ratios[key].append(b / a)
        detail = (
            ""
            if bounds
            else f" (steps {median(ratios['steps']):.2f}, tokens {median(ratios['tokens']):.2f})"
        )
        print(speedup_line(f"{arm} vs gpt2-modern", ratios["time"], bounds, detail))


if __name__ == "__main__":
    main()
