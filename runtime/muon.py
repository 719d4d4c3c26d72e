"""Muon's systems side: one optimizer step that orthogonalises each matrix once, also under FSDP2.

Muon (Jordan et al. 2024) replaces each 2-D weight's momentum update by its orthogonalisation,
computed by a few Newton–Schulz iterations on the *whole* matrix. The math is the generated
project's (a `newton_schulz` function in train.py, passed in as `orthogonalize`); this module
only moves matrices to where that function runs:

- a plain tensor (one process, DDP, FSDP's NO_SHARD): orthogonalised where it is;
- an FSDP2 parameter (a DTensor sharded on dim 0 over a 1-D mesh): each matrix has one owner
  rank (round robin, largest first). The owner gathers the matrix's momentum update once
  (`gather`), orthogonalises it, and sends every rank its rows back (`scatter`): two
  collectives per matrix, and each rank runs 1/world of the Newton–Schulz work.
  `torch.optim.Muon` cannot step these DTensors: in torch 2.13 its step raises
  `aten.add_.Tensor: in-place operations that require placement changes are not supported`
  (`tests/muon_worker.py OUT.json --torch-muon` records the error on 2 ranks).

`cautious=True` decays only the entries whose update has the parameter's sign (cautious weight
decay, Chen et al. 2025, arXiv 2510.12402; modded-nanogpt record 43); the default is
`torch.optim.Muon`'s decoupled decay. `beta2` (NorMuon, Li et al. 2025, arXiv 2510.05491;
modded-nanogpt record 41) rescales each neuron's share of the orthogonalised update by a running
second moment (see `Muon._normalize`). `Muon` keeps `torch.optim.Muon`'s hyperparameters, state (`momentum_buffer`) and update, so
on one process it takes the same steps; the state is per parameter (shards under FSDP2) and
goes through DCP like AdamW's, so it resumes on any world size. `Chain` puts Muon and the
AdamW that takes the other parameters behind the one optimizer the training loop holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

Orthogonalize = Callable[[torch.Tensor], torch.Tensor]


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """The learning rate for one matrix, as `torch.optim.Muon` scales it.

    None/"original": lr * sqrt(max(1, rows / cols)); "match_rms_adamw": lr * 0.2 *
    sqrt(max(rows, cols)) (the update's RMS then matches AdamW's, so AdamW's lr carries over).
    """
    rows, cols = shape[0], shape[1]
    if adjust_lr_fn in (None, "original"):
        return lr * math.sqrt(max(1.0, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(
        f"adjust_lr_fn={adjust_lr_fn!r}; use None, 'original' or 'match_rms_adamw'"
    )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _is_row_sharded(param: torch.Tensor) -> bool:
    """An FSDP2 FULL_SHARD / SHARD_GRAD_OP parameter: rows split over a 1-D mesh."""
    return (
        isinstance(param, DTensor)
        and param.device_mesh.ndim == 1
        and tuple(param.placements) == (Shard(0),)
    )


class Muon(torch.optim.Optimizer):
    """Momentum, orthogonalised: `torch.optim.Muon`'s update with the orthogonalisation shared
    across FSDP2 ranks (see the module docstring). Parameters must be 2-D."""

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        orthogonalize: Orthogonalize,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        adjust_lr_fn: str | None = None,
        cautious: bool = False,
        beta2: float | None = None,
    ) -> None:
        if beta2 is not None and not 0 <= beta2 < 1:
            raise ValueError(f"beta2={beta2}: NorMuon's beta2 is in [0, 1)")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            adjust_lr_fn=adjust_lr_fn,
            cautious=cautious,
            beta2=beta2,
        )
        super().__init__(params, defaults)
        self.orthogonalize = orthogonalize
        for group in self.param_groups:
            adjusted_lr(1.0, group["adjust_lr_fn"], torch.Size((1, 1)))  # valid choice
            for param in group["params"]:
                if param.ndim != 2:
                    raise ValueError(
                        f"Muon takes 2-D parameters only; got shape {tuple(param.shape)}"
                    )
                if isinstance(param, DTensor) and not _is_row_sharded(param):
                    raise ValueError(
                        f"Muon supports FSDP2 parameters sharded on dim 0 over one mesh "
                        f"dimension (FULL_SHARD, SHARD_GRAD_OP); got {param.placements}"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            updates = [self._momentum_update(p, group) for p in params]
            orthogonal = self._orthogonalize_all(params, updates)
            if group["beta2"] is not None:
                orthogonal = self._normalize(params, orthogonal, group["beta2"])
            for param, update in zip(params, orthogonal):
                scale = adjusted_lr(group["lr"], group["adjust_lr_fn"], param.shape)
                local = _local(param)
                decay = group["lr"] * group["weight_decay"]
                if group["cautious"]:
                    # Cautious weight decay (Chen et al. 2025, modded-nanogpt record 43):
                    # decay only the entries the update also shrinks (same sign).
                    local.sub_(local * (update * local > 0), alpha=decay)
                else:
                    local.mul_(1 - decay)
                local.add_(update, alpha=-scale)
        return loss

    def _momentum_update(
        self, param: torch.Tensor, group: dict[str, Any]
    ) -> torch.Tensor:
        """buf <- momentum * buf + (1 - momentum) * grad; the update is Nesterov's look-ahead
        (grad towards buf by momentum) or buf itself. Elementwise: shards need no collective.
        """
        grad = _local(param.grad)
        state = self.state[param]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param.grad)
        buf = _local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf.clone()

    def _normalize(
        self, params: list[torch.Tensor], updates: list[torch.Tensor], beta2: float
    ) -> list[torch.Tensor]:
        """NorMuon's per-neuron normalisation of the orthogonalised updates (local rows).

        Along the matrix's longer side (a row per output of a tall or square matrix, a
        column per input of a wide one: modded-nanogpt's axis, record 48), each neuron's
        mean square m is averaged into `second_momentum_buffer` b <- beta2 b + (1 - beta2) m;
        the neuron's entries are divided by sqrt(b), and the matrix is rescaled to the
        Frobenius norm it had. Under FSDP2 a row's mean is local; column means and the two
        norms are sums over the ranks' rows: two all-reduces per step for all matrices.
        """
        sharded = [_is_row_sharded(p) for p in params]
        squares = [u.float().square() for u in updates]
        per_row = [p.shape[0] >= p.shape[1] for p in params]
        # 1. Each neuron's sum of squares, and each matrix's total: rows' sums are local.
        sums = [
            sq.sum(1 if row else 0, keepdim=True) for sq, row in zip(squares, per_row)
        ]
        totals = [s.sum().reshape(1) for s in sums]
        first = [
            (totals[i] if per_row[i] else sums[i].reshape(-1))
            for i in range(len(params))
            if sharded[i]
        ]
        summed = iter(self._all_reduce(params, first))
        for i in range(len(params)):
            if sharded[i] and per_row[i]:
                totals[i] = next(summed)
            elif sharded[i]:
                sums[i] = next(summed).reshape(sums[i].shape)
                totals[i] = sums[i].sum().reshape(1)
        # 2. The running second moments, and the norms after dividing by them.
        steps, new_totals = [], []
        for i, param in enumerate(params):
            size = param.shape[1] if per_row[i] else param.shape[0]
            buffer = _local(self._second_moment(param, per_row[i]))
            buffer.lerp_(sums[i] / size, 1 - beta2)
            steps.append(buffer.clamp_min(1e-10).rsqrt())
            new_totals.append((sums[i] * steps[i].square()).sum().reshape(1))
        second = [
            new_totals[i] for i in range(len(params)) if sharded[i] and per_row[i]
        ]
        summed = iter(self._all_reduce(params, second))
        for i in range(len(params)):
            if sharded[i] and per_row[i]:
                new_totals[i] = next(summed)
        return [
            update
            * (step * totals[i].sqrt() / new_totals[i].sqrt().clamp_min(1e-10)).to(
                update.dtype
            )
            for i, (update, step) in enumerate(zip(updates, steps))
        ]

    @staticmethod
    def _all_reduce(
        params: list[torch.Tensor], parts: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """`parts` summed over the ranks of the FSDP2 mesh, in one collective."""
        if not parts:
            return []
        group = next(p for p in params if _is_row_sharded(p)).device_mesh.get_group()
        flat = torch.cat(parts)
        dist.all_reduce(flat, group=group)
        return list(flat.split([part.numel() for part in parts]))

    def _second_moment(self, param: torch.Tensor, per_row: bool) -> torch.Tensor:
        """The parameter's NorMuon state: fp32, a value per row (sharded as its rows) or per
        column (on every rank), so DCP reshards it with the parameter."""
        state = self.state[param]
        if "second_momentum_buffer" not in state:
            rows, cols = param.shape
            shape = (rows, 1) if per_row else (1, cols)
            local = _local(param)
            if not _is_row_sharded(param):
                buffer = torch.zeros(shape, dtype=torch.float32, device=local.device)
            else:
                mine = (local.shape[0], 1) if per_row else shape
                buffer = DTensor.from_local(
                    torch.zeros(mine, dtype=torch.float32, device=local.device),
                    param.device_mesh,
                    [Shard(0) if per_row else Replicate()],
                    run_check=False,
                    shape=torch.Size(shape),
                    stride=(shape[1], 1),
                )
            state["second_momentum_buffer"] = buffer
        return state["second_momentum_buffer"]

    def _orthogonalize_all(
        self, params: list[torch.Tensor], updates: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Each parameter's orthogonalised update, as its local rows."""
        result: list[torch.Tensor | None] = [None] * len(params)
        sharded = [i for i, p in enumerate(params) if _is_row_sharded(p)]
        for i, param in enumerate(params):
            if i not in sharded:
                result[i] = self.orthogonalize(updates[i])
        if sharded:
            for i, rows in zip(
                sharded,
                self._orthogonalize_sharded(
                    [params[i] for i in sharded], [updates[i] for i in sharded]
                ),
            ):
                result[i] = rows
        return [r for r in result if r is not None]

    def _orthogonalize_sharded(
        self, params: list[torch.Tensor], updates: list[torch.Tensor]
    ) -> Iterator[torch.Tensor]:
        """Owner-computes: gather each matrix on one rank, orthogonalise it there, scatter rows."""
        group = params[0].device_mesh.get_group()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        # Round robin over the matrices, largest first, so the work is spread evenly.
        order = sorted(range(len(params)), key=lambda i: -params[i].numel())
        owner = {index: n % world for n, index in enumerate(order)}
        chunk_rows = [math.ceil(p.shape[0] / world) for p in params]

        def padded(tensor: torch.Tensor, rows: int) -> torch.Tensor:
            out = tensor.new_zeros((rows, tensor.shape[1]))
            out[: tensor.shape[0]] = tensor
            return out

        # 1. Every rank sends its rows of every matrix to that matrix's owner.
        gathered: dict[int, list[torch.Tensor]] = {}
        works = []
        for i, update in enumerate(updates):
            mine = padded(update, chunk_rows[i]).contiguous()
            dst = dist.get_global_rank(group, owner[i])
            if owner[i] == rank:
                gathered[i] = [torch.empty_like(mine) for _ in range(world)]
            works.append(
                dist.gather(mine, gathered.get(i), dst=dst, group=group, async_op=True)
            )
        for work in works:
            work.wait()
        # 2. Each owner orthogonalises its whole matrices and cuts them into row chunks.
        pieces: dict[int, list[torch.Tensor]] = {}
        for i, chunks in gathered.items():
            full = torch.cat(chunks)[: params[i].shape[0]]
            ortho = padded(self.orthogonalize(full), chunk_rows[i] * world)
            pieces[i] = [piece.contiguous() for piece in ortho.split(chunk_rows[i])]
        # 3. Each owner sends every rank its rows of the result.
        received, works = [], []
        for i, update in enumerate(updates):
            rows = torch.empty(
                (chunk_rows[i], update.shape[1]),
                dtype=pieces[i][0].dtype if i in pieces else self._ortho_dtype(update),
                device=update.device,
            )
            src = dist.get_global_rank(group, owner[i])
            works.append(
                dist.scatter(rows, pieces.get(i), src=src, group=group, async_op=True)
            )
            received.append(rows)
        for work in works:
            work.wait()
        for i, update in enumerate(updates):
            yield received[i][: update.shape[0]]

    def _ortho_dtype(self, update: torch.Tensor) -> torch.dtype:
        """The dtype `orthogonalize` returns (a tiny probe; non-owners must size their buffers)."""
        cached = getattr(self, "_dtype_cache", {})
        if update.dtype not in cached:
            cached[update.dtype] = self.orthogonalize(
                torch.eye(2, dtype=update.dtype)
            ).dtype
            self._dtype_cache = cached
        return cached[update.dtype]


class Chain:
    """Several optimizers that step together behind one object (Muon for the hidden matrices,
    AdamW for the rest). `param_groups` lists every group, so a schedule that sets
    `group["lr"]` reaches all of them; `checkpoint.save/resume` store each one's state.
    """

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = list(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [
            group for optimizer in self.optimizers for group in optimizer.param_groups
        ]

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)
