"""text_classification under torchrun: FSDP2 (one unit per `_no_split_modules` layer, with
activation checkpointing) and DDP on 2 CPU ranks match one process; a 2-rank checkpoint resumes
on 1 process (elastic); save_pretrained gathers the sharded weights; kill -9 of the workers
mid-training, then a restart, logs the uninterrupted run's losses (slow).

The model has dropout off (with it on, ranks draw other masks than one process: equal only in
distribution). The 5 validation rows split unevenly over 2 ranks (3 + 2): shares are padded.
Tolerances as in test_distributed.py (reduction order).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from projects import (  # noqa: E402
    assert_same_series,
    checkout_env,
    children,
    read_metrics,
    run_train,
)
from test_text_classification import pretrained_bert, toy_rows, write_csv  # noqa: E402

SMALL = [
    "--max_seq_len=16",
    "--global_batch_size=8",
    "--device_microbatch_size=2",
    "--lr=3e-3",
    "--max_duration=4ba",
    "--eval_interval=2ba",
    "--save_interval=2ba",
    "--dist_timeout=60",
    "--save_num_checkpoints_to_keep=0",
]


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # nothing is downloaded
        yield


@pytest.fixture(scope="module")
def setup(
    generated: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, offline: None
) -> dict:
    root = tmp_path_factory.mktemp("hf-dist")
    rows = toy_rows(85)
    args = [
        f"--model={pretrained_bert(root / 'bert', dropout=0.0)}",
        f"--data={write_csv(root / 'train.csv', rows[:80])}",
        f"--val_data={write_csv(root / 'val.csv', rows[80:])}",
    ]
    workdir = root / "one"
    workdir.mkdir()
    result = run_train(generated["bert-sst2"], workdir, *SMALL, *args, "--run_name=one")
    assert result.returncode == 0, result.stderr
    return {"project": generated["bert-sst2"], "args": args, "ref": workdir}


def torchrun(
    project: Path, workdir: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(project / "train.py"),
        "--device=cpu",
        *SMALL,
        *args,
    ]
    return subprocess.run(
        command,
        cwd=workdir,
        env={**checkout_env(), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=400,
    )


def same_run(metrics: list[dict], reference: list[dict]) -> None:
    assert (
        [m["step"] for m in metrics] == [m["step"] for m in reference] == [1, 2, 3, 4]
    )
    assert [m["loss"] for m in metrics] == pytest.approx(
        [m["loss"] for m in reference], rel=1e-5
    )
    for key in ("val_loss", "accuracy", "f1"):
        assert_same_series(
            [m.get(key) for m in metrics], [m.get(key) for m in reference], 1e-5, key
        )


@pytest.mark.parametrize(
    "args",
    [["--parallelism=fsdp", "--activation_checkpointing=true"], ["--parallelism=ddp"]],
    ids=["fsdp-ac-2", "ddp-2"],
)
def test_two_ranks_match_one_process_and_resume_on_one(
    setup: dict, args: list[str], tmp_path: Path
) -> None:
    result = torchrun(
        setup["project"], tmp_path, *setup["args"], *args, "--run_name=dist"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 FSDP units" in result.stdout and result.stdout.count("done: step 4") == 1
    reference = read_metrics(setup["ref"], "one")
    same_run(read_metrics(tmp_path, "dist"), reference)

    # save_pretrained gathered the (sharded) weights: the same model as one process's.
    ours = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "runs" / "dist" / "hf"
    )
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(
        setup["ref"] / "runs" / "one" / "hf"
    )
    for (name, a), (_, b) in zip(
        ours.state_dict().items(), theirs.state_dict().items()
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)

    if "--parallelism=fsdp" in args:
        # Elastic: the 2-rank run's step-2 checkpoint resumes on one process.
        elastic = tmp_path / "runs" / "elastic" / "checkpoints"
        shutil.copytree(
            tmp_path / "runs" / "dist" / "checkpoints" / "step-2", elastic / "step-2"
        )
        resumed = run_train(
            setup["project"], tmp_path, *SMALL, *setup["args"], "--run_name=elastic"
        )
        assert (
            resumed.returncode == 0 and "resumed from" in resumed.stdout
        ), resumed.stderr
        same_run(
            read_metrics(tmp_path, "dist")[:2] + read_metrics(tmp_path, "elastic"),
            reference,
        )


@pytest.mark.slow
def test_kill_9_of_the_workers_then_a_restart_continues_bitwise(
    setup: dict, tmp_path: Path
) -> None:
    """A preempted 2-rank job: its workers are killed (-9) mid-training, torchrun too; the same
    command resumes from the newest complete checkpoint and logs the uninterrupted run's losses.
    """
    changed = (
        "--max_duration",
        "--save_interval",
        "--eval_interval",
        "--save_num_checkpoints_to_keep",
    )
    args = [
        *(a for a in SMALL if not a.startswith(changed)),
        *setup["args"],
        "--parallelism=fsdp",
        "--max_duration=8ba",
        "--save_interval=1ba",
        "--eval_interval=4ba",
        "--save_num_checkpoints_to_keep=2",
    ]
    launch = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(setup["project"] / "train.py"),
        "--device=cpu",
        *args,
    ]
    env = {**checkout_env(), "HF_HUB_OFFLINE": "1"}

    def run(name: str) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [*launch, f"--run_name={name}"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result

    run("ref")
    metrics = tmp_path / "runs" / "killed" / "metrics.jsonl"
    with open(tmp_path / "killed.log", "w") as log:
        process = subprocess.Popen(
            [*launch, "--run_name=killed"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        if process.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    # torchrun starts its workers in sessions of their own: kill them by pid, then torchrun.
    workers = children(process.pid)
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=60)
    assert len(workers) == 2, (workers, (tmp_path / "killed.log").read_text()[-3000:])
    folder = tmp_path / "runs" / "killed" / "checkpoints"
    steps = sorted(
        int(p.name.removeprefix("step-"))
        for p in folder.glob("step-*")
        if (p / "COMPLETE").is_file()
    )
    assert steps and steps[-1] < 8, steps  # killed mid-training, after a complete save

    restarted = run("killed")
    assert (
        f"resumed from runs/killed/checkpoints/step-{steps[-1]} at step {steps[-1]}"
        in restarted.stdout
    )
    keys = ("step", "loss", "val_loss", "accuracy", "f1")
    trajectory = [[m.get(k) for k in keys] for m in read_metrics(tmp_path, "killed")]
    assert trajectory == [
        [m.get(k) for k in keys] for m in read_metrics(tmp_path, "ref")
    ]
    assert [row[0] for row in trajectory] == list(range(1, 9))
