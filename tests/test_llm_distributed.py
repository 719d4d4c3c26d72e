"""llm_finetune under torchrun: FSDP2 on 2 CPU ranks (the model sharded per decoder layer,
activation checkpointing on) logs one process's losses, exports the same weights (gathered
from the shards; with LoRA, merged), and its step-2 checkpoint resumes on one process
(elastic 2 -> 1) to the same end. llm-sft trains every weight (every run); llm-lora
(--slow) only the adapters, checkpointed without the frozen model. One torchrun launch per
recipe; under --slow also DDP resuming a one-process checkpoint on 2 ranks (elastic
1 -> 2). Tolerances as in test_distributed.py (reduction order)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from projects import (  # noqa: E402
    assert_same_series,
    read_metrics,
    run_train,
    torchrun,
)

SMALL = [
    "--seq_len=64",
    "--global_batch_size=8",
    "--device_microbatch_size=2",
    "--eval_batches=1",
    "--samples=1",
    "--sample_tokens=6",
    "--max_duration=4ba",
    "--eval_interval=2ba",
    "--save_interval=2ba",
    "--dist_timeout=60",
    "--save_num_checkpoints_to_keep=0",
]


def compared(workdir: Path, run_name: str) -> list[tuple]:
    return [
        (r["step"], r["loss"], r.get("val_loss"))
        for r in read_metrics(workdir, run_name)
    ]


def launch(project: Path, workdir: Path, *args: str) -> subprocess.CompletedProcess:
    """train.py on 2 CPU ranks (torchrun --standalone) with SMALL and `args`."""
    script = project / "train.py"
    return torchrun(workdir, 2, script, "--device=cpu", *SMALL, *args, timeout=600)


@pytest.mark.parametrize(
    "recipe", ["llm-sft", pytest.param("llm-lora", marks=pytest.mark.slow)]
)
def test_fsdp2_matches_one_process_and_resumes_on_one(
    recipe: str,
    generated: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if recipe == "llm-lora":
        pytest.importorskip("peft")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    project = generated[recipe]
    one = run_train(project, tmp_path, *SMALL, "--run_name=one")
    assert one.returncode == 0, one.stderr
    args = ("--parallelism=fsdp", "--activation_checkpointing=true", "--run_name=two")
    two = launch(project, tmp_path, *args)
    assert two.returncode == 0, two.stdout + two.stderr
    assert "4 FSDP units" in two.stdout and two.stdout.count("done: step 4") == 1
    reference = compared(tmp_path, "one")
    assert [r[0] for r in reference] == [1, 2, 3, 4]
    for ours, theirs in zip(compared(tmp_path, "two"), reference, strict=True):
        assert_same_series(list(ours), list(theirs), 1e-5)
    # The export gathered the shards: the same weights as one process's.
    merged = {
        name: transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "runs" / name / "hf"
        ).state_dict()
        for name in ("one", "two")
    }
    for key, value in merged["one"].items():
        torch.testing.assert_close(merged["two"][key], value, rtol=0, atol=1e-5)

    # Elastic: the 2-rank run's step-2 checkpoint resumes on one process.
    elastic = tmp_path / "runs" / "elastic" / "checkpoints"
    step = tmp_path / "runs" / "two" / "checkpoints" / "step-2"
    shutil.copytree(step, elastic / "step-2")
    resumed = run_train(project, tmp_path, *SMALL, "--run_name=elastic")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    ends = [r for r in compared(tmp_path, "elastic") if r[0] == 4]
    assert ends
    assert_same_series(list(ends[0]), list(reference[-1]), 1e-5)


@pytest.mark.slow
def test_ddp_resumes_a_one_process_checkpoint_on_two(
    generated: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Elastic 1 -> 2 with DDP: llm-sft's one-process step-2 checkpoint (full weights)
    resumes on 2 ranks and logs the one-process run's steps 3 and 4."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    project = generated["llm-sft"]
    one = run_train(project, tmp_path, *SMALL, "--run_name=one")
    assert one.returncode == 0, one.stderr
    step = tmp_path / "runs" / "one" / "checkpoints" / "step-2"
    shutil.copytree(step, tmp_path / "runs" / "ddp" / "checkpoints" / "step-2")
    ddp = launch(project, tmp_path, "--parallelism=ddp", "--run_name=ddp")
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    assert "resumed from" in ddp.stdout
    reference = compared(tmp_path, "one")[2:]
    assert [r[0] for r in reference] == [3, 4]
    for ours, theirs in zip(compared(tmp_path, "ddp"), reference, strict=True):
        assert_same_series(list(ours), list(theirs), 1e-5)
