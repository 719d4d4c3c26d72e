"""Steady-state step time: device_microbatch_size=auto (after its search) vs the same size fixed.

    python bench/microbatch.py                       # one process
    torchrun --standalone --nproc_per_node=2 bench/microbatch.py --parallelism=fsdp   # or ddp

Both loops run in the same process, interleaved in rounds, through the same
`search.attempts()` construct train.py uses. The auto search is forced down to --found by
raising torch.OutOfMemoryError above it (as an OOM would), then both are timed. The printed
ratio auto/fixed should be 1.00 within noise: a settled search has no hooks and no votes.
Allocator settings matter on CPU (DESIGN.md §12.8): the same ones apply to both sides; they are
printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn

from runtime import dist, parallel, microbatch


class Net(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(width),
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
            )
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--parallelism", default="none", choices=["none", "ddp", "fsdp"]
    )
    parser.add_argument("--batch", type=int, default=16, help="per-rank batch")
    parser.add_argument(
        "--found", type=int, default=4, help="auto is forced to settle here"
    )
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument(
        "--steps", type=int, default=10, help="steps per round and variant"
    )
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    env = dist.environment("auto")
    dist.init_process_group(env)
    torch.manual_seed(0)

    def build(size: int | str) -> tuple[nn.Module, microbatch.Search]:
        model = Net(args.width, args.depth).to(env.device)
        model = parallel.parallelize(
            model,
            model.blocks,
            env,
            parallel.ParallelConfig(parallelism=args.parallelism),
        )
        search = microbatch.Search(
            model, parallel.unwrap(model).blocks, env, size, args.batch, log=dist.print0
        )
        return model, search

    x = torch.randn(args.batch, 32, args.width, device=env.device)

    def step(model: nn.Module, search: microbatch.Search) -> None:
        for attempt in search.attempts(seq_len=x.shape[1]):
            with attempt:
                chunks = x.split(attempt.size)
                for i, chunk in enumerate(chunks):
                    if attempt.searching and attempt.size > args.found:
                        raise torch.OutOfMemoryError(
                            "bench: pretend this size does not fit"
                        )
                    parallel.sync_gradients(model, i == len(chunks) - 1)
                    (model(chunk).square().mean() / len(chunks)).backward()
        for p in model.parameters():
            p.grad = None

    variants = {"auto": build("auto"), "fixed": build(args.found)}
    for model, search in variants.values():
        step(model, search)  # auto: the search happens here; both: warm-up
        step(model, search)
    assert variants["auto"][1].size == args.found
    votes = [0]  # the search's all-reduces during the timed steps: must stay 0
    vote = microbatch._Vote._all_reduce

    def counted(self: microbatch._Vote, failed: int, running: int) -> tuple[bool, bool]:
        votes[0] += 1
        return vote(self, failed, running)

    microbatch._Vote._all_reduce = counted  # type: ignore[method-assign]
    hooks = sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks)
        for m in variants["auto"][0].modules()
    )
    hooks -= sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks)
        for m in variants["fixed"][0].modules()
    )
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_ in range(args.rounds):
        order = (
            ["auto", "fixed"] if round_ % 2 == 0 else ["fixed", "auto"]
        )  # no order bias
        for name in order:
            model, search = variants[name]
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.steps):
                step(model, search)
            if env.device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / args.steps)
    auto, fixed = statistics.median(times["auto"]), statistics.median(times["fixed"])
    malloc = {
        k: v for k, v in os.environ.items() if k.startswith("MALLOC_")
    } or "glibc defaults"
    dist.print0(
        f"parallelism={args.parallelism} world={env.world_size} device={env.device} "
        f"batch={args.batch} microbatch={args.found} allocator={malloc}"
    )
    dist.print0(
        f"settled auto vs fixed: {hooks} extra module hooks, {votes[0]} votes in timed steps"
    )
    dist.print0(
        f"step ms (median of {args.rounds} rounds x {args.steps} steps): "
        f"auto {1000 * auto:.2f}, fixed {1000 * fixed:.2f}, ratio auto/fixed {auto / fixed:.3f}"
    )
    dist.shutdown()


if __name__ == "__main__":
    main()
