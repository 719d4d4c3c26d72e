"""A project's copier answers: a recipe resolved into them, an algorithm added or removed.

Every answer is checked against copier.yml's questions and every algorithm against the catalog
(its tasks and model families, requires, conflicts, exclusive extension points, and each
hyperparameter's type, choices and range); a wrong one is a `RecipeError` naming the fix.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from runtime.time import Time, TimeError
from scaffold.catalog import (
    TRAIN_POINTS,
    Algorithm,
    Hyperparameter,
    ModelFamily,
    is_of_type,
    load_algorithms,
    load_models,
    load_tasks,
    within,
)
from scaffold.recipes import Recipe, RecipeError, did_you_mean, parse_override

# Answers scaffold computes itself; a recipe may not set them.
DERIVED_ANSWERS = ("project_name", "recipe", "algorithms")


def load_questions(template: Path) -> dict[str, dict[str, Any]]:
    """copier.yml's questions (keys not starting with `_`): the answers a recipe may set."""
    config = yaml.safe_load((template / "copier.yml").read_text())
    return {key: value for key, value in config.items() if not key.startswith("_")}


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


def _coerce(value: Any, kind: str, where: str) -> Any:
    if not is_of_type(value, kind):
        raise RecipeError(
            f"{where} = {value!r} must be of type {kind}; fix the recipe or the --set value"
        )
    if kind == "float":
        return float(value)
    if kind == "time":
        try:
            return str(Time.parse(value))
        except TimeError as error:
            raise RecipeError(f"{where}: {error}") from error
    return value


def _hyperparameter(hp: Hyperparameter, value: Any, where: str) -> Any:
    """A hyperparameter's value, checked against its type and (if declared) its choices and
    range."""
    value = _coerce(value, hp.type, where)
    if hp.choices and value not in hp.choices:
        raise RecipeError(
            f"{where} = {value!r} is not one of {', '.join(map(repr, hp.choices))}; "
            "fix the recipe or the --set value"
        )
    if hp.range and not within(value, hp.range):
        raise RecipeError(
            f"{where} = {value!r} is outside its range {hp.range}; "
            "fix the recipe or the --set value"
        )
    return value


def check_applies(
    name: str, spec: Algorithm, task: str, family: str, models: dict[str, ModelFamily]
) -> None:
    """Refuse an algorithm on a task or model family it does not declare, or whose extension
    points the family lacks."""
    if task not in spec.tasks:
        raise RecipeError(
            f"algorithm '{name}' does not apply to task '{task}' (it applies to: "
            f"{', '.join(spec.tasks) or 'none'}); remove it or pick another task"
        )
    if spec.models and family not in spec.models:
        raise RecipeError(
            f"algorithm '{name}' does not apply to model family '{family}' (it applies "
            f"to: {', '.join(spec.models)}); remove it or pick another model family"
        )
    touches_models = {
        spot.split(".")[1] for spot in spec.spots if spot.startswith("model.")
    }
    if touches_models and family not in touches_models:
        raise RecipeError(
            f"algorithm '{name}' changes the architecture of {', '.join(sorted(touches_models))} "
            f"models only; model family '{family}' has no place for it"
        )
    known = models[family].extension_points if family in models else {}
    for point in spec.model_points(family):
        if point not in known:
            raise RecipeError(
                f"algorithm '{name}' fills extension point '{point}', which model family "
                f"'{family}' lacks; remove the algorithm or pick another model family"
            )


def _check_exclusive_points(
    algorithms: list[str], catalog: dict[str, Algorithm], family: ModelFamily
) -> None:
    """Two algorithms cannot both replace the same default code in model.py (or train.py)."""
    owner: dict[str, str] = {}
    for name in algorithms:
        for point in (
            spot.split(".")[1]
            for spot in catalog[name].spots
            if spot.startswith("train.")
        ):
            if point in TRAIN_POINTS:
                if f"train.{point}" in owner:
                    raise RecipeError(
                        f"algorithms '{owner['train.' + point]}' and '{name}' both replace "
                        f"the {point} code of train.py; use one of them"
                    )
                owner[f"train.{point}"] = name
        for point in catalog[name].model_points(family.name):
            spec = family.extension_points.get(point)
            if spec is not None and spec.replaces:
                if point in owner:
                    raise RecipeError(
                        f"algorithms '{owner[point]}' and '{name}' both replace the "
                        f"'{point}' code of the {family.name} model; use one of them"
                    )
                owner[point] = name


