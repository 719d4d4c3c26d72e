"""Golden trees: every file `scaffold new` writes for each recipe is pinned in tests/golden/.

Run `pytest tests/test_golden.py --update-golden` after an intended template change and review
the diff like code.
"""

from __future__ import annotations

import difflib
import re
import shutil
from pathlib import Path

import pytest

import yaml

from conftest import RECIPES, REPO

GOLDEN = REPO / "tests" / "golden"


def tree(root: Path) -> dict[str, str]:
    return {
        path.relative_to(root).as_posix(): path.read_text()
        for path in sorted(root.rglob("*"))
        if path.is_file() and ".git" not in path.relative_to(root).parts
    }


@pytest.mark.parametrize("recipe", RECIPES)
def test_generated_tree_matches_golden(
    recipe: str, generated: dict[str, Path], request: pytest.FixtureRequest
) -> None:
    actual = tree(generated[recipe])
    golden_dir = GOLDEN / recipe
    if request.config.getoption("--update-golden"):
        shutil.rmtree(golden_dir, ignore_errors=True)
        for name, text in actual.items():
            (golden_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (golden_dir / name).write_text(text)
    expected = tree(golden_dir)
    problems = []
    for name in sorted(set(actual) | set(expected)):
        if name not in expected:
            problems.append(f"new file {name} (not in golden)")
        elif name not in actual:
            problems.append(f"missing file {name} (in golden)")
        elif actual[name] != expected[name]:
            diff = difflib.unified_diff(
                expected[name].splitlines(keepends=True),
                actual[name].splitlines(keepends=True),
                f"golden/{recipe}/{name}",
                f"generated/{name}",
            )
            problems.append("".join(diff))
    assert not problems, (
        "generated files differ from golden (rerun with --update-golden if intended):\n"
        + "\n".join(problems)
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_generated_project_is_committed(
    recipe: str, generated: dict[str, Path]
) -> None:
    import subprocess

    project = generated[recipe]
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=project, capture_output=True, text=True
    )
    log = subprocess.run(
        ["git", "log", "--oneline"], cwd=project, capture_output=True, text=True
    )
    assert status.returncode == 0 and status.stdout == ""
    assert len(log.stdout.splitlines()) == 1 and recipe in log.stdout
    # A run inside the project stays out of git (.gitignore), so `scaffold set` and
    # `scaffold upgrade`, which need a clean tree, still work after training there.
    (project / "runs" / "r").mkdir(parents=True)
    (project / "runs" / "r" / "log.txt").write_text("step=1\n")
    try:
        status = subprocess.run(
            ["git", "status", "--porcelain"],
            cwd=project,
            capture_output=True,
            text=True,
        )
    finally:
        shutil.rmtree(project / "runs")
    assert status.stdout == "", status.stdout


# Comments true for the project at hand: no comment names an algorithm the recipe did not
# select, or an evaluation metric its code never produces. Fence markers name their own
# algorithm; "AugMix's operations" cites another work's source. Two catalog names are also
# ordinary words in these files: Llama's own rotary positions and transformers' generate().
ORDINARY_WORDS = {"generate", "rotary"}
METRIC = re.compile(r"(?<![-\w])(?:ema_)?(val_\w+)")


def spelled(name: str) -> re.Pattern[str]:
    """An algorithm's name as a comment writes it: mixup, MixUp, selective backprop."""
    return re.compile(
        r"(?<![\w.`])" + name.replace("_", r"[_ -]?") + r"(?![\w']|`)", re.IGNORECASE
    )


ALGORITHMS = {
    path.name: spelled(path.name)
    for path in sorted((REPO / "templates" / "algorithms").iterdir())
    if path.is_dir() and path.name not in ORDINARY_WORDS
}


def test_comments_name_only_what_the_project_has() -> None:
    problems = []
    for golden in sorted(GOLDEN.iterdir()):
        answers = yaml.safe_load((golden / ".copier-answers.yml").read_text())
        selected = set(answers.get("algorithms") or {})
        files = {
            path: path.read_text().splitlines() for path in sorted(golden.rglob("*.py"))
        }
        code = "\n".join(
            line for lines in files.values() for line in lines if "#" not in line
        )
        for path, lines in files.items():
            for number, line in enumerate(lines, 1):
                comment = line.partition("#")[2].strip()
                if not comment or re.match(r"(end )?algorithm: ", comment):
                    continue
                named = [
                    name
                    for name, pattern in ALGORITHMS.items()
                    if name not in selected and pattern.search(comment)
                ]
                named += [
                    metric
                    for metric in METRIC.findall(comment)
                    if f'"{metric}"' not in code
                ]
                if named:
                    where = path.relative_to(GOLDEN)
                    problems.append(f"{where}:{number}: {named}: {comment[:90]}")
    assert not problems, "\n".join(problems)
