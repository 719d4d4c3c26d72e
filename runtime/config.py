"""Fill a training script's `Config` dataclass from the command line and a TOML file.

    cfg = config.parse(Config)        # reads sys.argv[1:], exits with a message on error

A value a field's type refuses can carry its own fix, said instead of "expected an integer":
    config.parse(Config, refusals={"device_microbatch_size": {"auto": "why; the fix"}})

Accepted forms: --key=value, --key value, bare --flag for bool fields, and
--config FILE.toml (a flat table of field names, applied first so that
command-line values win). Values are converted by the field's type hint:
str, int, float, bool, Time, Literal[...] and unions of these.

Why not tyro: its errors are multi-line panels (only suppressible, not reformattable, so a
bad value could not stay one `error:` line naming the key), its flags are --dashed-names
with --flag/--no-flag booleans (`--compile=true` is refused), it reads no TOML file, and
Time needs a custom constructor. Writing TOML is tomli-w's job (escaping, nan/inf, keys).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import io
import os
import re
import sys
import textwrap
import time
import tokenize
import tomllib
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

import tomli_w

from .time import Time, TimeError

T = TypeVar("T")

CONFIG_OPTION = "config"
_TRUE_WORDS = frozenset({"true", "1", "yes", "on"})
_FALSE_WORDS = frozenset({"false", "0", "no", "off"})
_HELP_HINT = "run with --help to list keys"
# How long ranks other than 0 hold a bad-configuration exit for rank 0 to print it (fail).
VERDICT_WAIT_S = 20.0


class ConfigError(ValueError):
    """A one-line, user-facing problem with the command line or config file."""


# ---------------------------------------------------------------- type hints


def _is_literal(hint: Any) -> bool:
    return typing.get_origin(hint) is Literal


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def _union_members(hint: Any) -> list[Any]:
    # Literal members first: "auto" must not be tried as an int and rejected
    members = list(typing.get_args(hint))
    return [m for m in members if _is_literal(m)] + [
        m for m in members if not _is_literal(m)
    ]


def _type_name(hint: Any) -> str:
    """Short name for --help, e.g. int, Time, {a,b}, int | {auto}."""
    if hint in (str, int, float, bool, Time):
        return hint.__name__
    if _is_literal(hint):
        return "{" + ",".join(str(choice) for choice in typing.get_args(hint)) + "}"
    if _is_union(hint):
        return " | ".join(_type_name(member) for member in typing.get_args(hint))
    raise TypeError(
        f"unsupported config field type {hint!r}; "
        "use str, int, float, bool, Time, Literal or a union of these"
    )


def _expected(hint: Any) -> str:
    """What a value must look like, for error messages."""
    if hint is str:
        return "a string"
    if hint is int:
        return "an integer (e.g. 8 or 1_000)"
    if hint is float:
        return "a number (e.g. 0.1 or 3e-4)"
    if hint is bool:
        return "true or false"
    if hint is Time:
        return "a Time (e.g. 2000ba, 10ep, 0.25dur)"
    if _is_literal(hint):
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(hint))
    if _is_union(hint):
        return " or ".join(_expected(member) for member in _union_members(hint))
    raise TypeError(f"unsupported config field type {hint!r}")


# ---------------------------------------------------------------- conversion


def _from_text(text: str, hint: Any) -> Any:
    """Convert command-line text to `hint`; ValueError says what was expected."""
    if hint is str:
        return text
    if hint is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected {_expected(int)}") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected {_expected(float)}") from None
    if hint is bool:
        word = text.strip().lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
        raise ValueError("expected true or false (also yes/no, on/off, 1/0)")
    if hint is Time:
        return Time.parse(text)  # TimeError already explains the fix
    if _is_literal(hint):
        for choice in typing.get_args(hint):
            if text == str(choice):
                return choice
        raise ValueError(f"expected {_expected(hint)}")
    if _is_union(hint):
        for member in _union_members(hint):
            try:
                return _from_text(text, member)
            except ValueError:
                continue
        raise ValueError(f"expected {_expected(hint)}")
    raise TypeError(f"unsupported config field type {hint!r}")


def _from_toml(value: Any, hint: Any) -> Any:
    """Check an already-typed TOML value against `hint`; strings are parsed for Time/Literal/unions."""
    if isinstance(value, str) and (
        hint is Time or _is_literal(hint) or _is_union(hint)
    ):
        return _from_text(value, hint)
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if (
        hint is float
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
    ):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    if _is_literal(hint) and any(
        value == c and type(value) is type(c) for c in typing.get_args(hint)
    ):
        return value
    if _is_union(hint):
        for member in _union_members(hint):
            try:
                return _from_toml(value, member)
            except ValueError:
                continue
    raise ValueError(f"expected {_expected(hint)}")


# ---------------------------------------------------------------- parsing


def _normalize_key(key: str) -> str:
    return key.replace("-", "_")


def _init_fields(cls: type) -> list[dataclasses.Field[Any]]:
    return [field for field in dataclasses.fields(cls) if field.init]


def _field_hints(cls: type) -> dict[str, Any]:
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"expected a dataclass type, got {cls!r}")
    hints = typing.get_type_hints(cls)
    result = {field.name: hints[field.name] for field in _init_fields(cls)}
    for hint in result.values():
        _type_name(hint)  # fail early on a type the parser cannot handle
    return result


# Keys a project has only where it was generated with an answer: {key: what adds them}.
ANSWER_KEYS = {
    "tensor_parallel": (
        "this project was generated without tensor parallelism; add it with `scaffold "
        "set tensor_parallel=true` (your edits are kept; GPT and Hugging Face causal-LM "
        "projects)"
    ),
}


def _unknown_key_message(key: str, known: Sequence[str], where: str) -> str:
    if key in ANSWER_KEYS:
        return f"unknown config key {key!r}{where}: {ANSWER_KEYS[key]}"
    close = difflib.get_close_matches(key, known, n=1)
    suggestion = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown config key {key!r}{where}{suggestion}; {_HELP_HINT}"


def _scan_argv(
    argv: Sequence[str], hints: dict[str, Any]
) -> tuple[dict[str, str], str | None]:
    """Split argv into raw {field: text} values and the --config path; no conversion yet."""
    raw: dict[str, str] = {}
    config_path: str | None = None
    index = 0
    while index < len(argv):
        arg = argv[index]
        index += 1
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(
                f"unexpected argument {arg!r}; options are written --key=value ({_HELP_HINT})"
            )
        key, has_equals, value = arg[2:].partition("=")
        name = _normalize_key(key)
        if not name:
            raise ConfigError(f"empty option name in {arg!r}; write --key=value")
        if name != CONFIG_OPTION and name not in hints:
            raise ConfigError(_unknown_key_message(name, list(hints), ""))
        if name in raw or (name == CONFIG_OPTION and config_path is not None):
            raise ConfigError(
                f"duplicate key --{name} on the command line; give it once"
            )
        if not has_equals:
            next_arg = argv[index] if index < len(argv) else None
            if hints.get(name) is bool and name != CONFIG_OPTION:
                # a bare flag means true; "--flag false" is also understood
                if (
                    next_arg is not None
                    and next_arg.lower() in _TRUE_WORDS | _FALSE_WORDS
                ):
                    value = next_arg
                    index += 1
                else:
                    value = "true"
            elif next_arg is None or next_arg.startswith("--"):
                raise ConfigError(f"missing value for --{name}; write --{name}=VALUE")
            else:
                value = next_arg
                index += 1
        if name == CONFIG_OPTION:
            if not value:
                raise ConfigError(
                    "missing value for --config; write --config=FILE.toml"
                )
            config_path = value
        else:
            raw[name] = value
    return raw, config_path


# A field's refused values that carry their own fix: {field: {value as text: why and fix}}.
Refusals = Mapping[str, Mapping[str, str]]


def _refusal(refusals: Refusals | None, name: str, value: object) -> str | None:
    return (refusals or {}).get(name, {}).get(str(value))


def _read_toml(
    path: str, hints: dict[str, Any], refusals: Refusals | None = None
) -> dict[str, Any]:
    """Load and type-check a flat TOML config file."""
    try:
        with open(path, "rb") as file:
            table = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(
            f"config file {path!r} not found; check the path given to --config"
        ) from None
    except OSError as error:
        raise ConfigError(
            f"cannot read config file {path!r}: {error.strerror}; check the path and its permissions"
        ) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        detail = " ".join(str(error).split())
        raise ConfigError(
            f"invalid TOML in config file {path!r}: {detail}; fix the file's syntax"
        ) from None
    values: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            raise ConfigError(
                f"key {key!r} in config file {path!r} is a table; the file must be flat key = value lines"
            )
        name = _normalize_key(key)
        if name not in hints:
            raise ConfigError(
                _unknown_key_message(name, list(hints), f" in config file {path!r}")
            )
        if name in values:
            raise ConfigError(
                f"key {name!r} appears twice in config file {path!r}; keep one"
            )
        try:
            values[name] = _from_toml(value, hints[name])
        except ValueError as error:
            why = _refusal(refusals, name, value) or error
            raise ConfigError(
                f"bad value {value!r} for key {key!r} in config file {path!r}: {why}"
            ) from None
    return values


def from_args(cls: type[T], argv: Sequence[str], refusals: Refusals | None = None) -> T:
    """Build `cls` from command-line arguments (and the --config file they name)."""
    hints = _field_hints(cls)
    raw, config_path = _scan_argv(argv, hints)
    values = {}
    if config_path is not None:
        values = _read_toml(config_path, hints, refusals)
    for name, text in raw.items():
        try:
            values[name] = _from_text(text, hints[name])
        except TimeError as error:
            raise ConfigError(f"bad value for --{name}: {error}") from None
        except ValueError as error:
            why = _refusal(refusals, name, text) or error
            raise ConfigError(f"bad value {text!r} for --{name}: {why}") from None
    for field in _init_fields(cls):
        required = (
            field.default is dataclasses.MISSING
            and field.default_factory is dataclasses.MISSING
        )
        if required and field.name not in values:
            raise ConfigError(
                f"missing value for required key --{field.name}; pass --{field.name}=VALUE"
            )
    return cls(**values)


# ---------------------------------------------------------------- help


def field_comments(cls: type) -> dict[str, str]:
    """The trailing `# comment` of each field line in the class source ({} if the source is unavailable)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError, SyntaxError):
        return {}
    comments: dict[str, str] = {}
    depth = 0
    at_line_start = True
    current_field: str | None = None
    for position, token in enumerate(tokens):
        if token.type == tokenize.INDENT:
            depth += 1
        elif token.type == tokenize.DEDENT:
            depth -= 1
        elif token.type == tokenize.NEWLINE:
            current_field = None
            at_line_start = True
            continue
        elif token.type == tokenize.COMMENT and current_field is not None:
            comments.setdefault(current_field, token.string.lstrip("#").strip())
        elif token.type == tokenize.NAME and at_line_start and depth == 1:
            following = tokens[position + 1] if position + 1 < len(tokens) else None
            if (
                following is not None
                and following.type == tokenize.OP
                and following.string == ":"
            ):
                current_field = token.string
        if token.type not in (
            tokenize.INDENT,
            tokenize.DEDENT,
            tokenize.NL,
            tokenize.COMMENT,
        ):
            at_line_start = False
    return comments


