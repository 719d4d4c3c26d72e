"""Passes per step are the user's: whatever an algorithm does to a batch's rows, a step runs
the forward/backward passes `global_batch_size / device_microbatch_size` says (per rank),
each over the tokens of `device_microbatch_size` of the user's rows.

Each run goes through tests/count_passes.py, which counts the model's forwards with
gradients (and the gradient-free ones apart) between optimizer steps.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from projects import checkout_env, read_metrics
from runtime import microbatch
from scaffold.render import new_project

COUNT_PASSES = Path(__file__).resolve().parent / "count_passes.py"
# A few steps, evaluation and checkpoints at the end only (outside the counted steps).
STEPS = ["--max_duration=3ba", "--eval_interval=100ba", "--save_interval=100ba"]
QUARTER_ROWS = "--alibi_train_sequence_length_scaling=0.25"


def counted(
    project: Path, workdir: Path, run_name: str, *args: str, env: dict | None = None
) -> list[tuple[list[list[int]], int]]:
    """Per step: the shape of each pass's input and the gradient-free forwards."""
    result = subprocess.run(
        [
            sys.executable,
            str(COUNT_PASSES),
            str(project / "train.py"),
            "--device=cpu",
            f"--run_name={run_name}",
            "--eval_batches=1",
            *args,
        ],
        cwd=workdir,
        env={**checkout_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = re.findall(
        r"^passes step=\d+ shapes=(.*) scoring=(\d+)$", result.stdout, re.M
    )
    return [(json.loads(shapes), int(scoring)) for shapes, scoring in lines]


def tokens(shape: list[int]) -> int:
    """Token positions of a pass: rows x length (a text model's input)."""
    return shape[0] * shape[1]


def test_gpt2_speedup_runs_as_many_passes_as_gpt2_baseline(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """ALiBi's quarter rows (Composer's 0.25; the recipe trains full rows) and
    sequence-length warmup: 2 passes per step (16 rows, 8 per pass), as the baseline; each
    full-length pass holds the baseline's 8 x 128 tokens.
    """
    baseline = counted(generated["gpt2-baseline"], tmp_path, "base", *STEPS)
    speedup = counted(
        generated["gpt2-speedup"], tmp_path, "speedup", *STEPS, QUARTER_ROWS
    )
    assert [len(passes) for passes, _ in baseline] == [2, 2, 2]
    assert [len(passes) for passes, _ in speedup] == [2, 2, 2]
    assert all(shape == [8, 128] for passes, _ in baseline for shape in passes)
    # Step 1 warms up at 8 tokens (4 pieces of 2 per row), steps 2-3 at full length.
    assert speedup[0][0] == [[32, 2], [32, 2]]
    for passes, _ in speedup[1:]:
        assert passes == [[32, 32], [32, 32]]
        assert [tokens(s) for s in passes] == [8 * 128, 8 * 128]


def test_auto_microbatching_finds_a_size_in_the_users_rows(
    generated_auto: dict[str, Path], tmp_path: Path
) -> None:
    """Memory for 512 tokens per pass: both recipes (gpt2-speedup at quarter rows) settle
    at 4 of their 16 rows (4 x 128 tokens) at full length, and run 4 passes a step there.
    """
    memory = {microbatch.INJECT_ENV: "tokens=512"}
    runs = {}
    for recipe in ("gpt2-baseline", "gpt2-speedup"):
        passes = counted(
            generated_auto[recipe],
            tmp_path,
            recipe,
            *STEPS,
            "--log_interval=1ba",
            *([QUARTER_ROWS] if recipe == "gpt2-speedup" else []),
            env=memory,
        )
        sizes = [r["microbatch_size"] for r in read_metrics(tmp_path, recipe)]
        runs[recipe] = (passes, sizes)
    (base_passes, base_sizes), (passes, sizes) = (
        runs["gpt2-baseline"],
        runs["gpt2-speedup"],
    )
    assert base_sizes == [4, 4, 4]
    # gpt2-speedup: step 1 warms up at 8 tokens (16 rows fit), steps 2-3 at full length.
    assert sizes == [16, 4, 4]
    # The step after the size settled at full length: one attempt, as the baseline's.
    assert [tokens(s) for s in passes[2][0]] == [tokens(s) for s in base_passes[2][0]]
    assert [tokens(s) for s in passes[2][0]] == [512] * 4


def test_masked_lm_alibi_rows_and_unpadding_keep_the_passes(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """mosaicbert (unpadding, ALiBi at full length) and mosaicbert with half rows run
    bert-pretrain-baseline's 2 passes of 16 x 128 tokens a step."""
    baseline = counted(generated["bert-pretrain-baseline"], tmp_path, "base", *STEPS)
    mosaic = counted(generated["mosaicbert"], tmp_path, "mosaic", *STEPS)
    halves = counted(
        generated["mosaicbert"],
        tmp_path,
        "halves",
        *STEPS,
        "--alibi_train_sequence_length_scaling=0.5",
    )
    assert [passes for passes, _ in baseline] == [[[16, 128], [16, 128]]] * 3
    assert [passes for passes, _ in mosaic] == [[[16, 128], [16, 128]]] * 3
    assert [passes for passes, _ in halves] == [[[32, 64], [32, 64]]] * 3


SELECTIVE_BACKPROP = """
[answers]
task = "image_classification"
model_family = "resnet"
model = "tiny"

[algorithms.selective_backprop]
"""


def test_selective_backprop_trains_its_kept_rows_in_full_microbatches(
    tmp_path: Path,
) -> None:
    """Selective backprop keeps 8 of 16 samples on step 3: its scoring forwards run the
    step's 4 microbatches of 4 without gradients, then 2 passes train the kept 8, 4 per
    pass (Composer splits the kept batch by the microbatch size too); steps 1-2 train 4.
    """
    (tmp_path / "recipe.toml").write_text(SELECTIVE_BACKPROP)
    new_project(str(tmp_path / "recipe.toml"), tmp_path / "p", [], "p")
    steps = counted(
        tmp_path / "p",
        tmp_path,
        "sb",
        *STEPS,
        "--precision=fp32",
        "--global_batch_size=16",
        "--device_microbatch_size=4",
        "--bn_group_size=2",
        "--selective_backprop_start=0.5",  # from step 3 (batch 2) on, every other step
        "--selective_backprop_keep=0.5",
        "--selective_backprop_interval=2",
    )
    rows = [[shape[0] for shape in passes] for passes, _ in steps]
    assert rows == [[4, 4, 4, 4], [4, 4, 4, 4], [4, 4]]
    # (Step 1's count holds the set-up's forwards: FLOPs, shapes.)
    assert [scoring for _, scoring in steps[1:]] == [0, 4]
