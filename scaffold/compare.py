"""A project's code against its pristine render: what `upgrade`, `add` and `remove` can work around.

An algorithm usually has several blocks (a Config field, a check, the code at its event, a
metric, model code); they are compared with the pristine blocks one by one, per file. What
`upgrade`, `add` and `remove` cannot work around is a *problem* (a broken or duplicated fence, a
missing or reordered event marker, a Config field an algorithm reads but the user removed, a
file that does not parse); an edited, moved or deleted block is a *note*: the 3-way merge keeps
it, except that `remove` of such an algorithm asks for `--force` (see `remove_blockers`).
"""

from __future__ import annotations

import difflib
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from scaffold.fences import Block, PyFile, read_py
from scaffold.project import ANSWERS_FILE, project_py_files, py_files

# Statuses of an algorithm in the table.
INTACT, EDITED, MOVED, DELETED, BROKEN, DUPLICATED, UNLISTED, UNREADABLE = (
    "intact",
    "edited",
    "moved",
    "deleted",
    "fence broken",
    "duplicated",
    "not in answers",
    "unreadable",
)


@dataclass(frozen=True)
class AlgorithmState:
    name: str
    status: str
    detail: str = ""
    blocks: str = ""  # "found/generated", e.g. "2/3"
    edited_blocks: tuple[
        tuple[Block, Block], ...
    ] = ()  # (pristine, user's) pairs that differ
    leftover_blocks: tuple[
        Block, ...
    ] = ()  # the user's blocks of the algorithm, all of them


@dataclass(frozen=True)
class MarkerState:
    path: str
    name: str
    status: str  # present, missing, out of order, duplicated


@dataclass
class Report:
    """The result of a check; `problems` is empty when upgrade/add/remove can proceed."""

    project: Path
    version: str
    algorithms: list[AlgorithmState] = field(default_factory=list)
    markers: list[MarkerState] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def state(self, algorithm: str) -> AlgorithmState | None:
        return next((a for a in self.algorithms if a.name == algorithm), None)


def _read_user(project: Path, relpath: str) -> PyFile | None:
    path = project / relpath
    if not path.is_file():
        return None
    return read_py(relpath, path.read_text(errors="replace"))


def _check_markers(pristine: PyFile, user: PyFile | None, report: Report) -> None:
    expected = [name for name, _ in pristine.events]
    have = [name for name, _ in user.events] if user else []
    counts = Counter(have)
    common = [name for name in have if name in expected]
    order_ok = common == [name for name in expected if name in counts] and all(
        counts[n] <= 1 for n in expected
    )
    for name in expected:
        if counts[name] == 0:
            status = "missing"
            report.problems.append(
                f"{pristine.path}: the marker `# event: {name}` is missing; put the line "
                f"back where the event happens (see `scaffold diff`), followed by a blank line"
            )
        elif counts[name] > 1:
            status = "duplicated"
            report.problems.append(
                f"{pristine.path}: the marker `# event: {name}` occurs {counts[name]} times; "
                "keep one"
            )
        elif not order_ok and _out_of_place(name, expected, have):
            status = "out of order"
            report.problems.append(
                f"{pristine.path}: the marker `# event: {name}` is out of order (expected: "
                f"{' -> '.join(expected)}); move it back"
            )
        else:
            status = "present"
        report.markers.append(MarkerState(pristine.path, name, status))


def _out_of_place(name: str, expected: list[str], have: list[str]) -> bool:
    """Whether `name` sits between other markers than in the pristine order."""
    order = [n for n in have if n in expected]
    rank = {n: i for i, n in enumerate(expected)}
    at = order.index(name)
    before = order[at - 1] if at > 0 else None
    after = order[at + 1] if at + 1 < len(order) else None
    return (before is not None and rank[before] > rank[name]) or (
        after is not None and rank[after] < rank[name]
    )


