"""llm_finetune under torchrun (CPU, gloo), few launches per recipe:

- FSDP2 on 2 ranks (the model sharded per decoder layer, activation checkpointing on) logs
  one process's losses and exports the same weights (gathered from the shards; with LoRA,
  merged), although one rank is SIGKILLed mid-step 5 (tests/fault_worker.py) and torchrun
  (`--max-restarts=1`) restarts the group: it resumes from the newest complete checkpoint
  (step 4), logs every step once, and the surviving rank says why it stopped in one line.
- Elastic 2 -> 3 -> 2 -> 1: that run's step-2 checkpoint resumes on 3 ranks (to step 4),
  that one's on 2 ranks (to step 6), that one's on one process (to step 8), and every step
  logs what the process that never stopped logged.

llm-sft trains every weight (every run); llm-lora (--slow) only the adapters, and its
checkpoints hold only them, resharded like the full weights. Every run also: llm-lora (generated
with auto_microbatching) under DDP on 2 ranks with an out-of-memory injected on rank 1 settles
both ranks at a smaller microbatch and logs one process's losses. Under --slow also: DDP resuming
a one-process checkpoint on 2 ranks (elastic 1 -> 2). The bitwise kill -9 cases (same world
size: mid-step, mid-evaluation, mid-save) are in test_restarts.py (--slow).

Tolerance: rel 1e-5 on losses, as test_distributed.py and test_masked_lm.py: ranks change
only the order of floating-point reductions (FSDP's reduce-scatter over 2 or 3 ranks,
gradient accumulation over 6, 3 or 2 microbatches); measured here at most 8e-8 relative. A
wrong data cursor, optimizer state or step moves the loss by more than 50 times the
tolerance (asserted: the smallest change between two logged steps).
"""

from __future__ import annotations

import shutil
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

TESTS = Path(__file__).resolve().parent
FAULT_WORKER = TESTS / "fault_worker.py"
STOP_AFTER = TESTS / "stop_after.py"
# A global batch of 12 rows divides over 1, 2 and 3 ranks (2 rows per microbatch).
SMALL = [
    "--seq_len=64",
    "--global_batch_size=12",
    "--device_microbatch_size=2",
    "--eval_batches=1",
    "--samples=1",
    "--sample_tokens=6",
    "--max_duration=8ba",
    "--eval_interval=2ba",
    "--save_interval=2ba",
    "--dist_timeout=30",
    "--save_num_checkpoints_to_keep=0",
]
FSDP = ["--parallelism=fsdp", "--activation_checkpointing=true"]
TOLERANCE = 1e-5  # relative
SURVIVOR_LINE = "stopped: a collective failed because another rank died or hangs"


def compared(workdir: Path, run_name: str) -> list[tuple]:
    return [
        (r["step"], r["loss"], r.get("val_loss"))
        for r in read_metrics(workdir, run_name)
    ]


def launch(
    project: Path, workdir: Path, nproc: int, run_name: str, *wrapper: object
) -> str:
    """`torchrun --max-restarts=1 [WRAPPER] train.py` with SMALL and FSDP on `nproc` CPU
    ranks; its output. WRAPPER: fault_worker.py or stop_after.py and its argument."""
    script = project / "train.py"
    args = [*wrapper, script, "--device=cpu", *SMALL, *FSDP, f"--run_name={run_name}"]
    done = torchrun(workdir, nproc, *args, restarts=1, timeout=600)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    return output


