"""`scaffold check` and `scaffold diff`: hand edits compared with a pristine render of the
project's own template version (libcst reads markers and fences as comments); the same check
as the preflight of `upgrade`, `add` and `remove`, whose refusals touch nothing; `remove` of an
edited algorithm asks for --force.

Each test edits a copy of a project generated once per session (conftest's `generated`).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml

import scaffold.check
import scaffold.diff
from conftest import RECIPES, scaffold_cli
from scaffold import __version__
from scaffold.catalog import EVENTS, load_algorithms, task_events
from scaffold.check import check
from scaffold.compare import (
    BROKEN,
    DELETED,
    DUPLICATED,
    EDITED,
    INTACT,
    MOVED,
    UNLISTED,
    UNREADABLE,
    Report,
)
from scaffold.diff import diff, diff_texts
from scaffold.fences import read_py
from scaffold.history import TemplateRelease
from scaffold.paths import template_dir
from scaffold.project import pristine_render, read_answers
from scaffold.render import commit_all
from scaffold.upgrade import UpdateError, add, remove, upgrade
from test_upgrade import make_template, replace_once, snapshot

RECIPE = "gpt2-speedup"  # alibi (model.py), gradient_clipping and seq_length_warmup (train.py)
CLIP_STEP = (
    "            grad_norm = parallel.clip_grad_norm_(\n"
    "                model.parameters(), cfg.gradient_clipping_max_norm\n"
    "            )\n"
)
CLIP_FENCE = re.compile(
    r"[ ]*# algorithm: gradient_clipping\n.*?# end algorithm: gradient_clipping\n\n",
    re.S,
)


@pytest.fixture
def project(generated: dict[str, Path], project_copy: Callable[[Path], Path]) -> Path:
    return project_copy(generated[RECIPE])


@pytest.fixture(scope="module")
def newer(tmp_path_factory: pytest.TempPathFactory) -> TemplateRelease:
    """A later template version (one line of train.py changed), for `upgrade`."""
    root = tmp_path_factory.mktemp("newer")
    template = make_template(
        root,
        {"common/train.py.jinja": ('f"done: step', 'f"finished: step')},
        {},
    )
    major, minor, patch = __version__.split("+")[0].split(".")
    return TemplateRelease(template, f"{major}.{minor}.{int(patch) + 1}")


def edit(project: Path, old: str, new: str, message: str = "hand edit") -> None:
    replace_once(project / "train.py", old, new)
    commit_all(project, message)


def status(report: Report, algorithm: str) -> str:
    state = report.state(algorithm)
    assert state is not None, [a.name for a in report.algorithms]
    return state.status


# --- no edits --------------------------------------------------------------------------------


@pytest.fixture
def one_pristine_render(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`check` and `diff` share one pristine render per answers and version (rendering is
    most of their cost; neither writes to the render)."""
    renders: dict[str, Path] = {}
    with ExitStack() as kept:

        @contextmanager
        def shared(answers: dict[str, Any], version: str) -> Iterator[Path]:
            key = repr((sorted(answers.items()), version))
            if key not in renders:
                renders[key] = kept.enter_context(pristine_render(answers, version))
            yield renders[key]

        monkeypatch.setattr(scaffold.check, "pristine_render", shared)
        monkeypatch.setattr(scaffold.diff, "pristine_render", shared)
        yield
        assert len(renders) == 1, "check and diff rendered different answers"


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.usefixtures("one_pristine_render")
def test_an_unedited_project_is_clean_and_its_diff_is_empty(
    recipe: str, generated: dict[str, Path]
) -> None:
    project = generated[recipe]
    report = check(project)
    assert report.ok, report.problems
    recorded = (
        yaml.safe_load((project / ".copier-answers.yml").read_text())["algorithms"]
        or {}
    )
    assert sorted(a.name for a in report.algorithms) == sorted(recorded)
    assert all(a.status == INTACT for a in report.algorithms)
    assert report.markers and all(m.status == "present" for m in report.markers)
    # The events where an algorithm of the task can act: forward_backward(), above main(),
    # holds the microbatch events, main() the others, in loop order.
    marked = task_events(load_algorithms(template_dir()), read_answers(project)["task"])
    in_file_order = [*EVENTS[6:9], *EVENTS[:6], *EVENTS[9:]]
    assert [m.name for m in report.markers] == [e for e in in_file_order if e in marked]
    assert diff(project) == []


