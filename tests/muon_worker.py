"""A torchrun worker for tests/test_modern.py: `runtime.muon.Muon` on FSDP2 (N ranks) against
one process (plain and with NorMuon's beta2), and the collectives of one optimizer step: ours, and with `--torch-muon`
`torch.optim.Muon`'s (or the error its step raises on these DTensors).

Usage: torchrun --nproc_per_node=N tests/muon_worker.py OUT.json [--torch-muon]

The torch.optim.Muon probe is asked for, not run by the test: the test does not read it,
and its step raises part-way through.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.debug import CommDebugMode

from runtime import muon

STEPS = 3
LR, MOMENTUM, WEIGHT_DECAY, BETA2 = 0.02, 0.95, 0.01, 0.9


def newton_schulz(update: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The generated project's orthogonalisation (templates/algorithms/muon), copied for the test."""
    a, b, c = 3.4445, -4.775, 2.0315
    x = update.bfloat16()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def build() -> nn.Module:
    """Matrices of uneven row counts: 40, 24, 7 (4 + 3 rows on 2 ranks) and 1 (a rank with none)."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 40, bias=False),
        nn.ReLU(),
        nn.Linear(40, 24, bias=False),
        nn.ReLU(),
        nn.Linear(24, 7, bias=False),
        nn.ReLU(),
        nn.Linear(7, 1, bias=False),
    )


def sharded_build() -> nn.Module:
    """build() under FSDP2 over all ranks, each layer its own unit."""
    model = build()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    return fully_shard(model)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(8, 16), torch.randn(8, 1)


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int
) -> None:
    x, y = batch()
    x, y = x.tensor_split(world)[rank], y.tensor_split(world)[rank]
    for _ in range(STEPS):
        (
            (model(x) - y) ** 2
        ).mean().backward()  # FSDP averages over ranks: the global mean
        optimizer.step()
        optimizer.zero_grad()


def full(model: nn.Module) -> list[torch.Tensor]:
    return [
        p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        for p in model.parameters()
    ]


def collectives(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """The collectives of one optimizer.step() (gradients already there), by kind."""
    x, y = batch()
    ((model(x[:2]) - y[:2]) ** 2).mean().backward()
    with CommDebugMode() as comm:
        optimizer.step()
    optimizer.zero_grad()
    return {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    calls = []

    def counted(update: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(update.shape))
        return newton_schulz(update)

    # One process: runtime.muon.Muon and torch.optim.Muon on plain tensors.
    reference = build()
    train(
        reference,
        muon.Muon(
            reference.parameters(),
            newton_schulz,
            lr=LR,
            weight_decay=WEIGHT_DECAY,
            momentum=MOMENTUM,
        ),
        0,
        1,
    )
    with_torch = build()
    train(
        with_torch,
        torch.optim.Muon(
            with_torch.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, momentum=MOMENTUM
        ),
        0,
        1,
    )
    sharded = sharded_build()
    optimizer = muon.Muon(
        sharded.parameters(),
        counted,
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        momentum=MOMENTUM,
    )
    train(sharded, optimizer, rank, world)
    ours_calls = len(calls) // STEPS
    diff = max(
        (a - b).abs().max().item() for a, b in zip(full(sharded), full(reference))
    )
    diff_torch = max(
        (a - b).abs().max().item() for a, b in zip(full(with_torch), full(reference))
    )
    moved = max(
        (a - b).abs().max().item() for a, b in zip(full(reference), full(build()))
    )
    # The optimizer state is sharded like the parameters: full momentum buffers agree too.
    buffers = [
        optimizer.state[p]["momentum_buffer"].full_tensor()
        for p in sharded.parameters()
    ]
    ours = collectives(sharded, optimizer)
    theirs: dict[str, int] | str = "not run (pass --torch-muon)"
    if "--torch-muon" in sys.argv[2:]:
        theirs_model = sharded_build()
        try:
            theirs = collectives(
                theirs_model, torch.optim.Muon(theirs_model.parameters(), lr=LR)
            )
        except RuntimeError as error:  # torch 2.13: an in-place add across placements
            theirs = str(error).splitlines()[0][:200]
    # NorMuon (beta2): FSDP2 against one process; its second moments per row or column.
    normuon = {"lr": LR, "weight_decay": WEIGHT_DECAY, "momentum": MOMENTUM}
    normuon_reference = build()
    train(
        normuon_reference,
        muon.Muon(
            normuon_reference.parameters(), newton_schulz, beta2=BETA2, **normuon
        ),
        0,
        1,
    )
    normuon_sharded = sharded_build()
    normuon_optimizer = muon.Muon(
        normuon_sharded.parameters(), newton_schulz, beta2=BETA2, **normuon
    )
    train(normuon_sharded, normuon_optimizer, rank, world)
    normuon_diff = max(
        (a - b).abs().max().item()
        for a, b in zip(full(normuon_sharded), full(normuon_reference))
    )
    normuon_moved = max(
        (a - b).abs().max().item() for a, b in zip(full(normuon_sharded), full(sharded))
    )
    second_moments = [
        normuon_optimizer.state[p]["second_momentum_buffer"].full_tensor()
        for p in normuon_sharded.parameters()
    ]
    normuon_collectives = collectives(normuon_sharded, normuon_optimizer)
    ns_per_rank = [0] * world
    dist.all_gather_object(ns_per_rank, ours_calls)
    if rank == 0:
        result = {
            "max_diff_fsdp_vs_one_process": diff,
            "max_diff_torch_muon_vs_ours": diff_torch,
            "max_change_from_init": moved,
            "momentum_buffer_shapes": [list(b.shape) for b in buffers],
            "collectives_ours": ours,
            "collectives_torch_muon": theirs,
            "newton_schulz_per_rank": ns_per_rank,
            "matrices": len(list(sharded.parameters())),
            "normuon_max_diff_fsdp_vs_one_process": normuon_diff,
            "normuon_max_diff_from_muon": normuon_moved,
            "normuon_second_moment_shapes": [list(m.shape) for m in second_moments],
            "normuon_collectives": normuon_collectives,
        }
        with open(sys.argv[1], "w") as out:
            json.dump(result, out)
    dist.barrier()
    dist.destroy_process_group()
    # The result is written and every rank passed the barrier. Interpreter teardown after
    # gloo's async gathers and scatters aborts the process now and then ("terminate called
    # without an active exception", on torch 2.13.0 and 2.14.1, with or without the probe
    # above): leave without it, so the test reads the numbers, not that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
