"""After a forced `scaffold remove`: delete what the 3-way merge left of the algorithm's blocks."""

from __future__ import annotations

import subprocess
from pathlib import Path

from scaffold.fences import FENCE_END, FENCE_START
from scaffold.project import project_py_files


def _without_blocks(lines: list[str], algorithm: str) -> list[str]:
    """`lines` without the algorithm's complete fenced regions (and the blank line after each)."""
    kept: list[str] = []
    skipping = skipped = False
    for line in lines:
        stripped = line.strip()
        if not skipping and (m := FENCE_START.match(stripped)) and m[1] == algorithm:
            skipping = True
        elif skipping:
            if (m := FENCE_END.match(stripped)) and m[1] == algorithm:
                skipping, skipped = False, True
        elif skipped and not stripped and (not kept or not kept[-1].strip()):
            skipped = False  # one blank line left by the block: not two in a row
        else:
            skipped = False
            kept.append(line)
    return lines if skipping else kept  # an unclosed fence: leave the text alone


def _resolve_conflicts(lines: list[str], algorithm: str) -> list[str]:
    """Take the template's side of each conflict that is only about the algorithm's blocks."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("<<<<<<< "):
            out.append(lines[i])
            i += 1
            continue
        try:
            base = next(
                j for j in range(i, len(lines)) if lines[j].startswith("||||||| ")
            )
            sep = next(j for j in range(base, len(lines)) if lines[j] == "=======")
            end = next(
                j for j in range(sep, len(lines)) if lines[j].startswith(">>>>>>> ")
            )
        except StopIteration:
            return (
                lines  # not diff3 markers as scaffold writes them: leave the file alone
            )
        ours, theirs = lines[i + 1 : base], lines[sep + 1 : end]
        if (
            "\n".join(_without_blocks(ours, algorithm)).strip()
            == "\n".join(theirs).strip()
        ):
            out.extend(theirs)
        else:
            out.extend(lines[i : end + 1])
        i = end + 1
    return out


def drop_algorithm(project: Path, algorithm: str) -> list[str]:
    """After a forced `remove`: delete what the merge left of the algorithm's fenced blocks.

    Conflicts whose only difference is the user's version of the algorithm's code take the
    template's side; fenced blocks left elsewhere (moved by the user) are deleted. A file whose
    conflicts are all resolved is marked resolved in git (unstaged). Returns the files changed.
    """
    changed = []
    for relpath in project_py_files(project):
        path = project / relpath
        text = path.read_text()
        lines = _without_blocks(
            _resolve_conflicts(text.splitlines(), algorithm), algorithm
        )
        new = "\n".join(lines) + ("\n" if text.endswith("\n") else "")
        if new == text:
            continue
        path.write_text(new)
        changed.append(relpath)
        if not any(line.startswith("<<<<<<< ") for line in lines):
            subprocess.run(
                ["git", "reset", "--quiet", "--", relpath],
                cwd=project,
                capture_output=True,
            )
    return changed
