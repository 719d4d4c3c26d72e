"""The repository's own Python is black-formatted at 88 columns (DESIGN.md §6.9).

`[tool.black]` in pyproject.toml is the configuration; this runs `black --check` with it
over the library code, as a maintainer would, and fails naming every file black would
change. tests/golden (generated projects, pinned byte for byte) is excluded by that
configuration. To fix: `black runtime scaffold bench tests`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("runtime", "scaffold", "bench", "tests")
WOULD = "would reformat "


def test_library_code_is_black_clean() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "black", "--check", *FOLDERS],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    unformatted = sorted(
        str(Path(line.removeprefix(WOULD)).relative_to(REPO))
        for line in result.stderr.splitlines()
        if line.startswith(WOULD)
    )
    assert not unformatted, (
        f"black would reformat {len(unformatted)} file(s); run "
        f"`black {' '.join(FOLDERS)}`:\n" + "\n".join(unformatted)
    )
    # 123: black could not read a file (a syntax error); its message names it.
    assert result.returncode == 0, result.stderr
