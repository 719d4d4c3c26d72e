"""Every combination `scaffold add` accepts trains at its defaults: the algorithms the
catalog allows together pass their start-up checks at their defaults, and train for 2
steps, on the task they belong to (every task with more than one algorithm).

The pairs are grouped: for each pair `scaffold add` accepts, the largest set of algorithms
it accepts beside it, so a handful of projects holds every pair (every pair shares those
projects' events, rows and targets). Each group of every model family runs train.py's
setup() at the Config's defaults (cheap: no launch); the first family's groups also train
(the mixers at their defaults too: they take turns); with --slow each pair also trains in a
project of its own. A pair that cannot work is a declared conflict, refused at `scaffold
new` and `scaffold add` (test_catalog.py). Selective backprop then MixUp or CutMix crashed
here before the mixers paired the kept rows; MixUp with CutMix at their defaults once
refused to start (their shares added up to 2)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest

from projects import (
    DIFFUSION_TINY,
    LLM_TINY,
    TEXT_CLASSIFICATION_TINY,
    project_modules,
    read_metrics,
    run_train,
)
from scaffold.answers import add_algorithm
from scaffold.catalog import load_algorithms, load_models, load_tasks
from scaffold.paths import template_dir
from scaffold.recipes import RecipeError
from scaffold.render import new_project

TEMPLATE = template_dir()
CATALOG = load_algorithms(TEMPLATE)
MODELS = load_models(TEMPLATE)
FAMILIES = {name: task.models for name, task in load_tasks(TEMPLATE).items()}
# Two tiny steps per task, evaluation and checkpoints out of the way.
COMMON = ["--max_duration=2ba", "--eval_interval=1000ba", "--save_interval=1000ba"]
TASK_ARGS = {
    # The tiny ResNet on the digits, 12 samples per step in BatchNorm groups of 2.
    "image_classification": [
        "--model=tiny",
        "--precision=fp32",
        "--global_batch_size=12",
        "--device_microbatch_size=2",
        "--bn_group_size=2",
        "--lr_warmup=1ba",
        "--eval_batches=1",
    ],
    "causal_lm": [
        "--model=tiny",
        "--seq_len=32",
        "--global_batch_size=4",
        "--device_microbatch_size=2",
        "--eval_batches=1",
    ],
    # The tiny BERT; a 512-token WordPiece trained once per run on Python's docs.
    "masked_lm": [
        "--model=tiny",
        "--seq_len=32",
        "--global_batch_size=4",
        "--device_microbatch_size=2",
        "--vocab_size=512",
        "--eval_batches=1",
    ],
    "text_classification": TEXT_CLASSIFICATION_TINY,
    "diffusion": DIFFUSION_TINY,
    # The tiny Llama fine-tuned on the task's embedded instructions.
    "llm_finetune": [*LLM_TINY, "--samples=0"],
}
# Settings that make each algorithm act within the 2 steps.
ACT_NOW = {
    "selective_backprop": [
        "--selective_backprop_start=0",
        "--selective_backprop_interval=1",
        f"--selective_backprop_keep={1 / 3!r}",
    ],
    "sam": ["--sam_interval=1"],
    "ema": ["--ema_update_interval=1ba", "--ema_half_life=2ba"],
    "progressive_resizing": ["--progressive_resizing_delay_fraction=0"],
    "layer_freezing": ["--layer_freezing_start=0"],
}
# The batch mixers take turns (one shared draw per step): seed 1 gives step 0 to
# mixup (its draw 0.149 falls below its half) and step 1 to cutmix (0.913).
MIXERS = ("mixup", "cutmix")
BOTH_MIXERS = ["--seed=1"]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def accepted(names: list[str], task: str, family: str) -> bool:
    """Whether `scaffold add` accepts `names`, added one by one to a project of `task`
    on `family` (conflicts, requirements, the places only one algorithm may fill)."""
    answers: dict[str, dict] = {}
    try:
        for name in names:
            answers = add_algorithm(answers, name, [], CATALOG, task, MODELS[family])
    except RecipeError:
        return False
    return True


def on_cpu(task: str, family: str) -> list[str]:
    """The algorithms of `task` on `family` that run on a CPU (these runs'; the CUDA-only
    memory recorders refuse a CPU run in one line, test_packs.py)."""
    return sorted(
        name
        for name, spec in CATALOG.items()
        if task in spec.tasks
        and (not spec.devices or "cpu" in spec.devices)
        and accepted([name], task, family)
    )


def task_pairs(task: str, family: str) -> list[tuple[str, str]]:
    names = on_cpu(task, family)
    return [
        (a, b)
        for a, b in itertools.combinations(names, 2)
        if accepted([a, b], task, family)
    ]


def groups(task: str, family: str) -> list[tuple[str, ...]]:
    """Sets of algorithms accepted together that hold every accepted pair of `task` on
    `family` (its one algorithm, where it has one)."""
    names = on_cpu(task, family)
    found: list[tuple[str, ...]] = []
    for pair in task_pairs(task, family) or [tuple(names)]:
        if any(set(pair) <= set(group) for group in found):
            continue
        chosen = list(pair)
        for name in names:
            if name not in chosen and accepted([*chosen, name], task, family):
                chosen.append(name)
        found.append(tuple(sorted(chosen)))
    return found


def runs(task: str, algorithms: tuple[str, ...]) -> list[str]:
    """Settings that make each of `algorithms` act within the 2 steps."""
    args = [*COMMON, *TASK_ARGS[task]]
    args += [flag for name in algorithms for flag in ACT_NOW.get(name, [])]
    return args + (BOTH_MIXERS if set(MIXERS) <= set(algorithms) else [])


def generate(root: Path, task: str, family: str, algorithms: tuple[str, ...]) -> Path:
    recipe = f'[answers]\ntask = "{task}"\nmodel_family = "{family}"\n'
    recipe += "".join(f"[algorithms.{name}]\n" for name in algorithms)
    (root / "recipe.toml").write_text(recipe)
    new_project(str(root / "recipe.toml"), root / "p", [], "p")
    return root / "p"


@pytest.fixture(scope="module")
def rendered(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str, str, tuple[str, ...]], Path]:
    """Each group's project, generated once for the start-up check and the training."""
    projects: dict[tuple, Path] = {}

    def project(task: str, family: str, algorithms: tuple[str, ...]) -> Path:
        key = (task, family, algorithms)
        if key not in projects:
            projects[key] = generate(tmp_path_factory.mktemp(task), *key)
        return projects[key]

    return project


