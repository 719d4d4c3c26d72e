"""`scaffold check` and `scaffold diff`: what the user changed in the generated code.

Both compare the project with a *pristine render*: the project's own recorded template version
rendered with its recorded answers into a temporary folder (from the template history, as
`scaffold upgrade` uses it). Python files are read with libcst, which keeps comments (the
`ast` module drops them), so the `# event: NAME` markers and the `# algorithm: NAME` ...
`# end algorithm: NAME` fences are real comments, never text inside a string or docstring.

An algorithm usually has several blocks (a Config field, a check, the code at its event, a
metric, model code); they are compared with the pristine blocks one by one, per file. What
`upgrade`, `add` and `remove` cannot work around is a *problem* (a broken or duplicated fence, a
missing or reordered event marker, a Config field an algorithm reads but the user removed, a
file that does not parse); an edited, moved or deleted block is a *note*: the 3-way merge keeps
it, except that `remove` of such an algorithm asks for `--force` (see `remove_blockers`).
"""

from __future__ import annotations

import difflib
import re
import tempfile
import textwrap
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

FENCE_START = re.compile(r"#\s*algorithm:\s*(\S+)\s*$")
FENCE_END = re.compile(r"#\s*end algorithm:\s*(\S+)\s*$")
EVENT = re.compile(r"#\s*event:\s*(\S+)\s*$")
ANSWERS_FILE = ".copier-answers.yml"

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


class CheckError(RuntimeError):
    """The project cannot be checked at all (not a scaffold project...); the message says why."""


# --- reading one Python file -------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One fenced algorithm block: lines `start`..`end` (1-based, fences included)."""

    algorithm: str
    path: str
    start: int
    end: int
    text: str  # the lines inside the fences, dedented (a block moved to another depth is the same)
    event: str  # the nearest `# event:` marker above the block ("" if none)
    scope: str  # the enclosing class/function, e.g. "GPT.forward" ("" at module level)
    above: str = (
        ""  # the nearest line of code above the block, outside every fence (stripped)
    )
    below: str = ""  # and below it

    def moved_from(self, other: Block) -> bool:
        """Whether this block stands elsewhere than `other`: another event or scope, or new
        neighbours on both sides (a line added next to a block does not move it)."""
        if (self.event, self.scope) != (other.event, other.scope):
            return True
        return self.above != other.above and self.below != other.below

    @property
    def where(self) -> str:
        return " ".join(
            part
            for part in (
                self.scope or "module",
                f"after {self.event}" if self.event else "",
            )
            if part
        )


@dataclass
class PyFile:
    """What check needs from one Python file: markers, fenced blocks, fence errors, Config fields."""

    path: str
    lines: list[str]
    events: list[tuple[str, int]] = field(
        default_factory=list
    )  # (name, line) in file order
    blocks: list[Block] = field(default_factory=list)
    fence_errors: list[tuple[str, str]] = field(
        default_factory=list
    )  # (algorithm, what is wrong)
    config_fields: list[str] | None = None  # None: no `class Config` here
    scopes: list[tuple[int, int, str]] = field(
        default_factory=list
    )  # (def line, last line, "GPT.forward")
    syntax_error: str = ""