def test_cli_check_and_diff_of_an_unedited_project(generated: dict[str, Path]) -> None:
    project = generated[RECIPE]
    result = scaffold_cli("check", str(project))
    assert result.returncode == 0, result.stderr
    for name in (
        "gradient_clipping",
        "alibi",
    ):  # every fenced block of theirs, in any file
        count = sum(
            path.read_text().count(f"# algorithm: {name}\n")
            for path in project.glob("*.py")
        )
        assert re.search(
            rf"^{name}\tintact\t{count}/{count}\t", result.stdout, re.MULTILINE
        ), result.stdout
    marked = len(task_events(load_algorithms(template_dir()), "causal_lm"))
    assert f"event markers: {marked} of {marked} in place" in result.stdout
    assert "ok: upgrade, add and remove can proceed" in result.stdout
    result = scaffold_cli("diff", str(project))
    assert result.returncode == 0 and result.stdout == "", result.stdout + result.stderr


def test_cli_check_of_a_folder_that_is_no_project_exits_2(tmp_path: Path) -> None:
    for command in ("check", "diff"):
        result = scaffold_cli(command, str(tmp_path))
        assert result.returncode == 2, result.stdout + result.stderr
        assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
        assert "has no .copier-answers.yml" in result.stderr


def test_an_answer_the_template_cannot_render_is_one_clear_error(project: Path) -> None:
    replace_once(
        project / ".copier-answers.yml",
        "    alibi:\n        train_sequence_length_scaling: 1.0\n",
        "    no_such_algorithm: {}\n",
    )
    result = scaffold_cli("check", str(project))
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        "cannot render this project's answers" in result.stderr
        and result.stderr.count("\n") == 1
    )


def test_fences_are_comments_not_text_in_strings() -> None:
    source = (
        '"""Docs:\n# algorithm: fake\n"""\n\n\ndef f():\n    # event: INIT\n\n'
        '    # algorithm: real\n    x = "# end algorithm: real"\n    # end algorithm: real\n    return x\n'
    )
    found = read_py("f.py", source)
    assert found.fence_errors == []
    assert [(b.algorithm, b.start, b.end, b.scope, b.event) for b in found.blocks] == [
        ("real", 9, 11, "f", "INIT")
    ]
    assert found.events == [("INIT", 7)]


# --- edits the merge can carry: notes, exit 0 ------------------------------------------------


def clip_block_lines(project: Path) -> tuple[int, int]:
    """The 1-based first and last lines of gradient clipping's AFTER_BACKWARD fence in train.py."""
    lines = (project / "train.py").read_text().splitlines()
    first = next(
        i
        for i, line in enumerate(lines, 1)
        if line == "            # algorithm: gradient_clipping"
    )
    last = next(
        i
        for i, line in enumerate(lines, 1)
        if i > first and line == "            # end algorithm: gradient_clipping"
    )
    return first, last


def test_an_edited_block_is_reported_and_diffed_under_its_algorithm(
    project: Path,
) -> None:
    edit(
        project,
        "            grad_norm = parallel.clip_grad_norm_(\n",
        "            grad_norm = 2 * parallel.clip_grad_norm_(\n",
    )
    edit(
        project,
        "    beta2: float = 0.95\n",
        "    beta2: float = 0.99\n",
        "outside any block",
    )

    report = check(project)

    assert report.ok, report.problems
    assert status(report, "gradient_clipping") == EDITED
    assert (
        f"train.py:{clip_block_lines(project)[0]}"
        in report.state("gradient_clipping").detail
    )
    assert (
        status(report, "seq_length_warmup") == INTACT
        and status(report, "alibi") == INTACT
    )
    lines = diff(project)
    text = "\n".join(lines)
    assert "=== train.py: algorithm gradient_clipping" in lines
    assert "-            grad_norm = parallel.clip_grad_norm_(" in text
    assert "+            grad_norm = 2 * parallel.clip_grad_norm_(" in text
    # an edit outside every block is grouped under the code above it (the Config class here)
    assert "+    beta2: float = 0.99" in text and "=== train.py: Config" in lines
    assert sum(line.startswith("@@") for line in lines) == 2


