"""Task, model and algorithm packs: every algorithm renders alone on every task and model family it
declares, trains, and sits exactly where its snippet file names say; undeclared combinations and
clashing extension points are refused; an algorithm owns its whole footprint.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import sys
from pathlib import Path

import black
import pytest

from conftest import scaffold_cli
from projects import project_modules
from scaffold.answers import resolve
from scaffold.catalog import (
    EVENTS,
    TRAIN_PLACES,
    TRAIN_POINTS,
    Algorithm,
    CatalogError,
    catalog_order,
    load_algorithms,
    load_models,
    load_tasks,
)
from scaffold.history import TemplateRelease
from scaffold.jinja_black import BLACK_MODE
from scaffold.paths import template_dir
from scaffold.recipes import RecipeError, load_recipe
from scaffold.render import new_project

TEMPLATE = template_dir()
CATALOG = load_algorithms(TEMPLATE)
TASKS = load_tasks(TEMPLATE)
MODELS = load_models(TEMPLATE)
# Two optimizer steps on a tiny batch: enough to run every event once and log every metric.
TWO_STEPS = [
    "--max_duration=2ba",
    "--eval_interval=1ba",
    "--eval_batches=1",
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--save_interval=2ba",
    "--device=cpu",
]
# Task-specific settings that TWO_STEPS' tiny batch needs (BatchNorm groups of 2 samples),
# and that keep a diffusion run short.
TASK_ARGS = {
    "image_classification": ["--bn_group_size=2"],
    # a VAE fitted for a few steps, one sample per prompt in few DDIM steps; v prediction
    # (zero_terminal_snr needs it, every other algorithm takes it)
    "diffusion": [
        "--tiny_vae_steps=5",
        "--samples_per_prompt=1",
        "--sample_steps=2",
        "--prediction_type=v_prediction",
    ],
}


def combinations() -> list[tuple[str, str, str]]:
    """(algorithm, task, model family) for every pairing an algorithm declares."""
    found = []
    for name, spec in CATALOG.items():
        for task in spec.tasks:
            for family in TASKS[task].models:
                if not spec.models or family in spec.models:
                    found.append((name, task, family))
    return found


def recipe_for(tmp_path: Path, task: str, family: str, algorithms: list[str]) -> Path:
    """A recipe with the task's defaults, the family's smallest preset and these algorithms
    (plus what they require)."""
    wanted = list(algorithms)
    for name in algorithms:
        wanted += [needed for needed in CATALOG[name].requires if needed not in wanted]
    lines = [
        "[answers]",
        f"task = {task!r}",
        f"model_family = {family!r}",
        f"model = {MODELS[family].presets[0]!r}",
    ]
    lines += [f"[algorithms.{name}]" for name in wanted]
    path = tmp_path / "recipe.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def train_in_process(
    project: Path, workdir: Path, monkeypatch: pytest.MonkeyPatch, *args: str
) -> list[dict]:
    """Run the generated train.py's main() in this process (no interpreter start-up per project)."""
    workdir.mkdir(exist_ok=True)
    monkeypatch.chdir(workdir)
    with project_modules(project) as modules:
        monkeypatch.setattr(
            sys, "argv", ["train.py", "--run_name=r", *TWO_STEPS, *args]
        )
        try:
            modules["train"].main()
        finally:
            from runtime import dist

            dist.shutdown()
    return [
        json.loads(line)
        for line in (workdir / "runs" / "r" / "metrics.jsonl").read_text().splitlines()
    ]


def fenced_events(source: str, name: str) -> list[str]:
    """Where each `# algorithm: name` fence of train.py sits: the event point it follows inside
    forward_backward() or main(), the start of either (no marker above it there: a task
    marks only the events its algorithms can act at), or the module-level section
    (config/checks/functions/imports) before them.
    """
    found, place = [], "module"
    for line in source.splitlines():
        stripped = line.strip()
        if line.startswith(("def main(", "def forward_backward(")):
            place = line.removeprefix("def ").split("(")[0]
        elif stripped.startswith("# event: "):
            place = stripped.removeprefix("# event: ")
        elif stripped == f"# algorithm: {name}":
            found.append(place)
    return found


def snippet_spots(name: str) -> set[str]:
    """Spots named by the algorithm folder's files, read from the file names themselves."""
    folder = TEMPLATE / "algorithms" / name
    return {path.name.removesuffix(".py.jinja") for path in folder.glob("*.py.jinja")}


