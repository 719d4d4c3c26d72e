"""The same train.py under torchrun: FSDP2 and DDP on 2 and 3 CPU ranks (gloo) match one process.

The data is a 9,000-byte text whose held-out tail holds 5 validation windows: the validation
batch splits unevenly over 2 and 3 ranks (3 + 2, 2 + 2 + 1 rows), so the ranks must pad their
shares to run the same number of forwards (FSDP hangs otherwise) and still give one process's
val_loss. The project has optimizer_monitor and gradient_clipping in its adaptive mode (AGC):
the per-parameter norms of the clipped gradients, of the weights and of the updates must be
one process's as well, whatever holds each tensor (shards, replicas, both). It also has the
generate monitor: its texts at each evaluation (every rank runs the forwards) are one
process's.

Each torchrun launch costs ~5 s here, so every launch checks several things. Tolerances:
ranks sum gradients in a different order than one process does, which moves fp32 results
by ~1e-7 per step (DESIGN.md §12.2: ~5e-7 on losses); over 4 AdamW steps the losses agree
to 1e-5 relative and the parameters to 1e-5 absolute (weights are ~0.02 in scale).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from projects import checkout_env, read_metrics, run_train
from scaffold.paths import template_dir
from scaffold.render import new_project

TEMPLATE = template_dir()

SMALL = [
    "--seq_len=32",
    "--global_batch_size=12",
    "--device_microbatch_size=2",
    "--max_duration=4ba",
    "--eval_interval=2ba",
    "--eval_batches=1",
    "--dist_timeout=60",
]
LAUNCH_TIMEOUT = 300

# Raises on rank 1 in its third microbatch: a crash in the middle of a step.
FAIL_ON_RANK_1 = """
import os, runpy, sys
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import runtime.parallel as parallel
calls = []
sync = parallel.sync_gradients
def sync_then_fail(model, enabled):
    calls.append(enabled)
    if os.environ["RANK"] == "1" and len(calls) == 3:
        raise RuntimeError("injected failure on rank 1")
    return sync(model, enabled)