def test_the_diff_applied_to_the_pristine_render_gives_the_users_files(
    project: Path, tmp_path: Path
) -> None:
    edit(
        project,
        "            grad_norm = parallel.clip_grad_norm_(\n",
        "            grad_norm = 2 * parallel.clip_grad_norm_(\n",
    )
    edit(
        project,
        'metrics["grad_norm"] = grad_norm.item()',
        'metrics["grad_norm"] = grad_norm.item() * 1',
    )
    edit(
        project,
        "            # event: BATCH_END\n\n",
        "            # event: BATCH_END\n\n            pass\n",
    )
    edit(project, "    beta2: float = 0.95\n", "    beta2: float = 0.99\n")
    (project / "README.md").write_text(
        (project / "README.md").read_text() + "My notes.\n"
    )
    commit_all(project, "edits")
    result = scaffold_cli("diff", str(project))
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if line.startswith("===")]
    assert headers == [
        "=== README.md",
        "=== train.py: Config",
        "=== train.py: algorithm gradient_clipping",
        "=== train.py: event BATCH_END",
    ]
    with pristine_render(read_answers(project), __version__) as pristine:
        shutil.copytree(pristine, tmp_path / "pristine")
    (tmp_path / "changes.patch").write_text(result.stdout)
    subprocess.run(["git", "init", "--quiet"], cwd=tmp_path / "pristine", check=True)
    subprocess.run(
        ["git", "apply", str(tmp_path / "changes.patch")],
        cwd=tmp_path / "pristine",
        check=True,
    )
    for name in ("train.py", "README.md"):
        assert (tmp_path / "pristine" / name).read_text() == (
            project / name
        ).read_text()


def test_diff_gives_each_event_its_own_hunk() -> None:
    old = (
        "def main():\n    # event: A\n\n    a = 1\n    b = 2\n    # event: B\n\n    c = 3\n"
        "    # algorithm: x\n    d = 4\n    # end algorithm: x\n"
    )
    new = (
        old.replace("a = 1", "a = 10")
        .replace("c = 3", "c = 30")
        .replace("d = 4", "d = 40")
    )
    hunks = diff_texts("train.py", old, new)
    assert [label for label, _ in hunks] == ["event A", "event B", "algorithm x"]
    assert hunks[0][1].splitlines() == [
        "@@ -1,7 +1,7 @@",
        " def main():",
        "     # event: A",
        " ",
        "-    a = 1",
        "+    a = 10",
        "     b = 2",
        "     # event: B",
        " ",
    ]
    assert "+    d = 40" in hunks[2][1] and "+    c = 30" not in hunks[2][1]


def test_a_deleted_algorithm_and_a_partly_deleted_one(project: Path) -> None:
    text, cuts = CLIP_FENCE.subn("", (project / "train.py").read_text())
    assert (
        cuts == 4
    )  # its Config field, its range check in setup(), the clipping, its metric
    # seq_length_warmup loses only its metric
    text = text.replace(
        '                # algorithm: seq_length_warmup\n                metrics["seq_len"] = '
        "seq_len  # the warmup's length this step\n"
        "                # end algorithm: seq_length_warmup\n\n",
        "",
    )
    (project / "train.py").write_text(text)
    commit_all(project, "delete")

    report = check(project)

    assert report.ok, report.problems
    assert status(report, "gradient_clipping") == DELETED
    assert status(report, "seq_length_warmup") == EDITED
    assert (
        "1 of 5 blocks deleted in train.py" in report.state("seq_length_warmup").detail
    )
    assert "=== train.py: algorithm gradient_clipping" in diff(project)