# ---------------------------------------------------------------- the catalog is consistent


def test_every_snippet_names_a_known_spot_and_every_model_point_exists() -> None:
    for name, spec in CATALOG.items():
        # Its spots: its snippets, the model code it declares it `replaces` (with nothing), and
        # train.checks where the template renders the checks of its declared ranges.
        ranged = "train.config" in spec.spots and any(
            hp.range for hp in spec.hyperparameters.values()
        )
        assert set(spec.spots) == snippet_spots(name) | set(spec.replaces) | (
            {"train.checks"} if ranged else set()
        )
        for spot in spec.replaces:  # only default code a model declares replaceable
            _, family, point = spot.split(".")
            assert MODELS[family].extension_points[point].replaces, (name, spot)
        assert spec.tasks and set(spec.tasks) <= set(TASKS), name
        assert (
            TEMPLATE / "algorithms" / name / "card.md"
        ).is_file(), f"{name} has no method card"
        for family in {
            spot.split(".")[1] for spot in spec.spots if spot.startswith("model.")
        }:
            assert family in MODELS, (name, family)
            assert set(spec.model_points(family)) <= set(
                MODELS[family].extension_points
            ), name


def test_a_misnamed_snippet_is_a_catalog_error(tmp_path: Path) -> None:
    template = tmp_path / "templates"
    shutil.copytree(TEMPLATE, template)
    (template / "algorithms" / "alibi" / "train.BATCH_BEGIN.py.jinja").write_text(
        "pass\n"
    )
    with pytest.raises(
        CatalogError, match="train.BATCH_BEGIN.py.jinja: a snippet is named"
    ):
        load_algorithms(template)


def test_cli_events_are_derived_from_snippet_file_names() -> None:
    listing = scaffold_cli("algorithms")
    assert listing.returncode == 0, listing.stderr
    rows = dict(line.split("\t", 1) for line in listing.stdout.splitlines()[1:])
    for name in CATALOG:
        spots = snippet_spots(name)
        expected = {
            spot.split(".")[1] for spot in spots if spot.split(".")[1] in EVENTS
        }
        expected |= {
            {**TRAIN_POINTS, **TRAIN_PLACES}[spot.split(".")[1]]
            for spot in spots
            if spot.split(".")[1] in {**TRAIN_POINTS, **TRAIN_PLACES}
        }
        if any(spot.startswith("model.") for spot in spots):
            expected.add("MODEL")
        listed = {event for event in EVENTS if re.search(rf"\b{event}\b", rows[name])}
        assert listed == expected, name


def test_cli_lists_algorithms_for_a_task() -> None:
    listing = scaffold_cli("algorithms", "--task", "causal_lm")
    assert listing.returncode == 0 and "alibi" in listing.stdout
    unknown = scaffold_cli("algorithms", "--task", "causal")
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        "error: unknown task 'causal' (did you mean 'causal_lm'?); tasks: "
        + ", ".join(TASKS)
    ]


def test_catalog_order_follows_declared_before_and_after() -> None:
    algorithms = {
        "mixup": Algorithm("mixup", ""),
        "label_smoothing": Algorithm("label_smoothing", "", before=("mixup",)),
        "selective_backprop": Algorithm(
            "selective_backprop", "", before=("mixup", "label_smoothing")
        ),
        "ema": Algorithm("ema", "", after=("zloss",)),
        "zloss": Algorithm("zloss", ""),
    }
    order = catalog_order(algorithms)
    assert (
        order.index("selective_backprop")
        < order.index("label_smoothing")
        < order.index("mixup")
    )
    assert order.index("zloss") < order.index("ema")
    with pytest.raises(CatalogError, match="cycle"):
        catalog_order(
            {
                "a": Algorithm("a", "", before=("b",)),
                "b": Algorithm("b", "", before=("a",)),
            }
        )


# ---------------------------------------------------------------- every algorithm alone


