"""Releases 0.2.0 and 0.3.0 -> this version: every recipe a release shipped trains the
same losses, a project of the release with a hand edit upgrades keeping it, and the
release's checkpoint resumes.

A release's projects are rendered from the templates of the commit released as that
version and trained with that commit's own runtime, so the comparison is with what the
release ran.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import pytest
import yaml
from packaging.version import Version

from conftest import RECIPES
from projects import REPO, checkout_env, read_metrics, source_at
from scaffold import __version__
from scaffold.history import TemplateRelease
from scaffold.render import commit_all, installed_release, new_project, render
from scaffold.upgrade import upgrade

STEPS = 12
# Settings that let every recipe take 12 steps in seconds on the embedded data (the
# ImageNet recipes' global batch exceeds the 1,437 training digits, as README says).
FAST = {
    "image_classification": [
        "--global_batch_size=256",
        "--device_microbatch_size=128",
        "--bn_group_size=32",
        "--precision=fp32",
        # 0.2.0's loop cannot put the ImageNet recipes' 8ep warm-up against 12ba (this
        # one converts it, runtime.time.as_fraction): both sides warm up the same way.
        "--lr_warmup=0.25dur",
    ],
}
# The arithmetic moved once: AdamW's update is one fused kernel on the CPU too (0.2.0's
# and 0.3.0's ran per tensor there), which rounds differently (parameters within 1.5e-8
# after 10 steps): losses within a relative 1e-6, where they were bitwise equal before.
RELATIVE = 1e-6


@dataclass(frozen=True)
class Release:
    """A published release: its commit, and how this version trains what it trained."""

    version: str
    commit: str
    # New options whose defaults change what a recipe trains, set back to the release's
    # behaviour on the new side (the release's loop does not know the flags).
    since: dict[str, list[str]]
    # One recipe per task, each with most of its task's algorithms, in every run; all of
    # them with --slow.
    every_run: tuple[str, ...]
    # Settings given to both sides where this version deliberately fixed what the release
    # trained and no option brings the release's behaviour back: the comparison then
    # covers the rest of the recipe.
    both: dict[str, list[str]] = field(default_factory=dict)
    # Recipes whose runs at the release do not repeat (why): nothing to compare with.
    unrepeatable: dict[str, str] = field(default_factory=dict)

    @cached_property
    def recipes(self) -> frozenset[str]:
        """The recipes the release had (its golden trees hold their answers); newer ones
        have nothing to compare with."""
        return frozenset(
            git_out("ls-tree", "--name-only", f"{self.commit}:tests/golden")
        )

    def recorded_answers(self, recipe: str) -> dict:
        """The answers the release recorded for `recipe` (its golden tree's)."""
        recorded = "\n".join(
            git_out("show", f"{self.commit}:tests/golden/{recipe}/.copier-answers.yml")
        )
        return yaml.safe_load(recorded)


def git_out(*args: str) -> list[str]:
    """The lines git prints for `args` in this repository."""
    return subprocess.run(
        ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()


RELEASE_0_2_0 = Release(
    "0.2.0",
    "e505f85f8df8c7d945cd7d7096dac869c9ada644",  # the last commit of 0.2.0
    # ALiBi's train_sequence_length_scaling (Composer's default 0.25; 0.2.0 trained full
    # rows) and RandAugment's augmentation_set (Composer's default "all"; 0.2.0 drew
    # "original"'s factors); layer freezing's units (Composer's leaves; 0.2.0 froze blocks).
    since={
        "bert-sst2-speedup": ["--layer_freezing_units=blocks"],
        "gpt2-speedup": ["--alibi_train_sequence_length_scaling=1"],
        "resnet50-hot": ["--randaugment_augmentation_set=original"],
    },
    every_run=("gpt2-modern", "resnet50-hot", "bert-sst2-speedup"),
)
RELEASE_0_3_0 = Release(
    "0.3.0",
    "25435ca71a3a472c8e9015a4812d7e992845c4cc",  # the last commit of 0.3.0
    # gpt2-speedup trains ALiBi's full-length rows since 23f25a0 (0.3.0 took Composer's
    # 0.25); layer freezing's units are Composer's leaves since 9d9fe39 (0.3.0 froze
    # blocks). Set back, both recipes agree within RELATIVE (measured: 1.2e-7 and 1.1e-8,
    # the fused AdamW update).
    since={
        "bert-sst2-speedup": ["--layer_freezing_units=blocks"],
        "gpt2-speedup": ["--alibi_train_sequence_length_scaling=0.25"],
    },
    # New in 0.3.0 or not in 0.2.0's list: one per task, the cheap ones.
    every_run=("gpt2-speedrun", "cifar-resnet56-medium", "mosaicbert-sst2"),
    # RandAugment's set "all" draws brightening factors x 0.75 and translate_y up to a
    # third of the height since 86b7d9f, as Composer's augmentation_primitives (0.3.0 drew
    # them as "original"'s: a fix, with no option to undo it). With "original" on both
    # sides resnet50-hot trains 0.3.0's losses bitwise (measured).
    both={"resnet50-hot": ["--randaugment_augmentation_set=original"]},
    unrepeatable=dict.fromkeys(
        ("bert-pretrain-baseline", "mosaicbert"),
        # Measured: three runs of 0.3.0's bert-pretrain-baseline, same commit and flags,
        # each in a fresh folder, logged step-1 losses of 8.2986, 8.3052 and 8.3053. The
        # WordPiece vocabulary 0.3.0 trains differs from process to process (tokenizers'
        # trainer breaks ties by numbers it hands out in HashMap order, tokenizers#1794;
        # 5 of 4,096 tokens differed); this version gives the trainer those numbers, and
        # test_masked_lm checks that two processes train one vocabulary.
        "0.3.0 trained another WordPiece vocabulary in each fresh folder",
    ),
)
RELEASES = (RELEASE_0_2_0, RELEASE_0_3_0)


@dataclass(frozen=True)
class Extracted:
    """A release's templates, held in the template history under its version, and a
    folder holding its runtime package."""

    release: Release
    templates: TemplateRelease
    runtime: Path

    def generate(self, recipe: str, dest: Path) -> Path:
        """`recipe` as the release generated it: its recorded answers rendered from its
        templates (this scaffold's catalog code reads today's packs only)."""
        answers = {
            key: value
            for key, value in self.release.recorded_answers(recipe).items()
            if not key.startswith("_")
        }
        answers["project_name"] = dest.name
        render(answers, dest, self.templates)
        commit_all(dest, f"generated by scaffold {self.release.version}")
        return dest


@pytest.fixture(scope="module")
def extracted(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Extracted]]:
    """Every release, by version. The module has a template history of its own, where each
    release's tag holds that release's templates, as on a machine that installed them:
    this checkout's templates, which still declare version 0.3.0, render under a
    development version (`0.3.0+dev.HASH`) there."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
        releases = {}
        for release in RELEASES:
            root = tmp_path_factory.mktemp(f"release-{release.version}")
            source_at(release.commit, root, "templates", "runtime")
            templates = TemplateRelease(root / "templates", release.version)
            assert templates.prepare_history() == release.version
            releases[release.version] = Extracted(release, templates, root)
        yield releases


def task_of(project: Path) -> str:
    return yaml.safe_load((project / ".copier-answers.yml").read_text())["task"]


def train(
    project: Path, workdir: Path, runtime_root: Path, *args: str, stop_after: int = 0
) -> list[dict]:
    """12 steps of `project` on the CPU, importing `runtime` from `runtime_root`; with
    `stop_after`, the run stops right after saving that step (tests/stop_after.py)."""
    workdir.mkdir(parents=True)
    env = {**checkout_env(), "PYTHONPATH": str(runtime_root), "OMP_NUM_THREADS": "1"}
    stop = (
        [str(REPO / "tests" / "stop_after.py"), str(stop_after)] if stop_after else []
    )
    command = [
        sys.executable,
        *stop,
        str(project / "train.py"),
        "--device=cpu",
        "--run_name=r",
        f"--max_duration={STEPS}ba",
        "--eval_interval=6ba",
        "--save_interval=6ba",
        *FAST.get(task_of(project), []),
        *args,
    ]
    result = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return read_metrics(workdir, "r")


def compared(rows: list[dict]) -> list[tuple[int, str, float]]:
    keys = ("loss", "val_loss", "val_top1", "accuracy")
    return [(row["step"], key, row[key]) for row in rows for key in keys if key in row]


def assert_same_losses(after: list[dict], before: list[dict], *where: object) -> None:
    """The same logged metrics at the same steps, within RELATIVE."""
    after_, before_ = compared(after), compared(before)
    assert [(step, key) for step, key, _ in after_] == [
        (step, key) for step, key, _ in before_
    ]
    for (step, key, value), (_, _, reference) in zip(after_, before_):
        assert abs(value - reference) <= RELATIVE * abs(reference), (
            *where,
            step,
            key,
            value,
            reference,
        )


@pytest.mark.parametrize(
    "release, recipe",
    [
        pytest.param(
            release,
            name,
            id=f"{release.version}-{name}",
            marks=(
                pytest.mark.skip(reason=release.unrepeatable[name])
                if name in release.unrepeatable
                else () if name in release.every_run else pytest.mark.slow
            ),
        )
        for release in RELEASES
        for name in RECIPES
        if name in release.recipes
    ],
)
def test_every_recipe_trains_the_losses_of_each_release(
    release: Release, recipe: str, extracted: dict[str, Extracted], tmp_path: Path
) -> None:
    old_release = extracted[release.version]
    old = old_release.generate(recipe, tmp_path / "old" / "p")
    new = tmp_path / "new" / "p"
    new_project(recipe, new, [])
    both = release.both.get(recipe, [])
    before = train(old, tmp_path / "run-old", old_release.runtime, *both)
    after = train(
        new, tmp_path / "run-new", REPO, *both, *release.since.get(recipe, [])
    )
    assert_same_losses(after, before, recipe)


# A line every release since 0.1.0 wrote alike, among unchanged neighbours.
HAND_EDIT = (
    "    save_async: bool = False  # write checkpoints while training goes on\n",
    "    save_async: bool = False  # write checkpoints while training goes on; hand edit\n",
)


@pytest.mark.parametrize(
    "release, recorded",
    [
        # The upgrade records the full-length rows 0.2.0 trained (ALiBi's `earlier`),
        # where a fresh project of 0.2.0's time took Composer's 0.25.
        pytest.param(RELEASE_0_2_0, "1.0", id="0.2.0"),
        # 0.3.0 recorded Composer's 0.25 in its answers; the upgrade keeps it (a fresh
        # project trains full rows).
        pytest.param(RELEASE_0_3_0, "0.25", id="0.3.0"),
    ],
)
def test_a_released_project_with_a_hand_edit_upgrades_and_resumes_its_checkpoint(
    release: Release, recorded: str, extracted: dict[str, Extracted], tmp_path: Path
) -> None:
    """A gpt2-speedup project of the release, edited and trained (a checkpoint at step 6
    of 12): `scaffold upgrade` keeps the edit with no conflict, the files equal a fresh
    render plus the edit, and the upgraded project resumes the release's checkpoint and
    ends where the release's project ended (within RELATIVE: AdamW's fused update)."""
    old_release = extracted[release.version]
    project = old_release.generate("gpt2-speedup", tmp_path / "my-gpt")
    train_py = project / "train.py"
    assert train_py.read_text().count(HAND_EDIT[0]) == 1
    train_py.write_text(train_py.read_text().replace(*HAND_EDIT))
    commit_all(project, "hand edit")
    reference = train(project, tmp_path / "uninterrupted", old_release.runtime)
    # The release trains 6 of the 12 steps and saves; the upgraded project finishes.
    work = tmp_path / "work"
    train(project, work, old_release.runtime, stop_after=6)
    (work / "runs" / "r" / "metrics.jsonl").unlink()

    result = upgrade(project)

    assert result.old_version == release.version
    assert result.new_version == installed_release().prepare_history()
    assert Version(result.new_version).public == __version__
    assert result.changes.conflicted == []
    assert HAND_EDIT[1] in train_py.read_text()
    fresh = tmp_path / "fresh" / "my-gpt"
    new_project(
        "gpt2-speedup", fresh, [f"alibi.train_sequence_length_scaling={recorded}"]
    )
    assert train_py.read_text() == (fresh / "train.py").read_text().replace(*HAND_EDIT)
    env = {**checkout_env(), "OMP_NUM_THREADS": "1"}
    resumed = subprocess.run(
        [
            sys.executable,
            str(train_py),
            "--device=cpu",
            "--run_name=r",
            f"--max_duration={STEPS}ba",
            "--eval_interval=6ba",
            "--save_interval=6ba",
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "step-6" in resumed.stdout
    tail = [row for row in reference if row["step"] > 6]
    assert_same_losses(read_metrics(work, "r"), tail)


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(name, marks=() if name == "gpt2-speedup" else pytest.mark.slow)
        for name in sorted(RELEASE_0_3_0.recipes - set(RELEASE_0_3_0.unrepeatable))
    ],
)
def test_a_0_3_0_project_not_yet_upgraded_trains_its_losses_on_this_runtime(
    recipe: str, extracted: dict[str, Extracted], tmp_path: Path
) -> None:
    """`pip install -U scaffold` without `scaffold upgrade`: a 0.3.0 project imports
    this runtime and trains the losses it trained on 0.3.0's (within RELATIVE: AdamW's
    fused update), so the runtime keeps every call 0.3.0's loops make."""
    old_release = extracted["0.3.0"]
    project = old_release.generate(recipe, tmp_path / "p")
    both = RELEASE_0_3_0.both.get(recipe, [])
    before = train(project, tmp_path / "run-0.3.0", old_release.runtime, *both)
    after = train(project, tmp_path / "run-now", REPO, *both)
    assert_same_losses(after, before, recipe)


def test_a_0_2_0_project_not_yet_upgraded_says_how_to_upgrade(
    extracted: dict[str, Extracted], tmp_path: Path
) -> None:
    """`pip install -U scaffold` without `scaffold upgrade`: the 0.2.0 loop stops with one
    line naming the command, before anything is written."""
    project = extracted["0.2.0"].generate("gpt2-baseline", tmp_path / "my-gpt")
    (tmp_path / "work").mkdir()
    result = subprocess.run(
        [
            sys.executable,
            str(project / "train.py"),
            "--device=cpu",
            "--max_duration=2ba",
        ],
        cwd=tmp_path / "work",
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and "`scaffold upgrade`" in lines[0] and "0.2.0" in lines[0]
    ), result.stderr
    assert not (tmp_path / "work" / "runs" / "my-gpt" / "checkpoints").exists()