def _compare_algorithm(
    name: str, pristine: list[Block], user: list[Block], broken: list[str]
) -> AlgorithmState:
    if broken:
        return AlgorithmState(
            name, BROKEN, "; ".join(broken), leftover_blocks=tuple(user)
        )
    if not user:
        return AlgorithmState(
            name,
            DELETED,
            f"all {len(pristine)} blocks deleted" if len(pristine) > 1 else "",
        )
    edited: list[tuple[Block, Block]] = []
    moved: list[Block] = []
    notes: list[str] = []
    by_file: dict[str, tuple[list[Block], list[Block]]] = {}
    for block in pristine:
        by_file.setdefault(block.path, ([], []))[0].append(block)
    for block in user:
        by_file.setdefault(block.path, ([], []))[1].append(block)
    for path, (mine, theirs) in by_file.items():
        if len(theirs) > len(mine):
            where = ", ".join(f"{b.path}:{b.start}" for b in theirs)
            return AlgorithmState(
                name,
                DUPLICATED,
                f"{len(theirs)} blocks in {path} where the template has "
                f"{len(mine)} ({where})",
                leftover_blocks=tuple(user),
            )
        pairs = _pair(mine, theirs)
        for old, new in pairs:
            if old.text != new.text:
                edited.append((old, new))
            elif new.moved_from(old):
                moved.append(new)
        if len(theirs) < len(mine):
            notes.append(
                f"{len(mine) - len(theirs)} of {len(mine)} blocks deleted in {path}"
            )
    if edited:
        notes.insert(0, ", ".join(f"{new.path}:{new.start}" for _, new in edited))
    if moved:
        notes.append(
            "moved: " + ", ".join(f"{b.path}:{b.start} ({b.where})" for b in moved)
        )
    status = (
        EDITED if edited or len(user) < len(pristine) else MOVED if moved else INTACT
    )
    return AlgorithmState(
        name,
        status,
        "; ".join(notes),
        edited_blocks=tuple(edited),
        leftover_blocks=tuple(user),
    )


def _pair(pristine: list[Block], user: list[Block]) -> list[tuple[Block, Block]]:
    """Pair each of the user's blocks with a pristine one: same text first, then in order."""
    if len(pristine) == len(user):
        same_texts = sorted(b.text for b in pristine) == sorted(b.text for b in user)
        if not same_texts:
            return list(zip(pristine, user))
    free = list(pristine)
    pairs: list[tuple[Block, Block]] = []
    rest: list[Block] = []
    for block in user:
        same = next((p for p in free if p.text == block.text), None)
        if same is None:
            rest.append(block)
        else:
            free.remove(same)
            pairs.append((same, block))
    for block in rest:  # edited: the closest remaining pristine block
        best = max(
            free,
            key=lambda p: difflib.SequenceMatcher(None, p.text, block.text).ratio(),
        )
        free.remove(best)
        pairs.append((best, block))
    return pairs


def _config_fields(
    pristine: PyFile, user: PyFile | None, deleted: set[str], report: Report
) -> None:
    if pristine.config_fields is None or user is None or user.config_fields is None:
        return
    for block in pristine.blocks:
        if block.algorithm in deleted:
            continue
        inside = set(
            pristine.lines[i - 1].split(":")[0].strip()
            for i in range(block.start + 1, block.end)
        )
        for name in [f for f in pristine.config_fields if f in inside]:
            if name not in user.config_fields:
                report.problems.append(
                    f"{user.path}: Config field `{name}`, which algorithm {block.algorithm} reads, is missing "
                    f"(removed or renamed); restore it, or `scaffold remove {block.algorithm}`"
                )