def trains(
    project: Path, task: str, algorithms: tuple[str, ...], workdir: Path
) -> None:
    args = runs(task, algorithms)
    result = run_train(project, workdir, *args, "--run_name=r")
    assert result.returncode == 0, (algorithms, args, result.stderr[-3000:])
    for mixer in MIXERS:
        if mixer in algorithms:  # it mixed a step
            lambdas = [r[f"{mixer}_lambda"] for r in read_metrics(workdir, "r")]
            assert min(lambdas) < 1.0, (mixer, lambdas)


CHECKED = [
    (task, family, group)
    for task in TASK_ARGS
    for family in FAMILIES[task]
    for group in groups(task, family)
]
GROUPS = [
    (task, group) for task, family, group in CHECKED if family == FAMILIES[task][0]
]
PAIRS = [
    (task, pair) for task in TASK_ARGS for pair in task_pairs(task, FAMILIES[task][0])
]


def test_the_groups_hold_every_accepted_pair() -> None:
    for task in TASK_ARGS:
        for family in FAMILIES[task]:
            for pair in task_pairs(task, family):
                assert any(
                    (t, f) == (task, family) and set(pair) <= set(g)
                    for t, f, g in CHECKED
                ), pair
    assert len(GROUPS) <= 2 * len(TASK_ARGS)  # a handful of projects in CI


@pytest.mark.parametrize(
    ("task", "family", "algorithms"),
    CHECKED,
    ids=[f"{family}:" + "+".join(g) for _, family, g in CHECKED],
)
def test_accepted_algorithms_pass_their_checks_at_their_defaults(
    task: str,
    family: str,
    algorithms: tuple[str, ...],
    rendered: Callable[[str, str, tuple[str, ...]], Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """train.py's start-up checks (setup()) at every default: no refusal."""
    monkeypatch.chdir(tmp_path)
    with project_modules(rendered(task, family, algorithms)) as modules:
        train = modules["train"]
        from runtime import dist

        try:
            train.setup(train.Config())
        except SystemExit:
            refusal = capsys.readouterr().err.strip()
            pytest.fail(f"{'+'.join(algorithms)} at their defaults: {refusal}")
        finally:
            dist.shutdown()


@pytest.mark.parametrize(
    ("task", "algorithms"), GROUPS, ids=["+".join(g) for _, g in GROUPS]
)
def test_allowed_algorithms_train_together(
    task: str,
    algorithms: tuple[str, ...],
    rendered: Callable[[str, str, tuple[str, ...]], Path],
    tmp_path: Path,
) -> None:
    project = rendered(task, FAMILIES[task][0], algorithms)
    trains(project, task, algorithms, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(("task", "pair"), PAIRS, ids=["+".join(p) for _, p in PAIRS])
def test_each_allowed_pair_trains(
    task: str, pair: tuple[str, str], tmp_path: Path
) -> None:
    project = generate(tmp_path, task, FAMILIES[task][0], pair)
    (tmp_path / "w").mkdir()
    trains(project, task, pair, tmp_path / "w")