@pytest.mark.parametrize(("name", "task", "family"), combinations())
def test_every_algorithm_renders_alone_and_trains(
    name: str, task: str, family: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "p"
    new_project(str(recipe_for(tmp_path, task, family, [name])), project, [], "p")
    spec = CATALOG[name]
    for path in project.rglob("*.py"):
        source = path.read_text()
        assert (
            black.format_str(source, mode=BLACK_MODE) == source
        ), f"{path.name} is not black-clean"
        assert source.count(f"# algorithm: {name}\n") == source.count(
            f"# end algorithm: {name}\n"
        )
    train = (project / "train.py").read_text()
    # no classes but Config, no dynamo config written per step (test_model_points.py)
    from test_model_points import check_train_py

    assert check_train_py(train) == []
    # one fence per train.* snippet: each train.<EVENT> one under its event marker, the
    # imports/config/checks/functions ones before main(); metrics go where the task logs
    places = fenced_events(train, name)
    train_spots = [
        spot.split(".")[1]
        for spot in spec.spots
        if spot.startswith("train.") and task not in spec.model_only_tasks
    ]
    assert len(places) == len(train_spots)
    for spot in train_spots:
        if spot in EVENTS:
            assert spot in places, (name, spot, places)
        if spot in ("optimizer", "loss"):  # replaced host code: makes what its event
            marker = f"# event: {TRAIN_POINTS[spot]}"  # point names (optimizer, loss)
            assert train.index(f"# algorithm: {name}") < train.index(marker), (
                name,
                spot,
                places,
            )
        elif spot in TRAIN_POINTS:  # replaced host code inside its event's stretch
            assert TRAIN_POINTS[spot] in places, (name, spot, places)
        elif spot in TRAIN_PLACES:  # a task's place inside its event's stretch
            assert TRAIN_PLACES[spot] in places, (name, spot, places)
    sections = [
        spot
        for spot in train_spots
        if spot not in EVENTS
        and spot not in TRAIN_POINTS
        and spot not in TRAIN_PLACES
        and spot != "metrics"
    ]
    assert places.count("module") == len(sections)
    model = (project / "model.py").read_text()
    written = [
        p
        for p in spec.model_points(family)
        if f"model.{family}.{p}" not in spec.replaces
        # the tensor-parallel plan's points: in projects with that answer only
        and not p.startswith("tensor_parallel")
    ]
    assert model.count(f"# algorithm: {name}\n") == len(written)

    if spec.devices and "cpu" not in spec.devices:
        return  # CUDA only (memory snapshots): its refusal here is tested in test_monitors
    rows = train_in_process(
        project, tmp_path / "work", monkeypatch, *TASK_ARGS.get(task, [])
    )
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]
    assert all(math.isfinite(row["loss"]) for row in rows if "loss" in row)


def first_pairing(name: str) -> tuple[str, str]:
    """The algorithm's first task and a model family of it that the algorithm declares."""
    spec = CATALOG[name]
    task = spec.tasks[0]
    return task, next(
        f for f in TASKS[task].models if not spec.models or f in spec.models
    )


def cuttable_files(name: str) -> list[str]:
    """The generated files from which cutting the algorithm's fences by hand leaves a working
    project: train.py, and model.py where the algorithm replaces no default code there
    (replaced host code has no default left once cut out; `scaffold remove` restores it).
    Empty where train.py's fences replace host code too."""
    spec = CATALOG[name]
    if any(
        spot.split(".")[1] in TRAIN_POINTS
        for spot in spec.spots
        if spot.startswith("train.")
    ):
        return []
    family = first_pairing(name)[1]
    points = spec.model_points(family)
    files = (
        ["train.py"] if any(spot.startswith("train.") for spot in spec.spots) else []
    )
    if points and not any(
        MODELS[family].extension_points[point].replaces for point in points
    ):
        files.append("model.py")
    return files


def fence_count(name: str) -> int:
    """How many fences cutting the algorithm by hand removes."""
    spec = CATALOG[name]
    count = 0
    if "train.py" in cuttable_files(name):
        count += len([spot for spot in spec.spots if spot.startswith("train.")])
    if "model.py" in cuttable_files(name):
        count += len(spec.model_points(first_pairing(name)[1]))
    return count


def cutting_cases() -> list:
    """Every algorithm whose fences can be cut by hand; in every run, per task the ones
    with the most fences to cut and any cut from both files, the rest with --slow (a
    render and a run each)."""
    names = [name for name in CATALOG if cuttable_files(name)]
    most = {
        task: max(fence_count(n) for n in names if first_pairing(n)[0] == task)
        for task in {first_pairing(n)[0] for n in names}
    }
    every_run = {
        name
        for name in names
        if fence_count(name) == most[first_pairing(name)[0]]
        or len(cuttable_files(name)) == 2
    }
    return [
        name if name in every_run else pytest.param(name, marks=pytest.mark.slow)
        for name in names
    ]