parallel.sync_gradients = sync_then_fail
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def torchrun(
    project: Path,
    workdir: Path,
    nproc: int,
    *args: str,
    script: list[str] | None = None,
    timeout: int = LAUNCH_TIMEOUT,
) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *(script or [str(project / "train.py")]),
        "--device=cpu",
        *SMALL,
        *args,
    ]
    return subprocess.run(
        command,
        cwd=workdir,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """9,000 bytes of text: 8,820 to train on (20 batches of 12 windows), 180 held out (5 windows)."""
    source = Path(subprocess.__file__).read_bytes()
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_bytes(source[:9000])
    return path


def final_weights(workdir: Path, run_name: str) -> dict[str, torch.Tensor]:
    """The last checkpoint's model weights, consolidated without a process group."""
    out = workdir / f"{run_name}.pt"
    dcp_to_torch_save(workdir / "runs" / run_name / "checkpoints" / "step-4", out)
    return torch.load(out, weights_only=True)["model"]


@pytest.fixture(scope="module")
def speedup(tmp_path_factory: pytest.TempPathFactory, isolated_home: Path) -> Path:
    """gpt2-speedup with optimizer_monitor and adaptive gradient clipping: the clipped
    gradients' per-parameter norms must be one process's too (FSDP2 shards, DDP
    replicas, HSDP's replicated shards all counted once; AGC's rows and vectors)."""
    root = tmp_path_factory.mktemp("speedup")
    recipe = (TEMPLATE / "recipes/gpt2-speedup.toml").read_text()
    table = "[algorithms.gradient_clipping]\n"
    assert table in recipe
    recipe = recipe.replace(table, table + 'clipping_type = "adaptive"\n')
    monitors = "\n[algorithms.optimizer_monitor]\n\n[algorithms.generate]\n"
    (root / "recipe.toml").write_text(recipe + monitors + "max_new_tokens = 8\n")
    new_project(str(root / "recipe.toml"), root / "my-gpt", [], "my-gpt")
    return root / "my-gpt"


@pytest.fixture(scope="module")
def reference(
    speedup: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[dict]]:
    """One process, same global batch: the run every distributed run must reproduce."""
    workdir = tmp_path_factory.mktemp("reference")
    result = run_train(speedup, workdir, *SMALL, f"--data={corpus}", "--run_name=one")
    assert result.returncode == 0, result.stderr
    assert "8,820 train, 180 validation" in result.stdout  # (180 - 1) // 32 = 5 windows
    return workdir, read_metrics(workdir, "one")


@pytest.mark.parametrize(
    ("nproc", "args"),
    [
        (2, ["--parallelism=fsdp"]),
        (2, ["--parallelism=ddp", "--activation_checkpointing=true"]),
        (
            3,
            [
                "--parallelism=fsdp",
                "--sharding_strategy=SHARD_GRAD_OP",
                "--activation_checkpointing=true",
            ],
        ),
        (
            2,
            [
                "--parallelism=fsdp",
                "--sharding_strategy=HYBRID_SHARD",
                "--hybrid_shard_size=1",
            ],
        ),
    ],
    ids=["fsdp-2", "ddp-ac-2", "fsdp-shard-grad-op-ac-3", "hsdp-2"],
)
def test_distributed_run_matches_one_process(
    nproc: int, args: list[str], speedup: Path, corpus: Path, reference, tmp_path: Path
) -> None:
    ref_dir, ref_metrics = reference
    result = torchrun(
        speedup, tmp_path, nproc, *args, f"--data={corpus}", "--run_name=dist"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    metrics = read_metrics(tmp_path, "dist")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]  # rank 0 alone writes metrics
    assert [m["loss"] for m in metrics] == pytest.approx(
        [m["loss"] for m in ref_metrics], rel=1e-5
    )
    val = [(m["step"], m["val_loss"]) for m in metrics if "val_loss" in m]
    ref_val = [(m["step"], m["val_loss"]) for m in ref_metrics if "val_loss" in m]
    assert [step for step, _ in val] == [step for step, _ in ref_val] == [2, 4]
    # 5 validation rows over the ranks, padded to equal shares: one process's val_loss.
    assert [loss for _, loss in val] == pytest.approx(
        [loss for _, loss in ref_val], rel=1e-6
    )
    # generate: every rank ran the forwards (FSDP gathers each block's weights for
    # each) and the texts are one process's.
    texts = [{k: v for k, v in m.items() if k.startswith("generate/")} for m in metrics]
    assert [sorted(t) for t in texts if t] == [["generate/0", "generate/1"]] * 2
    assert texts == [
        {k: v for k, v in m.items() if k.startswith("generate/")} for m in ref_metrics
    ]
    # optimizer_monitor: every gradient, weight and update norm is one process's.
    for ours, theirs in zip(metrics, ref_metrics, strict=True):
        norms = [key for key in theirs if "/" in key and "generate/" not in key]
        assert len(norms) > 40 and norms == [
            key for key in ours if "/" in key and "generate/" not in key
        ]
        for key in norms:
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-7), key
    # Throughput is the whole job's: the same tokens per step as one process.
    assert all(m["tokens_per_s"] > 0 for m in metrics)
    # Only rank 0 logs.
    assert result.stdout.count("done: step 4") == 1
    # Parameters after 4 steps, gathered from the sharded checkpoint, agree with one process.
    ours, theirs = final_weights(tmp_path, "dist"), final_weights(ref_dir, "one")
    assert ours.keys() == theirs.keys()
    for name in theirs:
        torch.testing.assert_close(
            ours[name], theirs[name], rtol=0, atol=1e-5, msg=name
        )


