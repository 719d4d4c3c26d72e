"""BERT pretraining on a CPU: mosaicbert against bert-pretrain-baseline, then each
pretrained model fine-tuned on the offline classification set.

Both recipes train as generated (tiny preset, seq 128, global batch 32, a 4,096-token
WordPiece tokenizer trained once on Python's documentation topics and shared by every
run) for the same `--steps` (the recipes' 300 by default; each recipe's warmup and decay
follow the budget), evaluating every `--eval-every` steps on the same validation masks
(15%: `eval_mask_rate`, whatever the recipe's training rate). The target is the
baseline's final masked-LM validation loss, for the same seed; for each arm the training
time and the real (non-padding) tokens to first reach it, interpolated between
evaluations, and the baseline's over the arm's. Time is CPU time: every run's train.py
runs with torch on one thread and the monitor's clock set to the process's CPU time
(`_common.CPU_CLOCK`; evaluation and checkpoints excluded, as from `train_s`); each
run's wall seconds (start-up and evaluation included) are printed beside it.

Then each pretrained run is exported (`scaffold export --format hf`) and fine-tuned with
`--model=<export>` in its recipe family's fine-tune project (bert-pretrain-baseline's
BertForMaskedLM folder in `bert-sst2`, mosaicbert's own layout, ALiBi and GeGLU, in
`mosaicbert-sst2`), as the README's pretrain -> fine-tune commands do, on that recipe's offline data (standard-library lines, prose or code),
3 epochs, the same seed, at `--finetune-lr` (bert-sst2's 2e-5 is for bert-base: the tiny
encoder barely moves at it); its final validation accuracy is printed.

Arms run interleaved (both recipes for seed 1, then seed 2, ...). Medians over seeds:
one `speedup: mosaicbert = X` line (time; tokens beside it).

`--device=cuda`: every run (pretraining and fine-tuning) on the GPU with
`--precision=amp_bf16` (the recipes' bf16 as autocast) and train.py's `compile=auto`
(each layer compiled on CUDA, as a generated project runs there). Time is then wall time:
`train_s` on the monitor's own clock (perf_counter), training steps only; every step's
log reads its loss, a device sync, so queued GPU work is counted (at an evaluation step
up to that one step's may land in the evaluation's paused time instead). Compilation
happens in the first steps and counts as training time in both arms alike.

    OMP_NUM_THREADS=1 python bench/bert_recipe.py [--seeds 1 2 3] [--steps 300]
    python bench/bert_recipe.py --device=cuda --seeds 1 2 3
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from _common import REPO, bench_env, budget_args, generate, median, print_conditions
from _common import scratch, speedup_line, train
from lm_recipe import reach

BASELINE, ARM = "bert-pretrain-baseline", "mosaicbert"
# Each pretrained arm fine-tunes in the project of its family (README).
FINETUNE = {BASELINE: "bert-sst2", ARM: "mosaicbert-sst2"}


def curve(records: list[dict]) -> list[tuple[int, int, float, float]]:
    """(step, real tokens so far, training CPU seconds, validation loss) at every
    evaluation."""
    return [
        (r["step"], r["tokens"], r["train_s"], r["val_loss"])
        for r in records
        if "val_loss" in r
    ]


def timed(
    project: Path, root: Path, name: str, device: str, *args: str
) -> tuple[list[dict], float]:
    """train.py, on the CPU clock on the CPU (wall time on CUDA); its records and the
    run's wall seconds."""
    started = time.perf_counter()
    on_gpu = ["--device=cuda", "--precision=amp_bf16"] if device == "cuda" else []
    records = train(project, root, name, *on_gpu, *args, cpu_clock=device == "cpu")
    return records, time.perf_counter() - started


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def export(project: Path, run: Path, out: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "scaffold", "export", "--format", "hf", str(run)]
        + [str(out), "--project", str(project)],
        check=True,
        env=bench_env(),
        cwd=REPO,
        capture_output=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--finetune-lr", type=float, default=5e-4)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--finetune",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="fine-tune each pretrained run (--no-finetune: pretraining only, half "
        "the processes)",
    )
    args = parser.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing downloads
    root = scratch()
    projects = {arm: generate(arm, root) for arm in (BASELINE, ARM)}
    finetunes = {
        arm: generate(recipe, root) for arm, recipe in FINETUNE.items() if args.finetune
    }
    common = budget_args(args.steps, args.eval_every)
    print_conditions()
    clock = "CPU" if args.device == "cpu" else "wall (CUDA, amp_bf16, compile=auto)"
    print(
        f"{args.steps} steps, recipes as generated (tiny, 32 x 128); target: the "
        f"baseline's final val_loss; fine-tune: bert-sst2 / mosaicbert-sst2, lr "
        f"{args.finetune_lr}; device {args.device}, training time on the {clock} clock"
    )
    print(
        f"{'seed':>4} {'recipe':22} {'final val':>9} {'target':>7} {'steps':>6} "
        f"{'tokens':>8} {'time s':>6} {'train s':>9} {'run cpu':>7} {'wall':>6} "
        f"{'ft acc':>6} {'ft wall':>7}"
    )
    ratios: dict[str, list[float]] = {"time": [], "tokens": []}
    bounds: list[float] = []
    accuracy: dict[str, list[float]] = {BASELINE: [], ARM: []}
    for seed in args.seeds:
        runs = {}
        for arm, project in projects.items():
            name = f"{arm}-{seed}"
            cpu = children_cpu()
            records, wall = timed(
                project, root, name, args.device, f"--seed={seed}", *common
            )
            run_cpu = children_cpu() - cpu
            acc, tuned_wall = float("nan"), 0.0
            if args.finetune:
                export(project, root / "runs" / name, root / f"{name}-hf")
                tuned, tuned_wall = timed(
                    finetunes[arm], root, f"ft-{name}", args.device,
                    f"--model={root / f'{name}-hf'}", f"--lr={args.finetune_lr}",
                    f"--seed={seed}", "--autoresume=false",
                )  # fmt: skip
                acc = [r for r in tuned if "accuracy" in r][-1]["accuracy"]
                accuracy[arm].append(acc)
            runs[arm] = (curve(records), records[-1]["train_s"], run_cpu, wall)
            runs[arm] += (acc, tuned_wall)
        target = runs[BASELINE][0][-1][3]
        base = reach(target, runs[BASELINE][0])
        for arm, (points, train_cpu, run_cpu, wall, acc, ft_wall) in runs.items():
            reached = reach(target, points)
            shown = (
                ("never", "", "")
                if reached is None
                else (f"{reached[0]:.0f}", f"{reached[1]:.0f}", f"{reached[2]:.1f}")
            )
            print(
                f"{seed:4d} {arm:22} {points[-1][3]:9.4f} {target:7.4f} {shown[0]:>6} "
                f"{shown[1]:>8} {shown[2]:>6} {train_cpu:9.1f} {run_cpu:7.1f} "
                f"{wall:6.1f} {acc:6.3f} {ft_wall:7.1f}",
                flush=True,
            )
            if arm == BASELINE:
                continue
            if reached is None:
                bounds.append(base[2] / train_cpu)
            else:
                ratios["time"].append(base[2] / reached[2])
                ratios["tokens"].append(base[1] / reached[1])
    print(f"load average at the end (1, 5, 15 min): {os.getloadavg()}")
    for arm, values in accuracy.items() if args.finetune else ():
        shown = " / ".join(f"{v:.3f}" for v in values)
        print(f"fine-tuned accuracy: {arm} = {median(values):.3f} (seeds: {shown})")
    print(
        f"median over {len(args.seeds)} seeds of the baseline's training time ({clock}; "
        "and tokens) to its final val_loss over mosaicbert's:"
    )
    detail = "" if bounds else f" (time; tokens {median(ratios['tokens']):.2f})"
    print(speedup_line(ARM, ratios["time"], bounds, detail))


if __name__ == "__main__":
    main()
