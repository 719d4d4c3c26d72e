"""`scaffold diff`: the user's changes to the generated files, labelled by where they are.

The project is compared with its pristine render; each change is named by the algorithm block
it touches, else by the event point or the class or function it sits in, so a reader sees
"train.py: algorithm ema" or "train.py: event BATCH_END" above each hunk.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from scaffold.fences import PyFile, read_py
from scaffold.project import ANSWERS_FILE, open_project, pristine_render


def _scope_at(line: int, file: PyFile) -> str:
    inside = [
        (first, name) for first, last, name in file.scopes if first <= line <= last
    ]
    return max(inside)[1] if inside else ""


def _label(line: int, file: PyFile | None) -> str:
    """What a line belongs to: an algorithm block, else the event above it in the same function,
    else its class or function ("module level" outside them)."""
    if file is None:
        return "file"
    for block in file.blocks:
        if block.start <= line <= block.end:
            return f"algorithm {block.algorithm}"
    scope = _scope_at(line, file)
    top = scope.split(".")[0]
    events = [
        name
        for name, at in file.events
        if at <= line and _scope_at(at, file).split(".")[0] == top
    ]
    if events and top:
        return f"event {events[-1]}"
    return scope or "module level"


CONTEXT = 3  # lines of context around a change, as in `git diff`


def _change_label(
    op: tuple[str, int, int, int, int], old_file: PyFile | None, new_file: PyFile | None
) -> str:
    """Name a change by where it is: an algorithm block it touches (in the pristine file, else in
    the user's), else the event point or class/function of the pristine line above it.
    """
    _, i1, i2, j1, j2 = op
    if old_file is None and new_file is None:
        return "file"
    touched = [_label(i + 1, old_file) for i in range(i1, i2)] + [
        _label(j + 1, new_file) for j in range(j1, j2)
    ]
    block = next((label for label in touched if label.startswith("algorithm ")), None)
    if block:
        return block
    return (
        _label(i1 + 1 if i2 > i1 else max(i1, 1), old_file) if old_file else touched[0]
    )


def diff_texts(relpath: str, old: str, new: str) -> list[tuple[str, str]]:
    """(label, unified hunk) pairs: changes next to each other under the same label share a hunk;
    changes under different labels get hunks of their own."""
    old_lines, new_lines = old.splitlines(), new.splitlines()
    is_py = relpath.endswith(".py")
    old_file = read_py(relpath, old) if is_py and old else None
    new_file = read_py(relpath, new) if is_py and new else None
    ops = difflib.SequenceMatcher(
        None, old_lines, new_lines, autojunk=False
    ).get_opcodes()
    segments: list[tuple[str, list[tuple[str, int, int, int, int]]]] = []
    for op in ops:
        if op[0] == "equal":
            continue
        label = _change_label(op, old_file, new_file)
        if (
            segments
            and segments[-1][0] == label
            and op[1] - segments[-1][1][-1][2] <= 2 * CONTEXT
        ):
            segments[-1][1].append(op)
        else:
            segments.append((label, [op]))
    hunks: list[tuple[str, str]] = []
    previous_end = 0  # where the last hunk's changes ended (old lines): context never reaches back over them
    for index, (label, changes) in enumerate(segments):
        first, last = changes[0], changes[-1]
        following = (
            segments[index + 1][1][0][1]
            if index + 1 < len(segments)
            else len(old_lines)
        )
        before = min(CONTEXT, first[1] - previous_end)
        after = min(CONTEXT, following - last[2])
        old_start, new_start = first[1] - before, first[3] - before
        old_end, new_end = last[2] + after, last[4] + after
        lines = [
            f"@@ -{old_start + 1},{old_end - old_start} +{new_start + 1},{new_end - new_start} @@"
        ]
        lines.extend(" " + line for line in old_lines[old_start : first[1]])
        for k, (tag, i1, i2, j1, j2) in enumerate(changes):
            if k:  # the unchanged lines between two changes of this hunk
                lines.extend(" " + line for line in old_lines[changes[k - 1][2] : i1])
            lines.extend("-" + line for line in old_lines[i1:i2])
            lines.extend("+" + line for line in new_lines[j1:j2])
        lines.extend(" " + line for line in old_lines[last[2] : old_end])
        hunks.append((label, "\n".join(lines)))
        previous_end = last[2]
    return hunks


def _generated_files(root: Path) -> list[str]:
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.is_file()
        and ".git" not in p.relative_to(root).parts
        and p.name != ANSWERS_FILE
    )


def diff(project: Path) -> list[str]:
    """`scaffold diff`: the user's changes to the generated files, as unified diffs per block/event."""
    project, answers, version = open_project(project)
    out: list[str] = []
    with pristine_render(answers, version) as pristine:
        for relpath in _generated_files(pristine):
            old = (pristine / relpath).read_text(errors="replace")
            mine = project / relpath
            if not mine.is_file():
                out.append(f"=== {relpath}: deleted (generated by template {version})")
                continue
            new = mine.read_text(errors="replace")
            if new == old:
                continue
            grouped: dict[str, list[str]] = {}
            for label, hunk in diff_texts(relpath, old, new):
                grouped.setdefault(label, []).append(hunk)
            for label, hunks in grouped.items():
                out.append(
                    f"=== {relpath}" if label == "file" else f"=== {relpath}: {label}"
                )
                out.append(f"--- a/{relpath}")
                out.append(f"+++ b/{relpath}")
                out.extend(hunks)
    if out:
        out.insert(
            0,
            f"# your changes (b/) against the files template {version} renders from {ANSWERS_FILE} (a/)",
        )
    return out
