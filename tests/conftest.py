"""Shared fixtures: an isolated HOME (template-history cache), generated projects, golden updates."""

from __future__ import annotations

import os

# Before torch is imported, here and in every process the tests start (they inherit the
# environment): one thread per process. The suite runs a process per core (xdist) and most
# tests start more, so torch's default of a thread per core oversubscribes the machine, and
# its busy-waiting threads then slow every process many times over on a loaded CPU.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No TORCH_LOGS or DIFFUSERS_VERBOSITY: the processes see what a user's do, and the
# generated projects hide torchao's import notices themselves (runtime.quiet).

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from projects import TINY_STEPS, checkout_env, read_metrics, torchrun_command
from scaffold.paths import template_dir
from scaffold.recipes import recipe_paths

REPO = Path(__file__).resolve().parent.parent
collect_ignore = ["golden"]  # generated projects' own tests run in test_e2e.py
RECIPES = tuple(recipe_paths(template_dir()))  # every shipped recipe
RECIPE_AUTO_IMAGE = "cifar-resnet56-baseline"  # the image task with auto_microbatching


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--update-golden",
        action="store_true",
        help="rewrite tests/golden/ from the templates",
    )
    parser.addoption(
        "--slow", action="store_true", help="also run the long fault-injection tests"
    )


def pytest_collection_modifyitems(
    config: pytest.Config, items: list[pytest.Item]
) -> None:
    if config.getoption("--slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def isolated_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh HOME, so ~/.cache/scaffold/template-history is built from this checkout's templates."""
    home = tmp_path_factory.mktemp("home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HOME", str(home))
        # A bare machine: no git identity. scaffold must cope on its own.
        for var in (
            "GIT_AUTHOR_NAME",
            "GIT_AUTHOR_EMAIL",
            "GIT_COMMITTER_NAME",
            "GIT_COMMITTER_EMAIL",
        ):
            patch.delenv(var, raising=False)
        patch.setenv("GIT_CONFIG_NOSYSTEM", "1")
        yield home


def scaffold_cli(
    *args: str, cwd: Path | None = None, columns: int = 200
) -> subprocess.CompletedProcess[str]:
    """Run the `scaffold` command line as a user would (the installed console script's
    module), its output into a pipe, in a terminal `columns` wide."""
    return subprocess.run(
        [sys.executable, "-m", "scaffold", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**checkout_env(), "COLUMNS": str(columns)},
    )


# `scaffold new` for several projects in one interpreter: the command line's own entry
# point, as a user calls it, without an interpreter start and imports per project.
NEW_MANY = """
import json, sys
from scaffold.cli import app
for args in json.loads(sys.argv[1]):
    try:
        app(["new", *args], prog_name="scaffold")
    except SystemExit as stop:
        if stop.code:
            raise
"""


def scaffold_new_many(projects: dict[Path, list[str]]) -> None:
    """`scaffold new ARGS DEST` for each DEST: ARGS in `projects`."""
    jobs = [[*args, str(dest)] for dest, args in projects.items()]
    result = subprocess.run(
        [sys.executable, "-c", NEW_MANY, json.dumps(jobs)],
        capture_output=True,
        text=True,
        timeout=60 * len(jobs),
        env={**checkout_env(), "COLUMNS": "200"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert all((dest / ".copier-answers.yml").is_file() for dest in projects)


@pytest.fixture(scope="session")
def generated(
    tmp_path_factory: pytest.TempPathFactory, isolated_home: Path
) -> dict[str, Path]:
    """Each shipped recipe generated once through the CLI, named after its recipe."""
    root = tmp_path_factory.mktemp("generated")
    projects = {recipe: root / recipe / recipe for recipe in RECIPES}
    scaffold_new_many({dest: ["--recipe", r] for r, dest in projects.items()})
    return projects


@pytest.fixture(scope="session")
def generated_auto(
    tmp_path_factory: pytest.TempPathFactory, isolated_home: Path
) -> dict[str, Path]:
    """Recipes generated with the out-of-memory search (`--set auto_microbatching=true`)."""
    root = tmp_path_factory.mktemp("generated-auto")
    auto = (
        "gpt2-baseline",
        "gpt2-speedup",
        RECIPE_AUTO_IMAGE,
        "llm-lora",
        "sd-speedup",
    )
    projects = {recipe: root / recipe / recipe for recipe in auto}
    scaffold_new_many(
        {
            dest: ["--recipe", r, "--set", "auto_microbatching=true"]
            for r, dest in projects.items()
        }
    )
    return projects


@pytest.fixture
def project_copy(tmp_path: Path):
    """A writable copy of a generated project (tests may train in it)."""

    def copy(source: Path) -> Path:
        target = tmp_path / source.name
        shutil.copytree(
            source, target, ignore=shutil.ignore_patterns("runs", "__pycache__")
        )
        return target

    return copy


@pytest.fixture(scope="session")
def two_rank_reference(
    generated: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> list[dict]:
    """metrics.jsonl of an uninterrupted TINY run of gpt2-baseline on 2 ranks (torchrun --standalone)."""
    workdir = tmp_path_factory.mktemp("reference")
    result = subprocess.run(
        torchrun_command(generated["gpt2-baseline"], 2, "--run_name=ref"),
        cwd=workdir,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(workdir, "ref")
    assert [row["step"] for row in rows] == list(range(1, TINY_STEPS + 1))
    return rows