def compare(
    project: Path, pristine_root: Path, answers: dict[str, Any], version: str
) -> Report:
    """Check the project's files against a pristine render of its version and answers."""
    report = Report(project, version)
    listed = list(answers.get("algorithms") or {})
    pristine_blocks: dict[str, list[Block]] = {name: [] for name in listed}
    user_blocks: dict[str, list[Block]] = {name: [] for name in listed}
    broken: dict[str, list[str]] = {}
    files: list[tuple[PyFile, PyFile | None]] = []
    unreadable: dict[str, str] = {}  # algorithm -> a file of it that does not parse
    paths = sorted(set(py_files(pristine_root)) | set(project_py_files(project)))
    for relpath in paths:
        pristine_path = pristine_root / relpath
        pristine = (
            read_py(relpath, pristine_path.read_text())
            if pristine_path.is_file()
            else None
        )
        user = _read_user(project, relpath)
        if user is not None and user.syntax_error:
            report.problems.append(
                f"{user.syntax_error}; fix it (conflict markers left from a merge?)"
            )
            for block in pristine.blocks if pristine else []:
                unreadable.setdefault(block.algorithm, relpath)
            continue
        if pristine is None:  # a file of the user's: only fences in it matter
            pristine = PyFile(relpath, [])
        files.append((pristine, user))
        for block in pristine.blocks:
            pristine_blocks.setdefault(block.algorithm, []).append(block)
        for block in user.blocks if user else []:
            user_blocks.setdefault(block.algorithm, []).append(block)
        for name, what in user.fence_errors if user else []:
            broken.setdefault(name, []).append(what)
    for name in listed:
        mine, theirs = pristine_blocks.get(name, []), user_blocks.get(name, [])
        if name in unreadable:
            state = AlgorithmState(
                name, UNREADABLE, f"{unreadable[name]} does not parse"
            )
        else:
            state = _compare_algorithm(name, mine, theirs, broken.get(name, []))
        report.algorithms.append(replace(state, blocks=f"{len(theirs)}/{len(mine)}"))
    for name in sorted(set(user_blocks) | set(broken) - set(listed)):
        if name in listed:
            continue
        blocks = user_blocks.get(name, [])
        if broken.get(name):
            report.algorithms.append(
                AlgorithmState(
                    name, BROKEN, "; ".join(broken[name]), leftover_blocks=tuple(blocks)
                )
            )
        else:
            report.algorithms.append(
                AlgorithmState(
                    name,
                    UNLISTED,
                    ", ".join(f"{b.path}:{b.start}" for b in blocks),
                    f"{len(blocks)}/0",
                    leftover_blocks=tuple(blocks),
                )
            )
    for state in report.algorithms:
        if state.status == BROKEN:
            report.problems.append(
                f"fence of {state.name} broken: {state.detail}; restore the fence lines "
                "(see `scaffold diff`)"
            )
        elif state.status == DUPLICATED:
            report.problems.append(
                f"{state.name} is duplicated: {state.detail}; keep one copy of each block"
            )
    deleted = {s.name for s in report.algorithms if s.status in (DELETED, BROKEN)}
    for pristine, user in files:
        _check_markers(pristine, user, report)
        _config_fields(pristine, user, deleted, report)
    return report


# --- pristine render ---------------------------------------------------------------------------


def remove_blockers(report: Report, algorithm: str) -> list[str]:
    """Why removing `algorithm` by a 3-way merge would leave the user's version of its code behind."""
    state = report.state(algorithm)
    if state is None or state.status not in (EDITED, MOVED):
        return []
    why = []
    for old, new in state.edited_blocks:
        shown = "\n".join(f"    {line}" for line in new.text.splitlines())
        why.append(
            f"{new.path}:{new.start}-{new.end} ({new.where}) differs from the generated block:\n{shown}"
        )
    if state.status == MOVED:
        why.append(f"blocks were moved ({state.detail})")
    return why


def add_blockers(report: Report, algorithm: str) -> list[str]:
    state = report.state(algorithm)
    if state is not None and state.status == UNLISTED:
        return [
            f"the project already has fenced `# algorithm: {algorithm}` blocks ({state.detail}) that "
            f"{ANSWERS_FILE} does not list; delete them (or rename their fences) first"
        ]
    return []
