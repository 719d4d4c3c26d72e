"""Catalog algorithms on the llm_finetune task, on LoRA adapters (peft): their effects.

The full-weight model trains them in test_catalog_resume.py (kill -9 in a save, bitwise
resume) and test_pairs.py (together); here the same project trains the tiny Llama's LoRA
adapters twice, 4 steps, a checkpoint (adapters only) after each:
- layer_freezing (start 0, level 1, by blocks) freezes the first k - 1 of the 4 decoder layers in step
  k: their adapters stop changing, the last layer's never do;
- gradient_clipping: the logged grad_norm is the adapters' gradient norm before clipping
  (the same first step in both runs); with max_norm 1e-12 the adapters barely move
  (AdamW's update shrinks when the gradient falls below its eps), with 1e3 they move.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

import torch  # noqa: E402

from conftest import scaffold_cli  # noqa: E402
from projects import read_metrics, run_train  # noqa: E402
from runtime.checkpoint import read_weights  # noqa: E402

RECIPE = """[answers]
task = "llm_finetune"
model_family = "hf_causal"
model = "tiny"
lora = true
[algorithms.layer_freezing]
start = 0.0
units = "blocks"
[algorithms.gradient_clipping]
"""
SMALL = [
    "--seq_len=64",
    "--global_batch_size=4",
    "--device_microbatch_size=4",
    "--samples=0",
    "--eval_batches=1",
    "--eval_interval=1000ba",
    "--max_duration=4ba",
    "--save_interval=1ba",
    "--save_num_checkpoints_to_keep=0",
]


def adapters(workdir: Path, run: str, step: int, layer: int) -> list[torch.Tensor]:
    step_dir = workdir / "runs" / run / "checkpoints" / f"step-{step}"
    weights = read_weights(step_dir)[0]
    found = [v for k, v in sorted(weights.items()) if f".layers.{layer}." in k]
    assert found and all(".lora_" in k for k in weights), sorted(weights)[:4]
    return found


def moved(workdir: Path, run: str, a: int, b: int, layer: int) -> float:
    """The largest change of a layer's adapter weights from checkpoint a to b."""
    before, after = adapters(workdir, run, a, layer), adapters(workdir, run, b, layer)
    return max((x - y).abs().max().item() for x, y in zip(before, after))


def test_layer_freezing_and_gradient_clipping_on_lora_adapters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "recipe.toml").write_text(RECIPE)
    made = scaffold_cli(
        "new", "--recipe", str(tmp_path / "recipe.toml"), "p", cwd=tmp_path
    )
    assert made.returncode == 0, made.stderr
    project = tmp_path / "p"
    for run, max_norm in (("free", "1e3"), ("clipped", "1e-12")):
        args = (*SMALL, f"--gradient_clipping_max_norm={max_norm}", f"--run_name={run}")
        result = run_train(project, tmp_path, *args)
        assert result.returncode == 0, result.stderr[-3000:]
    free, clipped = read_metrics(tmp_path, "free"), read_metrics(tmp_path, "clipped")
    assert [r["frozen_layers"] for r in free] == [0, 1, 2, 3]

    # Layer k - 1 trains up to step k - 1 and is frozen from step k on (step 1 has the
    # warmup's learning rate 0).
    for layer in (1, 2):
        assert moved(tmp_path, "free", layer, layer + 1, layer) > 0
        assert moved(tmp_path, "free", layer + 1, 4, layer) == 0
    assert moved(tmp_path, "free", 3, 4, 3) > 0  # the last layer is never frozen

    # The same first gradient, logged before clipping; clipped to 1e-12 it hardly moves.
    assert clipped[0]["grad_norm"] == free[0]["grad_norm"] > 1e-3
    for layer in (1, 2, 3):  # each trains in step layer + 1 (frozen after it)
        free_move = moved(tmp_path, "free", layer, layer + 1, layer)
        assert moved(tmp_path, "clipped", layer, layer + 1, layer) < 1e-2 * free_move
