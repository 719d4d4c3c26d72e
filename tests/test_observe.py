"""Seeing a run, end to end on generated projects: MFU's FLOPs formula, interval-mean losses
without per-step syncs, trackers read back by their own libraries, early stopping, the
profiler window and `scaffold plot`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from projects import project_modules, read_metrics, run_train

SMALL_RUN = (
    "--seq_len=32",
    "--global_batch_size=4",
    "--eval_batches=1",
    "--eval_interval=100ba",
)


@pytest.mark.parametrize(
    "recipe, has_position_table", [("gpt2-baseline", True), ("gpt2-speedup", False)]
)
def test_gpt_flops_per_token_is_6n_plus_attention(
    recipe: str, has_position_table: bool, generated: dict[str, Path]
) -> None:
    with project_modules(generated[recipe]) as modules:
        model_module = modules["model"]
        seq, vocab = 64, 256
        config = model_module.GPTConfig(
            vocab_size=vocab, max_seq_len=seq, **model_module.PRESETS["tiny"]
        )
        model = model_module.GPT(config)
        layers, width = config.n_layer, config.n_embd
        # By hand: tied embedding once; per block 2 LayerNorms, qkv, proj, fc, proj (+ biases).
        per_block = (
            2 * 2 * width
            + (3 * width * width + 3 * width)
            + (width * width + width)
            + (4 * width * width + 4 * width)
            + (4 * width * width + width)
        )
        n = vocab * width + layers * per_block + 2 * width  # + final LayerNorm
        assert model.num_params() == n + (seq * width if has_position_table else 0)
        assert model.flops_per_token(seq) == 6 * n + 12 * layers * seq * width


def test_logged_loss_is_the_interval_mean(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """log_interval=3ba logs the token mean of the 3 steps' losses (no step is dropped),
    and CPU runs log memory and ETA but no MFU."""
    project = generated["gpt2-baseline"]
    every = run_train(
        project, tmp_path, *SMALL_RUN, "--max_duration=6ba", "--run_name=every"
    )
    assert every.returncode == 0, every.stderr
    third = run_train(
        project,
        tmp_path,
        *SMALL_RUN,
        "--max_duration=6ba",
        "--run_name=third",
        "--log_interval=3ba",
    )
    assert third.returncode == 0, third.stderr
    losses = [r["loss"] for r in read_metrics(tmp_path, "every")]
    records = read_metrics(tmp_path, "third")
    assert [r["step"] for r in records] == [3, 6]
    for record, chunk in zip(records, (losses[:3], losses[3:])):
        assert math.isclose(record["loss"], sum(chunk) / 3, rel_tol=1e-6)
        assert record["rss_gb"] > 0 and record["eta_s"] >= 0 and "mfu" not in record
    assert (
        "mfu: not measured on cpu"
        in (tmp_path / "runs" / "third" / "log.txt").read_text()
    )


def test_trackers_flag_logs_tensorboard_and_mlflow_and_rejects_unknown(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    project = generated["gpt2-baseline"]
    bad = run_train(project, tmp_path, *SMALL_RUN, "--trackers=tensorboard,comet")
    assert bad.returncode == 2 and "unknown tracker 'comet'" in bad.stderr
    assert not (tmp_path / "runs").exists()
    result = run_train(
        project,
        tmp_path,
        *SMALL_RUN,
        "--max_duration=4ba",
        "--run_name=tracked",
        "--trackers=tensorboard,mlflow",
    )
    assert result.returncode == 0, result.stderr
    records = read_metrics(tmp_path, "tracked")
    events = EventAccumulator(str(tmp_path / "runs" / "tracked" / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("loss")] == [
        (r["step"], round(r["loss"], 5)) for r in records
    ]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    (run,) = client.search_runs(
        [client.get_experiment_by_name("scaffold").experiment_id]
    )
    assert run.data.params["max_duration"] == "4ba" and run.info.run_name == "tracked"
    history = sorted(
        (m.step, m.value)
        for m in client.get_metric_history(run.info.run_id, "val_loss")
    )
    assert history == [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]


def test_early_stopping_saves_says_why_and_a_rerun_trains_no_further(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """lr=0: the weights never change, so val_loss is flat from the first evaluation (step 1):
    with patience 3ba the run stops at step 4 of 30, saves a checkpoint there, and says why.
    """
    project = generated["gpt2-baseline"]
    args = (
        *SMALL_RUN[:3],
        "--max_duration=30ba",
        "--run_name=plateau",
        "--lr=0",
        "--eval_interval=1ba",
        "--save_interval=100ba",
        "--early_stop_metric=val_loss",
        "--early_stop_patience=3ba",
    )
    result = run_train(project, tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert [r["step"] for r in read_metrics(tmp_path, "plateau")] == [1, 2, 3, 4]
    assert "early stopping at step 4: val_loss has not improved" in result.stdout
    run = tmp_path / "runs" / "plateau"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-4"]
    again = run_train(project, tmp_path, *args)
    assert again.returncode == 0, again.stderr
    assert "nothing to train" in again.stdout
    assert [r["step"] for r in read_metrics(tmp_path, "plateau")] == [1, 2, 3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-4"]


def test_profile_window_writes_a_chrome_trace_of_the_training_step(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    import json

    project = generated["gpt2-baseline"]
    bad = run_train(project, tmp_path, *SMALL_RUN, "--profile=5ba")
    assert bad.returncode == 2 and "START:END" in bad.stderr
    result = run_train(
        project,
        tmp_path,
        *SMALL_RUN,
        "--max_duration=5ba",
        "--run_name=prof",
        "--profile=2ba:4ba",
    )
    assert result.returncode == 0, result.stderr
    assert "profile: steps 3-4 recorded in" in result.stdout
    trace = json.loads(
        (tmp_path / "runs" / "prof" / "profile" / "rank0.trace.json").read_text()
    )
    names = {event.get("name", "") for event in trace["traceEvents"]}
    assert any(
        name.startswith("Optimizer.step#AdamW") for name in names
    )  # the step itself
    assert {"aten::scaled_dot_product_attention", "aten::addmm"} <= names  # forward
    assert any("Backward" in name for name in names)  # and backward


def test_a_recipe_answer_chooses_the_trackers(tmp_path: Path) -> None:
    from conftest import scaffold_cli

    dest = tmp_path / "tracked"
    result = scaffold_cli(
        "new",
        str(dest),
        "--recipe",
        "gpt2-baseline",
        "--set",
        "trackers=tensorboard,mlflow",
    )
    assert result.returncode == 0, result.stderr
    assert 'trackers: str = "tensorboard,mlflow"' in (dest / "train.py").read_text()
