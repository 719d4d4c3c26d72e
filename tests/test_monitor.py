"""Tests for runtime.monitor: metrics.jsonl, resume trimming, paused throughput, rank-0-only output."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from projects import checkout_env
from runtime.monitor import Monitor
from runtime.time import Progress, Time

GLOBAL_BATCH = 4
TOKENS_PER_STEP = 4 * 256


def make(
    run_dir: Path, step: int = 0, enabled: bool = True
) -> tuple[Monitor, Progress]:
    progress = Progress(batches_per_epoch=10)
    for _ in range(step):
        progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    monitor = Monitor(run_dir, Time.parse("100ba"), GLOBAL_BATCH, enabled=enabled)
    monitor.start(progress)
    return monitor, progress


def test_a_task_without_tokens_logs_samples_only(tmp_path: Path) -> None:
    """Image classification counts samples, not tokens: no tokens=0, tokens_per_s=0 columns."""
    run_dir = tmp_path / "run"
    monitor, progress = make(run_dir)
    progress.advance(samples=GLOBAL_BATCH, tokens=0)
    monitor.log(progress, loss=2.5)
    monitor.close()
    (record,) = records(run_dir)
    assert record["samples"] == GLOBAL_BATCH and record["samples_per_s"] > 0
    assert "tokens" not in record and "tokens_per_s" not in record


def records(run_dir: Path) -> list[dict]:
    return [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


def test_log_appends_json_lines_with_throughput(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    monitor, progress = make(run_dir)
    progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    monitor.log(progress, loss=2.5, lr=1e-3)
    progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    time.sleep(0.05)
    monitor.log(progress, loss=2.0)
    monitor.log(
        progress, val_loss=1.9
    )  # same step again: no interval, so no throughput
    monitor.close()

    first, second, third = records(run_dir)
    assert (
        first["step"] == 1
        and first["epoch"] == 0
        and first["loss"] == 2.5
        and first["lr"] == 1e-3
    )
    assert second["step"] == 3 and second["loss"] == 2.0 and "lr" not in second
    for record in (first, second):
        assert record["tokens_per_s"] > 0 and record["samples_per_s"] > 0
        assert (
            record["tokens_per_s"] / record["samples_per_s"]
            == TOKENS_PER_STEP / GLOBAL_BATCH
        )
    # Two steps in at least 50 ms: at most 2 * TOKENS_PER_STEP / 0.05 tokens/s, and >= 25 ms per step.
    assert second["tokens_per_s"] <= 2 * TOKENS_PER_STEP / 0.05
    assert second["step_ms"] >= 24
    train_s = third.pop("train_s")
    assert (
        third.pop("rss_gb") > 0 and third.pop("eta_s") > 0
    )  # memory and ETA ride along
    assert third == {
        "step": 3,
        "epoch": 0,
        "val_loss": 1.9,
        "samples": 3 * GLOBAL_BATCH,
        "tokens": 3 * TOKENS_PER_STEP,
    }
    # Training time accumulates across records: at least the 50 ms slept, never decreasing.
    assert (
        first["train_s"] <= second["train_s"] <= train_s and second["train_s"] >= 0.05
    )
    assert (
        "step=3" in (run_dir / "log.txt").read_text()
    )  # no live bar here: records go to the log


def test_without_a_terminal_tens_of_lines_are_printed_and_every_evaluation(
    tmp_path: Path, capsys
) -> None:
    """600 steps, each logged (metrics.jsonl holds 600 records); no terminal (no bar), the
    Config's console_interval of 0.05dur: the first record, the first of each twentieth of
    the run and every evaluation's are printed, to the console and log.txt alike."""
    progress = Progress(batches_per_epoch=1000)
    monitor = Monitor(tmp_path, Time.parse("600ba"), GLOBAL_BATCH)
    monitor.start(progress, Time.parse("0.05dur"))
    for _ in range(600):
        progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
        evaluated = {"val_loss": 1.0} if progress.batch % 100 == 50 else {}
        monitor.log(progress, loss=2.0, **evaluated)
    monitor.close()
    lines = capsys.readouterr().out.splitlines()
    printed = [int(line.split()[0].removeprefix("step=")) for line in lines]
    assert printed == sorted({1, *range(30, 601, 30), *range(50, 600, 100)})
    logged = (tmp_path / "log.txt").read_text().splitlines()
    assert [line.split("] ", 1)[1] for line in logged] == lines
    assert len(records(tmp_path)) == 600

    # An interval in batches that records do not land on (a record every 10 steps, a
    # line every 25): the first record at or after each boundary.
    capsys.readouterr()
    progress = Progress(batches_per_epoch=1000)
    monitor = Monitor(tmp_path / "b", Time.parse("100ba"), GLOBAL_BATCH)
    monitor.start(progress, Time.parse("25ba"))
    for _ in range(100):
        progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
        if progress.batch % 10 == 0:
            monitor.log(progress, loss=2.0)
    monitor.close()
    lines = capsys.readouterr().out.splitlines()
    assert [int(line.split()[0].removeprefix("step=")) for line in lines] == [
        10,
        30,
        50,
        80,
        100,
    ]


