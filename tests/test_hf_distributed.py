"""text_classification under torchrun: FSDP2 (one unit per `_no_split_modules` layer, with
activation checkpointing) and DDP on 2 CPU ranks match one process; a 2-rank checkpoint resumes
on 1 process (elastic); save_pretrained gathers the sharded weights.

The model has dropout off (with it on, ranks draw other masks than one process: equal only in
distribution). The 5 validation rows split unevenly over 2 ranks (3 + 2): shares are padded.
Tolerances as in test_distributed.py (reduction order).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from projects import checkout_env, read_metrics, run_train  # noqa: E402
from test_text_classification import pretrained_bert, toy_rows, write_csv  # noqa: E402

SMALL = ["--max_seq_len=16", "--global_batch_size=8", "--device_microbatch_size=2", "--lr=3e-3",
         "--max_duration=4ba", "--eval_interval=2ba", "--save_interval=2ba", "--dist_timeout=60",
         "--save_num_checkpoints_to_keep=0"]


@pytest.fixture(scope="module", autouse=True)
def offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")  # nothing is downloaded
        yield


@pytest.fixture(scope="module")
def setup(generated: dict[str, Path], tmp_path_factory: pytest.TempPathFactory, offline: None) -> dict:
    root = tmp_path_factory.mktemp("hf-dist")
    rows = toy_rows(85)
    args = [f"--model={pretrained_bert(root / 'bert', dropout=0.0)}",
            f"--data={write_csv(root / 'train.csv', rows[:80])}",
            f"--val_data={write_csv(root / 'val.csv', rows[80:])}"]
    workdir = root / "one"
    workdir.mkdir()
    result = run_train(generated["bert-sst2"], workdir, *SMALL, *args, "--run_name=one")
    assert result.returncode == 0, result.stderr
    return {"project": generated["bert-sst2"], "args": args, "ref": workdir}


def torchrun(project: Path, workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               str(project / "train.py"), "--device=cpu", *SMALL, *args]
    return subprocess.run(command, cwd=workdir, env={**checkout_env(), "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=400)


def same_run(metrics: list[dict], reference: list[dict]) -> None:
    assert [m["step"] for m in metrics] == [m["step"] for m in reference] == [1, 2, 3, 4]
    assert [m["loss"] for m in metrics] == pytest.approx([m["loss"] for m in reference], rel=1e-5)
    for key in ("val_loss", "accuracy", "f1"):
        assert [m.get(key) for m in metrics] == pytest.approx([m.get(key) for m in reference], rel=1e-5)


@pytest.mark.parametrize("args", [["--parallelism=fsdp", "--activation_checkpointing=true"], ["--parallelism=ddp"]],
                         ids=["fsdp-ac-2", "ddp-2"])
def test_two_ranks_match_one_process_and_resume_on_one(setup: dict, args: list[str], tmp_path: Path) -> None:
    result = torchrun(setup["project"], tmp_path, *setup["args"], *args, "--run_name=dist")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 FSDP units" in result.stdout and result.stdout.count("done: step 4") == 1
    reference = read_metrics(setup["ref"], "one")
    same_run(read_metrics(tmp_path, "dist"), reference)

    # save_pretrained gathered the (sharded) weights: the same model as one process's.
    ours = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "runs" / "dist" / "hf")
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(setup["ref"] / "runs" / "one" / "hf")
    for (name, a), (_, b) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)

    if "--parallelism=fsdp" in args:
        # Elastic: the 2-rank run's step-2 checkpoint resumes on one process.
        elastic = tmp_path / "runs" / "elastic" / "checkpoints"
        shutil.copytree(tmp_path / "runs" / "dist" / "checkpoints" / "step-2", elastic / "step-2")
        resumed = run_train(setup["project"], tmp_path, *SMALL, *setup["args"], "--run_name=elastic")
        assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr
        same_run(read_metrics(tmp_path, "dist")[:2] + read_metrics(tmp_path, "elastic"), reference)