class _Collector(cst.CSTVisitor):
    """Own-line comments with their enclosing scope, and the fields of `class Config`."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self) -> None:
        self.comments: list[tuple[int, int, str]] = []  # (line, column, text)
        self.scopes: list[tuple[int, int, int, str]] = (
            []
        )  # (first body line, last line, body column, name)
        self._names: list[str] = []
        self.config_fields: list[str] | None = None

    def _enter(self, node: cst.FunctionDef | cst.ClassDef) -> None:
        self._names.append(node.name.value)
        span = self.get_metadata(PositionProvider, node)
        body = node.body
        if isinstance(body, cst.IndentedBlock) and body.body:
            column = self.get_metadata(PositionProvider, body.body[0]).start.column
            header = self.get_metadata(PositionProvider, node.name).start.line
            self.scopes.append(
                (header + 1, span.end.line, column, ".".join(self._names))
            )

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        if node.name.value == "Config" and len(self._names) == 0:
            self.config_fields = [
                stmt.body[0].target.value
                for stmt in (
                    node.body.body if isinstance(node.body, cst.IndentedBlock) else []
                )
                if isinstance(stmt, cst.SimpleStatementLine)
                and isinstance(stmt.body[0], cst.AnnAssign)
                and isinstance(stmt.body[0].target, cst.Name)
            ]
        self._enter(node)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self._names.pop()

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._enter(node)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self._names.pop()

    def visit_Comment(self, node: cst.Comment) -> None:
        start = self.get_metadata(PositionProvider, node).start
        self.comments.append((start.line, start.column, node.value))

    def scope_of(self, line: int, column: int) -> str:
        inside = [
            (first, name)
            for first, last, col, name in self.scopes
            if first <= line <= last and column >= col
        ]
        return max(inside)[1] if inside else ""


def read_py(path: str, source: str) -> PyFile:
    """Parse one Python file with libcst and collect its markers, fences and Config fields."""
    lines = source.splitlines()
    found = PyFile(path, lines)
    if not re.search(
        r"#\s*(end )?algorithm:|#\s*event:|^class Config\b|^<<<<<<< ", source, re.M
    ):
        return found  # nothing to compare: skip the parse
    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError as error:
        found.syntax_error = f"{path} does not parse (line {error.raw_line}: {error.message.splitlines()[0]})"
        return found
    collector = _Collector()
    MetadataWrapper(module, unsafe_skip_copy=True).visit(collector)
    found.config_fields = collector.config_fields
    found.scopes = [
        (first - 1, last, name) for first, last, _, name in collector.scopes
    ]
    open_: tuple[str, int] | None = None
    last_event = ""
    for line, column, text in sorted(collector.comments):
        if lines[line - 1].strip() != text.strip():
            continue  # a trailing comment after code: not a marker
        if match := EVENT.match(text):
            last_event = match[1]
            found.events.append((match[1], line))
        elif match := FENCE_START.match(text):
            if open_ is not None:
                found.fence_errors.append(
                    (
                        open_[0],
                        f"{path}:{open_[1]}: `# algorithm: {open_[0]}` has no "
                        f"`# end algorithm: {open_[0]}` before line {line}",
                    )
                )
            open_ = (match[1], line)
            open_event, open_scope = last_event, collector.scope_of(line, column)
        elif match := FENCE_END.match(text):
            name = match[1]
            if open_ is None:
                found.fence_errors.append(
                    (
                        name,
                        f"{path}:{line}: `# end algorithm: {name}` has no "
                        f"`# algorithm: {name}` above it",
                    )
                )
            elif open_[0] != name:
                found.fence_errors.append(
                    (
                        open_[0],
                        f"{path}:{open_[1]}: `# algorithm: {open_[0]}` is "
                        f"closed by `# end algorithm: {name}` (line {line})",
                    )
                )
                found.fence_errors.append(
                    (
                        name,
                        f"{path}:{line}: `# end algorithm: {name}` closes "
                        f"`# algorithm: {open_[0]}`",
                    )
                )
                open_ = None
            else:
                body = textwrap.dedent("\n".join(lines[open_[1] : line - 1])).strip(
                    "\n"
                )
                found.blocks.append(
                    Block(name, path, open_[1], line, body, open_event, open_scope)
                )
                open_ = None
    if open_ is not None:
        found.fence_errors.append(
            (
                open_[0],
                f"{path}:{open_[1]}: `# algorithm: {open_[0]}` has no "
                f"`# end algorithm: {open_[0]}`",
            )
        )
    fenced = {
        line for block in found.blocks for line in range(block.start, block.end + 1)
    }
    host = [
        number
        for number in range(1, len(lines) + 1)
        if number not in fenced and lines[number - 1].strip()
    ]
    found.blocks = [
        replace(
            block,
            above=next(
                (lines[n - 1].strip() for n in reversed(host) if n < block.start), ""
            ),
            below=next((lines[n - 1].strip() for n in host if n > block.end), ""),
        )
        for block in found.blocks
    ]
    return found


# --- the check ---------------------------------------------------------------------------------


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


def _py_files(root: Path) -> list[str]:
    return sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*.py")
        if ".git" not in p.relative_to(root).parts
    )


def _project_py_files(project: Path) -> list[str]:
    """The project's Python files that git does not ignore (not runs/, not caches)."""
    import subprocess

    listed = subprocess.run(
        [
            "git",
            "ls-files",
            "--cached",
            "--others",
            "--exclude-standard",
            "-z",
            "--",
            "*.py",
        ],
        cwd=project,
        capture_output=True,
        text=True,
    )
    if listed.returncode != 0:  # not a git work tree
        return [p for p in _py_files(project) if not p.startswith(("runs/", "."))]
    return sorted(p for p in listed.stdout.split("\0") if p and (project / p).is_file())


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
    paths = sorted(set(_py_files(pristine_root)) | set(_project_py_files(project)))
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