def resolve(recipe: Recipe, template: Path, project_name: str) -> dict[str, Any]:
    """Validated, complete copier answers for a recipe: every default filled in, every name checked."""
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]{0,63}", project_name):
        raise RecipeError(
            f"project name '{project_name}' is not a valid name; use letters, digits, "
            "'-' and '_', starting with a letter (e.g. my-gpt)"
        )
    questions = load_questions(template)
    catalog = load_algorithms(template)

    answers: dict[str, Any] = {}
    for key, value in recipe.answers.items():
        if key in DERIVED_ANSWERS:
            raise RecipeError(
                f"recipe '{recipe.name}': '{key}' is set by scaffold itself; remove it"
            )
        if key not in questions:
            raise RecipeError(
                f"recipe '{recipe.name}': unknown answer '{key}'"
                f"{did_you_mean(key, list(questions))}; known answers: "
                f"{', '.join(k for k in questions if k not in DERIVED_ANSWERS)}"
            )
        question = questions[key]
        value = _coerce(value, _answer_type(question), f"answer '{key}'")
        choices = question.get("choices")
        if choices and value not in (
            list(choices.values()) if isinstance(choices, dict) else choices
        ):
            raise RecipeError(
                f"answer '{key}' = {value!r} is not one of {', '.join(map(str, choices))}"
            )
        answers[key] = value

    tasks, models = load_tasks(template), load_models(template)
    task = answers.setdefault("task", questions["task"]["default"])
    if task not in tasks:
        raise RecipeError(
            f"answer 'task' = {task!r} is not a task pack{did_you_mean(task, list(tasks))}; "
            f"known tasks: {', '.join(tasks)}"
        )
    # Defaults follow the task: its first model family, then that family's first preset.
    family = answers.setdefault("model_family", tasks[task].models[0])
    if family not in tasks[task].models:
        raise RecipeError(
            f"answer 'model_family' = {family!r} does not fit task '{task}'; it takes: "
            f"{', '.join(tasks[task].models)}"
        )
    preset = answers.setdefault("model", models[family].presets[0])
    if preset not in models[family].presets:
        raise RecipeError(
            f"answer 'model' = {preset!r} is not a {family} preset"
            f"{did_you_mean(str(preset), list(models[family].presets))}; presets: "
            f"{', '.join(models[family].presets)}"
        )
    if answers.get("tensor_parallel") and not models[family].tensor_parallel:
        with_plan = ", ".join(name for name, m in models.items() if m.tensor_parallel)
        raise RecipeError(
            f"answer 'tensor_parallel' = true needs a model pack with a tensor-parallel "
            f"plan; {family!r} has none (packs with one: {with_plan}); drop the answer"
        )
    if answers.get("tensor_parallel") and answers.get("auto_microbatching"):
        raise RecipeError(
            "answers 'tensor_parallel' and 'auto_microbatching' cannot be combined (the "
            "out-of-memory search does not run under tensor parallelism); drop one"
        )

    algorithms: dict[str, dict[str, Any]] = {}
    for name in sorted(
        recipe.algorithms, key=lambda n: list(catalog).index(n) if n in catalog else -1
    ):
        if name not in catalog:
            raise RecipeError(
                f"recipe '{recipe.name}': unknown algorithm '{name}'"
                f"{did_you_mean(name, list(catalog))}; run `scaffold algorithms` to list them"
            )
        spec = catalog[name]
        check_applies(name, spec, task, family, models)
        params = dict(recipe.algorithms[name])
        for param in params:
            if param not in spec.hyperparameters:
                known = ", ".join(spec.hyperparameters) or "none"
                raise RecipeError(
                    f"algorithm '{name}' has no hyperparameter '{param}'"
                    f"{did_you_mean(param, list(spec.hyperparameters))}; it has: {known}"
                )
        algorithms[name] = {
            key: _hyperparameter(hp, params.get(key, hp.default), f"{name}.{key}")
            for key, hp in spec.hyperparameters.items()
        }
    for name in algorithms:
        for other in catalog[name].conflicts:
            if other in algorithms:
                raise RecipeError(
                    f"algorithms '{name}' and '{other}' conflict and cannot be used "
                    "together; remove one of them from the recipe"
                )
        for needed in catalog[name].requires:
            if needed not in algorithms:
                raise RecipeError(
                    f"algorithm '{name}' requires '{needed}'; add [algorithms.{needed}] "
                    "to the recipe"
                )
    _check_exclusive_points(list(algorithms), catalog, models[family])
    return {
        "project_name": project_name,
        "recipe": recipe.name,
        **answers,
        "algorithms": algorithms,
    }


def _in_catalog_order(
    algorithms: dict[str, dict[str, Any]], catalog: dict[str, Algorithm]
) -> dict[str, dict[str, Any]]:
    """The order `resolve` writes, so removing then adding an algorithm gives back the same answers."""
    order = list(catalog)
    return {
        name: algorithms[name]
        for name in sorted(
            algorithms, key=lambda n: order.index(n) if n in order else -1
        )
    }


def add_algorithm(
    current: dict[str, dict[str, Any]],
    name: str,
    overrides: list[str],
    catalog: dict[str, Algorithm],
    task: str,
    family: ModelFamily,
) -> dict[str, dict[str, Any]]:
    """A project's algorithm answers with `name` added (hyperparameters: defaults, then `overrides`)."""
    if name not in catalog:
        raise RecipeError(
            f"unknown algorithm '{name}'{did_you_mean(name, list(catalog))}; "
            "run `scaffold algorithms` to list them"
        )
    if name in current:
        raise RecipeError(
            f"algorithm '{name}' is already in this project; its hyperparameters are "
            "Config fields in train.py: change them there"
        )
    spec = catalog[name]
    check_applies(name, spec, task, family.name, {family.name: family})
    for other in spec.conflicts:
        if other in current:
            raise RecipeError(
                f"algorithms '{name}' and '{other}' conflict and cannot be used together; "
                f"remove '{other}' first (scaffold remove {other}) if you want '{name}'"
            )
    for other in current:
        if other in catalog and name in catalog[other].conflicts:
            raise RecipeError(
                f"algorithms '{other}' and '{name}' conflict and cannot be used together; "
                f"remove '{other}' first (scaffold remove {other}) if you want '{name}'"
            )
    for needed in spec.requires:
        if needed not in current:
            raise RecipeError(
                f"algorithm '{name}' requires '{needed}'; add it first: scaffold add {needed}"
            )
    params: dict[str, Any] = {}
    for text in overrides:
        key, value = parse_override(text)
        key = key.removeprefix(
            f"{name}."
        )  # `--set alibi.x=1` reads like `scaffold new`'s form
        if key not in spec.hyperparameters:
            known = ", ".join(spec.hyperparameters) or "none"
            raise RecipeError(
                f"algorithm '{name}' has no hyperparameter '{key}'"
                f"{did_you_mean(key, list(spec.hyperparameters))}; it has: {known}"
            )
        params[key] = value
    resolved = {
        key: _hyperparameter(hp, params.get(key, hp.default), f"{name}.{key}")
        for key, hp in spec.hyperparameters.items()
    }
    added = _in_catalog_order({**current, name: resolved}, catalog)
    _check_exclusive_points(list(added), catalog, family)
    return added


def remove_algorithm(
    current: dict[str, dict[str, Any]], name: str, catalog: dict[str, Algorithm]
) -> dict[str, dict[str, Any]]:
    """A project's algorithm answers without `name`; refused while another algorithm requires it."""
    if name not in current:
        present = ", ".join(current) or "none"
        raise RecipeError(
            f"algorithm '{name}' is not in this project{did_you_mean(name, list(current))}; "
            f"it has: {present}"
        )
    for other in current:
        if other != name and other in catalog and name in catalog[other].requires:
            raise RecipeError(
                f"algorithm '{other}' requires '{name}'; remove '{other}' first "
                f"(scaffold remove {other})"
            )
    return _in_catalog_order(
        {key: value for key, value in current.items() if key != name}, catalog
    )
