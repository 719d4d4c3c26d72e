"""The per-step cost of the pre-emption agreement (`Preemption.agreed()`: one all-reduce of one int).

    python bench/preempt.py [--nproc 2] [--rounds 10] [--steps 20] [--model tiny]

Launches `torchrun --standalone --nproc_per_node=N` on the CPU (gloo). Every rank trains the
generated gpt2-baseline model under FSDP2 (as train.py does) on random tokens, in rounds that
alternate A (steps without the agreement) and B (the same steps, each followed by
`preemption.agreed()`), and reports the median step time of each side and the ratio B/A, plus
the cost of the call alone (median over 2,000 calls). No signal arrives: this is the price every
step pays for being able to stop. Allocator settings are the same on both sides (printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path


def worker(project: str, model_name: str, rounds: int, steps: int) -> None:
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, project)
    from model import GPT, PRESETS, GPTConfig  # the generated project's model

    from runtime import dist, parallel
    from runtime.preempt import Preemption

    env = dist.environment("cpu")
    dist.init_process_group(env, timeout=timedelta(seconds=120))
    torch.manual_seed(0)
    seq_len, per_rank, micro = 64, 4, 2
    model = GPT(
        GPTConfig(
            vocab_size=256, max_seq_len=seq_len, dropout=0.0, **PRESETS[model_name]
        )
    )
    plan = parallel.ParallelConfig(
        parallelism="fsdp",
        sharding_strategy="FULL_SHARD",
        precision="fp32",
        activation_checkpointing=False,
        cpu_offload=False,
        hybrid_shard_size=0,
    )
    model = parallel.parallelize(model, model.blocks, env, plan)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    preemption = Preemption()
    data = torch.randint(0, 256, (per_rank, seq_len + 1))

    def step(agree: bool) -> float:
        start = time.perf_counter()
        inputs, targets = data[:, :-1], data[:, 1:]
        microbatches = list(zip(inputs.split(micro), targets.split(micro)))
        for i, (x, y) in enumerate(microbatches):
            parallel.sync_gradients(model, i == len(microbatches) - 1)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum")
            (loss / y.numel()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if agree:
            assert not preemption.agreed()
        return time.perf_counter() - start

    for _ in range(5):
        step(True)  # warm-up
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(rounds):
        for agree in (False, True) if round_ % 2 == 0 else (True, False):
            dist.barrier()
            times[agree] += [step(agree) for _ in range(steps)]
    dist.barrier()
    calls = []
    for _ in range(2000):
        start = time.perf_counter()
        preemption.agreed()
        calls.append(time.perf_counter() - start)
    if env.is_main:
        a, b = statistics.median(times[False]), statistics.median(times[True])
        call = statistics.median(calls)
        print(f"{'':28} {'median step':>12}")
        print(f"{'A: no agreement':28} {a * 1e3:>9.2f} ms")
        print(f"{'B: agreed() every step':28} {b * 1e3:>9.2f} ms")
        print(
            f"agreed() alone: median {call * 1e6:.0f} us over 2000 calls "
            f"({call / a * 100:.2f}% of a step)"
        )
        print(
            f"summary: B/A = {b / a:.3f}x step time ({env.world_size} ranks, gloo, {model_name}, "
            f"{rounds} rounds x {steps} steps each side)"
        )
    preemption.close()
    dist.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="tiny")
    parser.add_argument(
        "--worker", help=argparse.SUPPRESS
    )  # the generated project, inside torchrun
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.model, args.rounds, args.steps)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _common import ALLOCATOR, bench_env, generate, scratch

    project = generate("gpt2-baseline", scratch())
    print("allocator:", " ".join(f"{k}={v}" for k, v in ALLOCATOR.items()), flush=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={args.nproc}",
            __file__,
            f"--worker={project}",
            f"--model={args.model}",
            f"--rounds={args.rounds}",
            f"--steps={args.steps}",
        ],
        check=True,
        env={**bench_env(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
    )


if __name__ == "__main__":
    main()