def read_answers(project: Path) -> dict[str, Any]:
    import yaml

    path = project / ANSWERS_FILE
    if not path.is_file():
        raise CheckError(
            f"{project} has no {ANSWERS_FILE}, so it was not generated by `scaffold new` "
            "(or the file was deleted: restore it from git history)"
        )
    try:
        answers = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise CheckError(
            f"{path} is not valid YAML ({error}); restore it from git history"
        ) from None
    if not isinstance(answers, dict):
        raise CheckError(f"{path} holds no answers; restore it from git history")
    return answers


@contextmanager
def pristine_render(answers: dict[str, Any], version: str) -> Iterator[Path]:
    """The project as template `version` renders it with `answers`, in a temporary folder."""
    from scaffold.history import has_version, history_path
    from scaffold.render import render_version

    if not has_version(history_path(), version):
        raise CheckError(
            f"the template history does not hold version {version}, which the project records; "
            f"install a scaffold release that knows it (pip install 'scaffold>={version}')"
        )
    data = {key: value for key, value in answers.items() if not key.startswith("_")}
    with tempfile.TemporaryDirectory(prefix="scaffold-pristine.") as scratch:
        dest = Path(scratch) / "project"
        try:
            render_version(data, dest, version)
        except Exception as error:  # copier's and jinja's errors share no base class
            raise CheckError(
                f"template {version} cannot render this project's answers ({' '.join(str(error).split())}); "
                f"restore {ANSWERS_FILE} from git history"
            ) from None
        yield dest


def _prepare(project: Path) -> tuple[Path, dict[str, Any], str]:
    from scaffold.render import installed_release

    project = project.expanduser().absolute()
    if not project.is_dir():
        raise CheckError(
            f"{project} is not a folder; pass the folder of a scaffold project"
        )
    answers = read_answers(project)
    if not answers.get("_commit"):
        raise CheckError(
            f"{project / ANSWERS_FILE} records no template version (_commit); restore "
            "the file from git history"
        )
    installed_release().prepare_history()
    return project, answers, str(answers["_commit"])


def check(project: Path) -> Report:
    """`scaffold check`: the project's markers, fences and Config fields against a pristine render."""
    project, answers, version = _prepare(project)
    with pristine_render(answers, version) as pristine:
        return compare(project, pristine, answers, version)


# --- the diff ----------------------------------------------------------------------------------


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
    project, answers, version = _prepare(project)
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


# --- what upgrade, add and remove need ---------------------------------------------------------


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
    import subprocess

    changed = []
    for relpath in _project_py_files(project):
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
