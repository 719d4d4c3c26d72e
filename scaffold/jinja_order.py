"""A jinja `in_catalog_order` filter: the selected algorithms in the order their code runs.

The order of the `algorithms` answer is not to be trusted: `scaffold new` passes it in catalog
order, but copier writes `.copier-answers.yml` with sorted keys, so every later render (upgrade,
add, remove, check, diff) reads it back alphabetically. Blocks placed in that order would move
in the user's files. The templates therefore order the names themselves, by the catalog of the
template being rendered (its algorithm.toml `before`/`after`, ties alphabetical).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path

from jinja2 import Environment, pass_environment
from jinja2.ext import Extension


@functools.lru_cache(maxsize=16)
def _catalog_names(template_root: str) -> tuple[str, ...]:
    from scaffold.catalog import declared_order

    return tuple(declared_order(Path(template_root)))


@pass_environment
def in_catalog_order(environment: Environment, algorithms: Iterable[str]) -> list[str]:
    """`algorithms`' names in catalog order (names the catalog lacks keep theirs, last)."""
    names = list(algorithms)
    searchpath = getattr(environment.loader, "searchpath", None) or ["."]
    order = [name for name in _catalog_names(str(searchpath[0])) if name in names]
    return order + [name for name in names if name not in order]


class CatalogOrderExtension(Extension):
    """Registers `in_catalog_order` in copier's jinja environment (`_jinja_extensions`)."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        environment.filters["in_catalog_order"] = in_catalog_order
