"""nanoGPT-format character data: the vocabulary from meta.pkl against GPT-2's 50,304 tokens.

nanoGPT's character datasets are `train.bin`/`val.bin` of uint16 plus a `meta.pkl` giving
`vocab_size`. A loop that ignores meta.pkl builds GPT-2's vocabulary, and the tiny model then
spends most of each step in a 50,304-wide output layer. This bench writes the standard library's
source as character data (one id per distinct byte, meta.pkl beside it), then trains the
generated gpt2-baseline on it twice, A/B alternating: as shipped (meta.pkl read) and with
`--vocab_size=50304` (what the loop did before it read meta.pkl). It reports median step time
and each run's peak resident memory. A regression check by benchmark, not a timed test.

    python bench/vocab.py [--rounds 2] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np

from _common import ALLOCATOR, bench_env, generate, median, scratch

WARMUP_STEPS = 5


def write_char_data(folder: Path, max_bytes: int = 4_000_000) -> int:
    """The stdlib's source as nanoGPT character data; returns the vocabulary size."""
    root = Path(sysconfig.get_paths()["stdlib"])
    text = b"\n".join(p.read_bytes() for p in sorted(root.glob("*.py")))[:max_bytes]
    raw = np.frombuffer(text, dtype=np.uint8)
    chars = np.unique(raw)
    ids = np.searchsorted(chars, raw).astype(np.uint16)  # dense ids 0..len(chars)-1
    split = int(0.9 * len(ids))
    ids[:split].tofile(folder / "train.bin")
    ids[split:].tofile(folder / "val.bin")
    meta = {"vocab_size": len(chars), "itos": {i: chr(c) for i, c in enumerate(chars)}}
    meta["stoi"] = {s: i for i, s in meta["itos"].items()}
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta))
    return len(chars)


def run(
    project: Path, workdir: Path, name: str, *args: str
) -> tuple[float, float, int]:
    """(median step ms, peak RSS in MiB, model parameters) of one training run."""
    command = [
        sys.executable,
        str(project / "train.py"),
        "--device=cpu",
        f"--run_name={name}",
        *args,
    ]
    process = subprocess.Popen(
        command,
        cwd=workdir,
        env=bench_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    _, status, usage = os.wait4(process.pid, 0)
    stderr = process.stderr.read().decode() if process.stderr else ""
    if status != 0:
        raise RuntimeError(f"train.py failed:\n{stderr[-3000:]}")
    run_dir = workdir / "runs" / name
    records = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    log = (run_dir / "log.txt").read_text()
    params = int(log.split(" parameters")[0].rsplit(" ", 1)[1].replace(",", ""))
    return (
        median([r["step_ms"] for r in records][WARMUP_STEPS:]),
        usage.ru_maxrss / 1024,
        params,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    root = scratch()
    project = generate("gpt2-baseline", root)
    data = root / "chars"
    data.mkdir()
    vocab = write_char_data(data)
    common = (
        f"--data={data / 'train.bin'}",
        "--model=tiny",
        "--seq_len=128",
        "--global_batch_size=16",
        "--device_microbatch_size=8",
        f"--max_duration={args.steps}ba",
        f"--eval_interval={args.steps}ba",
        f"--save_interval={args.steps}ba",
        "--eval_batches=1",
        "--autoresume=false",
    )
    print(
        f"allocator: {' '.join(f'{k}={v}' for k, v in ALLOCATOR.items())}; character data, "
        f"meta.pkl vocab_size={vocab}"
    )
    print(
        f"{'round':>5} {'meta.pkl ms/step':>17} {'MiB':>6} {'gpt2-vocab ms/step':>19} {'MiB':>6}"
    )
    honoured, ignored = [], []
    for round_ in range(args.rounds):
        honoured.append(run(project, root, f"meta-{round_}", *common))
        ignored.append(
            run(project, root, f"gpt2vocab-{round_}", *common, "--vocab_size=50304")
        )
        print(
            f"{round_:5d} {honoured[-1][0]:17.2f} {honoured[-1][1]:6.0f} {ignored[-1][0]:19.2f} "
            f"{ignored[-1][1]:6.0f}",
            flush=True,
        )
    step_ratio = median([r[0] for r in ignored]) / median([r[0] for r in honoured])
    memory_ratio = median([r[1] for r in ignored]) / median([r[1] for r in honoured])
    print(
        f"parameters: {honoured[0][2]:,} (meta.pkl) vs {ignored[0][2]:,} (GPT-2 vocabulary)"
    )
    print(
        f"meta.pkl honoured: {step_ratio:.1f}x faster per step, {memory_ratio:.1f}x less peak memory "
        "than with GPT-2's vocabulary"
    )


if __name__ == "__main__":
    main()