def test_paused_time_is_excluded_from_throughput(tmp_path: Path) -> None:
    monitor, progress = make(tmp_path)
    monitor.log(progress)  # start an interval now
    time.sleep(0.05)  # "training"
    with monitor.paused():
        time.sleep(0.6)  # "evaluation": must not count
    progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    monitor.log(progress, loss=1.0)
    time.sleep(0.05)  # next interval has no pause: the paused time must not carry over
    progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    monitor.log(progress, loss=0.9)

    _, paused, plain = records(tmp_path)
    # Counting the pause would give step_ms >= 650; excluding it gives ~50 (+ overhead).
    assert 45 <= paused["step_ms"] < 350
    assert paused["tokens_per_s"] > TOKENS_PER_STEP / 0.35
    assert 45 <= plain["step_ms"] < 350


def test_resume_drops_lines_after_the_checkpoint(tmp_path: Path) -> None:
    monitor, progress = make(tmp_path)
    for _ in range(5):
        progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
        monitor.log(progress, loss=float(progress.batch))
    monitor.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3, 4, 5]

    # The run crashed after step 5; the newest checkpoint is step 3.
    resumed, progress = make(tmp_path, step=3)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == lines[
        :3
    ]  # kept verbatim
    progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    resumed.log(progress, loss=40.0)
    steps = [r["step"] for r in records(tmp_path)]
    assert steps == [1, 2, 3, 4]
    assert records(tmp_path)[-1]["loss"] == 40.0
    # The first interval after resume counts only steps since the checkpoint.
    assert records(tmp_path)[-1]["tokens_per_s"] > 0


def test_resume_survives_a_torn_last_line(tmp_path: Path) -> None:
    good = [json.dumps({"step": s, "epoch": 0, "loss": 1.0}) for s in (1, 2)]
    # A crash in the middle of a write leaves half a line.
    (tmp_path / "metrics.jsonl").write_text("\n".join(good) + '\n{"step": 3, "epo')
    monitor, progress = make(tmp_path, step=2)
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == good
    progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    monitor.log(progress, loss=0.5)
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]


def test_disabled_monitor_writes_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    script = tmp_path / "train.py"
    script.write_text("print('train')\n")
    monitor, progress = make(run_dir, step=0, enabled=False)
    with monitor.paused():
        pass
    progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    monitor.update(progress)
    monitor.log(progress, loss=1.0)
    monitor.info("hello")
    monitor.record_run("a = 1\n", script, torch.device("cpu"), world_size=2)
    monitor.close()
    assert not run_dir.exists()

    # A non-zero rank on resume must not rewrite rank 0's metrics either.
    run_dir.mkdir()
    text = "".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3))
    (run_dir / "metrics.jsonl").write_text(text)
    monitor, progress = make(run_dir, step=1, enabled=False)
    progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    monitor.log(progress, loss=1.0)
    assert (run_dir / "metrics.jsonl").read_text() == text
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]


