"""Which torch.compile form trains faster on this machine: the generated gpt2-baseline with
`--compile=false`, `true` (each block compiled, the loss compiled apart: what `auto` picks on
CUDA) and `model` (the whole model as one graph, the loss compiled apart: nanoGPT's form).

Each arm is a fresh process on the CPU (the same model, data, seed and steps), run
interleaved round by round. Reported per arm: the median step time after warmup (the
monitor's step_ms; with `--clock cpu` (the default) the process's CPU seconds, torch on one thread), its
ratio to the eager arm, and the run's whole wall seconds (the cold compile is most of the
difference: inductor compiles in worker processes, so a CPU clock would not see it).

    python bench/compile_modes.py [--rounds 2] [--steps 40] [--model tiny] [--clock cpu|wall]
"""

from __future__ import annotations

import argparse
import os
import time

from _common import (
    add_clock,
    apply_clock,
    generate,
    median,
    print_conditions,
    scratch,
    train,
)

WARMUP_STEPS = 5
MODES = ("false", "true", "model")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs of each arm")
    parser.add_argument("--steps", type=int, default=40, help="steps per run")
    parser.add_argument("--model", default="tiny", help="the size preset")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--micro", type=int, default=8, help="microbatch")
    add_clock(parser)
    args = parser.parse_args()
    apply_clock(args.clock)
    cpu_clock = args.clock == "cpu"
    root = scratch()
    project = generate("gpt2-baseline", root)
    print_conditions()
    print(
        f"gpt2-baseline {args.model}, seq {args.seq_len}, batch {args.batch} x "
        f"microbatch {args.micro}, {args.steps} steps (median after {WARMUP_STEPS}); "
        + ("CPU time, 1 thread" if cpu_clock else "wall time, default threads")
    )
    print(f"{'compile':8} {'round':>5} {'ms/step':>9} {'run wall s':>11}  load (1 min)")
    steps_ms: dict[str, list[float]] = {mode: [] for mode in MODES}
    walls: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in MODES:
            start = time.perf_counter()
            records = train(
                project,
                root,
                f"{mode}-{round_}",
                f"--compile={mode}",
                f"--model={args.model}",
                f"--seq_len={args.seq_len}",
                f"--global_batch_size={args.batch}",
                f"--device_microbatch_size={args.micro}",
                f"--max_duration={args.steps}ba",
                f"--eval_interval={args.steps}ba",
                f"--save_interval={args.steps}ba",
                "--eval_batches=1",
                "--autoresume=false",
                cpu_clock=cpu_clock,
            )
            walls[mode].append(time.perf_counter() - start)
            steps_ms[mode].append(
                median([r["step_ms"] for r in records][WARMUP_STEPS:])
            )
            print(
                f"{mode:8} {round_:5d} {steps_ms[mode][-1]:9.2f} {walls[mode][-1]:11.1f}"
                f"  {os.getloadavg()[0]:.2f}",
                flush=True,
            )
    eager = median(steps_ms["false"])
    for mode in MODES:
        print(
            f"compile={mode}: {median(steps_ms[mode]):.2f} ms/step, "
            f"{eager / median(steps_ms[mode]):.3f}x eager's steps/s, "
            f"run {median(walls[mode]):.0f} s wall (eager {median(walls['false']):.0f} s)"
        )


if __name__ == "__main__":
    main()
