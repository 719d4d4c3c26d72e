"""Release 0.2.0 -> this version: every shipped recipe trains the same losses, a 0.2.0
project with a hand edit upgrades keeping it, and a 0.2.0 checkpoint resumes.

The 0.2.0 projects are rendered from the templates of the commit released as 0.2.0 and
trained with that commit's own runtime, so the comparison is with what 0.2.0 ran.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import RECIPES
from projects import REPO, checkout_env, read_metrics
from scaffold import __version__
from scaffold.history import TemplateRelease
from scaffold.render import commit_all, new_project
from scaffold.upgrade import upgrade

RELEASE_0_2_0 = "e505f85f8df8c7d945cd7d7096dac869c9ada644"  # the last commit of 0.2.0
STEPS = 12
# Settings that let every recipe take 12 steps in seconds on the embedded data (the
# ImageNet recipes' global batch exceeds the 1,437 training digits, as README says).
FAST = {
    "image_classification": ["--global_batch_size=256", "--device_microbatch_size=128",
                             "--bn_group_size=32", "--precision=fp32"],
}
# One recipe per task, each with most of its task's algorithms, in every run; all of them
# with --slow.
EVERY_RUN = ("gpt2-modern", "resnet50-hot", "bert-sst2-speedup")
# The relative difference allowed where the arithmetic moved (e.g. a loop moved into a
# function): none was needed so far, the losses are bitwise equal.
RELATIVE = 1e-6


def source_at(commit: str, dest: Path, *folders: str) -> Path:
    """`folders` of this repository at `commit`, extracted under `dest`."""
    found = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True)
    if found.returncode != 0:
        pytest.skip(f"this checkout's git history lacks release commit {commit[:7]} (a shallow clone?)")
    archive = subprocess.run(["git", "archive", "--format=tar", commit, *folders], cwd=REPO,
                             capture_output=True, check=True)
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def task_of(project: Path) -> str:
    return yaml.safe_load((project / ".copier-answers.yml").read_text())["task"]


def train(project: Path, workdir: Path, runtime_root: Path, *args: str, stop_after: int = 0) -> list[dict]:
    """12 steps of `project` on the CPU, importing `runtime` from `runtime_root`; with
    `stop_after`, the run stops right after saving that step (tests/stop_after.py)."""
    workdir.mkdir(parents=True)
    env = {**checkout_env(), "PYTHONPATH": str(runtime_root), "OMP_NUM_THREADS": "1"}
    stop = [str(REPO / "tests" / "stop_after.py"), str(stop_after)] if stop_after else []
    command = [sys.executable, *stop, str(project / "train.py"), "--device=cpu", "--run_name=r",
               f"--max_duration={STEPS}ba", "--eval_interval=6ba", "--save_interval=6ba",
               *FAST.get(task_of(project), []), *args]
    result = subprocess.run(command, cwd=workdir, env=env, capture_output=True, text=True,
                            timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(workdir, "r")


@pytest.fixture(scope="module")
def release_0_2_0(tmp_path_factory: pytest.TempPathFactory) -> tuple[TemplateRelease, Path]:
    """(0.2.0's templates as a release, a folder holding 0.2.0's runtime package)."""
    root = source_at(RELEASE_0_2_0, tmp_path_factory.mktemp("release-0.2.0"), "templates", "runtime")
    return TemplateRelease(root / "templates", "0.2.0"), root


def compared(rows: list[dict]) -> list[tuple[int, str, float]]:
    keys = ("loss", "val_loss", "val_top1", "accuracy")
    return [(row["step"], key, row[key]) for row in rows for key in keys if key in row]


@pytest.mark.parametrize("recipe", [
    pytest.param(name, marks=() if name in EVERY_RUN else pytest.mark.slow) for name in RECIPES
])
def test_every_recipe_trains_the_losses_of_0_2_0(recipe: str, release_0_2_0, tmp_path: Path) -> None:
    old_release, old_runtime = release_0_2_0
    old = tmp_path / "old" / "p"
    new = tmp_path / "new" / "p"
    new_project(recipe, old, [], release=old_release)
    new_project(recipe, new, [])
    before = compared(train(old, tmp_path / "run-old", old_runtime))
    after = compared(train(new, tmp_path / "run-new", REPO))
    assert [(step, key) for step, key, _ in after] == [(step, key) for step, key, _ in before]
    for (step, key, value), (_, _, reference) in zip(after, before):
        assert abs(value - reference) <= RELATIVE * abs(reference), (recipe, step, key, value, reference)


HAND_EDIT = (
    "            batch = batch.to(env.device, non_blocking=True)\n",
    "            batch = batch.to(env.device, non_blocking=True)  # hand edit\n",
)


def test_a_0_2_0_project_with_a_hand_edit_upgrades_and_resumes_its_checkpoint(
    release_0_2_0, tmp_path: Path
) -> None:
    """A gpt2-speedup project of 0.2.0, edited and trained (a checkpoint at step 6 of 12):
    `scaffold upgrade` keeps the edit with no conflict, the files equal a fresh render plus
    the edit, and the upgraded project resumes 0.2.0's checkpoint and ends where the 0.2.0
    project ended, bitwise."""
    old_release, old_runtime = release_0_2_0
    project = tmp_path / "my-gpt"
    new_project("gpt2-speedup", project, [], release=old_release)
    train_py = project / "train.py"
    assert train_py.read_text().count(HAND_EDIT[0]) == 1
    train_py.write_text(train_py.read_text().replace(*HAND_EDIT))
    commit_all(project, "hand edit")
    reference = train(project, tmp_path / "uninterrupted", old_runtime)
    # 0.2.0 trains 6 of the 12 steps and saves; the upgraded project finishes the run.
    work = tmp_path / "work"
    train(project, work, old_runtime, stop_after=6)
    (work / "runs" / "r" / "metrics.jsonl").unlink()

    result = upgrade(project)

    assert result.old_version == "0.2.0" and result.new_version == __version__
    assert result.changes.conflicted == []
    assert HAND_EDIT[1] in train_py.read_text()
    fresh = tmp_path / "fresh" / "my-gpt"
    new_project("gpt2-speedup", fresh, [])
    assert train_py.read_text() == (fresh / "train.py").read_text().replace(*HAND_EDIT)
    env = {**checkout_env(), "OMP_NUM_THREADS": "1"}
    resumed = subprocess.run(
        [sys.executable, str(train_py), "--device=cpu", "--run_name=r", f"--max_duration={STEPS}ba",
         "--eval_interval=6ba", "--save_interval=6ba"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step-6" in resumed.stdout
    tail = [row for row in reference if row["step"] > 6]
    assert compared(read_metrics(work, "r")) == compared(tail)
