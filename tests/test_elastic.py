"""Elastic, crash-safe checkpoints, end to end: torchrun on CPU (gloo) and generated projects.

Launches are few and grouped (each torchrun start costs seconds on this machine):
- runtime level: saved on 2 ranks (FSDP2, and DDP with an asynchronous save), loaded on 3 ranks
  (FSDP2) and 1 process: the model, AdamW and an extra state entry (an EMA module) equal the
  saved state bitwise.
- a generated project (issue 4's "done when", smaller): 2 ranks to the end (the reference);
  2 ranks cut off after step 4, resumed on 2 ranks (bitwise equal losses and weights), and the
  same step-4 checkpoint resumed on 3 ranks to step 8 and on 1 process to the end (losses within
  a justified tolerance), every launch with the same `--parallelism=fsdp` (on one process: FSDP
  over a mesh of one rank); 2 ranks with `save_async` (bitwise equal: saving in the background
  changes nothing).
- kill -9 at random moments (and inside a save, between data and marker): each restart resumes
  from the newest complete checkpoint, and the finished run equals an uninterrupted one bitwise.
- damaged checkpoint, other model, missing load_path: one `error:` line, exit 2, nothing deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from projects import checkout_env, children, read_metrics

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "elastic_worker.py"
STOP_AFTER = TESTS / "stop_after.py"
# global_batch_size 12 divides by 1, 2 and 3 ranks.
SMALL = [
    "--device=cpu",
    "--seq_len=32",
    "--global_batch_size=12",
    "--device_microbatch_size=3",
    "--eval_batches=1",
    "--dist_timeout=120",
]
# Issue 4's scenario, smaller: 12 steps with a checkpoint every 4 (all kept).
ELASTIC = [
    "--max_duration=12ba",
    "--save_interval=4ba",
    "--eval_interval=4ba",
    "--save_num_checkpoints_to_keep=0",
]

# Losses after a world-size change differ from the uninterrupted run only by the order of
# floating-point reductions (FSDP's reduce-scatter over 2 vs 3 ranks, the loss all-reduce).
# Measured here: at most 3.2e-7 over 8 steps (one fp32 ulp of the summed loss, divided by the
# token count). 2e-5 is 60x that, yet 1000x below the smallest change of the loss between two
# steps of this run (~0.03): a wrong data cursor, a stale optimizer state or a restart from the
# wrong step moves the loss by far more than the tolerance (asserted below as well).
LOSS_TOLERANCE = 2e-5


def torchrun(
    nproc: int, *args: str, cwd: Path, timeout: int = 400
) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *map(str, args),
    ]
    return subprocess.run(
        command,
        cwd=cwd,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def python(
    *args: str, cwd: Path, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=cwd,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~250 kB of text: enough windows for every run here, quicker to load than the default."""
    source = Path(json.__file__).parent.parent
    text = "".join(
        (source / name).read_text()
        for name in ("argparse.py", "typing.py", "inspect.py")
    )
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text(text[:250_000])
    return path


def trajectory(workdir: Path, run: str) -> list[tuple]:
    return [
        (r["step"], r["loss"], r.get("val_loss")) for r in read_metrics(workdir, run)
    ]


def weights(workdir: Path, run: str, step: int) -> dict[str, torch.Tensor]:
    """A run's checkpoint, consolidated without a process group (the export path)."""
    from safetensors.torch import load_file

    from runtime.checkpoint import export_safetensors

    out = workdir / f"{run}-{step}.safetensors"
    export_safetensors(workdir / "runs" / run / "checkpoints" / f"step-{step}", out)
    return load_file(out)


# ---------------------------------------------------------------- runtime level


def test_saved_state_comes_back_bitwise_on_any_world_size(tmp_path: Path) -> None:
    """FSDP2 and DDP on 2 ranks -> FSDP2 on 3 ranks and one process: model, AdamW and EMA exact."""
    ok(torchrun(2, WORKER, "save", tmp_path, cwd=tmp_path))
    assert all(
        (tmp_path / run / "step-3" / "COMPLETE").is_file() for run in ("fsdp", "ddp")
    )
    assert sorted(
        p.name for p in (tmp_path / "fsdp" / "step-3").glob("rng-rank*.pt")
    ) == ["rng-rank0.pt", "rng-rank1.pt"]
    assert (
        "identical on 3 rank(s) (fsdp)"
        in ok(torchrun(3, WORKER, "load", tmp_path, cwd=tmp_path)).stdout
    )
    assert (
        "identical on 1 rank(s) (none)"
        in ok(python(WORKER, "load", tmp_path, cwd=tmp_path)).stdout
    )


