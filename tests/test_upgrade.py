"""`scaffold upgrade`, `add` and `remove`: template changes and algorithm changes merged into an
edited project, hand edits kept; refusals that touch nothing; the release bundle of the history.

Two template versions are built from temporary copies of `templates/`: "0.1.0" is the template
as it is, "0.2.0" changes the end of train.py's loop, changes tests/test_smoke.py and adds a
file. Each test has its own HOME, hence its own template history.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from conftest import REPO, scaffold_cli
from projects import source_at
from scaffold import __version__
from scaffold.answers import add_algorithm, remove_algorithm
from scaffold.catalog import Algorithm, ModelFamily, load_algorithms
from scaffold.history import (
    TemplateRelease,
    dev_version,
    ensure_version,
    git,
    history_path,
)
from scaffold.paths import template_dir
from scaffold.recipes import RecipeError
from scaffold.render import commit_all, new_project, render
from scaffold.upgrade import UpdateError, add, remove, upgrade

RECIPE = "gpt2-speedup"
# The template change of "0.2.0", away from every hand edit below.
OLD_LINE = 'f"done: step {progress.batch}'
NEW_LINE = 'f"finished: step {progress.batch}'
SMOKE_CHANGE = (
    '"--eval_batches=1",',
    '"--eval_batches=1",  # one batch is enough here',
)
ADDED_FILE = "NOTES.md"
GRAD_CLIP_FENCE = re.compile(
    r"[ ]*# algorithm: gradient_clipping\n.*?# end algorithm: gradient_clipping\n", re.S
)


def replace_once(path: Path, old: str, new: str) -> None:
    """Edit a file; fails loudly if the text to replace is not there exactly once."""
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} occurs {text.count(old)} times in {path}"
    path.write_text(text.replace(old, new))


def make_template(
    root: Path, changes: dict[str, tuple[str, str]], added: dict[str, str]
) -> Path:
    """A copy of the shipped templates with text replacements and added files."""
    template = root / "templates"
    shutil.copytree(
        template_dir(), template, ignore=shutil.ignore_patterns("__pycache__")
    )
    for relpath, (old, new) in changes.items():
        replace_once(template / relpath, old, new)
    for relpath, text in added.items():
        (template / relpath).write_text(text)
    return template


@dataclass(frozen=True)
class Versions:
    old: TemplateRelease
    new: TemplateRelease


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> Versions:
    root = tmp_path_factory.mktemp("versions")
    old = make_template(root / "0.1.0", {}, {})
    new = make_template(
        root / "0.2.0",
        {
            "common/train.py.jinja": (OLD_LINE, NEW_LINE),
            "tasks/causal_lm/tests/test_smoke.py.jinja": SMOKE_CHANGE,
        },
        {
            f"tasks/causal_lm/{ADDED_FILE}.jinja": "# {{ project_name }}: notes\n\nAdded in template 0.2.0.\n"
        },
    )
    return Versions(TemplateRelease(old, "0.1.0"), TemplateRelease(new, "0.2.0"))


@pytest.fixture(autouse=True)
def own_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh HOME per test: its own ~/.cache/scaffold/template-history (subprocesses see it too)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    return home


def generate(tmp_path: Path, release: TemplateRelease, recipe: str = RECIPE) -> Path:
    return generate_at(tmp_path / "my-gpt", release, recipe)


def generate_at(
    dest: Path, release: TemplateRelease, recipe: str = RECIPE, *overrides: str
) -> Path:
    new_project(recipe, dest, list(overrides), "my-gpt", release=release)
    return dest


def files_of(root: Path) -> dict[str, str]:
    """Every file outside .git, as text."""
    return {
        path.relative_to(root).as_posix(): path.read_text()
        for path in sorted(root.rglob("*"))
        if path.is_file() and ".git" not in path.relative_to(root).parts
    }


def snapshot(root: Path) -> dict[str, str]:
    """A byte-exact fingerprint of a folder (every file, .git's refs included) and its git state."""
    digest = {
        path.relative_to(root).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
        and path.relative_to(root).parts[:2]
        != (".git", "index")  # git status refreshes it
    }
    if (root / ".git").exists():
        digest["<status>"] = run_git(
            root, "status", "--porcelain", "--untracked-files=all"
        )
    return digest


def run_git(project: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=project, capture_output=True, text=True, check=True
    ).stdout


def make_hand_edits(project: Path, delete_clipping: bool = True) -> None:
    """The edits of a user who owns the loop, committed. Deleting gradient clipping by hand
    means deleting its four fenced blocks (Config field, its range check in setup(), the
    clipping, the grad_norm metric)."""
    train = project / "train.py"
    # a new line inside the training loop
    replace_once(
        train,
        "            inputs, targets = batch[:, :-1], batch[:, 1:]\n",
        "            inputs, targets = batch[:, :-1], batch[:, 1:]\n"
        "            batch = batch.contiguous()  # hand edit: inside the loop\n",
    )
    # a changed hyperparameter default
    replace_once(train, "    beta2: float = 0.95\n", "    beta2: float = 0.99\n")
    if (
        delete_clipping
    ):  # a deleted algorithm: its fenced blocks (field, check, clipping, metric)
        text, cuts = GRAD_CLIP_FENCE.subn("", train.read_text())
        assert cuts == 4
        train.write_text(text)
    # a new file, and a deleted template file
    (project / "sweep.toml").write_text("lr = 1e-3\n")
    (project / "tests" / "test_smoke.py").unlink()
    commit_all(project, "hand edits")


# --- upgrade ---------------------------------------------------------------------------------


def test_upgrade_keeps_hand_edits_and_applies_template_changes(
    tmp_path: Path, versions: Versions
) -> None:
    project = generate(tmp_path, versions.old)
    make_hand_edits(project)
    edited = (project / "train.py").read_text()

    result = upgrade(project, versions.new)

    train = (project / "train.py").read_text()
    assert "batch = batch.contiguous()  # hand edit: inside the loop" in train
    assert "beta2: float = 0.99" in train and "beta2: float = 0.95" not in train
    assert (
        "# algorithm: gradient_clipping" not in train
        and "grad_norm.item()" not in train
    )
    assert NEW_LINE in train and OLD_LINE not in train
    # exactly the template's one-line change on top of the user's file, nothing else
    assert train == edited.replace(OLD_LINE, NEW_LINE)
    assert (project / ADDED_FILE).read_text().startswith("# my-gpt: notes")
    assert not (
        project / "tests" / "test_smoke.py"
    ).exists()  # deleted by the user: stays deleted
    assert (project / "sweep.toml").read_text() == "lr = 1e-3\n"
    assert "_commit: 0.2.0" in (project / ".copier-answers.yml").read_text()
    assert result.changes.modified == [".copier-answers.yml", "train.py"]
    assert result.changes.added == [ADDED_FILE]
    assert result.changes.conflicted == [] and result.changes.deleted == []
    # left for review: nothing committed
    assert run_git(project, "log", "--format=%s", "-1").strip() == "hand edits"


def test_upgrade_without_edits_equals_a_fresh_generation(
    tmp_path: Path, versions: Versions
) -> None:
    project = generate_at(tmp_path / "old" / "my-gpt", versions.old)
    upgrade(project, versions.new)
    fresh = generate_at(tmp_path / "fresh" / "my-gpt", versions.new)
    assert files_of(project) == files_of(fresh)
    # and the diff is the template's change and the recorded version, nothing else
    diff = run_git(project, "diff", "--numstat").split("\n")
    assert sorted(line.split("\t")[2] for line in diff if line) == [
        ".copier-answers.yml",
        "tests/test_smoke.py",
        "train.py",
    ]


def test_same_line_edit_gives_diff3_markers_and_can_be_redone(
    tmp_path: Path, versions: Versions
) -> None:
    project = generate(tmp_path, versions.old)
    replace_once(project / "train.py", OLD_LINE, 'f"all done: step {progress.batch}')
    commit_all(project, "reword the final message")

    result = upgrade(project, versions.new)

    assert result.changes.conflicted == ["train.py"]
    lines = (project / "train.py").read_text().splitlines()
    marker_at = {
        line.split(" ")[0]: index
        for index, line in enumerate(lines)
        if line.startswith(("<<<<<<<", "|||||||", "=======", ">>>>>>>"))
    }
    assert list(marker_at) == [
        "<<<<<<<",
        "|||||||",
        "=======",
        ">>>>>>>",
    ]  # diff3 style, in order
    assert "all done: step" in lines[marker_at["<<<<<<<"] + 1]  # the user's line
    assert OLD_LINE in lines[marker_at["|||||||"] + 1]  # the old template's
    assert NEW_LINE in lines[marker_at["======="] + 1]  # the new template's
    # git knows the file is conflicted, so `git checkout -m` can recreate the markers
    assert run_git(project, "status", "--porcelain", "train.py").startswith("UU")
    (project / "train.py").write_text("resolved badly\n")
    run_git(project, "checkout", "-m", "train.py")
    assert "<<<<<<<" in (project / "train.py").read_text()


def test_cli_upgrade_merges_into_the_installed_version_and_exits_0(
    tmp_path: Path,
) -> None:
    # An older release whose final message differs; the installed scaffold is the newer one.
    old_template = make_template(
        tmp_path / "old",
        {"common/train.py.jinja": ('f"done: step', 'f"over: step')},
        {},
    )
    project = generate(tmp_path, TemplateRelease(old_template, "0.0.1"))
    make_hand_edits(project)

    result = scaffold_cli("upgrade", str(project))

    assert result.returncode == 0, result.stderr
    assert f"upgraded {project} from template 0.0.1 to {__version__}" in result.stdout
    assert "modified  train.py" in result.stdout and "git diff" in result.stdout
    train = (project / "train.py").read_text()
    assert (
        'f"done: step' in train
        and "hand edit: inside the loop" in train
        and "beta2: float = 0.99" in train
    )


def test_cli_conflict_exits_1_and_says_how_to_resolve(tmp_path: Path) -> None:
    old_template = make_template(
        tmp_path / "old",
        {"common/train.py.jinja": ('f"done: step', 'f"over: step')},
        {},
    )
    project = generate(tmp_path, TemplateRelease(old_template, "0.0.1"))
    replace_once(project / "train.py", 'f"over: step', 'f"all over: step')
    commit_all(project, "same line as the template")

    result = scaffold_cli("upgrade", str(project))

    assert result.returncode == 1, result.stdout + result.stderr
    assert "conflict  train.py" in result.stdout
    assert "git add" in result.stderr and "git checkout -m FILE" in result.stderr
    assert "|||||||" in (project / "train.py").read_text()


def test_dry_run_writes_nothing_and_shows_the_changes(
    tmp_path: Path, versions: Versions
) -> None:
    project = generate(tmp_path, versions.old)
    make_hand_edits(project)
    before = snapshot(project)

    result = upgrade(project, versions.new, dry_run=True)

    assert snapshot(project) == before
    assert result.dry_run and result.changes.added == [ADDED_FILE]
    assert result.changes.modified == [".copier-answers.yml", "train.py"]
    assert re.search(r"train\.py +\| +2 \+-", result.diffstat), result.diffstat
    assert re.search(rf"{ADDED_FILE} +\| +3 \+", result.diffstat), result.diffstat


def test_cli_dry_run_reports_conflicts_without_writing(tmp_path: Path) -> None:
    old_template = make_template(
        tmp_path / "old",
        {"common/train.py.jinja": ('f"done: step', 'f"over: step')},
        {},
    )
    project = generate(tmp_path, TemplateRelease(old_template, "0.0.1"))
    replace_once(project / "train.py", 'f"over: step', 'f"all over: step')
    commit_all(project, "same line as the template")
    before = snapshot(project)

    result = scaffold_cli("upgrade", "--dry-run", str(project))

    assert snapshot(project) == before
    assert result.returncode == 1 and "would conflict" in result.stderr
    assert "dry run: nothing was written" in result.stdout
    # the conflicted file's real change: the three marker lines, the old and the new line
    assert re.search(r"train\.py +\| +6 \+{6}$", result.stdout, re.M), result.stdout


def test_upgrade_at_the_same_version_changes_nothing(
    tmp_path: Path, versions: Versions
) -> None:
    project = generate(tmp_path, versions.old)
    before = snapshot(project)
    result = upgrade(project, versions.old)
    assert result.changes.empty and result.old_version == result.new_version == "0.1.0"
    assert snapshot(project) == before


# --- development installs --------------------------------------------------------------------


def tag_commit(version: str) -> str:
    return git("rev-parse", f"refs/tags/{version}^{{commit}}", cwd=history_path())


def test_a_development_install_never_moves_a_release_tag(tmp_path: Path) -> None:
    """Tag 0.1.0 holds tree A; a development install of 0.1.0 with tree B gets 0.1.0+dev.<B>."""
    a, b = tmp_path / "a", tmp_path / "b"
    for folder, text in ((a, "one\n"), (b, "two\n")):
        folder.mkdir()
        (folder / "copier.yml").write_text(text)
    assert ensure_version(a, "0.1.0") == "0.1.0"
    released = tag_commit("0.1.0")

    snapshot = ensure_version(b, "0.1.0")

    history = history_path()
    tree_b = git("rev-parse", f"{snapshot}^{{tree}}", cwd=history)
    assert snapshot == dev_version("0.1.0", tree_b) and re.fullmatch(
        r"0\.1\.0\+dev\.[0-9a-f]{12}", snapshot
    )
    assert tag_commit("0.1.0") == released  # the release tag did not move
    assert git("show", "0.1.0:copier.yml", cwd=history) == "one"
    assert git("show", f"{snapshot}:copier.yml", cwd=history) == "two"
    assert (
        git("rev-parse", f"{snapshot}^", cwd=history) == released
    )  # history reads as 0.1.0, then the snapshot
    # Idempotent, and the release's own files still map to the release.
    tags = git("tag", "--list", cwd=history)
    assert (
        ensure_version(b, "0.1.0") == snapshot and ensure_version(a, "0.1.0") == "0.1.0"
    )
    assert git("tag", "--list", cwd=history) == tags
    # A release bundle that disagrees adds its other tags but does not move an existing one either.
    bundle = tmp_path / "release.bundle"
    _load_build_script().build_bundle(_release_repo(tmp_path / "release"), bundle)
    assert ensure_version(b, "0.1.0", bundle) == snapshot
    assert (
        tag_commit("0.1.0") == released
        and git("show", "0.2.0:copier.yml", cwd=history) == "two"
    )


def test_development_snapshots_upgrade_add_and_remove(
    tmp_path: Path, versions: Versions
) -> None:
    """A project of release 0.1.0 upgrades to a development install of 0.1.0 with other templates."""
    project = generate(tmp_path, versions.old)
    make_hand_edits(project, delete_clipping=False)
    development = TemplateRelease(versions.new.template, "0.1.0")

    result = upgrade(project, development)

    assert result.old_version == "0.1.0" and result.new_version.startswith("0.1.0+dev.")
    train = (project / "train.py").read_text()
    assert (
        NEW_LINE in train
        and "hand edit: inside the loop" in train
        and "beta2: float = 0.99" in train
    )
    assert (
        f"_commit: {result.new_version}"
        in (project / ".copier-answers.yml").read_text()
    )
    assert result.changes.conflicted == [] and result.changes.added == [ADDED_FILE]
    commit_all(project, "upgraded to the development snapshot")
    assert upgrade(project, development).changes.empty  # already there
    # add/remove re-render at the project's (development) version
    removed = remove(project, "seq_length_warmup", development)
    assert removed.old_version == removed.new_version == result.new_version
    assert (
        removed.changes.conflicted == []
        and "seq_length_warmup" not in (project / "train.py").read_text()
    )
    assert NEW_LINE in (project / "train.py").read_text()
    # the release 0.1.0 is older than nothing here: going back to it is an update, not a downgrade
    commit_all(project, "no warmup")
    back = upgrade(project, versions.old)
    assert (
        back.new_version == "0.1.0" and OLD_LINE in (project / "train.py").read_text()
    )


# --- refusals --------------------------------------------------------------------------------


def _dirty(project: Path) -> None:
    (project / "train.py").write_text(
        (project / "train.py").read_text() + "# uncommitted\n"
    )


def _untracked(project: Path) -> None:
    (project / "scratch.txt").write_text("not added\n")


def _not_git(project: Path) -> None:
    shutil.rmtree(project / ".git")


def _no_answers(project: Path) -> None:
    (project / ".copier-answers.yml").unlink()
    commit_all(project, "drop answers")


def _set_answer(project: Path, old: str, new: str) -> None:
    replace_once(project / ".copier-answers.yml", old, new)
    commit_all(project, "change answers")


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (_dirty, "has uncommitted changes (train.py); commit or stash them first"),
        (_untracked, "has uncommitted changes (scratch.txt)"),
        (_not_git, "is not in a git work tree"),
        (
            _no_answers,
            "has no .copier-answers.yml, so it was not generated by `scaffold new`",
        ),
        (
            lambda p: _set_answer(p, "_commit: 0.0.1", "_commit: 0.0.7"),
            "template version 0.0.7, which the template history does not hold",
        ),
        (
            lambda p: _set_answer(
                p,
                "_src_path: ~/.cache/scaffold/template-history",
                "_src_path: gh:someone/else",
            ),
            "records template source 'gh:someone/else'",
        ),
    ],
    ids=[
        "dirty",
        "untracked",
        "not-git",
        "no-answers",
        "unknown-version",
        "other-source",
    ],
)
def test_cli_refusals_touch_nothing_and_exit_2(
    spoil, message: str, tmp_path: Path
) -> None:
    project = generate(
        tmp_path, TemplateRelease(make_template(tmp_path / "old", {}, {}), "0.0.1")
    )
    spoil(project)
    before = snapshot(project)

    result = scaffold_cli("upgrade", str(project))

    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    ), result.stderr
    assert message in result.stderr
    assert snapshot(project) == before


