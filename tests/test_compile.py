"""Compilation (`--compile`): regional (each block compiled in place, composed with activation
checkpointing, FSDP2 and auto-microbatching) or the whole model (`model`, one process); the
loss compiled as a graph of its own; checkpoint keys unchanged; recompilation bounded.

A cold compile costs 20-80 s on this machine (more under load), so the default run compiles
twice: `test_regional_compile_matches_eager_and_keeps_keys` in process and one generated run,
`test_compiled_run_computes_its_loss_in_a_graph_and_never_recompiles_after_warmup`. The
recompilation bound, the whole-model form, the other recipes and the multi-process
composition are `slow`.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from projects import checkout_env, project_modules, read_metrics, run_train
from runtime import parallel
from runtime.dist import DistEnv

CPU = torch.device("cpu")
ONE_PROCESS = DistEnv(
    rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU
)


@pytest.fixture(scope="module")
def modules(generated: dict[str, Path]):
    with project_modules(generated["gpt2-baseline"]) as found:
        yield found


def tiny_gpt(modules, n_layer: int = 2):
    model_module = modules["model"]
    torch.manual_seed(0)
    config = model_module.GPTConfig(
        vocab_size=256, max_seq_len=64, n_layer=n_layer, n_head=4, n_embd=64
    )
    return model_module.GPT(config)


def step(
    model: torch.nn.Module, batch: torch.Tensor
) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(batch[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_auto_means_cuda_only() -> None:
    cuda = torch.device("cuda", 0)
    # auto: regional compilation on CUDA (the loss compiled with it), none on the CPU.
    assert parallel.resolve_compile("auto", cuda) is True
    assert parallel.resolve_compile("auto", CPU) is False
    assert parallel.resolve_compile(True, CPU) and not parallel.resolve_compile(
        False, cuda
    )
    assert parallel.resolve_compile("model", CPU) == "model"
    assert parallel.resolve_precision("auto", cuda) == "amp_bf16"
    assert parallel.resolve_precision("auto", CPU) == "fp32"
    assert parallel.resolve_precision("bf16", cuda) == "bf16"


def test_the_loss_is_compiled_whenever_the_model_is() -> None:
    """compile_loss: the loss function itself without compilation, its compiled version
    (a graph of its own) with regional or whole-model compilation, so `auto` on CUDA
    compiles the loss."""

    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), targets, reduction="sum")

    assert parallel.compile_loss(loss, parallel.ParallelConfig(compile=False)) is loss
    cuda = torch.device("cuda", 0)
    for how in (True, "model", parallel.resolve_compile("auto", cuda)):
        compiled = parallel.compile_loss(loss, parallel.ParallelConfig(compile=how))
        assert compiled is not loss
        assert getattr(compiled, "_torchdynamo_orig_callable", None) is loss


def test_whole_model_compile_is_in_place_and_one_process_only(modules) -> None:
    """compile=model compiles the model's call in place (no `_orig_mod.` wrapper: the same
    module, the same keys, so checkpoints resume across the forms); FSDP2 and DDP are
    refused with the fix. Nothing is compiled until the first call: no compile cost here.
    """
    model = tiny_gpt(modules)
    keys = list(model.state_dict())
    config = parallel.ParallelConfig(compile="model")
    assert parallel.check(config, ONE_PROCESS) is None
    assert parallel.parallelize(model, model.blocks, ONE_PROCESS, config) is model
    assert list(model.state_dict()) == keys and type(model).__name__ == "GPT"
    assert model._compiled_call_impl is not None  # nn.Module.compile()
    assert all(  # the blocks are traced into the model's graph, not compiled apart
        not hasattr(block.forward, "_torchdynamo_orig_callable")
        for block in model.blocks
    )
    for parallelism in ("fsdp", "ddp"):
        problem = parallel.check(
            parallel.ParallelConfig(parallelism=parallelism, compile="model"),
            ONE_PROCESS,
        )
        assert problem and "one process" in problem and "--compile=true" in problem
    checkpointed = parallel.ParallelConfig(
        compile="model", activation_checkpointing=True
    )
    problem = parallel.check(checkpointed, ONE_PROCESS)
    assert problem and "checkpointing" in problem and "--compile=true" in problem
    assert "model or auto" in parallel.check(
        parallel.ParallelConfig(compile="blocks"), ONE_PROCESS
    )


def test_config_accepts_compile_and_records_the_resolved_value(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    project = generated["gpt2-baseline"]
    result = run_train(project, tmp_path, "--compile=maybe")
    assert (
        result.returncode == 2
        and "compile" in result.stderr
        and "true or false" in result.stderr
    )
    result = run_train(
        project, tmp_path, "--max_duration=1ba", "--eval_batches=1", "--run_name=r"
    )
    assert result.returncode == 0, result.stderr
    recorded = (tmp_path / "runs" / "r" / "config.toml").read_text()
    # On the CPU `auto` settles to no compilation and fp32; the record says what ran.
    assert "compile = false" in recorded and 'precision = "fp32"' in recorded


def test_regional_compile_matches_eager_and_keeps_keys(modules) -> None:
    """One cold compile: blocks compiled in place under activation checkpointing."""
    eager = tiny_gpt(modules)
    compiled = copy.deepcopy(eager)
    keys = list(eager.state_dict())
    config = parallel.ParallelConfig(compile=True, activation_checkpointing=True)
    model = parallel.parallelize(compiled, compiled.blocks, ONE_PROCESS, config)
    assert (
        model is compiled and list(model.state_dict()) == keys
    )  # no `_orig_mod.` prefix
    assert all(
        hasattr(block.forward, "_torchdynamo_orig_callable") for block in model.blocks
    )
    before = counters["stats"]["unique_graphs"]
    batch = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(1))
    loss_eager, grads_eager = step(eager, batch)
    loss_compiled, grads_compiled = step(model, batch)
    assert loss_compiled == pytest.approx(loss_eager, rel=1e-5)
    for name, grad in grads_eager.items():
        torch.testing.assert_close(grads_compiled[name], grad, rtol=1e-4, atol=1e-5)
    # Both blocks run the same code: they share the compiled graph(s) instead of one each.
    graphs = counters["stats"]["unique_graphs"] - before
    assert 1 <= graphs <= 2
    step(model, batch)
    assert (
        counters["stats"]["unique_graphs"] - before == graphs
    )  # same shape: no recompile


@pytest.mark.slow
def test_recompilation_is_bounded_over_sequence_lengths_and_microbatch_sizes(
    modules,
) -> None:
    """Sequence-length warmup's lengths (multiples of 8) and halved microbatch sizes: dynamo's
    automatic dynamic shapes recompile once per dimension that varies, then never again.
    """
    model = tiny_gpt(modules)
    parallel.parallelize(
        model, model.blocks, ONE_PROCESS, parallel.ParallelConfig(compile=True)
    )
    generator = torch.Generator().manual_seed(2)
    before = counters["stats"]["unique_graphs"]
    seen = []
    for seq_len in range(8, 65, 8):
        for batch_size in (4, 2, 1):
            step(
                model,
                torch.randint(0, 256, (batch_size, seq_len + 1), generator=generator),
            )
            seen.append(counters["stats"]["unique_graphs"] - before)
    # The first shape static; then batch symbolic, sequence symbolic and a batch of 1 (dynamo
    # specializes sizes 0 and 1): all within the first two lengths, nothing after them.
    assert seen[-1] <= 6 and seen[-1] == seen[5], seen
    with torch.no_grad():
        model(torch.randint(0, 256, (3, 40), generator=generator))
    assert (
        counters["stats"]["unique_graphs"] - before <= seen[-1] + 2
    )  # evaluation's own graph


@pytest.mark.slow
def test_compile_under_fsdp2_with_checkpointing_and_auto_microbatching_matches_eager(
    generated_auto: dict[str, Path], tmp_path: Path
) -> None:
    """2 ranks, FSDP2 + activation checkpointing + auto microbatching + sequence-length
    warmup: compiled and eager runs take the same steps (fp32 tolerance)."""
    project = generated_auto["gpt2-speedup"]

    def launch(name: str, compile_: bool) -> list[float]:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(project / "train.py"),
            "--device=cpu",
            "--seq_len=32",
            "--global_batch_size=8",
            "--device_microbatch_size=auto",
            "--activation_checkpointing=true",
            "--max_duration=4ba",
            "--eval_interval=4ba",
            "--eval_batches=1",
            "--dist_timeout=300",
            f"--compile={str(compile_).lower()}",
            f"--run_name={name}",
        ]
        result = subprocess.run(
            command,
            cwd=tmp_path,
            env=checkout_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return [r["loss"] for r in read_metrics(tmp_path, name)]

    eager, compiled = launch("eager", False), launch("compiled", True)
    assert len(eager) == 4 and compiled == pytest.approx(eager, rel=1e-4)


@pytest.mark.slow
def test_alibi_flex_attention_inside_compiled_blocks_matches_the_dense_bias(
    generated: dict[str, Path], monkeypatch
) -> None:
    """CUDA's default: compiled blocks taking FlexAttention's block mask. Forward only (the
    CPU has no FlexAttention backward), two lengths (the mask's shape changes).

    Dynamo captures the blocks with the BlockMask as an input and the compiled
    flex_attention inlined; the graphs run through AOTAutograd without inductor: inductor's
    CPU template for flex_attention rejects the strided q/k/v views inside a block
    ("NoValidChoicesError", torch 2.13), a CPU-only limit (CUDA uses the Triton template).
    """
    original = torch.compile
    monkeypatch.setattr(
        torch, "compile", lambda fn, **kw: original(fn, backend="aot_eager", **kw)
    )
    with project_modules(generated["gpt2-speedup"]) as found:
        model_module = found["model"]
        torch.manual_seed(0)
        config = model_module.GPTConfig(
            vocab_size=256, max_seq_len=64, n_layer=2, n_head=4, n_embd=64
        )
        dense = model_module.GPT(config)
        flex = copy.deepcopy(dense)
        parallel.parallelize(
            flex, flex.blocks, ONE_PROCESS, parallel.ParallelConfig(compile=True)
        )
        generator = torch.Generator().manual_seed(3)
        inputs = [
            torch.randint(0, 256, (2, seq), generator=generator) for seq in (40, 64)
        ]
        with torch.no_grad():
            expected = [
                dense(idx) for idx in inputs
            ]  # the CPU's path: dense bias, SDPA
            monkeypatch.setattr(
                model_module, "alibi_uses_flex", lambda device, dropout: True
            )
            for idx, logits in zip(inputs, expected):
                torch.testing.assert_close(flex(idx), logits, atol=1e-5, rtol=1e-5)


COMPILE_COUNTS = Path(__file__).resolve().parent / "compile_counts.py"
TORCHRUN_2 = [
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--standalone",
    "--nproc_per_node=2",
]
# What an eager cross-entropy dispatches (forward and backward); a compiled loss runs inside
# its graph's own kernels instead.
EAGER_LOSS_OPS = {
    "aten::cross_entropy_loss",
    "aten::log_softmax",
    "aten::_log_softmax",
    "aten::nll_loss",
    "aten::nll_loss_nd",
    "aten::nll_loss_forward",
    "aten::_log_softmax_backward_data",
    "aten::nll_loss_backward",
}


@dataclass
class Counts:
    """One rank's compile_counts.py line."""

    graphs: int
    breaks: int
    by_step: list[int]  # graphs made by the end of each optimizer step

    def after(self, warmup: int) -> list[int]:
        """The graphs made after the first `warmup` optimizer steps, at each later one."""
        return [graphs - self.by_step[warmup - 1] for graphs in self.by_step[warmup:]]


def counted_run(
    project: Path,
    workdir: Path,
    name: str,
    *args: str,
    launcher: list[str] | None = None,
) -> list[Counts]:
    """project's train.py on the CPU through compile_counts.py (under `launcher`, e.g.
    TORCHRUN_2): each rank's counts; the run must succeed."""
    command = [
        *(launcher or [sys.executable]),
        str(COMPILE_COUNTS),
        str(project / "train.py"),
        "--device=cpu",
        f"--run_name={name}",
        *args,
    ]
    result = subprocess.run(
        command,
        cwd=workdir,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    counts = []
    for line in result.stdout.splitlines():
        if line.startswith("compile-counts"):
            fields = dict(word.split("=") for word in line.split()[1:])
            by_step = [int(g) for g in fields["by_step"].split(",") if g]
            counts.append(Counts(int(fields["graphs"]), int(fields["breaks"]), by_step))
    return counts


def eager_loss_ops(workdir: Path, name: str) -> int:
    """Eager cross-entropy ops in run `name`'s --profile window (rank 0's trace)."""
    trace = workdir / "runs" / name / "profile" / "rank0.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    return sum(event.get("name") in EAGER_LOSS_OPS for event in events)


# Ten steps of 2 microbatches of 2 rows, evaluated at the end.
SHORT_RUN = [
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--max_duration=10ba",
    "--eval_interval=10ba",
    "--eval_batches=1",
    "--autoresume=false",
]
# gpt2-speedup warming its length up from 8 to 64 tokens in 7 of its 10 steps: a new
# sequence length at every step until the 8th.
WARMING_UP = [
    "--seq_len=64",
    "--seq_length_warmup_min_len=8",
    "--seq_length_warmup_duration=0.7dur",
    *SHORT_RUN,
]


def test_compiled_run_computes_its_loss_in_a_graph_and_never_recompiles_after_warmup(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """gpt2-speedup (ALiBi, sequence-length warmup) with --compile=true, what `auto` runs on
    CUDA, beside the same run eager:
    - after its second step nothing compiles again, though every step has a new length
      (dynamo's automatic dynamic shapes: the first step compiles each graph for its
      shapes, the second with the length symbolic), and no graph breaks;
    - the loss runs inside a compiled graph: the profiled step dispatches none of an eager
      cross-entropy's ops, where the eager run's does;
    - the same losses as eager (fp32);
    - its checkpoint (keys unchanged) resumes in an eager run, which then takes the same
      steps."""
    project = generated["gpt2-speedup"]
    args = [*WARMING_UP, "--save_interval=5ba", "--profile=6ba:7ba"]
    eager = run_train(project, tmp_path, *args, "--compile=false", "--run_name=eager")
    assert eager.returncode == 0, eager.stderr
    (counts,) = counted_run(project, tmp_path, "compiled", *args, "--compile=true")
    records = read_metrics(tmp_path, "compiled")
    lengths = [r["seq_len"] for r in records]
    assert len(set(lengths[:8])) == 8, lengths  # a new length at each of 8 steps
    assert counts.breaks == 0
    assert counts.after(2) == [0] * 8, counts
    assert eager_loss_ops(tmp_path, "eager") > 0
    assert eager_loss_ops(tmp_path, "compiled") == 0
    losses = [r["loss"] for r in read_metrics(tmp_path, "eager")]
    assert [r["loss"] for r in records] == pytest.approx(losses, rel=1e-4)
    step_5 = tmp_path / "runs" / "compiled" / "checkpoints" / "step-5"
    resumed = run_train(
        project,
        tmp_path,
        *WARMING_UP,
        "--compile=false",
        f"--load_path={step_5}",
        "--run_name=resumed",
    )
    assert resumed.returncode == 0, resumed.stderr
    resumed_losses = [r["loss"] for r in read_metrics(tmp_path, "resumed")]
    assert resumed_losses == pytest.approx(losses[5:], rel=1e-4)


@pytest.mark.slow
def test_sequence_length_warmup_under_compile_on_ddp_never_recompiles_after_warmup(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """gpt2-speedup (ALiBi + sequence-length warmup) with --compile=true, one process and DDP on
    2 ranks (pytorch issue 140229: a DDP-wrapped compiled model recompiled at every new length).
    Here the blocks are compiled, not the DDP module, and dynamo's automatic dynamic shapes make
    the sequence dimension symbolic at the first new length: nothing compiles after the second
    step on any rank, and the whole run (evaluation and the closing sample included) makes at
    most 6 graphs; the recompile limit is never hit (compile_counts.py makes that an error).
    """
    project = generated["gpt2-speedup"]
    args = [*WARMING_UP, "--compile=true", "--dist_timeout=600"]
    one = counted_run(project, tmp_path, "one", *args)
    ddp = counted_run(
        project, tmp_path, "ddp", *args, "--parallelism=ddp", launcher=TORCHRUN_2
    )
    assert len(one) == 1 and len(ddp) == 2
    for counts in one + ddp:
        assert counts.breaks == 0 and counts.after(2) == [0] * 8, counts
        assert counts.graphs <= 6, counts  # not one graph per length
    losses = [r["loss"] for r in read_metrics(tmp_path, "one")]
    assert len(set(r["seq_len"] for r in read_metrics(tmp_path, "one"))) >= 6
    assert [r["loss"] for r in read_metrics(tmp_path, "ddp")] == pytest.approx(
        losses, rel=1e-4
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "recipe, how",
    [
        ("gpt2-speedup", "model"),
        ("gpt2-modern", "true"),
        ("gpt2-speedrun", "true"),
        ("bert-pretrain-baseline", "true"),
    ],
)
def test_compiled_recipes_never_recompile_after_warmup_nor_break_a_graph(
    generated: dict[str, Path], tmp_path: Path, recipe: str, how: str
) -> None:
    """The language recipes compiled (the blocks; gpt2-speedup's whole model, warming its
    sequence length up): no graph break, nothing compiled after the second step, the
    losses (training and validation) of the eager run. Not here: mosaicbert, whose CPU
    attention path (rows grouped by length) breaks graphs where CUDA's FlexAttention path
    does not, and llm_finetune, whose layers compile one more variant the first time a
    batch has no padding (no attention mask)."""
    project = generated[recipe]
    args = {"gpt2-speedup": WARMING_UP, "bert-pretrain-baseline": SHORT_RUN}.get(
        recipe, ["--seq_len=64", *SHORT_RUN]
    )
    eager = run_train(project, tmp_path, *args, "--compile=false", "--run_name=eager")
    assert eager.returncode == 0, eager.stderr
    (counts,) = counted_run(project, tmp_path, "compiled", *args, f"--compile={how}")
    assert counts.breaks == 0, counts
    steps = len(read_metrics(tmp_path, "compiled"))
    calls = len(counts.by_step) // steps  # optimizer steps per training step (Muon: 2)
    assert counts.after(2 * calls) == [0] * (len(counts.by_step) - 2 * calls), counts
    expected = read_metrics(tmp_path, "eager")
    for record, reference in zip(read_metrics(tmp_path, "compiled"), expected):
        for key in ("loss", "val_loss"):
            assert record.get(key) == pytest.approx(reference.get(key), rel=1e-4)
