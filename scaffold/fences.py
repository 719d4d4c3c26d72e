"""The markers and fences of one generated Python file, read with libcst.

libcst keeps comments (the `ast` module drops them), so the `# event: NAME` markers and the
`# algorithm: NAME` ... `# end algorithm: NAME` fences found here are real comments, never
text inside a string or docstring. `read_py` returns a file's markers, its fenced blocks with
where each stands (event, enclosing class or function, neighbouring lines), its broken fences
and the fields of its `class Config`.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, field, replace

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

FENCE_START = re.compile(r"#\s*algorithm:\s*(\S+)\s*$")
FENCE_END = re.compile(r"#\s*end algorithm:\s*(\S+)\s*$")
EVENT = re.compile(r"#\s*event:\s*(\S+)\s*$")


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
    """One Python file's markers, fenced blocks, fence errors and Config fields."""

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