def test_cli_refuses_a_downgrade(tmp_path: Path) -> None:
    project = generate(
        tmp_path, TemplateRelease(make_template(tmp_path / "new", {}, {}), "9.0.0")
    )
    before = snapshot(project)
    result = scaffold_cli("upgrade", str(project))
    assert result.returncode == 2
    assert (
        f"template 9.0.0, newer than this scaffold ({__version__}); upgrading would downgrade it"
        in result.stderr
    )
    assert snapshot(project) == before


def test_missing_folder_is_refused(tmp_path: Path, versions: Versions) -> None:
    with pytest.raises(UpdateError, match="is not a folder"):
        upgrade(tmp_path / "nowhere", versions.new)


# --- add / remove ----------------------------------------------------------------------------


def test_remove_then_add_keeps_edits_and_restores_the_files(
    tmp_path: Path, versions: Versions
) -> None:
    project = generate(tmp_path, versions.old)
    make_hand_edits(project, delete_clipping=False)
    edited = files_of(project)

    removed = remove(project, "seq_length_warmup", versions.old)

    train = (project / "train.py").read_text()
    assert (
        "# algorithm: seq_length_warmup" not in train
        and "seq_length_warmup_min_len" not in train
    )
    assert "hand edit: inside the loop" in train and "beta2: float = 0.99" in train
    assert "seq_length_warmup" not in (project / ".copier-answers.yml").read_text()
    assert not (
        project / "tests" / "test_smoke.py"
    ).exists()  # the user's deletion holds
    assert removed.changes.conflicted == [] and "train.py" in removed.changes.modified
    commit_all(project, "remove seq_length_warmup")

    added = add(project, "seq_length_warmup", [], versions.old)

    assert added.changes.conflicted == []
    assert files_of(project) == edited


