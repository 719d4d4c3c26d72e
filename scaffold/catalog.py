"""The packs and the algorithm catalog: loading and validating what a template offers.

A project is rendered from three kinds of pack (DESIGN.md §5):
- a task, `templates/tasks/<task>/` with `task.toml` (summary, the model families it takes);
- a model family, `templates/models/<family>/` with `model.toml` (summary, size presets, and the
  extension points architectural algorithms fill);
- algorithms, `templates/algorithms/<name>/` with `algorithm.toml` (summary, paper, tasks and
  model families it applies to, hyperparameters, requires, conflicts, before/after) and snippet
  files whose names say where they go: `train.BATCH_START.py.jinja`, `train.config.py.jinja`,
  `model.gpt.attention.py.jinja`. Events and extension points are derived from those names.
A pack that breaks these rules is a template bug: `CatalogError`.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from runtime.config import in_range
from runtime.time import Time, TimeError

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
    # model.py has a tensor-parallel plan (the `tensor_parallel` answer is allowed)
    tensor_parallel: bool = False


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
    # Runs under tensor parallelism (the `tensor_parallel` answer), tested there; model
    # packs refuse --tensor_parallel > 1 with any other selected algorithm.
    tensor_parallel: bool = False

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
            name,
            meta["summary"],
            tuple(meta["presets"]),
            points,
            bool(meta.get("tensor_parallel", False)),
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


def task_events(algorithms: Mapping[str, Algorithm], task: str) -> tuple[str, ...]:
    """The loop events where an algorithm of `algorithms` can act in a project of `task`,
    in loop order: train.py marks these and no others."""
    acts: set[str] = set()
    for spec in algorithms.values():
        if task in spec.tasks:
            model_only = task in spec.model_only_tasks
            acts |= {e for e in spec.events if e == "MODEL" or not model_only}
    return tuple(event for event in EVENTS if event in acts)


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


def is_of_type(value: Any, kind: str) -> bool:
    """Whether `value` may stand for an answer or hyperparameter of type `kind` (an int may
    stand for a float; a "time" is a string, parsed by whoever converts it)."""
    return {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "time": isinstance(value, str),
        "yaml": True,
    }[kind]


def within(value: Any, interval: str) -> bool:
    """Whether the number `value` lies in `interval` (runtime.config's reading of it, the one
    the generated check uses); False for an interval that does not parse."""
    try:
        return in_range(value, interval)
    except ValueError:
        return False


def _has_type(value: Any, kind: str) -> bool:
    """Whether `value` is a hyperparameter value of type `kind` (a "time" one parses)."""
    if not is_of_type(value, kind):
        return False
    if kind == "time":
        try:
            Time.parse(value)
        except TimeError:
            return False
    return True


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
                hp.type not in ("int", "float") or not within(hp.default, hp.range)
            ):
                raise CatalogError(
                    f"{meta_path}: hyperparameter '{hp.name}' has range {hp.range!r}; a "
                    'range is an interval such as "[0, 1)" on an int or float that '
                    "holds its default"
                )
            if hp.earlier is not None and not (
                _has_type(hp.earlier[1], hp.type)
                and (not hp.choices or hp.earlier[1] in hp.choices)
                and (not hp.range or within(hp.earlier[1], hp.range))
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
            tensor_parallel=bool(meta.get("tensor_parallel", False)),
        )
    return {name: algorithms[name] for name in catalog_order(algorithms)}
