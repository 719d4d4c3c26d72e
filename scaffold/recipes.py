"""Recipes: TOML files of copier answers plus `[algorithms.<name>]` tables of hyperparameters.

Shipped recipes live in `templates/recipes/`; users copy and edit them, or pass their own
file. `--set key=value` (and `--set algorithm.key=value`) overrides a recipe's values before
they are resolved into a project's answers (`scaffold.answers`).
"""

from __future__ import annotations

import difflib
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class RecipeError(ValueError):
    """A recipe, an algorithm choice or a `--set` override is wrong; the message says how to fix it."""


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    answers: dict[str, Any]
    algorithms: dict[str, dict[str, Any]]


def did_you_mean(word: str, options: list[str] | tuple[str, ...]) -> str:
    """A hint naming the option closest to `word`, " (did you mean 'x'?)", or "" if none is."""
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def recipe_paths(template: Path) -> dict[str, Path]:
    paths = sorted((template / "recipes").glob("*.toml"), key=lambda path: path.stem)
    return {path.stem: path for path in paths}


def load_recipe(name_or_path: str, template: Path) -> Recipe:
    """A shipped recipe by name, or a recipe file by path (anything with a `/` or ending in .toml)."""
    shipped = recipe_paths(template)
    if name_or_path in shipped:
        path = shipped[name_or_path]
    elif "/" in name_or_path or name_or_path.endswith(".toml"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise RecipeError(
                f"recipe file {path} does not exist; pass a shipped recipe name "
                f"({', '.join(shipped)}) or the path of a .toml recipe file"
            )
    else:
        raise RecipeError(
            f"unknown recipe '{name_or_path}'{did_you_mean(name_or_path, list(shipped))}; "
            f"known recipes: {', '.join(shipped)} (or pass a path to a .toml recipe file)"
        )
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise RecipeError(
            f"recipe {path} is not valid TOML: {error}; fix the file"
        ) from error
    unknown = sorted(set(data) - {"description", "answers", "algorithms"})
    if unknown:
        raise RecipeError(
            f"recipe {path}: unknown top-level key '{unknown[0]}'; a recipe has only "
            "`description`, `[answers]` and `[algorithms.<name>]` tables"
        )
    algorithms = data.get("algorithms", {})
    if not isinstance(algorithms, dict) or not all(
        isinstance(v, dict) for v in algorithms.values()
    ):
        raise RecipeError(
            f"recipe {path}: write each algorithm as a table, e.g. [algorithms.alibi]"
        )
    return Recipe(
        name=path.stem,
        description=str(data.get("description", "")),
        answers=dict(data.get("answers", {})),
        algorithms={name: dict(params) for name, params in algorithms.items()},
    )


def parse_override(text: str) -> tuple[str, Any]:
    """`--set key=value`: the value is read as TOML (3e-4, true, "x") and otherwise kept as a string."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(
            f"--set '{text}' is not key=value; write e.g. --set lr=3e-4 or "
            "--set seq_length_warmup.min_len=16"
        )
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def apply_overrides(recipe: Recipe, overrides: list[str]) -> Recipe:
    answers = dict(recipe.answers)
    algorithms = {name: dict(params) for name, params in recipe.algorithms.items()}
    for text in overrides:
        key, value = parse_override(text)
        if "." in key:
            algorithm, _, param = key.partition(".")
            if algorithm not in algorithms:
                raise RecipeError(
                    f"--set {key}: algorithm '{algorithm}' is not in recipe "
                    f"'{recipe.name}' (it has: {', '.join(algorithms) or 'none'})"
                )
            algorithms[algorithm][param] = value
        else:
            answers[key] = value
    return Recipe(recipe.name, recipe.description, answers, algorithms)
