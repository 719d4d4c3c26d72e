"""Runtime objects a generated train.py builds from its Config in one line
(`X.from_config(cfg, ...)`): each reads the fields its Protocol names and behaves as the
explicit constructor given those values; every shipped recipe's Config has those fields.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import typing
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import RECIPES
from runtime import checkpoint, config, dist, early_stop, microbatch, monitor, parallel
from runtime import profile
from runtime.dist import DistEnv
from runtime.time import Progress, Time

GOLDEN = Path(__file__).parent / "golden"
CPU = DistEnv(
    rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu")
)
# What each Config-reading constructor reads: a recipe's Config must declare it all.
SETTINGS = (
    monitor.RunSettings,
    early_stop.EarlyStopSettings,
    checkpoint.CheckpointSettings,
    parallel.ParallelSettings,
    profile.ProfileSettings,
)


@dataclasses.dataclass
class Config:
    """The fields as a generated train.py declares them (values a run could have)."""

    seed: int = 7
    max_duration: Time = Time.parse("100ba")
    global_batch_size: int = 8
    device_microbatch_size: int | str = "auto"
    max_device_microbatch_size: int = 2
    console_interval: Time = Time.parse("0.05dur")
    trackers: str = ""
    early_stop_metric: str = "val_top1"
    early_stop_patience: Time = Time.parse("3ba")
    early_stop_min_delta: float = 0.5
    early_stop_mode: str = "max"
    profile: str = "2ba:3ba"
    save_num_checkpoints_to_keep: int = 1
    save_async: bool = False
    load_path: str = ""
    load_weights_only: bool = False
    autoresume: bool = True
    parallelism: str = "auto"
    sharding_strategy: str = "SHARD_GRAD_OP"
    precision: str = "auto"
    activation_checkpointing: bool = True
    cpu_offload: bool = False
    hybrid_shard_size: int = 0
    compile: bool | str = "auto"
    dist_timeout: int = 30


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipes_config_declares_what_the_runtime_reads(recipe: str) -> None:
    tree = ast.parse((GOLDEN / recipe / "train.py").read_text())
    (cls,) = [
        n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Config"
    ]
    declared = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    for settings in SETTINGS:
        missing = set(typing.get_type_hints(settings)) - declared
        assert not missing, f"{recipe}: Config lacks {missing} ({settings.__name__})"


def test_monitor_from_config_begins_where_the_run_stands(tmp_path: Path) -> None:
    run_dir, script = tmp_path / "run", tmp_path / "train.py"
    script.write_text("# the script that ran\n")
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(
        "".join(f'{{"step": {step}}}\n' for step in range(1, 6))
    )
    cfg = Config()
    made = monitor.Monitor.from_config(run_dir, cfg, CPU, flops_per_token=6e6)
    progress = Progress(batches_per_epoch=10, max_duration=cfg.max_duration)
    for _ in range(3):  # resumed at step 3
        progress.advance(samples=8, tokens=64)
    made.begin(progress, script)
    progress.advance(samples=8, tokens=64)
    made.log(progress, loss=1.0)
    made.close()
    steps = [
        json.loads(line)["step"]
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4]  # the lines after the resumed step were dropped
    assert (run_dir / "config.toml").read_text() == config.to_toml(cfg)
    assert (run_dir / "train.py").read_text() == script.read_text()
    log = (run_dir / "log.txt").read_text()
    assert "model: 6e+06 training FLOPs per token" in log
    assert "mfu: not measured on cpu" in log and "world size 1" in log
    plain = monitor.Monitor(tmp_path / "other", cfg.max_duration, 8)
    with pytest.raises(TypeError, match="from_config"):
        plain.begin(progress, script)


def test_early_stopper_from_config_watches_as_configured() -> None:
    lines: list[str] = []
    stopper = early_stop.EarlyStopper.from_config(Config(), log=lines.append)
    progress = Progress(batches_per_epoch=100)
    # mode max, min_delta 0.5: 10 -> 10.4 is no improvement; 3 batches later it stops.
    for value, stops in ((10.0, False), (10.4, False), (10.4, False), (10.4, True)):
        progress.advance(samples=8, tokens=64)
        assert (
            stopper.update(progress, {"val_top1": value}, Time.parse("100ba")) == stops
        )
    assert stopper.best == 10.0 and "on val_top1 (maximize, min_delta 0.5" in lines[0]


def test_checkpointer_from_config_keeps_and_resumes_as_configured(
    tmp_path: Path,
) -> None:
    def state(seed: int) -> dict:
        torch.manual_seed(seed)
        return {"model": nn.Linear(3, 2), "progress": Progress(batches_per_epoch=4)}

    cfg = Config(save_num_checkpoints_to_keep=1)
    saving = checkpoint.Checkpointer.from_config(tmp_path / "first", cfg)
    saved = state(seed=0)
    for _ in range(2):
        saved["progress"].advance(samples=8, tokens=64)
        saving.save(saved)
    assert [p.name for p in (tmp_path / "first").iterdir()] == ["step-2"]  # keep=1
    # A new run's folder, started from the first run's checkpoint (cfg.load_path).
    cfg = Config(load_path=str(tmp_path / "first"), load_weights_only=True)
    loaded = state(seed=1)
    resumed = checkpoint.Checkpointer.from_config(tmp_path / "second", cfg).resume(
        loaded
    )
    assert resumed is not None and resumed.weights_only
    assert torch.equal(loaded["model"].weight, saved["model"].weight)
    assert loaded["progress"].batch == 0  # weights only: progress starts over
    # A keyword given to resume() still wins over the config's.
    again = checkpoint.Checkpointer.from_config(tmp_path / "third", cfg)
    assert again.resume(state(seed=2), load_path="") is None


def test_search_from_config_starts_at_the_configured_size() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    search = microbatch.Search.from_config(model, [model[0]], CPU, Config(), print)
    assert search.auto and search.size == 2  # max_device_microbatch_size
    fixed = microbatch.Search.from_config(
        model, [model[0]], CPU, Config(device_microbatch_size=3), print, multiple_of=3
    )
    assert not fixed.auto and fixed.size == 3 and fixed.multiple_of == 3


def test_parallel_config_from_config_settles_auto_for_the_launch() -> None:
    plan = parallel.ParallelConfig.from_config(Config(), CPU)
    assert (plan.parallelism, plan.precision, plan.compile) == ("none", "fp32", False)
    assert plan.sharding_strategy == "SHARD_GRAD_OP" and plan.activation_checkpointing
    four = DistEnv(
        rank=1, local_rank=1, world_size=4, local_world_size=4, device=CPU.device
    )
    chosen = Config(precision="bf16", compile="model")
    plan = parallel.ParallelConfig.from_config(chosen, four)
    assert (plan.parallelism, plan.precision, plan.compile) == ("fsdp", "bf16", "model")


def test_profiler_from_config_reads_the_window(tmp_path: Path) -> None:
    profiler = profile.Profiler.from_config(Config(), tmp_path, CPU, print)
    assert profiler.window == (Time.parse("2ba"), Time.parse("3ba"))
    assert (
        profiler.folder == tmp_path / "profile" and profiler.max_duration.value == 100
    )


def test_setups_one_line_checks_name_the_field_and_the_fix() -> None:
    assert early_stop.check_settings(Config()) is None
    bad = Config(early_stop_min_delta=-1.0)
    assert early_stop.check_settings(bad) == "early_stop_min_delta=-1.0 must be >= 0"
    assert dist.check_batch(12, 4) is None
    assert dist.check_batch(10, 4) == (
        "global_batch_size=10 is not divisible by the world size 4; pick a multiple of 4"
    )


def test_tf32_is_turned_on_for_cuda_only() -> None:
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    try:
        matmul.fp32_precision = conv.fp32_precision = "ieee"
        dist.use_tf32(torch.device("cpu"))
        assert (matmul.fp32_precision, conv.fp32_precision) == ("ieee", "ieee")
        dist.use_tf32(torch.device("cuda", 0))  # a device object: no GPU is needed
        assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")
    finally:
        matmul.fp32_precision, conv.fp32_precision = before