def test_remove_beside_a_user_deleted_neighbour_merges_cleanly(
    tmp_path: Path, versions: Versions
) -> None:
    # The user deleted gradient clipping's fenced grad_norm metric; seq_length_warmup's metric
    # is its own fenced block after a blank line, so removing it is no conflict (in 0.1.0 the two
    # metric lines were adjacent and this was a 3-way conflict).
    project = generate(tmp_path, versions.old)
    make_hand_edits(project)
    removed = remove(project, "seq_length_warmup", versions.old)
    assert removed.changes.conflicted == []
    train = (project / "train.py").read_text()
    assert (
        'seq_len"]' not in train
        and "grad_norm" not in train
        and "hand edit: inside the loop" in train
    )


def test_add_with_hyperparameters_renders_them(
    tmp_path: Path, versions: Versions
) -> None:
    project = generate(tmp_path, versions.old, recipe="gpt2-baseline")
    make_hand_edits(project)
    add(
        project,
        "seq_length_warmup",
        ["min_len=16", "seq_length_warmup.duration=0.5dur"],
        versions.old,
    )
    train = (project / "train.py").read_text()
    assert "seq_length_warmup_min_len: int = 16" in train
    assert 'seq_length_warmup_duration: Time = Time.parse("0.5dur")' in train
    assert "hand edit: inside the loop" in train