@pytest.mark.parametrize(
    "recipe", ["llm-sft", pytest.param("llm-lora", marks=pytest.mark.slow)]
)
def test_fsdp2_survives_a_kill_and_resumes_on_3_2_and_1_ranks(
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
    reference = compared(tmp_path, "one")
    assert [r[0] for r in reference] == list(range(1, 9))
    losses = [r[1] for r in reference]
    assert (
        min(abs(a - b) for a, b in zip(losses, losses[1:])) > 50 * TOLERANCE * losses[0]
    )

    # FSDP2 on 2 ranks; rank 1 killed (-9) in the first forward of step 5.
    two = launch(project, tmp_path, 2, "two", FAULT_WORKER, "step:4:1")
    assert "4 FSDP units" in two and two.count("done: step 8") == 1
    assert "resumed from runs/two/checkpoints/step-4 at step 4\n" in two
    assert f"error: rank 0 {SURVIVOR_LINE}" in two and "Traceback" not in two
    for ours, theirs in zip(compared(tmp_path, "two"), reference, strict=True):
        assert_same_series(list(ours), list(theirs), TOLERANCE)
    # The export gathered the shards: the same weights as one process's.
    exported = {
        name: transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "runs" / name / "hf"
        ).state_dict()
        for name in ("one", "two")
    }
    for key, value in exported["one"].items():
        torch.testing.assert_close(exported["two"][key], value, rtol=0, atol=1e-5)

    # Elastic: the 2-rank step-2 checkpoint on 3 ranks, then 2, then one process.
    step_2 = tmp_path / "runs" / "two" / "checkpoints" / "step-2"
    shutil.copytree(step_2, tmp_path / "runs" / "elastic" / "checkpoints" / "step-2")
    three = launch(project, tmp_path, 3, "elastic", STOP_AFTER, 4)
    assert "at step 2 (saved on 2 rank(s), now 3)" in three
    again = launch(project, tmp_path, 2, "elastic", STOP_AFTER, 6)
    assert "at step 4 (saved on 3 rank(s), now 2)" in again
    last = run_train(project, tmp_path, *SMALL, *FSDP, "--run_name=elastic")
    assert last.returncode == 0, last.stderr
    assert "at step 6 (saved on 2 rank(s), now 1)" in last.stdout
    elastic = compared(tmp_path, "elastic")
    assert [r[0] for r in elastic] == list(range(3, 9))  # each step logged once
    for ours, theirs in zip(elastic, reference[2:], strict=True):
        assert_same_series(list(ours), list(theirs), TOLERANCE)


@pytest.mark.slow
def test_ddp_resumes_a_one_process_checkpoint_on_two(
    generated: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Elastic 1 -> 2 with DDP: llm-sft's one-process step-2 checkpoint (full weights)
    resumes on 2 ranks and logs the one-process run's steps 3 to 8."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    project = generated["llm-sft"]
    one = run_train(project, tmp_path, *SMALL, "--run_name=one")
    assert one.returncode == 0, one.stderr
    step = tmp_path / "runs" / "one" / "checkpoints" / "step-2"
    shutil.copytree(step, tmp_path / "runs" / "ddp" / "checkpoints" / "step-2")
    script = project / "train.py"
    ddp = torchrun(
        tmp_path, 2, script, "--device=cpu", *SMALL, "--parallelism=ddp",
        "--run_name=ddp", timeout=600,
    )  # fmt: skip
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    assert "resumed from runs/ddp/checkpoints/step-2 at step 2" in ddp.stdout
    reference = compared(tmp_path, "one")[2:]
    assert [r[0] for r in reference] == list(range(3, 9))
    for ours, theirs in zip(compared(tmp_path, "ddp"), reference, strict=True):
        assert_same_series(list(ours), list(theirs), TOLERANCE)


def test_ddp_lora_settles_after_an_oom_and_equals_one_process(
    generated_auto: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DDP with peft's LoRA on 2 ranks, `--device_microbatch_size=auto`, rank 1 out of
    memory in backward above 2 rows: both ranks retry the batch at 3 then 2 rows of their
    6, and the run logs the losses of one process accumulating 6 microbatches of 2 rows
    (the loss is divided by the global batch's answer tokens, whatever the split), and
    exports the same merged weights."""
    pytest.importorskip("peft")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    project = generated_auto["llm-lora"]
    short = [
        *(a for a in SMALL if not a.startswith(("--max_d", "--device_m"))),
        "--max_duration=4ba",
    ]
    one = run_train(
        project, tmp_path, *short, "--device_microbatch_size=2", "--run_name=one"
    )
    assert one.returncode == 0, one.stderr
    monkeypatch.setenv("SCAFFOLD_INJECT_OOM", "ranks=1;above=2;phase=backward")
    ddp = torchrun(
        tmp_path, 2, project / "train.py", "--device=cpu", *short,
        "--parallelism=ddp", "--device_microbatch_size=auto", "--run_name=ddp",
        timeout=600,
    )  # fmt: skip
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    assert "retrying the batch at 3" in ddp.stdout
    assert "retrying the batch at 2" in ddp.stdout
    assert [r["microbatch_size"] for r in read_metrics(tmp_path, "ddp")] == [2] * 4
    reference = compared(tmp_path, "one")
    assert [r[0] for r in reference] == [1, 2, 3, 4]
    for ours, theirs in zip(compared(tmp_path, "ddp"), reference, strict=True):
        assert_same_series(list(ours), list(theirs), TOLERANCE)
    exported = {
        name: transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path / "runs" / name / "hf"
        ).state_dict()
        for name in ("one", "ddp")
    }
    for key, value in exported["one"].items():
        torch.testing.assert_close(exported["ddp"][key], value, rtol=0, atol=1e-6)
