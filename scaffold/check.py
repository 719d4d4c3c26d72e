"""`scaffold check`: whether `upgrade`, `add` and `remove` can proceed on the project's code.

The project's markers, fences and Config fields are compared with its pristine render
(`scaffold.compare`); the command prints the report.
"""

from __future__ import annotations

from pathlib import Path

from scaffold.compare import Report, compare
from scaffold.project import open_project, pristine_render


def check(project: Path) -> Report:
    """The project's markers, fences and Config fields against a pristine render."""
    project, answers, version = open_project(project)
    with pristine_render(answers, version) as pristine:
        return compare(project, pristine, answers, version)
