"""The algorithm catalog and recipes: loading, validation, and resolving a recipe into copier answers.

An algorithm is a folder `templates/algorithms/<name>/` with `algorithm.toml` (summary, events,
hyperparameters with defaults, requires, conflicts) and its snippets. A recipe is a TOML file of
copier answers plus `[algorithms.<name>]` tables of hyperparameters; users copy and edit them.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from runtime.time import Time, TimeError

# Answers scaffold computes itself; a recipe may not set them.
DERIVED_ANSWERS = ("project_name", "recipe", "algorithms")
HYPERPARAMETER_TYPES = ("int", "float", "bool", "str", "time")


class RecipeError(ValueError):
    """A recipe, an algorithm choice or a `--set` override is wrong; the message says how to fix it."""


@dataclass(frozen=True)
class Hyperparameter:
    name: str
    type: str
    default: Any
    help: str


@dataclass(frozen=True)
class Algorithm:
    name: str
    summary: str
    events: tuple[str, ...]
    files: tuple[str, ...]
    requires: tuple[str, ...]
    conflicts: tuple[str, ...]
    hyperparameters: dict[str, Hyperparameter] = field(default_factory=dict)


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    answers: dict[str, Any]
    algorithms: dict[str, dict[str, Any]]


def _suggest(word: str, options: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def load_algorithms(template: Path) -> dict[str, Algorithm]:
    """Every algorithm in the template, in catalog (alphabetical) order."""
    algorithms: dict[str, Algorithm] = {}
    for meta_path in sorted((template / "algorithms").glob("*/algorithm.toml")):
        meta = tomllib.loads(meta_path.read_text())
        name = meta_path.parent.name
        hyperparameters = {
            key: Hyperparameter(key, spec["type"], spec["default"], spec.get("help", ""))
            for key, spec in meta.get("hyperparameters", {}).items()
        }
        algorithms[name] = Algorithm(
            name=name,
            summary=meta["summary"],
            events=tuple(meta.get("events", ())),
            files=tuple(meta.get("files", ())),
            requires=tuple(meta.get("requires", ())),
            conflicts=tuple(meta.get("conflicts", ())),
            hyperparameters=hyperparameters,
        )
    return algorithms


def load_questions(template: Path) -> dict[str, dict[str, Any]]:
    """copier.yml's questions (keys not starting with `_`): the answers a recipe may set."""
    config = yaml.safe_load((template / "copier.yml").read_text())
    return {key: value for key, value in config.items() if not key.startswith("_")}


def recipe_paths(template: Path) -> dict[str, Path]:
    return {path.stem: path for path in sorted((template / "recipes").glob("*.toml"))}


def _answer_type(question: dict[str, Any]) -> str:
    """A question's type; a `str` question whose default is a Time string holds Time strings."""
    kind = question.get("type", "str")
    if kind == "str" and isinstance(question.get("default"), str):
        try:
            Time.parse(question["default"])
            return "time"
        except TimeError:
            pass
    return kind


def load_recipe(name_or_path: str, template: Path) -> Recipe:
    """A shipped recipe by name, or a recipe file by path (anything with a `/` or ending in .toml)."""
    shipped = recipe_paths(template)
    if name_or_path in shipped:
        path = shipped[name_or_path]
    elif "/" in name_or_path or name_or_path.endswith(".toml"):
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise RecipeError(f"recipe file {path} does not exist; pass a shipped recipe name "
                              f"({', '.join(shipped)}) or the path of a .toml recipe file")
    else:
        raise RecipeError(f"unknown recipe '{name_or_path}'{_suggest(name_or_path, list(shipped))}; "
                          f"known recipes: {', '.join(shipped)} (or pass a path to a .toml recipe file)")
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise RecipeError(f"recipe {path} is not valid TOML: {error}; fix the file") from error
    unknown = sorted(set(data) - {"description", "answers", "algorithms"})
    if unknown:
        raise RecipeError(f"recipe {path}: unknown top-level key '{unknown[0]}'; a recipe has only "
                          "`description`, `[answers]` and `[algorithms.<name>]` tables")
    algorithms = data.get("algorithms", {})
    if not isinstance(algorithms, dict) or not all(isinstance(v, dict) for v in algorithms.values()):
        raise RecipeError(f"recipe {path}: write each algorithm as a table, e.g. [algorithms.alibi]")
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
        raise RecipeError(f"--set '{text}' is not key=value; write e.g. --set lr=3e-4 or "
                          "--set seq_length_warmup.min_len=16")
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
                raise RecipeError(f"--set {key}: algorithm '{algorithm}' is not in recipe "
                                  f"'{recipe.name}' (it has: {', '.join(algorithms) or 'none'})")
            algorithms[algorithm][param] = value
        else:
            answers[key] = value
    return Recipe(recipe.name, recipe.description, answers, algorithms)


def _coerce(value: Any, kind: str, where: str) -> Any:
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "time": isinstance(value, str),
        "yaml": True,
    }[kind]
    if not ok:
        raise RecipeError(f"{where} = {value!r} must be of type {kind}; fix the recipe or the --set value")
    if kind == "float":
        return float(value)
    if kind == "time":
        try:
            return str(Time.parse(value))
        except TimeError as error:
            raise RecipeError(f"{where}: {error}") from error
    return value