def test_record_run_writes_config_and_script_copy(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "exp"
    script = tmp_path / "train.py"
    source = "# the exact training script\nimport torch\nprint('ünïcode ok')\n"
    script.write_text(source)
    monitor, _ = make(run_dir)
    monitor.record_run(
        'lr = 0.001\nmodel = "gpt2"\n', script, torch.device("cpu"), world_size=1
    )
    monitor.close()
    assert (run_dir / "config.toml").read_text() == 'lr = 0.001\nmodel = "gpt2"\n'
    assert (run_dir / "train.py").read_text() == source
    log = (run_dir / "log.txt").read_text()
    assert f"torch {torch.__version__}" in log and "world size 1" in log


class FakeTerminal:
    """A stderr that says it is a terminal and remembers what was drawn on it."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass


def test_progress_bar_moves_while_training(tmp_path: Path, monkeypatch) -> None:
    """On a terminal the bar is redrawn as steps pass, not only at the end."""
    terminal = FakeTerminal()
    monkeypatch.setattr("sys.stderr", terminal)
    monkeypatch.setenv("COLUMNS", "100")
    monitor, progress = make(tmp_path)
    for _ in range(30):
        progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    time.sleep(0.15)  # tqdm redraws at most every 0.1 s
    monitor.update(progress)
    assert "30/100" in terminal.text
    monitor.close()


def test_mfu_is_model_flops_over_the_stated_peak(tmp_path: Path) -> None:
    """MFU = FLOPs per token x tokens/s / (peak x world size), by hand."""
    monitor, progress = make(tmp_path)
    flops_per_token, peak, world = 6 * 1000.0 + 12 * 2 * 256 * 64, 1e9, 2
    monitor.measure(torch.device("cpu"), world, "fp32", flops_per_token, peak=peak)
    monitor.log(progress)
    time.sleep(0.05)
    for _ in range(3):
        progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    monitor.log(progress, loss=1.0)
    record = records(tmp_path)[-1]
    seconds = 3 * record["step_ms"] / 1000
    expected = flops_per_token * 3 * TOKENS_PER_STEP / seconds / (peak * world)
    assert abs(record["mfu"] - expected) < 1e-9 * expected
    assert "mfu" in (tmp_path / "log.txt").read_text()


def test_cpu_leaves_mfu_out_and_logs_memory_and_eta(tmp_path: Path) -> None:
    monitor, progress = make(tmp_path)  # max_duration 100ba
    monitor.measure(torch.device("cpu"), 1, "fp32", flops_per_token=1e6)
    assert "mfu: not measured on cpu" in (tmp_path / "log.txt").read_text()
    time.sleep(0.1)
    for _ in range(10):
        progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    monitor.log(progress, loss=1.0)
    record = records(tmp_path)[-1]
    assert "mfu" not in record and "cuda_max_allocated_gb" not in record
    # A Python process with torch loaded holds tens of MB at least, and not terabytes.
    assert 0.01 < record["rss_gb"] < 1000
    # 10 of 100 steps in >= 0.1 s: the other 90 take >= 0.9 s at that rate (and not far more).
    assert 0.9 <= record["eta_s"] < 0.9 * 5


def test_peak_table_by_device_name_and_precision() -> None:
    from runtime.monitor import peak_flops

    assert peak_flops("NVIDIA H100 80GB HBM3", "amp_bf16") == 989.4e12  # SXM
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("NVIDIA H200", "fp32") == 67e12
    assert peak_flops("NVIDIA H200", "fp32", tf32=True) == 494.7e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "amp_bf16") == 312e12
    assert peak_flops("NVIDIA L4", "bf16") == 121e12
    assert peak_flops("NVIDIA L40S", "bf16") == 362.05e12  # not L4's row
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert peak_flops("Some Future GPU", "bf16") is None


def test_running_sum_reads_the_device_only_when_popped() -> None:
    from runtime.monitor import RunningSum

    running = RunningSum(torch.device("cpu"))
    running.add(torch.tensor(6.0), 3)
    running.add(torch.tensor(4.0), 2)
    assert running.pop() == 2.0  # (6 + 4) / (3 + 2): the mean over the interval
    running.add(torch.tensor(1.0), 4)
    assert running.pop() == 0.25  # started over
    assert running.pop() != running.pop()  # nothing since: nan


def test_tf32_is_read_whichever_api_turned_it_on() -> None:
    """The loops turn TF32 on with torch's backend API; after that the legacy getter
    (torch.get_float32_matmul_precision) raises, so MFU must read the backend API."""
    script = (
        "import torch\n"
        "from runtime.monitor import tf32_matmuls\n"
        "assert not tf32_matmuls()\n"
        "torch.backends.cuda.matmul.fp32_precision = 'tf32'\n"
        "assert tf32_matmuls()\n"
    )
    legacy = "import torch\nfrom runtime.monitor import tf32_matmuls\ntorch.set_float32_matmul_precision('high')\nassert tf32_matmuls()\n"
    for code in (script, legacy):
        result = subprocess.run(
            [sys.executable, "-c", code],
            env=checkout_env(),
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr


def test_training_flops_of_a_linear_layer_and_a_convolution_are_the_hand_count() -> (
    None
):
    """Forward: 2 FLOPs per multiply-add; training: 3x the forward."""
    from runtime.monitor import training_flops

    linear = torch.nn.Linear(16, 8)
    assert training_flops(linear, torch.zeros(4, 16)) == 3 * 2 * 4 * 16 * 8
    conv = torch.nn.Conv2d(3, 5, kernel_size=3, padding=1)  # 8x8 output positions
    assert (
        training_flops(conv, torch.zeros(2, 3, 8, 8))
        == 3 * 2 * 2 * (8 * 8) * 5 * 3 * 3 * 3
    )
    # Counting leaves the module as it was: training mode, no gradients.
    assert conv.training and conv.weight.grad is None
    dropout_net = torch.nn.Sequential(
        torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)
    ).eval()
    training_flops(dropout_net, {"input": torch.zeros(1, 4)})
    assert not dropout_net.training


def test_training_flops_count_attention_on_every_device() -> None:
    """scaled_dot_product_attention: QK^T and the weighted sum, 2 * 2 * L^2 * width forward."""
    from runtime.monitor import training_flops

    class Attention(torch.nn.Module):
        def forward(
            self, x: torch.Tensor
        ) -> torch.Tensor:  # (batch, heads, L, head width)
            return torch.nn.functional.scaled_dot_product_attention(
                x, x, x, is_causal=True
            )

    heads, length, width = 2, 16, 8
    flops = training_flops(Attention(), torch.zeros(1, heads, length, width))
    assert flops == 3 * 4 * length**2 * heads * width


def test_the_0_2_0_call_starts_at_once(tmp_path: Path) -> None:
    """Projects of 0.1.0 and 0.2.0 build the monitor after their resume, with the progress:
    lines logged after the resumed step are dropped and the bar starts there."""
    progress = Progress(batches_per_epoch=10)
    for _ in range(3):
        progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    (tmp_path / "metrics.jsonl").write_text(
        "".join(f'{{"step": {s}}}\n' for s in range(1, 6))
    )
    monitor = Monitor(tmp_path, progress, Time.parse("100ba"), GLOBAL_BATCH, True)
    assert [
        json.loads(line)["step"]
        for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == [1, 2, 3]
    progress.advance(samples=GLOBAL_BATCH, tokens=TOKENS_PER_STEP)
    monitor.log(progress, loss=1.0)
    assert (
        json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["step"]
        == 4
    )
    monitor.close()