def test_a_moved_block_is_reported_with_where_it_went(project: Path) -> None:
    # the clipping moved after the optimizer step (at BATCH_END): same code, other place
    train = project / "train.py"
    text = train.read_text()
    block = re.search(
        r"            # algorithm: gradient_clipping\n(.*?)# end algorithm: gradient_clipping\n\n",
        text[text.index("# event: AFTER_BACKWARD") :],
        re.S,
    )[0]
    text = text.replace(block, "", 1)
    text = text.replace(
        "            # event: BATCH_END\n\n",
        "            # event: BATCH_END\n\n" + block,
        1,
    )
    train.write_text(text)
    commit_all(project, "move")

    report = check(project)

    assert report.ok, report.problems
    assert status(report, "gradient_clipping") == MOVED
    assert "main after BATCH_END" in report.state("gradient_clipping").detail


def test_an_unlisted_fence_is_reported_but_does_not_block(project: Path) -> None:
    edit(
        project,
        "            # event: BATCH_END\n\n",
        "            # event: BATCH_END\n\n            # algorithm: my_trick\n            pass\n"
        "            # end algorithm: my_trick\n\n",
    )
    report = check(project)
    assert report.ok and status(report, "my_trick") == UNLISTED
    assert report.state("my_trick").detail.startswith("train.py:")


# --- problems: exit 1, and upgrade/add/remove refuse touching nothing ------------------------


def _duplicated(project: Path) -> None:
    edit(
        project,
        CLIP_STEP + "            # end algorithm: gradient_clipping\n",
        CLIP_STEP
        + "            # end algorithm: gradient_clipping\n\n            # algorithm: gradient_clipping\n"
        + CLIP_STEP
        + "            # end algorithm: gradient_clipping\n",
    )


def _end_fence_deleted(project: Path) -> None:
    edit(
        project,
        CLIP_STEP + "            # end algorithm: gradient_clipping\n",
        CLIP_STEP,
    )


def _start_fence_misspelt(project: Path) -> None:
    edit(
        project,
        "    # algorithm: seq_length_warmup\n    seq_length_warmup_duration",
        "    # algoritm: seq_length_warmup\n    seq_length_warmup_duration",
    )


def _fences_crossed(project: Path) -> None:
    edit(
        project,
        "    gradient_clipping_max_norm: float = 1.0  # max global L2 norm\n"
        "    # end algorithm: gradient_clipping\n",
        "    gradient_clipping_max_norm: float = 1.0  # max global L2 norm\n    # end algorithm: alibi\n",
    )


def _marker_removed(project: Path) -> None:
    edit(project, "            # event: BATCH_END\n\n", "")


def _markers_swapped(project: Path) -> None:
    text = (project / "train.py").read_text()
    text = text.replace("# event: BATCH_END", "# event: @").replace(
        "# event: EVAL", "# event: BATCH_END"
    )
    (project / "train.py").write_text(text.replace("# event: @", "# event: EVAL"))
    commit_all(project, "swap")


def _field_renamed(project: Path) -> None:
    train = project / "train.py"
    train.write_text(
        train.read_text().replace("gradient_clipping_max_norm", "clip_norm")
    )
    commit_all(project, "rename")


def _conflict_left(project: Path) -> None:
    edit(
        project,
        "            optimizer.step()\n",
        "<<<<<<< before updating\n            optimizer.step()\n=======\n>>>>>>> after updating\n",
    )


PROBLEMS = [
    (
        _duplicated,
        "gradient_clipping",
        DUPLICATED,
        "gradient_clipping is duplicated: 5 blocks in train.py where "
        "the template has 4",
    ),
    (
        _end_fence_deleted,
        "gradient_clipping",
        BROKEN,
        "`# algorithm: gradient_clipping` has no `# end algorithm: "
        "gradient_clipping` before line",
    ),
    (
        _start_fence_misspelt,
        "seq_length_warmup",
        BROKEN,
        "`# end algorithm: seq_length_warmup` has no "
        "`# algorithm: seq_length_warmup` above it",
    ),
    (
        _fences_crossed,
        "gradient_clipping",
        BROKEN,
        "`# algorithm: gradient_clipping` is closed by " "`# end algorithm: alibi`",
    ),
    (
        _marker_removed,
        None,
        None,
        "train.py: the marker `# event: BATCH_END` is missing",
    ),
    (_markers_swapped, None, None, "the marker `# event: BATCH_END` is out of order"),
    (
        _field_renamed,
        "gradient_clipping",
        EDITED,
        "Config field `gradient_clipping_max_norm`, which algorithm "
        "gradient_clipping reads, is missing (removed or renamed)",
    ),
    (_conflict_left, "gradient_clipping", UNREADABLE, "train.py does not parse (line"),
]
PROBLEM_IDS = [
    "duplicated",
    "end-fence-deleted",
    "start-fence-misspelt",
    "fences-crossed",
    "marker-removed",
    "markers-swapped",
    "field-renamed",
    "conflict-markers",
]