def test_cli_add_and_remove_refuse_with_the_reason(tmp_path: Path) -> None:
    old = TemplateRelease(make_template(tmp_path / "old", {}, {}), "0.0.1")
    project = generate(tmp_path, old, recipe="gpt2-baseline")  # only gradient_clipping
    before = snapshot(project)
    refusals = {
        ("add", "alibbi"): "unknown algorithm 'alibbi' (did you mean 'alibi'?)",
        ("add", "gradient_clipping"): "'gradient_clipping' is already in this project",
        (
            "remove",
            "alibi",
        ): "algorithm 'alibi' is not in this project; it has: gradient_clipping",
        (
            "add",
            "seq_length_warmup",
            "--set",
            "min_lenght=3",
        ): "no hyperparameter 'min_lenght' (did you mean 'min_len'?)",
        (
            "add",
            "seq_length_warmup",
            "--set",
            "min_len=short",
        ): "seq_length_warmup.min_len = 'short' must be of type int",
    }
    for args, message in refusals.items():
        result = scaffold_cli(*args, str(project))
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert result.stderr.startswith("error: ") and message in result.stderr, (
            args,
            result.stderr,
        )
    assert snapshot(project) == before


def test_cli_remove_then_add(tmp_path: Path) -> None:
    project = generate(
        tmp_path, TemplateRelease(make_template(tmp_path / "old", {}, {}), "0.0.1")
    )
    make_hand_edits(project)
    edited = files_of(project)
    removed = scaffold_cli("remove", "alibi", str(project))
    assert removed.returncode == 0, removed.stderr
    assert "modified  model.py" in removed.stdout
    assert "alibi" not in (project / ".copier-answers.yml").read_text()
    commit_all(project, "no alibi")
    # The recipe's full-length rows, which the catalog's default (0.25) is not.
    scaling = "train_sequence_length_scaling=1.0"
    added = scaffold_cli("add", "alibi", str(project), "--set", scaling)
    assert added.returncode == 0, added.stderr
    assert files_of(project) == edited


