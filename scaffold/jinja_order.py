"""Jinja filters over the catalog of the template being rendered: `in_catalog_order` (the
selected algorithms in the order their code runs), `algorithm` (a name's catalog entry:
its declared hyperparameters, ranges, spots, `replaces`, architecture phrase) and
`task_events` (the loop events an algorithm of the catalog can act at in a task: the ones
train.py marks).

The order of the `algorithms` answer is not to be trusted: `scaffold new` passes it in catalog
order, but copier writes `.copier-answers.yml` with sorted keys, so every later render (upgrade,
add, remove, check, diff) reads it back alphabetically. Blocks placed in that order would move
in the user's files. The templates therefore order the names themselves, by the catalog of the
template being rendered (its algorithm.toml `before`/`after`, ties alphabetical), read from
those declarations alone: `scaffold upgrade` re-renders older template versions, whose packs
this catalog code need not otherwise understand (they never use the `algorithm` filter).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import Environment, pass_environment
from jinja2.ext import Extension

if TYPE_CHECKING:
    from scaffold.catalog import Algorithm


@functools.lru_cache(maxsize=16)
def _catalog(template_root: str) -> dict[str, Algorithm]:
    from scaffold.catalog import load_algorithms

    return load_algorithms(Path(template_root))


@functools.lru_cache(maxsize=16)
def _order(template_root: str) -> tuple[str, ...]:
    from scaffold.catalog import declared_order

    return tuple(declared_order(Path(template_root)))


def _template_root(environment: Environment) -> str:
    searchpath = getattr(environment.loader, "searchpath", None) or ["."]
    return str(searchpath[0])


def _template_catalog(environment: Environment) -> dict[str, Algorithm]:
    return _catalog(_template_root(environment))


@pass_environment
def in_catalog_order(environment: Environment, algorithms: Iterable[str]) -> list[str]:
    """`algorithms`' names in catalog order (names the catalog lacks keep theirs, last)."""
    names = list(algorithms)
    order = [name for name in _order(_template_root(environment)) if name in names]
    return order + [name for name in names if name not in order]


@pass_environment
def algorithm(environment: Environment, name: str) -> Algorithm:
    """The catalog entry of algorithm `name` in the template being rendered (an empty one for
    a name it lacks: an algorithm since removed from the template writes nothing)."""
    from scaffold.catalog import Algorithm

    return _template_catalog(environment).get(name) or Algorithm(name, "")


@pass_environment
def task_events(environment: Environment, task: str) -> tuple[str, ...]:
    """The loop events where an algorithm of the template's catalog can act in `task`."""
    from scaffold.catalog import task_events as events

    return events(_template_catalog(environment), task)


class CatalogOrderExtension(Extension):
    """Registers `in_catalog_order`, `algorithm` and `task_events` in copier's jinja environment
    (`_jinja_extensions`)."""

    def __init__(self, environment: Environment) -> None:
        super().__init__(environment)
        environment.filters["in_catalog_order"] = in_catalog_order
        environment.filters["algorithm"] = algorithm
        environment.filters["task_events"] = task_events
