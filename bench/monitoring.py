"""Logging cost: time spent logging with log_interval=10ba, as a share of training time, in one run.

The generated gpt2-baseline project (tiny preset) trains in this process with its logging
entry points timed: `Monitor.log` (metrics.jsonl, log line, progress bar, memory, ETA),
`RunningSum.pop` (the one all-reduce and device read per logged step) and `Monitor.update`
(the progress bar, every step). The ratio is their summed time over the run's training time
(`train_s`, evaluation and checkpoints excluded), both from the same run. A second run with
log_interval=1ba shows what logging every step costs, for comparison.

    python bench/monitoring.py [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from _common import ALLOCATOR, bench_env, generate, scratch

DRIVER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
sys.argv = ["train.py", *sys.argv[2:]]
import runtime.monitor as monitor
import torch
torch.set_num_threads(1)  # CPU time then measures work, not threads spinning on a shared machine
spent = {"log": 0.0, "pop": 0.0, "update": 0.0}
cpu = {"log": 0.0, "pop": 0.0, "update": 0.0}
calls = {"log": 0, "pop": 0, "update": 0}

def timed(owner, name, key):
    original = getattr(owner, name)
    def wrapper(*args, **kwargs):
        start, start_cpu = time.perf_counter(), time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
            cpu[key] += time.thread_time() - start_cpu
            calls[key] += 1
    setattr(owner, name, wrapper)

timed(monitor.Monitor, "log", "log")
timed(monitor.RunningSum, "pop", "pop")
timed(monitor.Monitor, "update", "update")
import train
start_cpu = time.process_time()
train.main()
total_cpu = time.process_time() - start_cpu
print(json.dumps({"spent": spent, "cpu": cpu, "calls": calls, "total_cpu": total_cpu}))
"""


def run(project, workdir, run_name: str, steps: int, log_interval: str) -> dict:
    args = [
        f"--run_name={run_name}",
        "--device=cpu",
        "--model=tiny",
        "--seq_len=128",
        "--global_batch_size=16",
        "--device_microbatch_size=8",
        f"--max_duration={steps}ba",
        f"--eval_interval={steps}ba",
        f"--save_interval={steps}ba",
        "--eval_batches=1",
        "--autoresume=false",
        f"--log_interval={log_interval}",
    ]
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(project), *args],
        cwd=workdir,
        env=bench_env(),
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(result.stderr[-3000:])
    timing = json.loads(result.stdout.strip().splitlines()[-1])
    records = [
        json.loads(line)
        for line in (workdir / "runs" / run_name / "metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    train_s = records[-1]["train_s"]
    logging_s = sum(timing["spent"].values())
    logging_cpu = sum(timing["cpu"].values())
    return {
        "train_s": train_s,
        "logging_s": logging_s,
        "calls": timing["calls"],
        "step_ms": 1000 * train_s / steps,
        "share": logging_s / train_s,
        "cpu_share": logging_cpu / timing["total_cpu"],
        "logging_cpu_ms": 1000 * logging_cpu,
        "total_cpu_s": timing["total_cpu"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--intervals", default="10ba,1ba", help="log_interval values, one run each"
    )
    args = parser.parse_args()
    root = scratch()
    project = generate("gpt2-baseline", root)
    print(
        f"allocator: {' '.join(f'{k}={v}' for k, v in ALLOCATOR.items())}; stderr not a terminal (no live bar)"
    )
    print(
        "torch threads: 1; wall: logging wall time / train_s; cpu: logging thread CPU / process CPU (whole run)"
    )
    print(
        f"{'log_interval':>12} {'steps':>6} {'train s':>8} {'ms/step':>8} {'logging ms':>11} {'wall':>8} "
        f"{'logging cpu ms':>15} {'cpu s':>7} {'cpu':>8}  calls"
    )
    for interval in args.intervals.split(","):
        r = run(project, root, f"log-{interval}", args.steps, interval)
        print(
            f"{interval:>12} {args.steps:6d} {r['train_s']:8.2f} {r['step_ms']:8.2f} {1000 * r['logging_s']:11.2f} "
            f"{100 * r['share']:7.3f}% {r['logging_cpu_ms']:15.2f} {r['total_cpu_s']:7.2f} {100 * r['cpu_share']:7.3f}%"
            f"  {r['calls']}",
            flush=True,
        )
        print(
            f"logging cost at log_interval={interval}: {100 * r['share']:.3f}% of training wall time, "
            f"{100 * r['cpu_share']:.3f}% of the run's CPU time (target at 10ba: < 1%)",
            flush=True,
        )


if __name__ == "__main__":
    main()
