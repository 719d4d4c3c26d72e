"""Every combination composes: the algorithms the catalog allows together train for 2
steps, on the task they belong to (every task with more than one algorithm).

In CI the pairs are grouped: for each allowed pair, the largest set of algorithms the
catalog allows beside it (conflicts are the only exclusions), so a handful of projects
trains every pair at once (every pair shares those projects' events, rows and targets);
with --slow each pair also trains in a project of its own. A pair that cannot work is a
declared conflict, refused at `scaffold new` (test_catalog.py). Selective backprop then
MixUp or CutMix crashed here before the mixers paired the kept rows (issue 33)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from projects import DIFFUSION_TINY, LLM_TINY, TEXT_CLASSIFICATION_TINY, run_train
from scaffold.catalog import load_algorithms, load_tasks
from scaffold.paths import template_dir
from scaffold.render import new_project

TEMPLATE = template_dir()
CATALOG = load_algorithms(TEMPLATE)
FAMILY = {name: task.models[0] for name, task in load_tasks(TEMPLATE).items()}
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
# The batch mixers share one draw per step: each trains in a run of its own.
MIXERS = ("mixup", "cutmix")


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def allowed(a: str, b: str) -> bool:
    return b not in CATALOG[a].conflicts and a not in CATALOG[b].conflicts


def on_cpu(task: str) -> list[str]:
    """The algorithms of `task` that run on a CPU (these runs'; the CUDA-only memory
    recorders refuse a CPU run in one line, test_packs.py) on its first model family."""
    return sorted(
        name
        for name, spec in CATALOG.items()
        if task in spec.tasks
        and (not spec.devices or "cpu" in spec.devices)
        and (not spec.models or FAMILY[task] in spec.models)
    )


def task_pairs(task: str) -> list[tuple[str, str]]:
    names = on_cpu(task)
    return [(a, b) for a, b in itertools.combinations(names, 2) if allowed(a, b)]


def groups(task: str) -> list[tuple[str, ...]]:
    """Sets of algorithms allowed together that hold every allowed pair of `task`."""
    names = on_cpu(task)
    found: list[tuple[str, ...]] = []
    for pair in task_pairs(task):
        if any(set(pair) <= set(group) for group in found):
            continue
        chosen = list(pair)
        for name in names:
            if name not in chosen and all(allowed(name, c) for c in chosen):
                chosen.append(name)
        found.append(tuple(sorted(chosen)))
    return found


def runs(task: str, algorithms: tuple[str, ...]) -> list[list[str]]:
    """The runs that make each of `algorithms` act: one per batch mixer present."""
    args = [*COMMON, *TASK_ARGS[task]]
    args += [flag for name in algorithms for flag in ACT_NOW.get(name, [])]
    mixers = [m for m in MIXERS if m in algorithms]
    return [
        args + [f"--{m}_prob={1.0 if m == mine else 0.0}" for m in mixers]
        for mine in mixers or [None]
    ]


def generate(root: Path, task: str, algorithms: tuple[str, ...]) -> Path:
    recipe = f'[answers]\ntask = "{task}"\nmodel_family = "{FAMILY[task]}"\n'
    recipe += "".join(f"[algorithms.{name}]\n" for name in algorithms)
    (root / "recipe.toml").write_text(recipe)
    new_project(str(root / "recipe.toml"), root / "p", [], "p")
    return root / "p"


def trains(task: str, algorithms: tuple[str, ...], tmp_path: Path) -> None:
    project = generate(tmp_path, task, algorithms)
    for i, args in enumerate(runs(task, algorithms)):
        result = run_train(project, tmp_path, *args, f"--run_name=r{i}")
        assert result.returncode == 0, (algorithms, args, result.stderr[-3000:])


GROUPS = [(task, group) for task in TASK_ARGS for group in groups(task)]
PAIRS = [(task, pair) for task in TASK_ARGS for pair in task_pairs(task)]


def test_the_groups_hold_every_allowed_pair() -> None:
    for task, pair in PAIRS:
        assert any(t == task and set(pair) <= set(g) for t, g in GROUPS), pair
    assert len(GROUPS) <= 2 * len(TASK_ARGS)  # a handful of projects in CI


@pytest.mark.parametrize(
    ("task", "algorithms"), GROUPS, ids=["+".join(g) for _, g in GROUPS]
)
def test_allowed_algorithms_train_together(
    task: str, algorithms: tuple[str, ...], tmp_path: Path
) -> None:
    trains(task, algorithms, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize(("task", "pair"), PAIRS, ids=["+".join(p) for _, p in PAIRS])
def test_each_allowed_pair_trains(
    task: str, pair: tuple[str, str], tmp_path: Path
) -> None:
    trains(task, pair, tmp_path)
