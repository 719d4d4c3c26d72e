"""Every algorithm in the catalog resumes bitwise after kill -9 (DESIGN.md §11.5).

One parametrised test over `scaffold.catalog.load_algorithms`: an algorithm added to
`templates/algorithms/` is included without touching this file. For each, a tiny project of
a task it applies to trains 6 steps uninterrupted; a second run of the same project is killed
with SIGKILL inside its step-4 save (every rank's shards written, no COMPLETE marker: the
worst moment), then restarted: it resumes from step 2, and every logged value of every step
(loss, learning rate, the algorithm's own metrics, validation scores of every evaluated
model) must equal the uninterrupted run's bitwise. Composer's own resumption test marks SAM,
StochasticDepth, LayerFreezing and SWA as expected failures; here there are none.

Each case costs three short runs; the default run keeps a few (one per task at least, the
stateful ones first), the rest are marked slow (`pytest --slow`). An algorithm trains on the
first task it lists; a task that is no algorithm's first (llm_finetune) trains its first
algorithm as one more case, `NAME-TASK`, in the default run.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from projects import (
    DIFFUSION_TINY,
    LLM_TINY,
    TEXT_CLASSIFICATION_TINY,
    checkout_env,
    read_metrics,
)
from scaffold.catalog import Algorithm, load_algorithms, load_tasks
from scaffold.paths import template_dir
from scaffold.render import new_project

TEMPLATE = template_dir()
CATALOG = load_algorithms(TEMPLATE)
TASKS = load_tasks(TEMPLATE)
STOP_AFTER = Path(__file__).resolve().parent / "stop_after.py"

# A tiny, fast configuration per task (offline data, tiny models); 6 steps, a save every 2.
RUN = [
    "--max_duration=6ba",
    "--save_interval=2ba",
    "--eval_interval=3ba",
    "--save_num_checkpoints_to_keep=0",
    "--dist_timeout=60",
]
TASK_ARGS = {
    "image_classification": [
        "--model=tiny",
        "--precision=fp32",
        "--global_batch_size=8",
        "--device_microbatch_size=4",
        "--bn_group_size=2",
        "--lr=0.2",
        "--eval_batches=1",
    ],
    "causal_lm": [
        "--model=tiny",
        "--seq_len=32",
        "--global_batch_size=4",
        "--device_microbatch_size=2",
        "--eval_batches=1",
    ],
    "masked_lm": [
        "--model=tiny",
        "--seq_len=32",
        "--vocab_size=512",
        "--global_batch_size=4",
        "--device_microbatch_size=2",
        "--eval_batches=1",
    ],
    "text_classification": [*TEXT_CLASSIFICATION_TINY, "--lr=1e-3"],
    "diffusion": DIFFUSION_TINY,
    "llm_finetune": [*LLM_TINY, "--samples=1", "--sample_tokens=4"],
}
# Hyperparameters that make an algorithm act within 6 steps (its defaults act later, or
# barely); algorithms not named here train with their defaults.
ACTIVE: dict[str, dict[str, Any]] = {
    "ema": {"half_life": "2ba"},
    "layer_freezing": {"start": 0.0},
    "selective_backprop": {"start": 0.0, "interval": 1},
    "sam": {"interval": 2},
    "factorize": {"min_channels": 16, "min_features": 8, "latent_features": 0.25},
    "swa": {
        "start": "0.3dur",
        "end": "0.8dur",
        "update_interval": "1ba",
        "schedule_lr": True,
        "bn_batches": 1,
    },
    # Muon's options (the default Newton-Schulz resumes in gpt2-modern's own smoke test).
    "muon": {
        "orthogonalizer": "polar_express",
        "cautious_weight_decay": True,
        "normuon": True,
        "weight_decay": 1.2,
    },
}
# Cases in the default run: the stateful and the historically broken; plus the first
# algorithm of any task none of these covers.
FAST = {"ema", "sam", "layer_freezing", "seq_length_warmup", "precomputed_latents"}
# Logged values that measure time, memory or the machine (system_metrics), not training:
# they differ between any two runs.
UNTIMED = re.compile(r"(_s|_ms|_gb|_mb|per_s|mfu|_bytes)$|^system/")


def task_of(spec: Algorithm) -> str:
    return next(
        task for task in (*spec.tasks, *TASKS) if task in TASKS and task in spec.tasks
    )


def fast_cases() -> set[str]:
    fast = {name for name in FAST if name in CATALOG}
    for task in TASKS:
        applies = [
            name
            for name, spec in CATALOG.items()
            if spec.tasks and task_of(spec) == task
        ]
        if applies and not fast & set(applies):
            fast.add(sorted(applies)[0])
    return fast


def cases() -> list[Any]:
    fast = fast_cases()
    marks = {name: () if name in fast else (pytest.mark.slow,) for name in CATALOG}
    for name, spec in CATALOG.items():
        if spec.devices and "cpu" not in spec.devices:  # CUDA only (memory snapshots)
            marks[name] += (
                pytest.mark.skipif(
                    not torch.cuda.is_available(), reason=f"{name} runs on CUDA only"
                ),
            )
    found = [
        pytest.param(name, task_of(spec), id=name, marks=marks[name])
        for name, spec in CATALOG.items()
        if spec.tasks
    ]
    first = {task_of(spec) for spec in CATALOG.values() if spec.tasks}
    for task in TASKS:
        applies = sorted(name for name, s in CATALOG.items() if task in s.tasks)
        if applies and task not in first:
            found.append(pytest.param(applies[0], task, id=f"{applies[0]}-{task}"))
    return found


def recipe(name: str, task: str) -> str:
    """A recipe for `name` (and what it requires) on `task`."""
    spec = CATALOG[name]
    family = spec.models[0] if spec.models else TASKS[task].models[0]
    lines = [f'[answers]\ntask = "{task}"\nmodel_family = "{family}"\nmodel = "tiny"\n']
    for algorithm in (*spec.requires, name):
        lines.append(f"[algorithms.{algorithm}]")
        for key, value in ACTIVE.get(algorithm, {}).items():
            toml = str(value).lower() if isinstance(value, bool) else repr(value)
            lines.append(f"{key} = {toml}".replace("'", '"'))
    return "\n".join(lines) + "\n"


def train(
    project: Path, task: str, run: str, kill_in_save: int = 0, device: str = "cpu"
) -> subprocess.CompletedProcess[str]:
    """`python train.py` in the project's parent folder (runs/ lands there)."""
    prefix = [str(STOP_AFTER), f"kill:{kill_in_save}"] if kill_in_save else []
    args = [f"--run_name={run}", f"--device={device}"]
    command = [
        sys.executable,
        *prefix,
        str(project / "train.py"),
        *RUN,
        *TASK_ARGS[task],
        *args,
    ]
    return subprocess.run(
        command,
        cwd=project.parent,
        env={**checkout_env(), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )


def logged(workdir: Path, run: str) -> list[dict[str, Any]]:
    return [
        {k: v for k, v in row.items() if not UNTIMED.search(k)}
        for row in read_metrics(workdir, run)
    ]


@pytest.mark.parametrize(("name", "task"), cases())
def test_kill_9_resumes_bitwise(name: str, task: str, tmp_path: Path) -> None:
    (tmp_path / "recipe.toml").write_text(recipe(name, task))
    project = tmp_path / "p"
    new_project(str(tmp_path / "recipe.toml"), project, [], "p")
    device = (CATALOG[name].devices or ("cpu",))[0]

    whole = train(project, task, "whole", device=device)
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-4000:]
    killed = train(project, task, "killed", kill_in_save=4, device=device)
    assert killed.returncode == -9, killed.stderr[-4000:]
    resumed = train(project, task, "killed", device=device)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-4000:]
    assert (
        "resumed from" in resumed.stdout and "step-2" in resumed.stdout
    ), resumed.stdout[-2000:]

    expected = logged(tmp_path, "whole")
    assert [row["step"] for row in expected] == [1, 2, 3, 4, 5, 6]
    assert logged(tmp_path, "killed") == expected