CATALOG = {
    "a": Algorithm("a", "", conflicts=("b",), tasks=("causal_lm",)),
    "b": Algorithm("b", "", tasks=("causal_lm",)),
    "c": Algorithm("c", "", requires=("b",), tasks=("causal_lm",)),
    "d": Algorithm("d", "", tasks=("image_classification",)),
}
GPT = ModelFamily("gpt", "", ("tiny",), {})


@pytest.mark.parametrize(
    ("current", "name", "message"),
    [
        ({"b": {}}, "a", "algorithms 'a' and 'b' conflict"),
        ({"a": {}}, "b", "algorithms 'a' and 'b' conflict"),
        ({}, "c", "algorithm 'c' requires 'b'; add it first: scaffold add b"),
        ({}, "e", "unknown algorithm 'e'"),
        ({}, "d", "algorithm 'd' does not apply to task 'causal_lm'"),
    ],
)
def test_add_refuses_conflicts_and_missing_requirements(
    current: dict, name: str, message: str
) -> None:
    with pytest.raises(RecipeError, match=message):
        add_algorithm(current, name, [], CATALOG, "causal_lm", GPT)


def test_remove_refuses_what_another_algorithm_requires() -> None:
    with pytest.raises(
        RecipeError, match="algorithm 'c' requires 'b'; remove 'c' first"
    ):
        remove_algorithm({"b": {}, "c": {}}, "b", CATALOG)
    assert remove_algorithm({"b": {}, "c": {}}, "c", CATALOG) == {"b": {}}


