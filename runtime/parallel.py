"""Data parallelism in one call: FSDP2 (`fully_shard`) or DDP, plus what goes with them.

`parallelize()` wraps a model for the job's world size:
- `none`: one process, the model as built.
- `ddp`: DistributedDataParallel; every rank holds the whole model (same as FSDP's NO_SHARD).
- `fsdp`: FSDP2, applied to each transformer block and then to the root, as torchtitan does.
  On one process it is a mesh of one rank: nothing sharded, but the same code path, state
  dict and checkpoints as on N ranks, and with `cpu_offload` the way one GPU fits a model
  whose parameters and optimizer state do not.
  Strategies: FULL_SHARD (parameters resharded after forward, except the last block's, which
  backward needs at once), SHARD_GRAD_OP (kept gathered between forward and backward: more
  memory, fewer all-gathers), HYBRID_SHARD (2-D mesh: shard within groups of
  `hybrid_shard_size` ranks, usually a node, replicate across groups).

Tensor parallelism (`tensor_parallel` = N > 1) splits each layer's matrices over groups of
N ranks, as torchtitan's `parallelize_llama` does: `data_parallel()` builds the 2-D mesh
(data x tensor, dims ("dp", "tp"), shape (world / N, N); a tensor-parallel group is N
consecutive ranks) and returns the data-parallel view of the launch the loop reads its
batches, counts and sums with; `parallelize(..., tensor_plan=...)` applies the model's
plan (model.py's `tensor_parallel_plan`: module paths to ColwiseParallel, RowwiseParallel,
SequenceParallel, PrepareModuleInput) on mesh["tp"] first, then activation checkpointing,
compilation and FSDP2 on mesh["dp"], torchtitan's order; parameters become 2-D DTensors,
which DCP reshards on resume to any other layout. The loss over logits split by vocabulary
runs under `loss_parallel()` (forward and backward). Refused under TP: DDP, NO_SHARD and
HYBRID_SHARD (FSDP2 on the data dimension only), whole-model compilation, CPU offload.

Precision `bf16` is FSDP2's mixed-precision policy: parameters all-gathered and computed in
bf16, gradients reduced in fp32 into fp32 master weights. (`amp_bf16`, autocast, needs nothing
here: it is a context manager in the loop.) Activation checkpointing recomputes each block's
activations in backward instead of storing them; it is applied in place, so parameter and
state-dict names do not change.

Compilation (`compile`) comes in two forms, both in place, so the module tree, parameter
names and checkpoint keys stay as they were (`torch.compile(model)` would add an `_orig_mod.`
prefix) and a run resumes across them:
- `True`, regional: each block's `forward` is replaced by its `torch.compile`d version
  (torchtitan compiles per block too). The blocks share one compiled graph (they run the same
  code), and the hooks on each block (activation checkpointing, FSDP2's all-gather and
  reduce-scatter, runtime.microbatch's votes) stay outside the compiled code, so they neither
  break the graph nor trigger recompilation when they are installed or removed. It composes
  with FSDP2 and DDP.
- `"model"`: the whole model's call compiled as one graph (`nn.Module.compile`), as nanoGPT
  compiles its model: fusions across block boundaries, one graph call per forward, a longer
  cold compile (every block traced). One process only: under FSDP2 the blocks are compiled
  (as torchtitan does), and compiling a DDP module recompiles at every new length (pytorch
  issue 140229). Without activation checkpointing: its hooks traced into the graph make
  the recomputed tensors differ from the saved ones (torch's CheckpointError).
The loss is compiled as a graph of its own in both (`compile_loss`), as torchtitan compiles
its loss: a language model's fp32 upcast of the logits and its log-softmax over the
vocabulary then fuse into kernels that never hold the logits in fp32.

Recompilation is bounded by dynamo's automatic dynamic shapes: the first call compiles for
its exact shapes; the first call where the batch (or the sequence) dimension differs compiles
once more with that dimension symbolic, and that graph serves every later size. So
sequence-length warmup (lengths 8, 16, ... seq_len) and the halving microbatch search cost
one extra compile each, not one per length (a microbatch of 1 sample adds one more: dynamo
specializes sizes 0 and 1). Measured in tests/test_compile.py: at most 5 training graphs
over lengths 8..64 and microbatches 4, 2, 1, all made in the first two lengths; evaluation
(no grad) adds its own. The recompile limit
(torch._dynamo.config.recompile_limit, 8) is not reached. In a generated gpt2-speedup run
(sequence-length warmup 8..64, 8 lengths in 10 steps) one process and each DDP rank made at most
3 graphs: DDP recompiling at every length (pytorch issue 140229) comes from compiling the DDP
module, which regional compilation never does.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import torch
import torch.nn as nn
from torch.distributed._composable import checkpoint as activation_checkpoint
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module
from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel
from torch.nn.parallel import DistributedDataParallel

from runtime.dist import DistEnv, reduce_sum
from runtime.dist import world_size as job_size

PARALLELISMS = ("none", "ddp", "fsdp")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
PRECISIONS = ("fp32", "amp_bf16", "bf16")
# No compilation, regional (each block in place), the whole model as one graph.
COMPILES: tuple[bool | str, ...] = (False, True, "model")
Compile = bool | Literal["model"]


@dataclass(frozen=True)
class ParallelConfig:
    parallelism: str = "none"
    sharding_strategy: str = "FULL_SHARD"
    precision: str = "fp32"
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    hybrid_shard_size: int = 0  # ranks per shard group; 0 = torchrun's LOCAL_WORLD_SIZE
    # torch.compile: True each block in place (regional), "model" the whole model in place
    compile: Compile = False
    tensor_parallel: int = 1  # ranks that split each layer (1: none)

    @classmethod
    def from_config(cls, cfg: ParallelSettings, env: DistEnv) -> ParallelConfig:
        """The config's parallelism settings, `auto` settled for this launch (its world
        size and device)."""
        return cls(
            parallelism=resolve_parallelism(cfg.parallelism, env.world_size),
            sharding_strategy=cfg.sharding_strategy,
            precision=resolve_precision(cfg.precision, env.device),
            activation_checkpointing=cfg.activation_checkpointing,
            cpu_offload=cfg.cpu_offload,
            hybrid_shard_size=cfg.hybrid_shard_size,
            compile=resolve_compile(cfg.compile, env.device),
            # A Config without the field: a project generated without tensor parallelism.
            tensor_parallel=getattr(cfg, "tensor_parallel", 1),
        )


class ParallelSettings(Protocol):
    """The fields of a training script's Config that `ParallelConfig.from_config` reads
    (each described where the Config declares it)."""

    parallelism: str
    sharding_strategy: str
    precision: str
    activation_checkpointing: bool
    cpu_offload: bool
    hybrid_shard_size: int
    compile: bool | str


def resolve_parallelism(requested: str, world_size: int) -> str:
    """`auto`: fsdp under torchrun (world size > 1), none for a single process."""
    if requested == "auto":
        return "fsdp" if world_size > 1 else "none"
    return requested


def resolve_precision(requested: str, device: torch.device) -> str:
    """`auto`: bf16 autocast on CUDA (tensor cores), fp32 on the CPU."""
    if requested == "auto":
        return "amp_bf16" if device.type == "cuda" else "fp32"
    return requested


def resolve_compile(requested: bool | str, device: torch.device) -> Compile:
    """`auto`: regional compilation on CUDA, where fused kernels repay the compile time; none
    on the CPU, where a run of minutes does not earn back a cold compile (DESIGN.md §12.4).

    Regional rather than the whole model: it is the form every launch can use (FSDP2 and
    DDP too), its cold compile traces one block instead of all, hooks stay outside its
    graphs, and whole-model compilation's extra fusions (across block boundaries) move a
    few activations per block, against the vocabulary-sized tensors the compiled loss
    saves, which both forms have (bench/README.md measures the two).
    """
    if requested == "auto":
        return device.type == "cuda"
    if requested == "model":
        return "model"
    return bool(requested)


def check(config: ParallelConfig, env: DistEnv) -> str | None:
    """Why this configuration cannot run here (one line naming the fix), or None."""
    if config.parallelism not in PARALLELISMS:
        return f"parallelism={config.parallelism!r}; use one of {', '.join(PARALLELISMS)} or auto"
    if config.sharding_strategy not in STRATEGIES:
        return f"sharding_strategy={config.sharding_strategy!r}; use one of {', '.join(STRATEGIES)}"
    if config.precision not in PRECISIONS:
        return f"precision={config.precision!r}; use one of {', '.join(PRECISIONS)}"
    if config.compile not in COMPILES:
        return f"compile={config.compile!r}; use true, false, model or auto"
    if config.compile == "model" and config.parallelism != "none":
        return (
            "compile=model compiles the whole model as one graph, for one process; with "
            f"--parallelism={config.parallelism} use --compile=true (each block compiled "
            "in place)"
        )
    if config.compile == "model" and config.activation_checkpointing:
        return (
            "compile=model traces activation checkpointing's hooks into one graph, whose "
            "recomputation torch rejects; use --compile=true (each block compiled, the "
            "checkpointing outside its graph)"
        )
    if config.parallelism == "none" and env.world_size > 1:
        return (
            f"parallelism=none with {env.world_size} processes would train {env.world_size} "
            "unrelated copies; use --parallelism=fsdp or ddp"
        )
    if config.precision == "bf16" and config.parallelism != "fsdp":
        return (
            "precision=bf16 is FSDP's mixed-precision policy; use --parallelism=fsdp, or "
            "--precision=amp_bf16 (autocast) without FSDP"
        )
    if config.cpu_offload and (
        config.parallelism != "fsdp" or env.device.type != "cuda"
    ):
        return (
            "cpu_offload moves FSDP-sharded parameters from the GPU to the CPU; it needs "
            "--parallelism=fsdp on CUDA (on the CPU the parameters are there already)"
        )
    if config.parallelism == "fsdp" and config.sharding_strategy == "HYBRID_SHARD":
        size = config.hybrid_shard_size or env.local_world_size
        if size < 1 or env.world_size % size:
            return (
                f"HYBRID_SHARD needs the world size ({env.world_size}) to be a multiple of "
                f"hybrid_shard_size ({size}); set --hybrid_shard_size to a divisor of it"
            )
    return check_tensor_parallel(config, env)


def check_tensor_parallel(config: ParallelConfig, env: DistEnv) -> str | None:
    """Why this launch cannot split layers over `tensor_parallel` ranks, or None."""
    tp = config.tensor_parallel
    if tp < 1:
        return f"tensor_parallel={tp}; use 1 (no tensor parallelism) or a rank count"
    if tp == 1:
        return None
    if config.parallelism == "ddp" or config.sharding_strategy in (
        "NO_SHARD",
        "HYBRID_SHARD",
    ):
        return (
            f"tensor_parallel={tp} composes with FSDP2 on the data dimension only; use "
            "--parallelism=fsdp (or auto) with --sharding_strategy=FULL_SHARD or "
            f"SHARD_GRAD_OP, not {config.parallelism}/{config.sharding_strategy}"
        )
    if config.compile == "model":
        return (
            f"tensor_parallel={tp} compiles each block (torchtitan's order); use "
            "--compile=true instead of --compile=model"
        )
    if config.cpu_offload:
        return f"tensor_parallel={tp} does not run with cpu_offload; drop --cpu_offload"
    if env.world_size % tp:
        return (
            f"tensor_parallel={tp} does not divide the world size {env.world_size}; "
            f"launch a multiple of {tp} processes (torchrun --nproc_per_node) or pick "
            f"a divisor of {env.world_size}"
        )
    return None


def data_parallel(env: DistEnv, config: ParallelConfig) -> DistEnv:
    """The launch as the loop counts data: without tensor parallelism `env` itself;
    with it (the process group joined), the 2-D mesh (world / tp, tp), dims ("dp",
    "tp"), and this rank's place on "dp": the ranks of a tensor-parallel group read the
    same batch, and `env.group` sums losses and counts once per data-parallel rank."""
    tp = config.tensor_parallel
    if tp == 1:
        return env
    mesh = init_device_mesh(
        env.device.type, (env.world_size // tp, tp), mesh_dim_names=("dp", "tp")
    )
    # Both dims as one (torchtitan flattens its meshes alike): a norm over 2-D DTensors
    # (gradient clipping) is then one all-reduce over all ranks, not one per dim.
    mesh["dp", "tp"]._flatten("dp_tp")
    return replace(
        env,
        rank=mesh.get_local_rank("dp"),
        world_size=env.world_size // tp,
        mesh=mesh,
    )


def loss_parallel(
    config: ParallelConfig,
) -> contextlib.AbstractContextManager[None]:
    """Under tensor parallelism torch's `loss_parallel()`: the cross-entropy of logits
    split by vocabulary (the output layer's ColwiseParallel) computed on the split, never
    gathered; the forward and the backward of the loss must run inside it. Else a no-op.
    """
    if config.tensor_parallel > 1:
        return torch_loss_parallel()
    return contextlib.nullcontext()


def apply_tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, plan: dict[str, ParallelStyle]
) -> None:
    """Split `model`'s layers over `mesh` ("tp") by `plan` (module path patterns to
    styles), in place. Tied parameters (a token embedding that is also the output
    layer's weight) are tied again afterwards: the plan distributes each module's
    parameters apart; the later module's then becomes the shared one."""
    names = dict(model.named_parameters(remove_duplicate=False))
    first = dict(model.named_parameters())  # each shared parameter under its first name
    shared = {
        name: next(key for key, value in first.items() if value is param)
        for name, param in names.items()
        if name not in first
    }
    parallelize_module(model, mesh, plan)
    for name, target in shared.items():
        owner_name, _, attribute = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        source_name, _, source_attribute = target.rpartition(".")
        source = model.get_submodule(source_name)
        first_split, later_split = (
            getattr(getattr(module, attr), "placements", None)
            for module, attr in ((source, source_attribute), (owner, attribute))
        )
        if first_split != later_split:
            raise ValueError(
                f"the tensor-parallel plan splits the tied {target} and {name} "
                f"differently ({first_split}, {later_split}); give both one placement"
            )
        setattr(source, source_attribute, getattr(owner, attribute))


def parallelize(
    model: nn.Module,
    blocks: Iterable[nn.Module],
    env: DistEnv,
    config: ParallelConfig,
    *,
    trained: bool = True,
    tensor_plan: dict[str, ParallelStyle] | None = None,
) -> nn.Module:
    """Apply tensor parallelism (`tensor_plan` on env.mesh["tp"], where `data_parallel`
    made one), activation checkpointing, compilation and FSDP2 or DDP, in that order (as
    torchtitan does); returns the module to train. `trained=False` (a module that only runs
    forwards, see `parallelize_copy`): every FSDP unit reshards after forward, so between
    forwards its parameters are the sharded DTensors, never left gathered for a backward.
    """
    blocks = list(blocks)
    if env.mesh is not None:
        apply_tensor_parallel(model, env.mesh["tp"], tensor_plan or {})
    if config.activation_checkpointing:
        for block in blocks:
            activation_checkpoint(block)
    compile_model(model, blocks, config.compile)
    if config.parallelism == "none":
        return model
    if config.parallelism == "ddp" or config.sharding_strategy == "NO_SHARD":
        device_ids = [env.device] if env.device.type == "cuda" else None
        # DDP broadcasts rank 0's buffers before every forward: a collective per pass,
        # which also meets runtime.microbatch's votes out of turn when one rank retries.
        # Only buffers a checkpoint holds can drift apart between ranks (BatchNorm's
        # running statistics); unsaved ones are constants every rank builds alike
        # (ALiBi's slopes, BlurPool's kernel), so a model with only those skips it.
        saved = model.state_dict().keys()
        drifting = any(name in saved for name, _ in model.named_buffers())
        return DistributedDataParallel(
            model, device_ids=device_ids, broadcast_buffers=drifting
        )

    if env.mesh is not None:
        mesh = env.mesh["dp"]  # FSDP2 on the data dimension: 2-D DTensor parameters
    elif config.sharding_strategy == "HYBRID_SHARD":
        shard = config.hybrid_shard_size or env.local_world_size
        mesh = init_device_mesh(
            env.device.type,
            (env.world_size // shard, shard),
            mesh_dim_names=("replicate", "shard"),
        )
    else:
        mesh = init_device_mesh(env.device.type, (env.world_size,))
    options: dict[str, object] = {"mesh": mesh}
    if config.precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if config.cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    reshard = config.sharding_strategy != "SHARD_GRAD_OP" or not trained
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again right away by backward: keep them.
        keep = trained and i == len(blocks) - 1
        fully_shard(block, reshard_after_forward=reshard and not keep, **options)
    fully_shard(model, reshard_after_forward=reshard, **options)
    return model


def compile_model(model: nn.Module, blocks: Iterable[nn.Module], how: Compile) -> None:
    """Compile in place (names and state-dict keys do not change): `True`, each block's
    forward becomes its compiled version (only `forward`, not the module's call: hooks on
    the block run outside the compiled code); `"model"`, the model's whole call is one
    compiled graph, its hooks and its blocks' hooks traced into it; `False`, nothing."""
    if how == "model":
        model.compile()
    elif how:
        for block in blocks:
            block.forward = torch.compile(block.forward)  # type: ignore[method-assign]


def compile_loss(
    loss: Callable[..., torch.Tensor], config: ParallelConfig
) -> Callable[..., torch.Tensor]:
    """`loss` compiled where the model is (either form), as a graph of its own; else `loss`.

    A language model's loss takes bf16 logits (under autocast) of (tokens, vocabulary):
    eagerly, their fp32 upcast, the log-softmax and, in backward, its gradient are each a
    vocabulary-sized fp32 tensor (3.3 GB apiece for 16 x 1024 tokens at GPT-2's 50,304).
    Compiled, they fuse into kernels that read the bf16 logits and write a bf16 gradient.

    Under tensor parallelism the loss takes logits split by vocabulary (a DTensor) and
    runs eagerly under `loss_parallel()`; its value comes back as this rank's plain
    tensor (the same on every rank of the group), its gradient flowing back through it.
    """
    if config.tensor_parallel > 1:
        return lambda *args: loss(*args).to_local()
    return torch.compile(loss) if config.compile else loss


def sync_gradients(model: nn.Module, enabled: bool) -> None:
    """Whether the next backward reduces gradients across ranks (off for all but the last microbatch)."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
    elif isinstance(model, DistributedDataParallel):
        # What DDP.no_sync() toggles; off throughout while runtime.microbatch defers it.
        deferred = getattr(model, "_scaffold_defer_gradient_sync", False)
        model.require_backward_grad_sync = enabled and not deferred


def defer_gradient_sync(model: nn.Module, deferred: bool) -> None:
    """DDP only: no backward reduces gradients until this is turned off again.

    runtime.microbatch searches the microbatch size this way (a backward that stops half
    way would leave DDP's reducer broken) and all-reduces the gradients itself.
    """
    if isinstance(model, DistributedDataParallel):
        model._scaffold_defer_gradient_sync = deferred
        if deferred:
            model.require_backward_grad_sync = False


def clip_grad_norm_(
    parameters: Iterable[nn.Parameter], max_norm: float
) -> torch.Tensor:
    """Clip gradients to a global L2 norm, also when FSDP shards them; returns the norm before clipping.

    With sharded (DTensor) gradients each rank holds part of the norm: reduce it to the full
    norm first, so every rank scales by the same factor.
    """
    parameters = [p for p in parameters if p.grad is not None]
    total_norm = grad_norm(parameters)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total_norm)
    return total_norm


@torch.no_grad()
def clip_grad_adaptive_(
    parameters: Iterable[nn.Parameter], max_ratio: float, eps: float = 1e-3
) -> None:
    """Adaptive gradient clipping (AGC, Brock et al. 2021; Composer's GradientClipping
    'adaptive'): where a unit's gradient norm exceeds `max_ratio` times its weight norm
    (floored at `eps`, as Brock et al.: a zero-initialised bias still learns; Composer
    has no floor), scale that unit's gradient down to it; 0/0 counts as no clipping.

    A unit is a row of a matrix (the norm over all dimensions after the first: an output
    channel of a convolution), a whole vector or scalar otherwise. FSDP2 shards on the
    first dimension, so each rank scales its own whole rows in place; the norms of vectors,
    split over ranks, are summed in one all-reduce (`local_squared_norms`).
    """
    parameters = [p for p in parameters if p.grad is not None]
    for param in parameters:
        if param.ndim >= 2:
            weight, grad = param.detach(), param.grad
            if isinstance(grad, DTensor):  # this rank's rows (in place: no_grad)
                weight, grad = weight.to_local(), grad.to_local()
            dims = tuple(range(1, grad.ndim))
            weight_norm = torch.linalg.vector_norm(weight, dim=dims, keepdim=True)
            limit = max_ratio * weight_norm.clamp(min=eps)
            norm = torch.linalg.vector_norm(grad, dim=dims, keepdim=True)
            grad.mul_((limit / norm).nan_to_num(nan=1.0).clamp(max=1.0))
    vectors = [param for param in parameters if param.ndim < 2]
    if vectors:
        weights = local_squared_norms(vectors)
        grads = local_squared_norms([param.grad for param in vectors])
        weight_norms, grad_norms = reduce_sum(torch.stack([weights, grads])).sqrt()
        limits = max_ratio * weight_norms.clamp(min=eps)
        scales = (limits / grad_norms).nan_to_num(nan=1.0).clamp(max=1.0)
        for param, scale in zip(vectors, scales.tolist()):
            param.grad.mul_(scale)


def grad_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the parameters' gradients, the same on every rank.

    With sharded (DTensor) gradients each rank holds part of the norm: it is reduced to the
    full norm. DDP's and a single process's gradients are whole already.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    total_norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total_norm, DTensor):
        total_norm = total_norm.full_tensor()
    return total_norm


def local_squared_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """This rank's share of each tensor's squared L2 norm, as one fp32 vector on the
    tensors' device, with no communication: summed over all ranks (`dist.reduce_sum`, one
    collective for them all) it is each whole tensor's squared norm, whatever the layout.

    A DTensor (FSDP2) contributes its local shard, divided by the number of ranks holding
    the same shard (HYBRID_SHARD's replicas; 1 when fully sharded); a plain tensor (DDP, one
    process), whole on every rank, is divided by the world size.
    """
    parts = []
    for tensor in tensors:
        if isinstance(tensor, DTensor):
            copies = math.prod(
                tensor.device_mesh.size(dim)
                for dim, placement in enumerate(tensor.placements)
                if placement.is_replicate()
            )
            tensor = tensor.to_local()
        else:
            copies = job_size()
        parts.append(
            torch.linalg.vector_norm(tensor.detach().float()).square() / copies
        )
    return torch.stack(parts) if parts else torch.zeros(0)


def parallelize_copy(
    model: nn.Module, blocks: Iterable[nn.Module], env: DistEnv, config: ParallelConfig
) -> nn.Module:
    """A copy of the model that is not trained (averaged weights, say), laid out like the
    model `parallelize` returns: under FSDP2 sharded per block then root with the same
    mesh, so each of its tensors has the placement of the model's and rank-local updates
    need no communication (its state dict reshards on resume like the model's); under DDP
    or one process left whole (no gradients to synchronise). Compiled like the model."""
    if config.parallelism == "fsdp" and config.sharding_strategy != "NO_SHARD":
        config = replace(config, activation_checkpointing=False)
        return parallelize(model, blocks, env, config, trained=False)
    compile_model(model, blocks, config.compile)
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's model inside a DDP wrapper (FSDP2 wraps in place)."""
    return model.module if isinstance(model, DistributedDataParallel) else model