@pytest.mark.parametrize(
    ("spoil", "algorithm", "expected", "message"), PROBLEMS, ids=PROBLEM_IDS
)
def test_check_names_the_problem_and_exits_1(
    spoil, algorithm, expected, message, project: Path
) -> None:
    spoil(project)

    report = check(project)

    assert not report.ok
    assert any(message in problem for problem in report.problems), report.problems
    if algorithm is not None:
        assert status(report, algorithm) == expected
    result = scaffold_cli("check", str(project))
    assert result.returncode == 1, result.stdout + result.stderr
    assert (
        message in result.stderr and "upgrade, add and remove refuse" in result.stderr
    )


def test_a_marker_report_names_each_missing_marker(project: Path) -> None:
    _marker_removed(project)
    report = check(project)
    assert [(m.name, m.status) for m in report.markers if m.status != "present"] == [
        ("BATCH_END", "missing")
    ]
    assert "  train.py: BATCH_END missing" in scaffold_cli("check", str(project)).stdout


@pytest.mark.parametrize(
    ("spoil", "message"),
    [(p[0], p[3]) for p in PROBLEMS[:2] + PROBLEMS[4:7]],
    ids=[PROBLEM_IDS[i] for i in (0, 1, 4, 5, 6)],
)
def test_upgrade_add_and_remove_refuse_and_touch_nothing(
    spoil, message: str, project: Path, newer: TemplateRelease
) -> None:
    spoil(project)
    before = snapshot(project)
    operations = [lambda: upgrade(project, newer)]
    if (
        spoil is _duplicated
    ):  # each command runs the same check; one spoil is enough for the others
        operations += [
            lambda: upgrade(project, newer, dry_run=True),
            lambda: remove(project, "alibi"),
        ]
    for operation in operations:
        with pytest.raises(UpdateError, match=re.escape(message)):
            operation()
        assert snapshot(project) == before


def test_cli_add_refuses_with_a_missing_marker(
    generated: dict[str, Path], project_copy
) -> None:
    project = project_copy(generated["gpt2-baseline"])
    _marker_removed(project)
    before = snapshot(project)
    result = scaffold_cli("add", "seq_length_warmup", str(project))
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith(
        "error: train.py: the marker `# event: BATCH_END` is missing"
    )
    assert result.stderr.count("\n") == 1 and "nothing was changed" in result.stderr
    assert snapshot(project) == before


def test_add_refuses_over_an_unlisted_fence_of_the_same_name(
    generated: dict[str, Path], project_copy
) -> None:
    project = project_copy(generated["gpt2-baseline"])
    edit(
        project,
        "            # event: BATCH_END\n\n",
        "            # event: BATCH_END\n\n            # algorithm: seq_length_warmup\n            pass\n"
        "            # end algorithm: seq_length_warmup\n\n",
    )
    before = snapshot(project)
    with pytest.raises(
        UpdateError, match="already has fenced `# algorithm: seq_length_warmup` blocks"
    ):
        add(project, "seq_length_warmup")
    assert snapshot(project) == before


# --- remove of an edited algorithm -----------------------------------------------------------