@pytest.mark.parametrize("algorithm", cutting_cases())
def test_deleting_an_algorithms_fences_by_hand_leaves_no_dangling_name(
    algorithm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An algorithm owns its Config fields, checks, helpers and metrics, and its code in
    model.py: cut every one of its fenced blocks out of train.py (and model.py, unless it
    replaces default code there) and the project still trains."""
    # The algorithm alone, on its first task and family (in a recipe, other algorithms'
    # blocks may read what this one sets: cutting it there is `scaffold remove`'s job).
    spec = CATALOG[algorithm]
    task, family = first_pairing(algorithm)
    project = tmp_path / "alone"
    new_project(str(recipe_for(tmp_path, task, family, [algorithm])), project, [], "p")
    fence = re.compile(
        rf"\n[ ]*# algorithm: {algorithm}\n.*?# end algorithm: {algorithm}\n", re.S
    )
    for name in cuttable_files(algorithm):
        path = project / name
        text, cuts = fence.subn("\n", path.read_text())
        snippets = (
            spec.model_points(family)
            if name == "model.py"
            else [spot for spot in spec.spots if spot.startswith("train.")]
        )
        assert cuts == len(snippets), name  # one fence per snippet of that file
        path.write_text(text)
    if spec.devices and "cpu" not in spec.devices:
        return  # CUDA only (memory snapshots): its refusal here is tested in test_monitors
    rows = train_in_process(
        project, tmp_path / "work", monkeypatch, *TASK_ARGS.get(task, [])
    )
    assert [row["step"] for row in rows if "loss" in row] == [1, 2]


# ---------------------------------------------------------------- refusals


def test_an_undeclared_task_is_refused_by_name(tmp_path: Path) -> None:
    """A second language-model task that no algorithm declares: every algorithm is refused on it."""
    template = tmp_path / "templates"
    shutil.copytree(TEMPLATE, template)
    shutil.copytree(template / "tasks" / "causal_lm", template / "tasks" / "other_lm")
    release = TemplateRelease(template, "9.9.9")
    for name in CATALOG:
        recipe = recipe_for(tmp_path, "other_lm", "gpt", [name])
        dest = tmp_path / f"refused-{name}"
        with pytest.raises(RecipeError) as refused:
            new_project(str(recipe), dest, [], "p", release=release)
        assert str(refused.value).startswith(
            f"algorithm '{name}' does not apply to task 'other_lm'"
        )
        assert not dest.exists() and not list(tmp_path.glob(f".refused-{name}.*"))


def test_cli_refuses_a_model_family_the_task_does_not_take(tmp_path: Path) -> None:
    dest = tmp_path / "p"
    result = scaffold_cli("new", str(dest), "--set", "model_family=resnet")
    assert result.returncode == 2 and not dest.exists()
    assert result.stderr.strip().splitlines() == [
        "error: answer 'model_family' = 'resnet' does not fit task 'causal_lm'; it takes: gpt"
    ]


def test_two_algorithms_replacing_one_extension_point_are_refused(
    tmp_path: Path,
) -> None:
    template = tmp_path / "templates"
    shutil.copytree(TEMPLATE, template)
    shutil.copytree(
        template / "algorithms" / "alibi", template / "algorithms" / "alibi_copy"
    )
    recipe = tmp_path / "r.toml"
    recipe.write_text("[algorithms.alibi]\n[algorithms.alibi_copy]\n")
    with pytest.raises(
        RecipeError, match="'alibi' and 'alibi_copy' both replace the 'attention' code"
    ):
        resolve(load_recipe(str(recipe), template), template, "p")


def test_an_extension_point_the_family_lacks_is_refused(tmp_path: Path) -> None:
    template = tmp_path / "templates"
    shutil.copytree(TEMPLATE, template)
    (template / "algorithms" / "alibi" / "model.gpt.rotary_cache.py.jinja").write_text(
        "pass\n"
    )
    recipe = tmp_path / "r.toml"
    recipe.write_text("[algorithms.alibi]\n")
    with pytest.raises(
        RecipeError,
        match="fills extension point 'rotary_cache', which model family 'gpt' lacks",
    ):
        resolve(load_recipe(str(recipe), template), template, "p")
