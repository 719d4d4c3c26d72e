"""GPU step time of a speed-up recipe against its baseline, arm by arm, at a real model size.

One CUDA device, each arm a fresh process of the generated train.py (compiled, bf16
autocast), the median `step_ms` of the steps after warm-up (for gpt2 only steps at the full
sequence length). Arms:

- `--family gpt`: gpt2-baseline, gpt2-speedup, and gpt2-speedup with
  `--seq_length_warmup_min_len=1024` (every step at full length: one static graph); the
  gpt2 preset (124M), seq 1024, batch 32 x microbatch 16, the stdlib bytes as GPT-2 tokens,
  as bench/gpu.py.
- `--family bert`: bert-pretrain-baseline and mosaicbert at `--model=bert-base`, batch 256 x
  128 in one microbatch, the default corpus and tokenizer.

`--profile` adds a torch.profiler window over two late steps (excluded from the medians) and
writes each arm's Chrome trace, gzipped, beside the numbers in `--out`.

    python bench/gpu_steps.py --family gpt|bert [--steps 30] [--profile] [--out DIR]

Without CUDA it prints "skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from _common import bench_env, generate, median, scratch
from overhead import write_train_bin

GPT = {
    "settings": {
        "model": "gpt2",
        "vocab_size": 50304,
        "seq_len": 1024,
        "global_batch_size": 32,
        "device_microbatch_size": 16,
    },
    "arms": {
        "gpt2-baseline": ("gpt2-baseline", []),
        "gpt2-speedup": ("gpt2-speedup", []),
        "gpt2-speedup, no warmup": (
            "gpt2-speedup",
            ["--seq_length_warmup_min_len=1024"],
        ),
    },
    "full_length": 1024,
    "warmup": 10,
}
BERT = {
    "settings": {
        "model": "bert-base",
        "global_batch_size": 256,
        "device_microbatch_size": 256,
    },
    "arms": {
        "bert-pretrain-baseline": ("bert-pretrain-baseline", []),
        "mosaicbert": ("mosaicbert", []),
    },
    "full_length": None,
    "warmup": 15,
}


def run_arm(
    project: Path, root: Path, name: str, settings: dict, extra: list[str], args
) -> list[dict]:
    """The arm's metrics records; its trace copied to args.out when profiled."""
    options = {
        **settings,
        "device": "cuda",
        "run_name": name,
        "precision": "amp_bf16",
        "compile": "true",
        "max_duration": f"{args.steps}ba",
        "eval_interval": f"{args.steps}ba",
        "save_interval": f"{args.steps}ba",
        "eval_batches": 1,
        "autoresume": "false",
    }
    if args.profile:
        options["profile"] = f"{args.steps - 5}ba:{args.steps - 3}ba"
    command = [
        sys.executable,
        str(project / "train.py"),
        *(f"--{key}={value}" for key, value in options.items()),
        *extra,
    ]
    result = subprocess.run(
        command, cwd=root, env=bench_env(), capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{result.stderr[-3000:]}")
    run = root / "runs" / name
    if args.profile:
        trace = run / "profile" / "rank0.trace.json"
        with (
            open(trace, "rb") as source,
            gzip.open(args.out / f"{name}.trace.json.gz", "wb") as target,
        ):
            shutil.copyfileobj(source, target)
    return [
        json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
    ]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--family", choices=("gpt", "bert"), required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()
    import torch  # after argparse: --help works anywhere

    if not torch.cuda.is_available():
        print("skipped: no CUDA device on this machine")
        return
    family = GPT if args.family == "gpt" else BERT
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing downloads
    root = scratch()
    recipes = {recipe for recipe, _ in family["arms"].values()}
    projects = {recipe: generate(recipe, root) for recipe in sorted(recipes)}
    settings = dict(family["settings"])
    if args.family == "gpt":
        settings["data"] = write_train_bin(projects["gpt2-baseline"], root)
    print(
        f"device: {torch.cuda.get_device_name(0)}; torch {torch.__version__}; "
        f"{settings}; {args.steps} steps, median after {family['warmup']}"
    )
    profiled = range(args.steps - 4, args.steps - 2) if args.profile else range(0)
    results = {}
    for name, (recipe, extra) in family["arms"].items():
        run_name = name.replace(",", "").replace(" ", "-")
        records = run_arm(projects[recipe], root, run_name, settings, extra, args)
        steps = [
            r["step_ms"]
            for r in records
            if "step_ms" in r
            and r["step"] > family["warmup"]
            and r["step"] not in profiled
            and (
                family["full_length"] is None
                or r.get("seq_len", family["full_length"]) == family["full_length"]
            )
        ]
        results[name] = median(steps)
        print(
            f"{name:26} {results[name]:8.1f} ms/step ({len(steps)} steps)", flush=True
        )
    first = next(iter(results))
    for name, ms in results.items():
        print(f"{name}: {ms / results[first]:.2f}x {first}'s step time")


if __name__ == "__main__":
    main()