def test_add_keeps_catalog_order() -> None:
    assert list(add_algorithm({"c": {}}, "b", [], CATALOG, "causal_lm", GPT)) == [
        "b",
        "c",
    ]
    assert list(add_algorithm({"b": {}}, "c", [], CATALOG, "causal_lm", GPT)) == [
        "b",
        "c",
    ]


# --- plain copier ----------------------------------------------------------------------------


def test_plain_copier_update_works(tmp_path: Path, versions: Versions) -> None:
    project = generate(tmp_path, versions.old)
    make_hand_edits(project)
    versions.new.prepare_history()  # any scaffold run puts its version in the history

    result = subprocess.run(
        [sys.executable, "-m", "copier", "update", "--trust", "--defaults"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
    )

    assert result.returncode == 0, result.stderr
    train = (project / "train.py").read_text()
    assert (
        NEW_LINE in train
        and "hand edit: inside the loop" in train
        and "beta2: float = 0.99" in train
    )
    assert (project / ADDED_FILE).exists() and not (
        project / "tests" / "test_smoke.py"
    ).exists()
    assert "_commit: 0.2.0" in (project / ".copier-answers.yml").read_text()


# --- the release bundle ----------------------------------------------------------------------


def _load_build_script():
    spec = importlib.util.spec_from_file_location(
        "build_template_history", REPO / "scripts" / "build_template_history.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _release_repo(root: Path) -> Path:
    """A repository with releases v0.1.0 and v0.2.0 (different templates/), plus tags to skip."""
    repo = root / "repo"
    (repo / "templates").mkdir(parents=True)
    identity = {
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    git("init", "--quiet", cwd=repo)
    (repo / "README.md").write_text("before templates\n")
    git("add", "-A", cwd=repo)
    git("commit", "--quiet", "-m", "no templates yet", cwd=repo, env=identity)
    git("tag", "v0.0.1", cwd=repo)
    for version, text in (("0.1.0", "one\n"), ("0.2.0", "two\n")):
        (repo / "templates" / "copier.yml").write_text(text)
        git("add", "-A", cwd=repo)
        git("commit", "--quiet", "-m", f"release {version}", cwd=repo, env=identity)
        git("tag", f"v{version}", cwd=repo)
    git("tag", "v0.3.0-rc1", cwd=repo)  # not a release
    return repo


def test_release_bundle_is_reproducible_and_holds_each_release(tmp_path: Path) -> None:
    script = _load_build_script()
    repo = _release_repo(tmp_path)
    first, second = tmp_path / "first.bundle", tmp_path / "second.bundle"

    assert script.build_bundle(repo, first) == ["0.1.0", "0.2.0"]
    assert script.build_bundle(repo, second) == ["0.1.0", "0.2.0"]

    assert first.read_bytes() == second.read_bytes()
    heads = git("bundle", "list-heads", str(first), cwd=tmp_path).splitlines()
    assert [line.split()[1] for line in heads] == ["refs/tags/0.1.0", "refs/tags/0.2.0"]
    # scaffold's history picks the tags up; each one holds exactly that release's templates/
    template = tmp_path / "installed"
    template.mkdir()
    (template / "copier.yml").write_text("two\n")
    assert ensure_version(template, "0.2.0", first) == "0.2.0"
    history = history_path()
    for version in ("0.1.0", "0.2.0"):
        assert git("rev-parse", f"{version}^{{tree}}", cwd=history) == git(
            "rev-parse", f"v{version}:templates", cwd=repo
        )
    assert git("rev-parse", "0.2.0^", cwd=history) == git(
        "rev-parse", "0.1.0", cwd=history
    )


def test_release_script_refuses_a_repo_without_releases(tmp_path: Path) -> None:
    repo = tmp_path / "empty"
    repo.mkdir()
    git("init", "--quiet", cwd=repo)
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts" / "build_template_history.py"),
            "--repo",
            str(repo),
            "--output",
            str(tmp_path / "x.bundle"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "no release tag vX.Y.Z" in result.stderr
    assert not (tmp_path / "x.bundle").exists()


def test_wheel_ships_the_bundle_only_when_built(tmp_path: Path) -> None:
    pytest.importorskip("hatchling")
    source = tmp_path / "src"
    tracked = run_git(
        REPO, "ls-files", "--cached", "--others", "--exclude-standard"
    ).split("\n")
    for name in filter(None, tracked):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    build = [
        sys.executable,
        "-c",
        "import sys; from hatchling.build import build_wheel; print(build_wheel(sys.argv[1]))",
    ]

    def wheel_names(out: Path) -> list[str]:
        done = subprocess.run(
            [*build, str(out)], cwd=source, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr
        with zipfile.ZipFile(out / done.stdout.strip().splitlines()[-1]) as wheel:
            return wheel.namelist()

    assert "scaffold/template-history.bundle" not in wheel_names(tmp_path / "plain")
    (source / "scaffold" / "template-history.bundle").write_bytes(b"bundle")
    names = wheel_names(tmp_path / "release")
    assert (
        "scaffold/template-history.bundle" in names
        and "scaffold/templates/copier.yml" in names
    )


# --- projects generated by release 0.1.0 ---------------------------------------------------------

RELEASE_0_1_0 = "b7878b8b46933427b12ce963cc72df17c6e35114"  # the commit tagged v0.1.0


def release_from_git_history(commit: str, version: str, dest: Path) -> TemplateRelease:
    """The templates/ folder of a past commit of this repository, published as `version`."""
    source_at(commit, dest, "templates")
    return TemplateRelease(dest / "templates", version)


# A line every release since 0.1.0 wrote alike, among unchanged neighbours.
HAND_EDIT = (
    "    save_async: bool = False  # write checkpoints while training goes on\n",
    "    save_async: bool = False  # write checkpoints while training goes on; hand edit\n",
)


def losses(project: Path, workdir: Path) -> list[tuple[float, float | None]]:
    from projects import read_metrics, run_train

    workdir.mkdir()
    result = run_train(
        project, workdir, "--max_duration=6ba", "--eval_interval=3ba", "--run_name=r"
    )
    assert result.returncode == 0, result.stderr
    return [(row["loss"], row.get("val_loss")) for row in read_metrics(workdir, "r")]


def test_a_0_1_0_project_with_a_hand_edit_upgrades_to_task_packs_and_trains_the_same(
    tmp_path: Path,
) -> None:
    """Release 0.1.0 (one template folder, algorithms named in it) -> today's task packs: the user's
    edit survives, nothing conflicts, the files equal a fresh render plus the edit, and training
    gives the same losses (within a relative 1e-6: AdamW's update is one fused kernel on the
    CPU since 0.1.0, which rounds differently)."""
    (tmp_path / "old-templates").mkdir()
    old = release_from_git_history(RELEASE_0_1_0, "0.1.0", tmp_path / "old-templates")
    new = TemplateRelease(template_dir(), __version__)
    # 0.1.0's own answers for its gpt2-speedup golden project (this scaffold resolves recipes
    # against today's packs, so the old project is rendered from its recorded answers).
    recorded = subprocess.run(
        ["git", "show", f"{RELEASE_0_1_0}:tests/golden/{RECIPE}/.copier-answers.yml"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    answers = {
        key: value
        for key, value in yaml.safe_load(recorded).items()
        if not key.startswith("_")
    }
    project = tmp_path / "my-gpt"
    render(answers, project, old)
    commit_all(project, "generated by scaffold 0.1.0")
    before = losses(project, tmp_path / "work-old")
    replace_once(project / "train.py", HAND_EDIT[0], HAND_EDIT[1])
    commit_all(project, "hand edit")

    result = upgrade(project, new)

    assert result.changes.conflicted == []
    train = (project / "train.py").read_text()
    assert HAND_EDIT[1] in train
    # ALiBi's train_sequence_length_scaling is newer than 0.1.0 (default 0.25): the upgrade
    # records the full-length rows 0.1.0 trained (its catalog entry's `earlier`).
    fresh = generate_at(
        tmp_path / "fresh" / "my-gpt",
        new,
        RECIPE,
        "alibi.train_sequence_length_scaling=1.0",
    )
    upgraded, expected = files_of(project), files_of(fresh)
    assert upgraded.pop("train.py") == expected.pop("train.py").replace(*HAND_EDIT)
    assert upgraded == expected
    assert "task: causal_lm" in upgraded[".copier-answers.yml"]
    after = losses(project, tmp_path / "work-new")
    assert [val is None for _, val in after] == [val is None for _, val in before]
    for new_pair, old_pair in zip(after, before):
        for value, reference in zip(new_pair, old_pair):
            if reference is not None:
                assert abs(value - reference) <= 1e-6 * abs(reference), (
                    value,
                    reference,
                )
    assert len(after) == len(before)


def upgraded_with_edits(
    tmp_path: Path, recipe: str, edits: list[tuple[str, str]]
) -> tuple[Path, dict]:
    """`recipe` generated at template 0.1.0 as `tmp_path/my-project`, `edits` (old, new)
    made and committed, upgraded to a 0.2.0 that changes OLD_LINE in the spine every
    task's train.py extends: train.py gets exactly that change on top of the edits, no
    conflict. The project and its answers."""
    root = tmp_path / "versions"
    old = TemplateRelease(make_template(root / "0.1.0", {}, {}), "0.1.0")
    change = {"common/train.py.jinja": (OLD_LINE, NEW_LINE)}
    new = TemplateRelease(make_template(root / "0.2.0", change, {}), "0.2.0")
    project = generate_at(tmp_path / "my-project", old, recipe)
    train = project / "train.py"
    for before, after in edits:
        replace_once(train, before, after)
    commit_all(project, "hand edits")
    edited = train.read_text()

    result = upgrade(project, new)

    assert train.read_text() == edited.replace(OLD_LINE, NEW_LINE)
    assert (
        result.changes.modified == [".copier-answers.yml", "train.py"]
        and result.changes.conflicted == []
    )
    answers = yaml.safe_load((project / ".copier-answers.yml").read_text())
    assert answers["_commit"] == "0.2.0"
    return project, answers


def test_an_image_classification_project_upgrades_keeping_hand_edits_and_trains(
    tmp_path: Path,
) -> None:
    """The vision task pack upgrades like the language one: template change merged, edits kept."""
    from projects import read_metrics, run_train

    beta2 = "    beta2: float = 0.999  # adamw\n"
    step = "            inputs = data.normalize(pixels, images)\n"
    edit = "            inputs = inputs.contiguous()  # hand edit: inside the loop\n"
    project, answers = upgraded_with_edits(
        tmp_path,
        "cifar-resnet56-baseline",
        [(beta2, beta2.replace("0.999", "0.99")), (step, step + edit)],
    )
    assert answers["bn_group_size"] == 128 and answers["momentum"] == 0.9
    trained = run_train(
        project,
        tmp_path,
        "--model=tiny",
        "--global_batch_size=8",
        "--device_microbatch_size=4",
        "--bn_group_size=4",
        "--max_duration=2ba",
        "--lr_warmup=0.5dur",
        "--run_name=up",
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "finished: step 2" in trained.stdout and [
        r["step"] for r in read_metrics(tmp_path, "up")
    ] == [1, 2]


def test_upgrade_records_the_values_older_projects_trained_with() -> None:
    """Options an older project's answers lack are recorded: with the value it trained
    with where the default changed since (`earlier`), else the default; a recorded value
    stays, and a project whose answers name every option is left as it is."""
    from scaffold.upgrade import ProjectState, _recorded_values

    catalog = load_algorithms(template_dir())

    def filled(name: str, **given: object) -> dict:
        defaults = {k: hp.default for k, hp in catalog[name].hyperparameters.items()}
        return {**defaults, **given}

    recorded = {
        "selective_backprop": {"keep": 0.5},
        "alibi": {"train_sequence_length_scaling": 0.5},
        "randaugment": {},
        "gradient_clipping": {"max_norm": 1.0},
    }
    old = ProjectState(Path("p"), {"algorithms": recorded}, "0.2.0", __version__)
    assert _recorded_values(old, catalog) == {
        "algorithms": {
            "selective_backprop": filled(
                "selective_backprop", keep=0.5, sampling="top"
            ),
            "alibi": filled("alibi", train_sequence_length_scaling=0.5),
            "randaugment": filled("randaugment", augmentation_set="original"),
            "gradient_clipping": filled("gradient_clipping", max_norm=1.0),
        }
    }
    assert (
        filled("randaugment")["augmentation_set"] != "original"
    )  # earlier, not default
    assert (
        recorded["randaugment"] == {}
    )  # the project's answers are not changed in place
    current = ProjectState(Path("p"), {"algorithms": recorded}, "0.3.0", __version__)
    assert _recorded_values(current, catalog)["algorithms"]["randaugment"] == filled(
        "randaugment"
    )
    # layer_freezing froze blocks up to 0.3.0; its units option came after.
    freezing = {"layer_freezing": {"start": 0.5, "level": 1.0}}
    at_0_3 = ProjectState(Path("p"), {"algorithms": freezing}, "0.3.0", __version__)
    assert _recorded_values(at_0_3, catalog)["algorithms"]["layer_freezing"] == filled(
        "layer_freezing", units="blocks"
    )
    assert filled("layer_freezing")["units"] == "leaves"  # Composer's, for new ones
    complete = {name: filled(name, **params) for name, params in recorded.items()}
    whole = ProjectState(Path("p"), {"algorithms": complete}, "0.3.0", __version__)
    assert _recorded_values(whole, catalog) == {}


def test_a_diffusion_project_upgrades_keeping_hand_edits(tmp_path: Path) -> None:
    """The diffusion task pack upgrades like the others: sd-speedup (four algorithms'
    fences) with a changed default and a line inside the training step gets the
    template's change and nothing else (that such a train.py trains: test_diffusion*).
    """
    guidance = "    guidance_scale: float = 1.0"
    step = "            inputs, targets = noised(parts, latents, states, noise, timesteps)\n"
    edit = '            inputs["noisy"] = inputs["noisy"].contiguous()  # hand edit\n'
    _, answers = upgraded_with_edits(
        tmp_path,
        "sd-speedup",
        [(guidance, guidance.replace("1.0", "2.0")), (step, step + edit)],
    )
    assert answers["task"] == "diffusion"
