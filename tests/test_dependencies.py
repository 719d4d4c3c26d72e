"""Every third-party package that `scaffold/` or `runtime/` imports is a declared dependency.

An import that only works because another dependency happens to pull the package in (rich
through typer, plumbum through copier) breaks the day that dependency drops it. Imports are
read with `ast`, so nothing is executed; an import at module level must be in
`[project] dependencies`, one nested in a function or a `try` (an optional feature) may be
in an optional extra instead.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from projects import real_library

REPO = Path(__file__).resolve().parent.parent
FIRST_PARTY = {"scaffold", "runtime"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement).group(0))


def imports(path: Path) -> list[tuple[str, bool, int]]:
    """(top-level module, imported at module level, line) for each absolute import in a file."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                found.extend(
                    (alias.name.split(".")[0], not nested, child.lineno)
                    for alias in child.names
                )
            elif (
                isinstance(child, ast.ImportFrom) and child.level == 0 and child.module
            ):
                found.append((child.module.split(".")[0], not nested, child.lineno))
            inner = nested or isinstance(
                child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Try)
            )
            visit(child, inner)

    visit(tree, False)
    return found


def distributions(module: str) -> list[str]:
    """The distributions that provide an import name (the import name when none is installed):
    mlflow's `mlflow` package comes from mlflow-skinny too, and declaring either is enough.
    """
    return [
        _normalize(name) for name in _packages_distributions().get(module, [module])
    ]


@functools.cache
def _packages_distributions() -> dict[str, list[str]]:
    # Reads every installed distribution's file list: seconds, so once per session.
    return metadata.packages_distributions()


def distribution(module: str) -> str:
    return distributions(module)[0]


def test_third_party_imports_are_declared() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    required = {_requirement_name(r) for r in project["dependencies"]}
    optional = {
        _requirement_name(r)
        for group in project.get("optional-dependencies", {}).values()
        for r in group
    }
    undeclared = []
    for package in ("scaffold", "runtime"):
        for path in sorted((REPO / package).rglob("*.py")):
            for module, top_level, line in imports(path):
                if (
                    module in sys.stdlib_module_names
                    or module in FIRST_PARTY
                    or module == "__future__"
                ):
                    continue
                names = set(distributions(module))
                name = distribution(module)
                if names & required or (not top_level and names & optional):
                    continue
                where = (
                    "dependencies" if top_level else "dependencies or an optional extra"
                )
                undeclared.append(
                    f"{path.relative_to(REPO)}:{line} imports {module} ({name}), not in {where}"
                )
    assert not undeclared, "\n".join(undeclared)


def test_the_check_sees_nested_and_from_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import os.path\nfrom rich.table import Table\nfrom . import x\n"
        "def f():\n    import tomli_w\ntry:\n    import yaml\nexcept ImportError:\n    pass\n"
    )
    assert imports(source) == [
        ("os", True, 1),
        ("rich", True, 2),
        ("tomli_w", False, 5),
        ("yaml", False, 7),
    ]
    assert distribution("yaml") == "pyyaml"


def test_the_integrations_are_the_real_libraries_beside_this_torch() -> None:
    """CI's environment (README's test command) has the real torchvision, timm, litdata and
    mosaicml-streaming, importable together with this torch and transformers: nothing
    fakes a library."""
    installed = {
        "torchvision.models": "torchvision",
        "timm": "timm",
        "litdata": "litdata",
        "streaming": "mosaicml-streaming",
        "transformers": "transformers",
        "torchao.float8": "torchao",
    }
    for name, dist in installed.items():
        module = real_library(name)  # imports beside this torch (CI: or fails)
        # an installed distribution's files, not a package put on the path
        top = module.__name__.split(".")[0]
        assert dist in distributions(top), (name, distributions(top))