def resolve(recipe: Recipe, template: Path, project_name: str) -> dict[str, Any]:
    """Validated, complete copier answers for a recipe: every default filled in, every name checked."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", project_name):
        raise RecipeError(f"project name '{project_name}' is not a valid name; use letters, digits, "
                          "'-' and '_', starting with a letter (e.g. my-gpt)")
    questions = load_questions(template)
    catalog = load_algorithms(template)

    answers: dict[str, Any] = {}
    for key, value in recipe.answers.items():
        if key in DERIVED_ANSWERS:
            raise RecipeError(f"recipe '{recipe.name}': '{key}' is set by scaffold itself; remove it")
        if key not in questions:
            raise RecipeError(f"recipe '{recipe.name}': unknown answer '{key}'"
                              f"{_suggest(key, list(questions))}; known answers: "
                              f"{', '.join(k for k in questions if k not in DERIVED_ANSWERS)}")
        question = questions[key]
        value = _coerce(value, _answer_type(question), f"answer '{key}'")
        choices = question.get("choices")
        if choices and value not in (list(choices.values()) if isinstance(choices, dict) else choices):
            raise RecipeError(f"answer '{key}' = {value!r} is not one of {', '.join(map(str, choices))}")
        answers[key] = value

    algorithms: dict[str, dict[str, Any]] = {}
    for name in sorted(recipe.algorithms, key=lambda n: list(catalog).index(n) if n in catalog else -1):
        if name not in catalog:
            raise RecipeError(f"recipe '{recipe.name}': unknown algorithm '{name}'"
                              f"{_suggest(name, list(catalog))}; run `scaffold algorithms` to list them")
        spec = catalog[name]
        params = dict(recipe.algorithms[name])
        for param in params:
            if param not in spec.hyperparameters:
                known = ", ".join(spec.hyperparameters) or "none"
                raise RecipeError(f"algorithm '{name}' has no hyperparameter '{param}'"
                                  f"{_suggest(param, list(spec.hyperparameters))}; it has: {known}")
        algorithms[name] = {
            key: _coerce(params.get(key, hp.default), hp.type, f"{name}.{key}")
            for key, hp in spec.hyperparameters.items()
        }
    for name in algorithms:
        for other in catalog[name].conflicts:
            if other in algorithms:
                raise RecipeError(f"algorithms '{name}' and '{other}' conflict and cannot be used "
                                  "together; remove one of them from the recipe")
        for needed in catalog[name].requires:
            if needed not in algorithms:
                raise RecipeError(f"algorithm '{name}' requires '{needed}'; add [algorithms.{needed}] "
                                  "to the recipe")
    return {"project_name": project_name, "recipe": recipe.name, **answers, "algorithms": algorithms}


def _in_catalog_order(algorithms: dict[str, dict[str, Any]], catalog: dict[str, Algorithm]) -> dict[str, dict[str, Any]]:
    """The order `resolve` writes, so removing then adding an algorithm gives back the same answers."""
    order = list(catalog)
    return {name: algorithms[name] for name in sorted(algorithms, key=lambda n: order.index(n) if n in order else -1)}


def add_algorithm(
    current: dict[str, dict[str, Any]], name: str, overrides: list[str], catalog: dict[str, Algorithm]
) -> dict[str, dict[str, Any]]:
    """A project's algorithm answers with `name` added (hyperparameters: defaults, then `overrides`)."""
    if name not in catalog:
        raise RecipeError(f"unknown algorithm '{name}'{_suggest(name, list(catalog))}; "
                          "run `scaffold algorithms` to list them")
    if name in current:
        raise RecipeError(f"algorithm '{name}' is already in this project; its hyperparameters are "
                          "Config fields in train.py: change them there")
    spec = catalog[name]
    for other in spec.conflicts:
        if other in current:
            raise RecipeError(f"algorithms '{name}' and '{other}' conflict and cannot be used together; "
                              f"remove '{other}' first (scaffold remove {other}) if you want '{name}'")
    for other in current:
        if other in catalog and name in catalog[other].conflicts:
            raise RecipeError(f"algorithms '{other}' and '{name}' conflict and cannot be used together; "
                              f"remove '{other}' first (scaffold remove {other}) if you want '{name}'")
    for needed in spec.requires:
        if needed not in current:
            raise RecipeError(f"algorithm '{name}' requires '{needed}'; add it first: scaffold add {needed}")
    params: dict[str, Any] = {}
    for text in overrides:
        key, value = parse_override(text)
        key = key.removeprefix(f"{name}.")  # `--set alibi.x=1` reads like `scaffold new`'s form
        if key not in spec.hyperparameters:
            known = ", ".join(spec.hyperparameters) or "none"
            raise RecipeError(f"algorithm '{name}' has no hyperparameter '{key}'"
                              f"{_suggest(key, list(spec.hyperparameters))}; it has: {known}")
        params[key] = value
    resolved = {
        key: _coerce(params.get(key, hp.default), hp.type, f"{name}.{key}")
        for key, hp in spec.hyperparameters.items()
    }
    return _in_catalog_order({**current, name: resolved}, catalog)


def remove_algorithm(
    current: dict[str, dict[str, Any]], name: str, catalog: dict[str, Algorithm]
) -> dict[str, dict[str, Any]]:
    """A project's algorithm answers without `name`; refused while another algorithm requires it."""
    if name not in current:
        present = ", ".join(current) or "none"
        raise RecipeError(f"algorithm '{name}' is not in this project{_suggest(name, list(current))}; "
                          f"it has: {present}")
    for other in current:
        if other != name and other in catalog and name in catalog[other].requires:
            raise RecipeError(f"algorithm '{other}' requires '{name}'; remove '{other}' first "
                              f"(scaffold remove {other})")
    return _in_catalog_order({key: value for key, value in current.items() if key != name}, catalog)
