"""CUDA: the microbatch size `auto` finds for the gpt2 preset, and its throughput vs hand-picked sizes.

    python bench/microbatch_cuda.py [--global_batch_size=64] [--seq_len=1024] [--steps=30]

Generates a gpt2-baseline project in a temporary folder, trains `--model=gpt2` with
`--device_microbatch_size=auto` (real out-of-memory errors, no injection), then with fixed
sizes around the one found, and prints tokens/s (median of the logged steps after the
first few) for each. Skipped (exit 0) where no GPU is present. Run it whenever one is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--global_batch_size", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    work = Path(tempfile.mkdtemp(prefix="mb-cuda-"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "scaffold",
            "new",
            "--recipe",
            "gpt2-baseline",
            str(work / "p"),
        ],
        check=True,
        env=env,
        cwd=REPO,
    )

    def train(size: str) -> tuple[int, float]:
        name = f"mb-{size}"
        subprocess.run(
            [
                sys.executable,
                "train.py",
                "--model=gpt2",
                f"--seq_len={args.seq_len}",
                f"--global_batch_size={args.global_batch_size}",
                f"--device_microbatch_size={size}",
                f"--max_duration={args.steps}ba",
                f"--eval_interval={args.steps}ba",
                "--eval_batches=1",
                f"--save_interval={10 * args.steps}ba",
                f"--run_name={name}",
                "--autoresume=false",
            ],
            check=True,
            env=env,
            cwd=work / "p",
        )
        records = [
            json.loads(line)
            for line in (work / "p" / "runs" / name / "metrics.jsonl")
            .read_text()
            .splitlines()
        ]
        steady = [r["tokens_per_s"] for r in records[5:] if "tokens_per_s" in r]
        return records[-1]["microbatch_size"], statistics.median(steady)

    found, auto_speed = train("auto")
    results = {f"auto (found {found})": auto_speed}
    for size in sorted({max(1, found // 2), found}):
        results[f"fixed {size}"] = train(str(size))[1]
    print(
        f"{torch.cuda.get_device_name()}, gpt2, seq_len {args.seq_len}, global batch {args.global_batch_size}"
    )
    for name, speed in results.items():
        print(f"{name:>16}: {speed:,.0f} tokens/s ({speed / auto_speed:.3f}x auto)")


if __name__ == "__main__":
    main()
