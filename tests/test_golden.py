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

from conftest import RECIPES, REPO, scaffold_new_many

GOLDEN = REPO / "tests" / "golden"


def tree(root: Path) -> dict[str, str]:
    return {
        path.relative_to(root).as_posix(): path.read_text()
        for path in sorted(root.rglob("*"))
        if path.is_file() and ".git" not in path.relative_to(root).parts
    }


# Generation answers pinned beside the recipes: golden/NAME, `scaffold new ARGS NAME`.
VARIANTS = {
    "gpt2-baseline-tp": ["--recipe", "gpt2-baseline", "--set", "tensor_parallel=true"],
}


@pytest.fixture(scope="module")
def generated_variants(
    tmp_path_factory: pytest.TempPathFactory, isolated_home: Path
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("variants")
    projects = {name: root / name / name for name in VARIANTS}
    scaffold_new_many({projects[name]: args for name, args in VARIANTS.items()})
    return projects


def assert_matches_golden(name: str, project: Path, update: bool) -> None:
    """`project`'s files are golden/NAME's (rewritten first with --update-golden)."""
    actual = tree(project)
    golden_dir = GOLDEN / name
    if update:
        shutil.rmtree(golden_dir, ignore_errors=True)
        for file, text in actual.items():
            (golden_dir / file).parent.mkdir(parents=True, exist_ok=True)
            (golden_dir / file).write_text(text)
    expected = tree(golden_dir)
    problems = []
    for file in sorted(set(actual) | set(expected)):
        if file not in expected:
            problems.append(f"new file {file} (not in golden)")
        elif file not in actual:
            problems.append(f"missing file {file} (in golden)")
        elif actual[file] != expected[file]:
            diff = difflib.unified_diff(
                expected[file].splitlines(keepends=True),
                actual[file].splitlines(keepends=True),
                f"golden/{name}/{file}",
                f"generated/{file}",
            )
            problems.append("".join(diff))
    assert not problems, (
        "generated files differ from golden (rerun with --update-golden if intended):\n"
        + "\n".join(problems)
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_generated_tree_matches_golden(
    recipe: str, generated: dict[str, Path], request: pytest.FixtureRequest
) -> None:
    update = request.config.getoption("--update-golden")
    assert_matches_golden(recipe, generated[recipe], update)


@pytest.mark.parametrize("variant", VARIANTS)
def test_answer_variant_tree_matches_golden(
    variant: str, generated_variants: dict[str, Path], request: pytest.FixtureRequest
) -> None:
    update = request.config.getoption("--update-golden")
    assert_matches_golden(variant, generated_variants[variant], update)


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
