"""Loop overhead, vision: the generated cifar-resnet56-baseline loop against a hand-written loop.

Both do the same work: the same ResNet (model.py, ghost BatchNorm included), the same digits
data with the same seeded crops (data.py), SGD with Nesterov momentum and decoupled weight
decay, the warmup + cosine schedule, gradient accumulation over the same microbatches and the
BatchNorm running-statistics update once per step. The generated loop runs as shipped
(DataLoader, progress, metrics.jsonl and log every step), evaluation and checkpoints out of
the timed steps. Runs alternate A B A B ... in one invocation; each reports its median step
time after warmup.

    python bench/overhead_vision.py [--rounds 3] [--steps 40] [--threads 1]

`--threads N` sets OMP_NUM_THREADS for both sides (default 1: on a shared, oversubscribed
machine two spinning intra-op threads per process made step times vary 3x between runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from _common import ALLOCATOR, bench_env, generate, median, scratch, train

WARMUP_STEPS = 5

# The hand-written reference: nothing but the work.
RAW_LOOP = r"""
import json, math, sys, time
import torch, torch.nn.functional as F
sys.path.insert(0, sys.argv[1])
import data
from model import PRESETS, ResNet, ResNetConfig, update_running_stats
preset, batch_size, micro, steps = sys.argv[2], *map(int, sys.argv[3:6])
lr_peak, warmup, wd = 0.4, 0.1, 2e-3
torch.manual_seed(42)
images = data.load_images("")
batches = data.Batches(images, "train", batch_size, seed=42, image_size=8)
model = ResNet(ResNetConfig(num_classes=10, in_channels=1, bn_group_size=micro, **PRESETS[preset]))
params = list(model.parameters())
decayed = [p for p in params if p.dim() >= 2]
optimizer = torch.optim.SGD(params, lr=lr_peak, momentum=0.9, nesterov=True)
times = []
for step in range(steps):
    start = time.perf_counter()
    pixels, labels, _ = batches[step % len(batches)]
    inputs = data.normalize(pixels, images)
    frac = step / steps
    lr = lr_peak * frac / warmup if frac < warmup else 0.5 * lr_peak * (
        1 + math.cos(math.pi * (frac - warmup) / (1 - warmup)))
    for group in optimizer.param_groups:
        group["lr"] = lr
    loss_sum = torch.zeros(())
    for x, y in zip(inputs.split(micro), labels.split(micro)):
        loss = F.cross_entropy(model(x).float(), y, reduction="sum")
        (loss / batch_size).backward()
        loss_sum += loss.detach()
    with torch.no_grad():
        torch._foreach_mul_(decayed, 1 - wd * lr / lr_peak)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    update_running_stats(model, lambda t: t)
    loss_sum.item()
    times.append(time.perf_counter() - start)
print(json.dumps(times))
"""


def raw_step_ms(
    project: Path, preset: str, batch: int, micro: int, steps: int
) -> float:
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            RAW_LOOP,
            str(project),
            preset,
            str(batch),
            str(micro),
            str(steps),
        ],
        env=bench_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return 1000 * median(json.loads(result.stdout)[WARMUP_STEPS:])


def generated_step_ms(
    project: Path,
    workdir: Path,
    run: str,
    preset: str,
    batch: int,
    micro: int,
    steps: int,
) -> float:
    records = train(
        project,
        workdir,
        run,
        f"--model={preset}",
        f"--global_batch_size={batch}",
        f"--device_microbatch_size={micro}",
        f"--bn_group_size={micro}",
        "--lr=0.4",
        "--lr_warmup=0.1dur",
        f"--max_duration={steps}ba",
        f"--eval_interval={steps}ba",
        f"--save_interval={steps}ba",
        "--eval_batches=1",
        "--autoresume=false",
    )
    return median([r["step_ms"] for r in records][WARMUP_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="A/B pairs per size")
    parser.add_argument(
        "--steps",
        type=int,
        default=40,
        help="steps per run (tiny); the larger size runs a third",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS for both loops (0: torch's default)",
    )
    args = parser.parse_args()
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(
            args.threads
        )  # bench_env() copies os.environ
    root = scratch()
    project = generate("cifar-resnet56-baseline", root)
    sizes = {
        # (preset, global batch, microbatch, steps): per-step overhead dominates ...
        "tiny": ("tiny", 128, 64, args.steps),
        # ... and compute dominates.
        "resnet20": (
            "cifar-resnet20",
            256,
            128,
            max(WARMUP_STEPS + 5, args.steps // 3),
        ),
    }
    print(
        f"allocator: {' '.join(f'{k}={v}' for k, v in ALLOCATOR.items())}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'default')}"
    )
    print(f"{'size':9} {'round':>5} {'raw ms/step':>12} {'generated ms/step':>18}")
    ratios = {}
    for size, (preset, batch, micro, steps) in sizes.items():
        raw, gen = [], []
        for round_ in range(args.rounds):
            raw.append(raw_step_ms(project, preset, batch, micro, steps))
            gen.append(
                generated_step_ms(
                    project, root, f"{size}-{round_}", preset, batch, micro, steps
                )
            )
            print(f"{size:9} {round_:5d} {raw[-1]:12.2f} {gen[-1]:18.2f}", flush=True)
        ratios[size] = median(raw) / median(
            gen
        )  # steps/s ratio = raw time / generated time
        print(
            f"{size:9} {'median':>5} {median(raw):12.2f} {median(gen):18.2f}"
            f"   generated/raw steps_per_s = {ratios[size]:.3f}"
        )
    print(
        f"overhead (vision): generated/raw steps_per_s = {ratios['tiny']:.2f} (tiny), "
        f"{ratios['resnet20']:.2f} (cifar-resnet20)"
    )


if __name__ == "__main__":
    main()