def test_remove_of_an_edited_block_shows_it_and_asks_for_force(project: Path) -> None:
    edit(
        project,
        "            grad_norm = parallel.clip_grad_norm_(\n",
        "            grad_norm = 2 * parallel.clip_grad_norm_(\n",
    )
    edit(
        project,
        "    beta2: float = 0.95\n",
        "    beta2: float = 0.99\n",
        "an edit elsewhere",
    )
    before = snapshot(project)

    result = scaffold_cli("remove", "gradient_clipping", str(project))

    assert result.returncode == 2, result.stdout + result.stderr
    assert "you changed gradient_clipping's code" in result.stderr
    first, last = clip_block_lines(project)
    assert f"train.py:{first}-{last} (main after AFTER_BACKWARD)" in result.stderr
    assert (
        "    grad_norm = 2 * parallel.clip_grad_norm_(" in result.stderr
    )  # the edited block, shown
    assert "scaffold remove gradient_clipping --force" in result.stderr
    assert snapshot(project) == before

    result = scaffold_cli("remove", "--force", "gradient_clipping", str(project))

    assert result.returncode == 0, result.stdout + result.stderr
    train = (project / "train.py").read_text()
    assert (
        "gradient_clipping" not in train
        and "grad_norm" not in train
        and "<<<<<<<" not in train
    )
    assert "beta2: float = 0.99" in train  # the other edit stays
    status_lines = subprocess.run(
        ["git", "status", "--porcelain"], cwd=project, capture_output=True, text=True
    ).stdout.splitlines()
    assert " M train.py" in status_lines  # resolved: not left unmerged
    black = subprocess.run(["black", "--check", "--quiet", "train.py"], cwd=project)
    assert black.returncode == 0
    report = check(project)
    assert report.ok and report.state("gradient_clipping") is None


def test_remove_force_also_removes_a_moved_block(project: Path) -> None:
    train = project / "train.py"
    text = train.read_text()
    block = (
        '                # algorithm: gradient_clipping\n                metrics["grad_norm"] = grad_norm.item()\n'
        "                # end algorithm: gradient_clipping\n\n"
    )
    text = text.replace(block, "", 1).replace(
        "                monitor.log(progress, **metrics)\n",
        "                monitor.log(progress, **metrics)\n\n" + block,
        1,
    )
    train.write_text(text)
    commit_all(project, "move the metric below the log call")
    assert status(check(project), "gradient_clipping") == MOVED
    with pytest.raises(UpdateError, match="blocks were moved"):
        remove(project, "gradient_clipping")

    result = remove(project, "gradient_clipping", force=True)

    assert result.changes.conflicted == []
    assert (
        "gradient_clipping" not in train.read_text()
        and "grad_norm" not in train.read_text()
    )


def test_remove_of_an_intact_algorithm_needs_no_force(project: Path) -> None:
    result = remove(project, "gradient_clipping")
    assert (
        result.changes.conflicted == []
        and "gradient_clipping" not in (project / "train.py").read_text()
    )


def test_an_edited_masked_lm_project_checks_diffs_and_upgrades(
    generated: dict[str, Path],
    project_copy: Callable[[Path], Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """mosaicbert (task masked_lm, bert pack): an edit inside unpadding's block of
    model.py is reported `edited` under unpadding (low_precision_layernorm intact),
    diffed under its algorithm, and kept by an upgrade that brings a newer masked_lm
    train.py."""
    project = project_copy(generated["mosaicbert"])
    line = "        y = varlen_attention(q, k, v, keep, dropout)\n"
    replace_once(project / "model.py", line, line.replace(")\n", ").contiguous()\n"))
    commit_all(project, "hand edit")

    report = check(project)
    assert report.ok, report.problems
    assert status(report, "unpadding") == EDITED
    assert status(report, "low_precision_layernorm") == INTACT
    assert "model.py:" in report.state("unpadding").detail
    lines = diff(project)
    assert "=== model.py: algorithm unpadding" in lines
    assert sum(line.startswith("@@") for line in lines) == 1

    template = make_template(
        tmp_path_factory.mktemp("newer-masked-lm"),
        {"common/train.py.jinja": ('f"done: step', 'f"finished: step')},
        {},
    )
    major, minor, patch = __version__.split("+")[0].split(".")
    upgrade(project, TemplateRelease(template, f"{major}.{minor}.{int(patch) + 1}"))
    assert "keep, dropout).contiguous()" in (project / "model.py").read_text()
    train = (project / "train.py").read_text()
    assert 'f"finished: step' in train and 'f"done: step' not in train