def test_bf16_mixed_precision_runs_on_cpu(
    speedup: Path, corpus: Path, reference, tmp_path: Path
) -> None:
    """FSDP2's bf16 policy on 2 ranks, and autocast in one process: close to fp32, not equal."""
    _, ref_metrics = reference
    # The same launch checks the profiler window (a trace per rank) and trackers (rank 0 only).
    tracked = (
        ["--trackers=tensorboard"] if importlib.util.find_spec("tensorboard") else []
    )
    fsdp_bf16 = torchrun(
        speedup,
        tmp_path,
        2,
        "--precision=bf16",
        f"--data={corpus}",
        "--run_name=bf16",
        "--profile=1ba:3ba",
        *tracked,
    )
    assert fsdp_bf16.returncode == 0, fsdp_bf16.stderr
    profile = tmp_path / "runs" / "bf16" / "profile"
    assert sorted(p.name for p in profile.iterdir()) == [
        "rank0.trace.json",
        "rank1.trace.json",
    ]
    for rank in (0, 1):
        names = {
            e.get("name", "")
            for e in json.loads((profile / f"rank{rank}.trace.json").read_text())[
                "traceEvents"
            ]
        }
        assert any(name.startswith("Optimizer.step#AdamW") for name in names)
    if tracked:  # one writer: rank 0
        assert (
            len(
                list(
                    (tmp_path / "runs" / "bf16" / "tensorboard").glob(
                        "events.out.tfevents.*"
                    )
                )
            )
            == 1
        )
    amp = run_train(
        speedup,
        tmp_path,
        *SMALL,
        "--precision=amp_bf16",
        f"--data={corpus}",
        "--run_name=amp",
    )
    assert amp.returncode == 0, amp.stderr
    for run in ("bf16", "amp"):
        losses = [m["loss"] for m in read_metrics(tmp_path, run)]
        assert losses == pytest.approx([m["loss"] for m in ref_metrics], abs=0.05)
        assert losses != [m["loss"] for m in ref_metrics]  # it did compute in bf16


def test_a_failing_rank_ends_the_job_fast_with_the_error_once(
    speedup: Path, tmp_path: Path
) -> None:
    wrapper = tmp_path / "fail.py"
    wrapper.write_text(FAIL_ON_RANK_1)
    result = torchrun(
        speedup,
        tmp_path,
        2,
        "--run_name=fail",
        script=[str(wrapper), str(speedup / "train.py")],
        timeout=120,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert output.count("RuntimeError: injected failure on rank 1") == 1, output


def test_bad_input_under_torchrun_is_one_message_before_training(
    speedup: Path, tmp_path: Path
) -> None:
    result = torchrun(
        speedup,
        tmp_path,
        3,
        "--sharding_strategy=HYBRID_SHARD",
        "--hybrid_shard_size=2",
    )
    assert result.returncode != 0
    assert (
        result.stderr.count("error: HYBRID_SHARD needs the world size (3)") == 1
    ), result.stderr
    assert not (tmp_path / "runs").exists()


def fake_rank(world_size: int) -> dict[str, str]:
    """torchrun's variables for rank 0 of a job: enough for the checks that run before joining it."""
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
    }


@pytest.mark.parametrize(
    ("world_size", "args", "message"),
    [
        (
            3,
            ["--global_batch_size=8"],
            "global_batch_size=8 is not divisible by the world size 3",
        ),
        (
            4,
            ["--sharding_strategy=HYBRID_SHARD", "--hybrid_shard_size=3"],
            "hybrid_shard_size (3)",
        ),
        (2, ["--parallelism=none"], "unrelated copies"),
        (1, ["--precision=bf16"], "precision=bf16 is FSDP's mixed-precision policy"),
        (2, ["--cpu_offload=true"], "cpu_offload"),
        (1, ["--device=cuda"], "CUDA is not available"),
    ],
)
def test_impossible_parallel_settings_are_refused(
    world_size: int, args: list[str], message: str, speedup: Path, tmp_path: Path
) -> None:
    if "--device=cuda" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    env = {**checkout_env(), **fake_rank(world_size)}
    overridden = {arg.split("=")[0] for arg in args}
    command = [
        sys.executable,
        str(speedup / "train.py"),
        *[a for a in SMALL if a.split("=")[0] not in overridden],
        *args,
    ]
    if "--device=cuda" not in args:
        command.append("--device=cpu")
    result = subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "runs").exists()