def _format_default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    return repr(value) if isinstance(value, str) else str(value)


def format_help(cls: type, prog: str = "train.py") -> str:
    """Usage text listing every field with its type, default and source comment."""
    hints = _field_hints(cls)
    comments = field_comments(cls)
    rows = [
        (
            "--config",
            "FILE.toml",
            "",
            "read values from a flat TOML file; command-line values win",
        )
    ]
    for field in _init_fields(cls):
        name, type_name = f"--{field.name}", _type_name(hints[field.name])
        rows.append(
            (
                name,
                type_name,
                f"default {_format_default(field)}",
                comments.get(field.name, ""),
            )
        )
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    lines = [f"usage: {prog} [--config FILE.toml] [--key=value ...]", "", "options:"]
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        lines.append(("  " + "  ".join(cells) + "  " + row[3]).rstrip())
    lines.append("")
    lines.append(
        "Keys may use dashes or underscores; bool keys given bare (--flag) mean true."
    )
    return "\n".join(lines) + "\n"


def parse(
    cls: type[T],
    argv: Sequence[str] | None = None,
    refusals: Refusals | None = None,
) -> T:
    """from_args() for scripts: prints help or a one-line error and exits instead of raising."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        prog = (
            sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else "train.py"
        )
        sys.stdout.write(format_help(cls, prog))
        raise SystemExit(0)
    try:
        return from_args(cls, args, refusals)
    except ConfigError as error:
        fail(str(error))


def fail(message: str, status: int = 2) -> typing.NoReturn:
    """Reject a configuration: one `error: ...` line on stderr, exit status 2 (as argparse does;
    `status` for other failures, such as storage).

    Under torchrun every rank reaches the same verdict; only rank 0 prints it. torchrun
    stops every rank as soon as one exits, so for a bad configuration (status 2) the other
    ranks wait up to VERDICT_WAIT_S first: rank 0 prints its line and exits, and torchrun
    stops them then.
    """
    if os.environ.get("RANK", "0") == "0":
        print("error: " + " ".join(message.splitlines()), file=sys.stderr)
    elif status == 2:
        time.sleep(VERDICT_WAIT_S)
    raise SystemExit(status)


@contextlib.contextmanager
def failing(*errors: type[Exception], prefix: str = "") -> Iterator[None]:
    """Inside, an error of these types (a bad path, a bad value: the user's input) is
    `fail(prefix + message)`: one line and exit status 2, instead of a traceback."""
    try:
        yield
    except errors as error:
        fail(f"{prefix}{error}")


# ---------------------------------------------------------------- declared ranges

# An interval: brackets closed, parentheses open, inf allowed ("[0, 1)", "(0, inf)", "[1, 10]").
# Declared once per hyperparameter in the template's algorithm.toml, checked by scaffold when a
# project is generated and, with the same text, by the generated setup() at run time.
_INTERVAL = re.compile(
    r"([\[(])\s*(-?inf|[-+0-9.e]+)\s*,\s*(-?inf|[-+0-9.e]+)\s*([\])])"
)


def _interval(text: str) -> tuple[bool, float, float, bool]:
    """(low closed, low, high, high closed) of an interval; ValueError if it does not parse."""
    match = _INTERVAL.fullmatch(text.strip())
    if match is not None:
        try:
            return match[1] == "[", float(match[2]), float(match[3]), match[4] == "]"
        except ValueError:  # e.g. "1.2.3"
            pass
    raise ValueError(f'{text!r} is not an interval such as "[0, 1)" or "(0, inf)"')


def in_range(value: float, interval: str) -> bool:
    """Whether the number `value` lies in `interval` ("[0, 1)": 0 <= value < 1); never NaN.

    ValueError for an interval that does not parse (a template bug, never user input).
    """
    low_closed, low, high, high_closed = _interval(interval)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    above = value >= low if low_closed else value > low
    below = value <= high if high_closed else value < high
    return above and below


def check_ranges(cfg: object, **intervals: str) -> None:
    """Reject the first field of `cfg` outside its interval, e.g.
    `check_ranges(cfg, mixup_alpha="(0, inf)", mixup_prob="[0, 1]")`: one `error:` line naming
    the key, its value and the interval, exit status 2 (see `fail`)."""
    for key, interval in intervals.items():
        value = getattr(cfg, key)
        if not in_range(value, interval):
            fail(f"{key}={value!r} is outside its range {interval}")


# ---------------------------------------------------------------- output


def to_toml(cfg: object) -> str:
    """The config as a flat TOML document that `--config` reads back to an equal config."""
    table: dict[str, Any] = {}
    for field in _init_fields(type(cfg)):
        value = getattr(cfg, field.name)
        table[field.name] = str(value) if isinstance(value, Time) else value
    return tomli_w.dumps(table)
