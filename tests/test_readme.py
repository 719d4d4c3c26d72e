"""README.md's two commands stay true: CI runs the test one verbatim; the main one is what we test."""

from __future__ import annotations

import re

from conftest import REPO


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S)
    return [
        line
        for block in blocks
        for line in block.splitlines()
        if line.startswith("pip install")
    ]


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    main, tests, *others = readme_commands()
    assert "scaffold new --recipe gpt2-speedup" in main and "python train.py" in main
    shipped = {path.stem for path in (REPO / "templates" / "recipes").glob("*.toml")}
    for command in others:  # the other recipes' main jobs name shipped recipes
        assert (
            re.search(r"scaffold new --recipe (\S+)", command).group(1) in shipped
        ), command
    assert "pytest" in tests
    ci_lines = (REPO / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines
