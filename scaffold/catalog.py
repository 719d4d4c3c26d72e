"""The packs, the algorithm catalog and recipes: loading, validation, and resolving a recipe into copier answers.

A project is rendered from three kinds of pack (DESIGN.md §5):
- a task, `templates/tasks/<task>/` with `task.toml` (summary, the model families it takes);
- a model family, `templates/models/<family>/` with `model.toml` (summary, size presets, and the
  extension points architectural algorithms fill);
- algorithms, `templates/algorithms/<name>/` with `algorithm.toml` (summary, paper, tasks and
  model families it applies to, hyperparameters, requires, conflicts, before/after) and snippet
  files whose names say where they go: `train.BATCH_START.py.jinja`, `train.config.py.jinja`,
  `model.gpt.attention.py.jinja`. Events and extension points are derived from those names.
A recipe is a TOML file of copier answers plus `[algorithms.<name>]` tables of hyperparameters;
users copy and edit them.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from runtime.config import in_range
from runtime.time import Time, TimeError

# Answers scaffold computes itself; a recipe may not set them.
DERIVED_ANSWERS = ("project_name", "recipe", "algorithms")
HYPERPARAMETER_TYPES = ("int", "float", "bool", "str", "time")
# The event points of every task's train.py, in loop order (DESIGN.md §4.2).
EVENTS = (
    "INIT",
    "MODEL",
    "OPTIMIZER",
    "FIT_START",
    "EPOCH_START",
    "BATCH_START",
    "MICROBATCH_START",
    "AFTER_FORWARD",
    "LOSS",
    "AFTER_BACKWARD",
    "BATCH_END",
    "EVAL",
    "EPOCH_END",
    "FIT_END",
)
# Other places in train.py an algorithm may write: its imports, Config fields, config checks,
# module-level helper functions, logged metrics, the list of per-sample training-data
# augmentations (`augment`, in a module-level function that builds it from the Config), and
# `stop`: after a step's metrics are logged and the early stopper has decided, where an
# algorithm may end training (`finished = stopper.stop(reason)`, saved: a resume stays
# stopped).
TRAIN_SECTIONS = (
    "imports",
    "config",
    "checks",
    "functions",
    "metrics",
    "augment",
    "stop",
)
# Places in a task's data.py an algorithm may write: module-level helper functions (the
# per-sample augmentations the DataLoader workers run).
DATA_SECTIONS = ("functions",)
# Code of train.py an algorithm may replace (at most one algorithm each), and the event it
# belongs to: `train.optimizer` stands instead of the task's optimizer construction,
# `train.encode` instead of the frozen encoders' forward of a step (the diffusion task's),
# `train.loss` instead of a microbatch's summed loss in forward_backward().
TRAIN_POINTS = {"optimizer": "OPTIMIZER", "encode": "BATCH_START", "loss": "LOSS"}
# Places inside the loop where any number of algorithms add code, and the event whose
# stretch holds them (listed as that event): the spine's `stop` (after EVAL's evaluation
# and metrics record: decide to stop), and the diffusion task's `noise` (the step's noise
# is drawn, the latents not yet noised: change `noise`) and `targets` (the UNet's
# `inputs` and `targets` are made: add per-sample entries to `inputs`), and the image
# task's `image_sides` (before a hub model is built, so before the run folder exists: add
# the image sides the algorithm will feed it to `sides`, each tried once by HubNet).
TRAIN_PLACES = {
    "stop": "EVAL",
    "noise": "BATCH_START",
    "targets": "BATCH_START",
    "image_sides": "INIT",
}
SNIPPET_SUFFIX = ".py.jinja"


class RecipeError(ValueError):
    """A recipe, an algorithm choice or a `--set` override is wrong; the message says how to fix it."""


# What an image algorithm does to a hub model (`--model=torchvision:NAME`, `timm:NAME`,
# `hf:FOLDER`), declared in its algorithm.toml as `hub_models` and shown by
# `scaffold catalog`; each kind is checked against the folder's snippets.
HUB_MODELS = {
    "any": "acts on the data, the loss, the optimizer or the weights: any model",
    "surgery": "changes the library's layers by type, in place (a model.resnet.hub snippet)",
    "refused": "needs model.py's own architecture: one error line at start-up (train.checks)",
}


class CatalogError(RuntimeError):
    """A pack in the template is malformed (a template bug, never user input)."""


@dataclass(frozen=True)
class Hyperparameter:
    name: str
    type: str
    default: Any
    help: str
    choices: tuple[Any, ...] = ()  # empty: any value of the type
    # An interval a number must lie in, e.g. "[0, 1)", "(0, inf)"; "": any. Checked by
    # `scaffold new`/`add`, and at run time by the check the template renders from it.
    range: str = ""
    # (version, value): projects generated before that version trained as if the value were
    # set (the option is new, or its default changed). `scaffold upgrade` records it for them,
    # so upgrading never changes what a project trains.
    earlier: tuple[str, Any] | None = None

    @property
    def literal(self) -> str:
        """The Config field's type for its choices: Literal["all", "safe"]."""
        return f"Literal[{', '.join(map(repr, self.choices))}]"


@dataclass(frozen=True)
class ExtensionPoint:
    name: str
    help: str
    replaces: bool  # the algorithm's code stands instead of the default: one algorithm at most


@dataclass(frozen=True)
class ModelFamily:
    name: str
    summary: str
    presets: tuple[str, ...]
    extension_points: dict[str, ExtensionPoint]


@dataclass(frozen=True)
class Task:
    name: str
    summary: str
    models: tuple[str, ...]


@dataclass(frozen=True)
class Algorithm:
    name: str
    summary: str
    # Where it writes: its snippet file names (train.BATCH_START, model.gpt.attention), the
    # spots it `replaces`, and train.checks when the template renders checks of its ranges.
    spots: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    hyperparameters: dict[str, Hyperparameter] = field(default_factory=dict)
    tasks: tuple[str, ...] = ()
    models: tuple[str, ...] = ()  # empty: any model family of its tasks
    before: tuple[
        str, ...
    ] = ()  # algorithms it must run before, at every event both use
    after: tuple[str, ...] = ()
    paper: str = ""
    # Spots whose default code it removes with nothing in its place (no snippet there), e.g.
    # model.gpt.position_embedding: the host writes neither the default nor an empty fence.
    replaces: tuple[str, ...] = ()
    # What it makes of the model, for model.py's docstring, formatted with its
    # hyperparameters ("ReLU² MLP", "logits soft-capped at {cap}"); "": no change to describe.
    architecture: str = ""
    # Image algorithms: what they do to a torchvision/timm/HF model (`--model=hub:NAME`),
    # one of HUB_MODELS; empty for the other tasks' algorithms.
    hub_models: str = ""
    # The device types it runs on (e.g. ("cuda",): CUDA memory snapshots; its train.checks
    # refuses any other in one line); empty: any.
    devices: tuple[str, ...] = ()
    # Tasks where it changes model.py only and writes nothing into train.py (e.g. ALiBi in
    # a classifier fine-tuned from an encoder pretrained with it: the architecture, not the
    # pretraining's row split).
    model_only_tasks: tuple[str, ...] = ()

    @property
    def events(self) -> tuple[str, ...]:
        """The loop events it acts at, in loop order; model changes act at MODEL."""
        acts = {spot.split(".")[1] for spot in self.spots if spot.startswith("train.")}
        acts |= {TRAIN_POINTS[point] for point in acts if point in TRAIN_POINTS}
        acts |= {TRAIN_PLACES[place] for place in acts if place in TRAIN_PLACES}
        if any(spot.startswith("model.") for spot in self.spots):
            acts.add("MODEL")
        return tuple(event for event in EVENTS if event in acts)

    def params(self, answers: dict[str, Any] | None) -> dict[str, Any]:
        """A project's hyperparameter answers, with the declared default of any it lacks (a
        hyperparameter added since the project was generated)."""
        return {
            **{key: hp.default for key, hp in self.hyperparameters.items()},
            **(answers or {}),
        }

    def describe(self, params: dict[str, Any]) -> str:
        """Its `architecture` phrase with the project's hyperparameters filled in."""
        return self.architecture.format(**params)

    def model_points(self, family: str) -> tuple[str, ...]:
        """The extension points of `family` it fills."""
        prefix = f"model.{family}."
        return tuple(
            spot.removeprefix(prefix) for spot in self.spots if spot.startswith(prefix)
        )


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    answers: dict[str, Any]
    algorithms: dict[str, dict[str, Any]]


def _suggest(word: str, options: list[str] | tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise CatalogError(f"{path}: {error}") from error


def load_tasks(template: Path) -> dict[str, Task]:
    tasks = {}
    for meta_path in sorted((template / "tasks").glob("*/task.toml")):
        meta = _read_toml(meta_path)
        name = meta_path.parent.name
        tasks[name] = Task(name, meta["summary"], tuple(meta["models"]))
    return tasks


def load_models(template: Path) -> dict[str, ModelFamily]:
    families = {}
    for meta_path in sorted((template / "models").glob("*/model.toml")):
        meta = _read_toml(meta_path)
        name = meta_path.parent.name
        points = {
            point: ExtensionPoint(
                point, spec.get("help", ""), bool(spec.get("replaces", False))
            )
            for point, spec in meta.get("extension_points", {}).items()
        }
        families[name] = ModelFamily(
            name, meta["summary"], tuple(meta["presets"]), points
        )
    return families


def _spot_of(snippet: Path) -> str:
    spot = snippet.name.removesuffix(SNIPPET_SUFFIX)
    parts = spot.split(".")
    valid = (
        (
            len(parts) == 2
            and parts[0] == "train"
            and parts[1]
            in EVENTS + TRAIN_SECTIONS + tuple(TRAIN_POINTS) + tuple(TRAIN_PLACES)
        )
        or (len(parts) == 2 and parts[0] == "data" and parts[1] in DATA_SECTIONS)
        or (len(parts) == 3 and parts[0] == "model")
    )
    if not valid:
        raise CatalogError(
            f"{snippet}: a snippet is named "
            f"train.<EVENT|{'|'.join(TRAIN_SECTIONS + tuple(TRAIN_POINTS) + tuple(TRAIN_PLACES))}>"
            f"{SNIPPET_SUFFIX}, "
            f"data.<{'|'.join(DATA_SECTIONS)}>{SNIPPET_SUFFIX} "
            f"or model.<family>.<extension point>{SNIPPET_SUFFIX}"
        )
    return spot


def catalog_order(algorithms: Mapping[str, Algorithm | SimpleNamespace]) -> list[str]:
    """Names in the order their code runs at any event: every declared `before`/`after` holds,
    ties broken alphabetically (a stable topological sort)."""
    must_precede: dict[str, set[str]] = {name: set() for name in algorithms}
    for name, spec in algorithms.items():
        must_precede[name] |= {other for other in spec.after if other in algorithms}
        for other in spec.before:
            if other in algorithms:
                must_precede[other].add(name)
    order: list[str] = []
    pending = sorted(algorithms)
    while pending:
        ready = [name for name in pending if must_precede[name] <= set(order)]
        if not ready:
            raise CatalogError(
                f"algorithms {', '.join(pending)} declare a cycle of before/after"
            )
        order.append(ready[0])
        pending.remove(ready[0])
    return order


def declared_order(template: Path) -> list[str]:
    """The template's algorithm names in catalog order, read from each algorithm.toml's
    `before`/`after` alone: the templates of older versions, which `scaffold upgrade`
    re-renders, are ordered by their own declarations whatever else their packs hold."""
    declared = {}
    for meta_path in sorted((template / "algorithms").glob("*/algorithm.toml")):
        meta = _read_toml(meta_path)
        declared[meta_path.parent.name] = SimpleNamespace(
            before=tuple(meta.get("before", ())), after=tuple(meta.get("after", ()))
        )
    return catalog_order(declared)


def _earlier(meta_path: Path, name: str, spec: Any) -> tuple[str, Any] | None:
    if spec is None:
        return None
    if not (isinstance(spec, dict) and set(spec) == {"until", "value"}):
        raise CatalogError(
            f"{meta_path}: hyperparameter '{name}' has earlier = {spec!r}; write "
            '{ until = "0.3.0", value = ... }: the value projects older than that '
            "version trained with"
        )
    return str(spec["until"]), spec["value"]


def load_algorithms(template: Path) -> dict[str, Algorithm]:
    """Every algorithm in the template, in catalog order (see `catalog_order`)."""
    algorithms: dict[str, Algorithm] = {}
    for meta_path in sorted((template / "algorithms").glob("*/algorithm.toml")):
        meta = _read_toml(meta_path)
        name = meta_path.parent.name
        hyperparameters = {
            key: Hyperparameter(
                key,
                spec["type"],
                spec["default"],
                spec.get("help", ""),
                tuple(spec.get("choices", ())),
                str(spec.get("range", "")),
                _earlier(meta_path, key, spec.get("earlier")),
            )
            for key, spec in meta.get("hyperparameters", {}).items()
        }
        for hp in hyperparameters.values():
            if hp.range and (
                hp.type not in ("int", "float") or not _in_range(hp.default, hp.range)
            ):
                raise CatalogError(
                    f"{meta_path}: hyperparameter '{hp.name}' has range {hp.range!r}; a "
                    'range is an interval such as "[0, 1)" on an int or float that '
                    "holds its default"
                )
            if hp.earlier is not None and not (
                _has_type(hp.earlier[1], hp.type)
                and (not hp.choices or hp.earlier[1] in hp.choices)
                and (not hp.range or _in_range(hp.earlier[1], hp.range))
            ):
                raise CatalogError(
                    f"{meta_path}: hyperparameter '{hp.name}' has earlier value "
                    f"{hp.earlier[1]!r}, which its type, choices or range refuse; "
                    "write the value older projects trained with"
                )
            if hp.choices and any(
                not _has_type(choice, hp.type) for choice in (hp.default, *hp.choices)
            ):
                raise CatalogError(
                    f"{meta_path}: hyperparameter '{hp.name}' has choices {list(hp.choices)}; "
                    f"each, and the default, must be of type {hp.type}"
                )
            if hp.choices and hp.default not in hp.choices:
                raise CatalogError(
                    f"{meta_path}: hyperparameter '{hp.name}': its default "
                    f"{hp.default!r} is not one of its choices {list(hp.choices)}"
                )
        snippets = {
            _spot_of(path) for path in meta_path.parent.glob(f"*{SNIPPET_SUFFIX}")
        }
        hub_models = str(meta.get("hub_models", ""))
        needs = {"surgery": "model.resnet.hub", "refused": "train.checks"}
        if hub_models and (
            hub_models not in HUB_MODELS
            or "image_classification" not in meta.get("tasks", ())
            or needs.get(hub_models, "") not in snippets | {""}
        ):
            raise CatalogError(
                f"{meta_path}: hub_models = {hub_models!r}; an image_classification "
                f"algorithm declares one of {', '.join(HUB_MODELS)} ({needs['surgery']} "
                f"snippet for surgery, {needs['refused']} for refused)"
            )
        replaces = tuple(meta.get("replaces", ()))
        for spot in replaces:
            if (
                spot in snippets
                or len(spot.split(".")) != 3
                or not spot.startswith("model.")
            ):
                raise CatalogError(
                    f"{meta_path}: replaces {spot!r}; `replaces` lists model.<family>.<point> "
                    "spots whose default code the algorithm removes, with no snippet there"
                )
        # Config fields `<name>_<hyperparameter>` (a train.config snippet) with a declared range
        # get their run-time check rendered at train.checks (common/packs.jinja).
        if "train.config" in snippets and any(
            hp.range for hp in hyperparameters.values()
        ):
            snippets.add("train.checks")
        spots = tuple(sorted(snippets | set(replaces)))
        model_only_tasks = tuple(meta.get("model_only_tasks", ()))
        if not set(model_only_tasks) <= set(meta.get("tasks", ())):
            raise CatalogError(
                f"{meta_path}: model_only_tasks {list(model_only_tasks)} must be among "
                "its tasks"
            )
        try:
            str(meta.get("architecture", "")).format(
                **{k: hp.default for k, hp in hyperparameters.items()}
            )
        except (KeyError, IndexError, ValueError) as error:
            raise CatalogError(
                f"{meta_path}: architecture names {error}, which is not a hyperparameter; "
                "write {name} for a hyperparameter's value"
            ) from error
        algorithms[name] = Algorithm(
            name=name,
            summary=meta["summary"],
            spots=spots,
            requires=tuple(meta.get("requires", ())),
            conflicts=tuple(meta.get("conflicts", ())),
            hyperparameters=hyperparameters,
            tasks=tuple(meta.get("tasks", ())),
            models=tuple(meta.get("models", ())),
            before=tuple(meta.get("before", ())),
            after=tuple(meta.get("after", ())),
            paper=str(meta.get("paper", "")),
            replaces=replaces,
            architecture=str(meta.get("architecture", "")),
            hub_models=hub_models,
            devices=tuple(meta.get("devices", ())),
            model_only_tasks=model_only_tasks,
        )
    return {name: algorithms[name] for name in catalog_order(algorithms)}


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


def load_questions(template: Path) -> dict[str, dict[str, Any]]:
    """copier.yml's questions (keys not starting with `_`): the answers a recipe may set."""
    config = yaml.safe_load((template / "copier.yml").read_text())
    return {key: value for key, value in config.items() if not key.startswith("_")}


def recipe_paths(template: Path) -> dict[str, Path]:
    paths = sorted((template / "recipes").glob("*.toml"), key=lambda path: path.stem)
    return {path.stem: path for path in paths}


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
            raise RecipeError(
                f"recipe file {path} does not exist; pass a shipped recipe name "
                f"({', '.join(shipped)}) or the path of a .toml recipe file"
            )
    else:
        raise RecipeError(
            f"unknown recipe '{name_or_path}'{_suggest(name_or_path, list(shipped))}; "
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


def _in_range(value: Any, interval: str) -> bool:
    """Whether the number `value` lies in `interval` (runtime.config's reading of it, the one
    the generated check uses); False for an interval that does not parse."""
    try:
        return in_range(value, interval)
    except ValueError:
        return False


def _has_type(value: Any, kind: str) -> bool:
    try:
        _coerce(value, kind, "")
    except RecipeError:
        return False
    return True


def _hyperparameter(hp: Hyperparameter, value: Any, where: str) -> Any:
    """A hyperparameter's value, checked against its type and (if declared) its choices and
    range."""
    value = _coerce(value, hp.type, where)
    if hp.choices and value not in hp.choices:
        raise RecipeError(
            f"{where} = {value!r} is not one of {', '.join(map(repr, hp.choices))}; "
            "fix the recipe or the --set value"
        )
    if hp.range and not _in_range(value, hp.range):
        raise RecipeError(
            f"{where} = {value!r} is outside its range {hp.range}; "
            "fix the recipe or the --set value"
        )
    return value


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
                f"{_suggest(key, list(questions))}; known answers: "
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
            f"answer 'task' = {task!r} is not a task pack{_suggest(task, list(tasks))}; "
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
            f"{_suggest(str(preset), list(models[family].presets))}; presets: "
            f"{', '.join(models[family].presets)}"
        )

    algorithms: dict[str, dict[str, Any]] = {}
    for name in sorted(
        recipe.algorithms, key=lambda n: list(catalog).index(n) if n in catalog else -1
    ):
        if name not in catalog:
            raise RecipeError(
                f"recipe '{recipe.name}': unknown algorithm '{name}'"
                f"{_suggest(name, list(catalog))}; run `scaffold algorithms` to list them"
            )
        spec = catalog[name]
        check_applies(name, spec, task, family, models)
        params = dict(recipe.algorithms[name])
        for param in params:
            if param not in spec.hyperparameters:
                known = ", ".join(spec.hyperparameters) or "none"
                raise RecipeError(
                    f"algorithm '{name}' has no hyperparameter '{param}'"
                    f"{_suggest(param, list(spec.hyperparameters))}; it has: {known}"
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
            f"unknown algorithm '{name}'{_suggest(name, list(catalog))}; "
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
                f"{_suggest(key, list(spec.hyperparameters))}; it has: {known}"
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
            f"algorithm '{name}' is not in this project{_suggest(name, list(current))}; "
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
