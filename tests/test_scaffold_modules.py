"""The generator's modules build on each other one way.

`upgrade`, `add`, `remove` and `set` (scaffold/upgrade.py) work on a project's recorded state,
its fences and their comparison with a pristine render; the modules of the `check` and `diff`
commands and the command line print those results and must stay out of what upgrade imports.
Read from the source (every import, also inside functions), so nothing is imported here.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "scaffold"
COMMAND_MODULES = {"check", "diff", "cli"}


def scaffold_imports(module: str) -> set[str]:
    """The scaffold modules that `module`'s source imports, anywhere in it."""
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "scaffold":  # from scaffold import check
                found |= {alias.name for alias in node.names}
            elif node.module.startswith("scaffold."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {
                alias.name.split(".")[1]
                for alias in node.names
                if alias.name.startswith("scaffold.")
            }
    return {name for name in found if (PACKAGE / f"{name}.py").is_file()}


def reachable(module: str) -> set[str]:
    """Every scaffold module that importing `module` can import, directly or through others."""
    seen: set[str] = set()
    pending = [module]
    while pending:
        for imported in scaffold_imports(pending.pop()) - seen:
            seen.add(imported)
            pending.append(imported)
    return seen


def test_upgrade_imports_no_command_module() -> None:
    imported = reachable("upgrade")
    assert {"history", "render"} <= imported  # the walk sees upgrade's real imports
    assert not imported & COMMAND_MODULES, (
        f"scaffold/upgrade.py reaches {sorted(imported & COMMAND_MODULES)}: move what it "
        "needs out of the command modules"
    )