# ---------------------------------------------------------------- generated project


def test_generated_project_resumes_bitwise_and_elastically(
    generated: dict[str, Path], tmp_path: Path, corpus: Path
) -> None:
    """Issue 4's done-when: 2 ranks to step 4, then 3 ranks to step 8, then 1 rank to the end,
    all with the same command line (`--parallelism=fsdp` included, also on one process).
    """
    train = generated["gpt2-speedup"] / "train.py"
    common = [*SMALL, *ELASTIC, f"--data={corpus}", "--parallelism=fsdp"]
    ok(torchrun(2, train, *common, "--run_name=ref", cwd=tmp_path))
    reference = trajectory(tmp_path, "ref")
    assert [step for step, *_ in reference] == list(range(1, 13))

    # Cut off after the step-4 checkpoint, as a preempted 2-rank job.
    ok(torchrun(2, STOP_AFTER, 4, train, *common, "--run_name=elastic", cwd=tmp_path))
    assert trajectory(tmp_path, "elastic") == reference[:4]
    shutil.copytree(tmp_path / "runs" / "elastic", tmp_path / "runs" / "same")

    # Same world size: bitwise, losses and weights.
    same = ok(torchrun(2, train, *common, "--run_name=same", cwd=tmp_path))
    assert "resumed from runs/same/checkpoints/step-4 at step 4" in same.stdout
    assert "re-seeded" not in same.stdout  # RNG restored exactly
    assert trajectory(tmp_path, "same") == reference
    ref_weights, same_weights = weights(tmp_path, "ref", 12), weights(
        tmp_path, "same", 12
    )
    assert ref_weights.keys() == same_weights.keys()
    assert all(torch.equal(ref_weights[k], same_weights[k]) for k in ref_weights)

    # Elastic: 3 ranks to step 8, then one process to the end.
    three = ok(
        torchrun(3, STOP_AFTER, 8, train, *common, "--run_name=elastic", cwd=tmp_path)
    )
    assert (
        "resumed from runs/elastic/checkpoints/step-4 at step 4 (saved on 2 rank(s), now 3)"
        in three.stdout
    )
    assert "RNG re-seeded from (seed, step, rank)" in three.stdout
    one = ok(python(train, *common, "--run_name=elastic", cwd=tmp_path))
    assert "at step 8 (saved on 3 rank(s), now 1)" in one.stdout
    assert "parallelism: fsdp, 1 process(es)" in one.stdout
    elastic = trajectory(tmp_path, "elastic")
    assert [step for step, *_ in elastic] == list(range(1, 13))  # each step logged once
    assert elastic[:4] == reference[:4]
    for (step, loss, val), (_, ref_loss, ref_val) in zip(
        elastic, reference, strict=True
    ):
        assert abs(loss - ref_loss) <= LOSS_TOLERANCE, (step, loss, ref_loss)
        assert (val is None) == (ref_val is None) and abs(
            (val or 0) - (ref_val or 0)
        ) <= LOSS_TOLERANCE
    steps = [loss for _, loss, _ in reference]
    assert (
        min(abs(a - b) for a, b in zip(steps, steps[1:])) > 100 * LOSS_TOLERANCE
    )  # a meaningful bound
    elastic_weights = weights(tmp_path, "elastic", 12)
    assert (
        max(
            (elastic_weights[k] - ref_weights[k]).abs().max().item()
            for k in ref_weights
        )
        < 1e-4
    )

    # Asynchronous saves change nothing about training, and every checkpoint is complete.
    asynchronous = ok(
        torchrun(
            2, train, *common, "--run_name=async", "--save_async=true", cwd=tmp_path
        )
    )
    assert "done: step 12" in asynchronous.stdout
    assert trajectory(tmp_path, "async") == reference
    folder = tmp_path / "runs" / "async" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["step-12", "step-4", "step-8"]
    assert all((p / "COMPLETE").is_file() for p in folder.iterdir())
    async_weights = weights(tmp_path, "async", 8)
    assert all(
        torch.equal(async_weights[k], v) for k, v in weights(tmp_path, "ref", 8).items()
    )


# ---------------------------------------------------------------- kill -9


def complete_steps(folder: Path) -> list[int]:
    return sorted(
        int(p.name.removeprefix("step-"))
        for p in folder.glob("step-*")
        if (p / "COMPLETE").is_file()
    )


def kill_trials(
    project: Path, workdir: Path, trials: int, seed: int, nproc: int = 1
) -> dict[str, int]:
    """Start, kill -9 at a random moment, check, restart; until `trials` kills were made.

    Every run must end with exactly the reference trajectory (so no step was lost or logged
    twice), and each restart must resume from the newest complete checkpoint there was.
    """
    rng = random.Random(seed)
    common = [
        *SMALL,
        "--max_duration=16ba",
        "--save_interval=1ba",
        "--eval_interval=8ba",
        "--save_num_checkpoints_to_keep=2",
        f"--data={workdir / 'corpus.txt'}",
    ]
    launch = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
        ]
        if nproc > 1
        else [sys.executable]
    )
    reference = subprocess.run(
        [*launch, str(project / "train.py"), *common, "--run_name=reference"],
        cwd=workdir,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    ok(reference)
    expected = trajectory(workdir, "reference")
    stats = {"kills": 0, "in_save": 0, "runs": 0}
    run, expect_resume = None, None
    deadline = time.monotonic() + 240 + 40 * trials
    while stats["kills"] < trials:
        assert time.monotonic() < deadline, stats
        if run is None:
            stats["runs"] += 1
            run, expect_resume = f"killed{stats['runs']}", None
        folder = workdir / "runs" / run / "checkpoints"
        args = [str(project / "train.py"), *common, f"--run_name={run}"]
        in_save = stats["kills"] % 5 == 2 and complete_steps(
            folder
        )  # some kills inside a save
        if in_save:
            args = [str(STOP_AFTER), f"kill:{max(complete_steps(folder)) + 1}", *args]
        log = workdir / f"{run}-{stats['kills']}.log"
        with open(log, "w") as out:
            process = subprocess.Popen(
                [*launch, *args],
                cwd=workdir,
                env=checkout_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        metrics = workdir / "runs" / run / "metrics.jsonl"
        logged = len(metrics.read_text().splitlines()) if metrics.exists() else 0
        # Wait for this launch to take a step, then kill it a random moment later.
        while process.poll() is None and not in_save:
            if metrics.exists() and len(metrics.read_text().splitlines()) > logged:
                time.sleep(rng.uniform(0.0, 0.6))
                break
            time.sleep(0.02)
        if not in_save and process.poll() is None:
            # The launcher and every rank: torchrun's workers have sessions of their own, so
            # killing its group alone leaves them training (and holding the run's lock).
            workers = children(process.pid) if nproc > 1 else []
            os.killpg(process.pid, signal.SIGKILL)
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        process.wait(timeout=300)
        text = log.read_text()
        if expect_resume is not None:
            assert f"resumed from {expect_resume} " in text, text[-3000:]
        if process.returncode == 0:  # finished before the kill: this run is done
            assert trajectory(workdir, run) == expected
            run = None
            continue
        stats["kills"] += 1
        stats["in_save"] += any(
            not (p / "COMPLETE").is_file() for p in folder.glob("step-*")
        )
        steps = complete_steps(folder)
        expect_resume = (
            folder.relative_to(workdir) / f"step-{steps[-1]}" if steps else None
        )
    # Finish the last run and compare it with the uninterrupted one.
    if run is not None:
        result = subprocess.run(
            [*launch, str(project / "train.py"), *common, f"--run_name={run}"],
            cwd=workdir,
            env=checkout_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        ok(result)
        if expect_resume is not None:
            assert f"resumed from {expect_resume} " in result.stdout
        assert trajectory(workdir, run) == expected
    return stats


@pytest.mark.slow  # 2 minutes; every run kills -9 in test_catalog_resume, test_image and others
def test_kill_9_at_random_moments_loses_nothing(
    generated: dict[str, Path], tmp_path: Path, corpus: Path
) -> None:
    shutil.copy(corpus, tmp_path / "corpus.txt")
    trials = 30
    stats = kill_trials(generated["gpt2-speedup"], tmp_path, trials, seed=trials)
    print(stats)
    assert stats["kills"] == trials and stats["in_save"] >= 2, stats


@pytest.mark.slow
def test_kill_9_under_torchrun(
    generated: dict[str, Path], tmp_path: Path, corpus: Path
) -> None:
    shutil.copy(corpus, tmp_path / "corpus.txt")
    stats = kill_trials(generated["gpt2-speedup"], tmp_path, 6, seed=2, nproc=2)
    assert stats["kills"] == 6, stats


# ---------------------------------------------------------------- errors


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file but run.lock (each start that gets the lock writes its pid there)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != "run.lock"
    }


def error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-4000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-4000:]
    return lines[0]


def test_bad_checkpoints_fail_clearly_and_delete_nothing(
    generated: dict[str, Path], tmp_path: Path, corpus: Path
) -> None:
    speedup, baseline = (
        generated["gpt2-speedup"] / "train.py",
        generated["gpt2-baseline"] / "train.py",
    )
    common = [*SMALL, "--max_duration=2ba", "--save_interval=1ba", f"--data={corpus}"]
    ok(python(speedup, *common, "--run_name=good", cwd=tmp_path))
    ok(python(baseline, *common, "--run_name=other", cwd=tmp_path))
    runs = tmp_path / "runs"
    before = snapshot(runs)

    line = error_line(
        python(
            speedup, *common, "--run_name=x", "--load_path=runs/nowhere", cwd=tmp_path
        )
    )
    assert "runs/nowhere does not exist" in line

    # A checkpoint of another model (learned positions: wpe) into the ALiBi model: keys named.
    line = error_line(
        python(speedup, *common, "--run_name=x", "--load_path=runs/other", cwd=tmp_path)
    )
    assert (
        "different model" in line
        and "wpe.weight" in line
        and "in the checkpoint but not in this model" in line
    )

    # A truncated shard in a checkpoint named as load_path: the file is named, exit 2,
    # nothing deleted (an explicit checkpoint is never swapped for another).
    newest = runs / "good" / "checkpoints" / "step-2"
    shard = sorted(newest.glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    truncated = snapshot(runs)
    explicit = ["--run_name=x", f"--load_path={newest}"]
    line = error_line(python(speedup, *common, *explicit, cwd=tmp_path))
    assert f"{shard} is truncated" in line and "load_path" in line
    # A corrupted one (same size, garbage header): named as well.
    shard.write_bytes(b"\0" * 64 + data[64:])
    line = error_line(python(speedup, *common, *explicit, cwd=tmp_path))
    assert f"{shard} is unreadable" in line
    shard.write_bytes(data[: len(data) // 2])
    assert (
        snapshot(runs) == truncated
    )  # no checkpoint deleted or changed by the failed loads
    assert before.keys() == truncated.keys()

    # The run resuming on its own: one line names the damaged newest checkpoint and why,
    # it resumes from the previous one (kept until then), and its save of step 2
    # replaces the damaged one with a readable one: the same loss as before.
    first = {r["step"]: r["loss"] for r in read_metrics(tmp_path, "good")}
    shard.write_bytes(b"\0" * 64 + data[64:])
    result = ok(python(speedup, *common, "--run_name=good", cwd=tmp_path))
    skipped = [x for x in result.stdout.splitlines() if "damaged checkpoint" in x]
    assert len(skipped) == 1 and f"{newest.relative_to(tmp_path)}" in skipped[0]
    assert "is unreadable" in skipped[0] and "kept" in skipped[0]
    assert "checkpoints/step-1 at step 1" in result.stdout
    assert (newest / "COMPLETE").is_file() and shard.read_bytes() != b"\0" * 64 + data[
        64:
    ]
    again = {r["step"]: r["loss"] for r in read_metrics(tmp_path, "good")}
    assert again == first
