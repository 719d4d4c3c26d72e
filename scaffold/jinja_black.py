"""A jinja `black` filter, so generated Python is formatted *inside* rendering.

copier's update re-renders the old and new template versions and 3-way merges them with the
user's files; formatting after rendering would be invisible to that baseline and turn into
spurious conflicts (DESIGN.md §8.3). Each `.py.jinja` wraps its body in `{% filter black %}`.
"""

from __future__ import annotations

import functools

import black
from jinja2 import Environment
from jinja2.ext import Extension

# Fixed, so that the same template renders the same bytes whatever Python runs black.
BLACK_MODE = black.Mode(target_versions={black.TargetVersion.PY310}, line_length=88)


@functools.lru_cache(maxsize=64)
def format_python(source: str) -> str:
    """Format generated Python with black; a syntax error names the offending line.

    Cached: an update renders the old and the new template version (and copier renders some
    of them twice), mostly the same files; black is most of an upgrade's time otherwise.
    """
    try:
        return black.format_str(source, mode=BLACK_MODE)
    except black.InvalidInput as error:  # a template bug, never user input
        numbered = "\n".join(
            f"{i + 1:4d} {line}" for i, line in enumerate(source.splitlines())
        )
        raise ValueError(
            f"template rendered invalid Python ({error}):\n{numbered}"
        ) from error


class BlackExtension(Extension):
    """Registers `black` and `repr` filters in copier's jinja environment (`_jinja_extensions`).

    `repr` renders a user-supplied value as a Python literal, properly escaped, never pasted.
    """

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        environment.filters["black"] = format_python
        environment.filters["repr"] = repr
