"""Helpers to import and run the modules of a generated project from the tests."""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import pytest

PROJECT_MODULES = ("train", "model", "data", "sample")
REPO = Path(__file__).resolve().parent.parent


def checkout_env() -> dict[str, str]:
    """The environment for subprocesses: generated projects import *this* checkout's runtime."""
    path = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p
    )
    return {**os.environ, "PYTHONPATH": path}


@contextmanager
def project_modules(project: Path) -> Iterator[dict[str, ModuleType]]:
    """Import a generated project's train/model/data modules (fresh, and forgotten afterwards)."""
    saved = {
        name: sys.modules.pop(name) for name in PROJECT_MODULES if name in sys.modules
    }
    sys.path.insert(0, str(project))
    try:
        yield {
            name: importlib.import_module(name)
            for name in PROJECT_MODULES
            if (project / f"{name}.py").is_file()  # sample.py: language models only
        }
    finally:
        sys.path.remove(str(project))
        for name in PROJECT_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def real_library(name: str) -> ModuleType:
    """The real library `name` (no stand-in). CI installs every one (.ci/run), so there a
    missing one fails the test module; elsewhere its tests are skipped, saying why."""
    if os.environ.get("CI"):
        return importlib.import_module(name)
    return pytest.importorskip(
        name, reason=f"{name} is not installed here: README's test command installs it"
    )


def run_train(
    project: Path, workdir: Path, *args: str, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """`python train.py ARGS` in `workdir` (runs/ lands there), on the CPU."""
    return subprocess.run(
        [sys.executable, str(project / "train.py"), "--device=cpu", *args],
        cwd=workdir,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


TRAIN_MANY = Path(__file__).resolve().parent / "train_many.py"


def run_train_many(
    runs: dict[str, tuple[Path, Path, list[str]]],
    timeout: int = 300,
    script: str = "train.py",
) -> dict[str, subprocess.CompletedProcess[str]]:
    """`python train.py ARGS` (or another of the project's scripts) in `workdir` (on the
    CPU) for each name: (project, workdir, args), in that order, all in one interpreter
    (tests/train_many.py): for runs that stop in setup, whose cost is mostly importing
    torch. What each would have returned alone.
    """
    jobs_dir = Path(tempfile.mkdtemp(prefix="train-many."))
    jobs = [
        [
            str(project / script),
            str(workdir),
            ["--device=cpu", *args],
            str(jobs_dir / name),
        ]
        for name, (project, workdir, args) in runs.items()
    ]
    (jobs_dir / "jobs.json").write_text(json.dumps(jobs))
    driver = subprocess.run(
        [sys.executable, str(TRAIN_MANY), str(jobs_dir / "jobs.json")],
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout * len(jobs),
    )
    assert driver.returncode == 0, driver.stdout[-3000:] + driver.stderr[-3000:]
    results = {
        name: subprocess.CompletedProcess(
            ["train.py", *args],
            int((jobs_dir / f"{name}.code").read_text()),
            (jobs_dir / f"{name}.out").read_text(),
            (jobs_dir / f"{name}.err").read_text(),
        )
        for name, (_, _, args) in runs.items()
    }
    shutil.rmtree(jobs_dir)
    return results


def run_train_apart(
    project: Path, root: Path, runs: dict[str, list[str]], script: str = "train.py"
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """`python train.py ARGS` (or `script`) of `project` for each name: ARGS in `runs`,
    each in its own new working folder root/NAME, all in one interpreter
    (run_train_many): for checks of runs that stop in setup. Each name: (its working
    folder, what the run returned)."""
    for name in runs:
        (root / name).mkdir(parents=True)
    results = run_train_many(
        {name: (project, root / name, args) for name, args in runs.items()},
        script=script,
    )
    return {name: (root / name, results[name]) for name in runs}


STOP_AFTER = Path(__file__).resolve().parent / "stop_after.py"


def run_killed(
    project: Path, workdir: Path, step: int, *args: str, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """`python train.py ARGS` on the CPU, killed (-9) inside its save of `step`
    (tests/stop_after.py): files on disk, no COMPLETE marker."""
    command = [
        sys.executable,
        str(STOP_AFTER),
        f"kill:{step}",
        str(project / "train.py"),
    ]
    return subprocess.run(
        [*command, "--device=cpu", *args],
        cwd=workdir,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def convert_data(project: Path, output: Path, *args: str) -> None:
    """`python data.py convert OUTPUT ARGS` in a generated project: it succeeds."""
    result = subprocess.run(
        [sys.executable, "data.py", "convert", str(output), *args],
        cwd=project,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith(f"wrote a streaming dataset to {output}")


def one_error_line(result: subprocess.CompletedProcess[str], workdir: Path) -> str:
    """Exit 2, a single `error:` line on stderr, and no run folder written."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not (workdir / "runs").exists()
    return lines[0]


def error_lines(
    project: Path, root: Path, runs: dict[str, list[str]]
) -> dict[str, str]:
    """train.py with each name's ARGS (in `runs`), each in its own folder under `root`,
    in one interpreter (run_train_apart): each refused with one error line, exit 2,
    nothing written. Each name: its error line."""
    results = run_train_apart(project, root, runs)
    return {
        name: one_error_line(result, workdir)
        for name, (workdir, result) in results.items()
    }


def assert_same_series(ours: list, theirs: list, rel: float, what: str = "") -> None:
    """`ours` equals `theirs` within `rel`, with None (not logged at that step) in the same
    places: pytest.approx refuses None as an expected value (pytest >= 9.2)."""
    assert [v is None for v in ours] == [v is None for v in theirs], (
        what,
        ours,
        theirs,
    )
    assert [v for v in ours if v is not None] == pytest.approx(
        [v for v in theirs if v is not None], rel=rel
    ), what


def read_metrics(workdir: Path, run_name: str) -> list[dict]:
    path = workdir / "runs" / run_name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


# A tiny 2-rank run (each step a few hundred ms here): the reference for pre-emption tests.
TINY = [
    "--device=cpu",
    "--model=tiny",
    "--seq_len=32",
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--eval_interval=1000ba",
    "--eval_batches=1",
    "--dist_timeout=60",
    "--save_interval=1000ba",
]
TINY_STEPS = 10
# llm_finetune's tiny Llama on 4 packed rows of Python's documentation Q&A per step.
# Tiny, offline runs of the text classifier and of the diffusion task (tiny UNet and VAE;
# v-prediction, which zero_terminal_snr requires), for tests that train every algorithm.
TEXT_CLASSIFICATION_TINY = [
    "--model=tiny",
    "--max_seq_len=16",
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--eval_batches=1",
]
DIFFUSION_TINY = [
    "--model=tiny",
    "--tiny_vae_steps=5",
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--eval_batches=1",
    "--eval_timesteps=2",
    "--samples_per_prompt=1",
    "--sample_steps=2",
    "--prediction_type=v_prediction",
]
LLM_TINY = [
    "--model=tiny",
    "--seq_len=64",
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--eval_batches=1",
]


def torchrun_command(project: Path, nproc: int, *args: str) -> list[str]:
    """`torchrun --standalone --nproc_per_node=N train.py` with the TINY settings."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(project / "train.py"),
        *TINY,
        f"--max_duration={TINY_STEPS}ba",
        *args,
    ]


def torchrun(
    workdir: Path, nproc: int, *args: object, restarts: int = 0, timeout: int = 300
) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc_per_node=N --max-restarts=R ARGS` in `workdir`."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            f"--max-restarts={restarts}",
            *map(str, args),
        ],
        cwd=workdir,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_workers(workdir: Path, run_name: str) -> list[int]:
    """Pids of the processes training `run_name` in `workdir` (torchrun's workers, not torchrun)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            if Path(os.readlink(entry / "cwd")) != workdir.resolve():
                continue
        except (OSError, ValueError):
            continue
        if (
            f"--run_name={run_name}" in argv
            and any(a.endswith("train.py") for a in argv)
            and not any(
                "torchrun" in a or a.endswith("torch.distributed.run") for a in argv
            )
            and "torch.distributed.run" not in argv
        ):
            found.append(int(entry.name))
    return sorted(found)


def pending_signals(pid: int) -> int:
    """The signals waiting to be delivered to `pid` (a bit mask, bit N-1 for signal N)."""
    status = Path(f"/proc/{pid}/status").read_text()
    masks = [
        int(line.split()[1], 16)
        for line in status.splitlines()
        if line.startswith(("SigPnd:", "ShdPnd:"))
    ]
    return masks[0] | masks[1]


def children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (torchrun's workers)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def running(pid: int) -> bool:
    """A process that exists and is not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def hand_counted_forward_flops(model, *args, **kwargs) -> int:
    """FLOPs of one forward counted by hand, independently of torch's FLOP counter: 2 per
    multiply-add of every nn.Conv2d and nn.Linear, from the shapes they actually saw."""
    import torch

    total = 0

    def count(module, inputs, output) -> None:
        nonlocal total
        if isinstance(module, torch.nn.Conv2d):
            per_output = (
                module.in_channels
                // module.groups
                * module.kernel_size[0]
                * module.kernel_size[1]
            )
            total += 2 * output.numel() * per_output
        else:
            total += 2 * output.numel() * module.in_features

    hooks = [
        m.register_forward_hook(count)
        for m in model.modules()
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))
    ]
    try:
        with torch.no_grad():
            model.eval()(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return total


def source_at(commit: str, dest: Path, *folders: str) -> Path:
    """`folders` of this repository at `commit`, extracted under `dest`."""
    found = subprocess.run(
        ["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True
    )
    if found.returncode != 0:
        pytest.skip(
            f"this checkout's git history lacks release commit {commit[:7]} (a shallow clone?)"
        )
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, *folders],
        cwd=REPO,
        capture_output=True,
        check=True,
    )
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest
