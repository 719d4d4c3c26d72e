"""runtime.microbatch: halving on out-of-memory, rank agreement without hangs, resume.

Multi-process tests launch torchrun (CPU, gloo) on a generated project with a short process
group timeout (`--dist_timeout`), so a protocol bug fails within seconds instead of hanging,
and a hard subprocess timeout on top. Several runs share one launch (tests/microbatch_driver.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from projects import checkout_env, read_metrics
from runtime import microbatch
from runtime.dist import DistEnv

DRIVER = Path(__file__).resolve().parent / "microbatch_driver.py"
LAUNCH_TIMEOUT = (
    240  # seconds; a hang would otherwise stall CI (the group timeout is 20 s)
)
# 12 samples per step: 6 per rank on 2 ranks (auto: 6 -> 3 -> 2), 4 on 3 ranks (4 -> 2).
SMALL = [
    "--device=cpu",
    "--seq_len=32",
    "--global_batch_size=12",
    "--eval_batches=1",
    "--max_duration=3ba",
    "--eval_interval=3ba",
    "--save_interval=3ba",
    "--dist_timeout=20",
]
FOUND = 2  # every injected run below fails above 2 samples per microbatch
# gpt2-speedup at ALiBi's quarter rows (Composer's 0.25; the recipe's own is 1): its blocks
# see each sample as 4 rows, so FOUND samples are FOUND * PIECES rows where the injection
# counts them.
PIECES = 4
QUARTER_ROWS = f"--alibi_train_sequence_length_scaling={1 / PIECES}"


# ---------------------------------------------------------------- pieces, in one process


def test_halve_rounds_up_and_stops_at_one() -> None:
    sizes = [16]
    while sizes[-1] > 1:
        sizes.append(microbatch.halve(sizes[-1]))
    assert sizes == [16, 8, 4, 2, 1]
    assert [microbatch.halve(n) for n in (6, 3, 2, 1)] == [3, 2, 1, 1]


def test_halve_keeps_multiples_of_a_group_size() -> None:
    """Image projects search sizes that do not split BatchNorm groups."""
    assert [microbatch.halve(n, 16) for n in (96, 48, 32, 16)] == [48, 32, 16, 16]
    assert [microbatch.halve(n, 2) for n in (6, 4, 2)] == [4, 2, 2]


def test_injection_parsing() -> None:
    parsed = microbatch.Injection.parse("ranks=1;above=4;phase=backward")
    assert parsed == microbatch.Injection(frozenset({1}), 4, "backward")
    assert microbatch.Injection.parse(" ranks = 0,2 ; ") == microbatch.Injection(
        frozenset({0, 2}), 0, "forward"
    )
    assert microbatch.Injection.parse("ranks=all;above=3").ranks is None
    assert microbatch.Injection.parse("tokens=64") == microbatch.Injection(
        None, None, "forward", 64
    )
    assert microbatch.Injection.parse("above=2;tokens=64").above == 2
    for bad, words in [
        ("rank=1", "'rank=1' is not ranks="),
        ("ranks=a", "ranks must be"),
        ("above=x", "above must be an integer"),
        ("above=-1", "above must be >= 0"),
        ("tokens=-5", "tokens must be >= 0"),
        ("phase=step", "phase must be forward or backward"),
        ("above=1;above=2", "above given twice"),
    ]:
        with pytest.raises(ValueError, match=words):
            microbatch.Injection.parse(bad)


def test_check_names_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    assert microbatch.check("auto") is None and microbatch.check(3) is None
    assert "device_microbatch_size=0 must be at least 1 or auto" in microbatch.check(0)
    monkeypatch.setenv(microbatch.INJECT_ENV, "phase=sideways")
    assert microbatch.INJECT_ENV in microbatch.check("auto")


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)
        )
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


CPU = DistEnv(
    rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu")
)


def train_step(
    size: int | str, fail_at: frozenset[tuple[int, int]] = frozenset(), log=None
):
    """One step as train.py does it; `fail_at` holds (size, i): OOM before microbatch i at that size."""
    model = Toy()
    search = microbatch.Search(
        model, model.blocks, CPU, size, per_rank_batch=8, log=log or (lambda m: None)
    )
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    attempts, sums = 0, []
    for attempt in search.attempts(seq_len=1):
        with attempt:
            attempts += 1
            loss_sum = torch.zeros(())
            for i, micro in enumerate(x.split(attempt.size)):
                if (attempt.size, i) in fail_at:
                    raise torch.OutOfMemoryError(
                        "simulated"
                    )  # after earlier backwards: partial grads
                loss = model(micro).sum()
                (loss / 8).backward()
                loss_sum += loss.detach()
            sums.append(loss_sum)
    return model, search, attempts, sums[-1]


def test_retry_starts_from_a_clean_state() -> None:
    """OOM at 8, then at size 4's 2nd microbatch, after one backward: those partial
    gradients are dropped, and size 2 gives exactly the gradients of a fixed size 2."""
    reference, _, _, reference_loss = train_step(2)
    model, search, attempts, loss_sum = train_step("auto", frozenset({(8, 0), (4, 1)}))
    assert search.size == 2 and attempts == 3
    grads = [p.grad for p in model.parameters()]
    assert all(torch.equal(g, r.grad) for g, r in zip(grads, reference.parameters()))
    assert torch.equal(
        loss_sum, reference_loss
    )  # accumulators restart with the attempt


def test_settled_size_runs_without_hooks_and_a_late_oom_propagates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, search, attempts, _ = train_step("auto")
    assert (search.size, attempts) == (8, 1)
    assert search.state_dict() == {
        "microbatch_size": 8,
        "microbatch_seq_len": 1,
        "microbatch_world_size": 1,
    }
    for module in model.modules():
        assert not module._forward_hooks and not module._forward_pre_hooks
    # Settled: an OOM is not swallowed (there is nothing to agree on); it says what to do.
    with pytest.raises(torch.OutOfMemoryError) as raised:
        for attempt in search.attempts(seq_len=1):
            with attempt:
                raise torch.OutOfMemoryError("late")
    assert "settled at 8" in "".join(raised.value.__notes__)
    assert list(search.attempts(seq_len=1)) and not model.blocks[0]._forward_hooks


def test_a_found_size_is_reused_from_its_state_dict_at_the_same_world_size() -> None:
    lines: list[str] = []
    _, found, _, _ = train_step("auto", frozenset({(8, 0)}), log=lines.append)
    assert found.state_dict() == {
        "microbatch_size": 4,
        "microbatch_seq_len": 1,
        "microbatch_world_size": 1,
    }
    assert lines[0] == "microbatch size: auto, starting at 8"  # by the search, once

    def search(size: int | str, world_size: int = 1) -> microbatch.Search:
        env = DistEnv(
            rank=0,
            local_rank=0,
            world_size=world_size,
            local_world_size=world_size,
            device=torch.device("cpu"),
        )
        model = Toy()
        return microbatch.Search(
            model, model.blocks, env, size, per_rank_batch=8, log=lines.append
        )

    lines.clear()
    resumed = search("auto")
    resumed.load_state_dict(found.state_dict())
    assert (resumed.size, resumed.settled_len) == (4, 1)
    assert [attempt.searching for attempt in resumed.attempts(seq_len=1)] == [False]
    assert lines == ["microbatch size: 4 (found before, from the checkpoint)"]
    # A longer sequence than the size was found for: searched again, from that size.
    attempts = resumed.attempts(seq_len=2)
    first = next(attempts)
    assert (first.size, first.searching) == (4, True)
    attempts.close()
    # 0.2.0 saved it merged with the early stopper's state: other keys are ignored.
    merged = search("auto")
    merged.load_state_dict({**found.state_dict(), "early_stop": {"best": 1.0}})
    assert merged.size == 4
    # Another world size (another share of the batch per rank), or a fixed size: unused.
    other = search("auto", world_size=2)
    other.load_state_dict(found.state_dict())
    assert (other.size, other.settled_len) == (8, 0)
    fixed = search(8)
    fixed.load_state_dict(found.state_dict())
    assert fixed.size == 8 and fixed.state_dict() == {}
    # Saved with a fixed size (an empty state), resumed with auto: a search from 8.
    fresh = search("auto")
    fresh.load_state_dict({})
    assert (fresh.size, fresh.settled_len) == (8, 0)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_injected_oom_one_process_gives_the_fixed_size_gradients(
    phase: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(microbatch.INJECT_ENV, f"above=2;phase={phase}")
    logged: list[str] = []
    model, search, attempts, _ = train_step("auto", log=logged.append)
    assert (search.size, attempts) == (2, 3)
    assert logged[-1] == "microbatch size: 2 fits (sequence length 1)"
    monkeypatch.delenv(microbatch.INJECT_ENV)
    reference, *_ = train_step(2)
    assert all(
        torch.equal(p.grad, r.grad)
        for p, r in zip(model.parameters(), reference.parameters())
    )


def test_injection_reads_rows_and_tokens_from_the_tensor() -> None:
    both = microbatch.Injection.parse("above=4;tokens=64")
    both.fire(0, torch.Size([4, 16, 8]), "forward")  # 4 rows of 16 positions: fits
    both.fire(
        0, torch.Size([4, 32, 8]), "backward"
    )  # another phase: not this injection's
    for shape, words in [
        ((4, 17, 8), "68 tokens per microbatch > 64"),
        ((5, 2, 8), "microbatch size 5 > 4"),
    ]:
        with pytest.raises(torch.OutOfMemoryError, match=words):
            both.fire(0, torch.Size(shape), "forward")
    microbatch.Injection.parse("ranks=1;tokens=1").fire(
        0, torch.Size([9, 9, 8]), "forward"
    )  # rank 0 spared


def test_evaluation_searches_its_own_size_where_training_is_not_settled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Training settled at 8 on sequences of 2 (warmup); evaluation at length 8 must not
    reuse 8 blindly: memory for 64 tokens per microbatch, so evaluation halves to 2."""
    monkeypatch.setenv(microbatch.INJECT_ENV, "tokens=16")
    model, logged = Toy(), []
    search = microbatch.Search(
        model, model.blocks, CPU, "auto", per_rank_batch=8, log=logged.append
    )

    def run(attempts, length: int) -> list[int]:
        sizes = []
        for attempt in attempts:
            with attempt:
                sizes.append(attempt.size)
                for micro in torch.zeros(8, length, 8).split(attempt.size):
                    model(micro)
        return sizes

    assert run(search.attempts(seq_len=2), 2) == [8]  # 16 tokens: fits
    with torch.no_grad():
        assert run(search.eval_attempts(seq_len=8), 8) == [8, 4, 2]
        assert run(search.eval_attempts(seq_len=8), 8) == [2]  # found once, then reused
    assert search.size == 8 and search.eval_size == 2  # training's size is its own
    assert "microbatch size: out of memory, retrying the evaluation at 4" in logged
    assert run(search.attempts(seq_len=8), 8) == [
        8,
        4,
        2,
    ]  # training reaches full length
    with torch.no_grad():
        assert run(search.eval_attempts(seq_len=8), 8) == [
            2
        ]  # training's size, settled there
    # Fixed sizes are never searched: an OOM in evaluation propagates, with advice.
    fixed = microbatch.Search(Toy(), [], CPU, 8, per_rank_batch=8)
    with pytest.raises(torch.OutOfMemoryError) as raised:
        for attempt in fixed.eval_attempts(seq_len=8):
            with attempt:
                raise torch.OutOfMemoryError("simulated")
    assert "--device_microbatch_size" in "".join(raised.value.__notes__)


def test_no_size_fits_exits_with_one_clear_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(microbatch.INJECT_ENV, "above=0;phase=backward")
    with pytest.raises(
        SystemExit, match="out of memory at every device_microbatch_size down to 1"
    ):
        train_step("auto")


# ---------------------------------------------------------------- generated projects, N ranks


def launch(
    project: Path, workdir: Path, nproc: int, plan: list[dict]
) -> subprocess.CompletedProcess[str]:
    plan_file = workdir / "plan.json"
    plan_file.write_text(json.dumps(plan))
    (workdir / "out").mkdir(exist_ok=True)
    runner = (
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
        ]
        if nproc > 1
        else [sys.executable]
    )
    return subprocess.run(
        [*runner, str(DRIVER), str(project), str(plan_file), str(workdir / "out")],
        cwd=workdir,
        env={**checkout_env(), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT,
    )


def final_params(workdir: Path, run_name: str) -> dict[str, torch.Tensor]:
    checkpoints = workdir / "runs" / run_name / "checkpoints"
    newest = max(checkpoints.iterdir(), key=lambda p: int(p.name.removeprefix("step-")))
    out = workdir / f"{run_name}.pt"
    dcp_to_torch_save(newest, out)
    return torch.load(out, weights_only=True)["model"]


@pytest.mark.parametrize(
    ("parallelism", "nproc"),
    # fsdp 3 ranks (uneven shards) and ddp 2 in every run; the other shapes with --slow
    [
        ("none", 1),
        pytest.param("fsdp", 2, marks=pytest.mark.slow),
        ("fsdp", 3),
        ("ddp", 2),
        pytest.param("ddp", 3, marks=pytest.mark.slow),
    ],
)
def test_one_rank_oom_in_forward_or_backward_settles_everywhere_and_trains_as_fixed(
    parallelism: str, nproc: int, generated_auto: dict[str, Path], tmp_path: Path
) -> None:
    """OOM on one rank only (forward in one run, backward in another): no hang, every rank
    settles on the same size, and the final weights equal a run with that size from the start.

    On one and two ranks also: evaluation at full length after every step while the sequence
    length warms up (8, 16, 24 of 32); memory for 48 tokens per microbatch on the last rank.
    Training settles at 6 rows on length 8; evaluation must find 1 row at length 32 (all ranks
    agreeing), not crash at 6, and give the val_loss of a run with size 1 throughout."""
    common = [*SMALL, f"--parallelism={parallelism}", QUARTER_ROWS]
    victim_fwd, victim_bwd = nproc - 1, max(nproc - 2, 0)
    plan = [
        {
            "name": "fixed",
            "inject": "",
            "args": [*common, "--run_name=fixed", f"--device_microbatch_size={FOUND}"],
        },
        {
            "name": "fwd",
            "inject": f"ranks={victim_fwd};above={FOUND * PIECES};phase=forward",
            "args": [*common, "--run_name=fwd", "--device_microbatch_size=auto"],
        },
        {
            "name": "bwd",
            "inject": f"ranks={victim_bwd};above={FOUND * PIECES};phase=backward",
            "args": [*common, "--run_name=bwd", "--device_microbatch_size=auto"],
        },
    ]
    warming = [
        *(a for a in common if not a.startswith("--eval_interval")),
        "--eval_interval=1ba",
        "--seq_length_warmup_duration=1dur",
    ]
    if nproc <= 2:
        plan += [
            {
                "name": "eval",
                "inject": f"ranks={nproc - 1};tokens=48",
                "args": [*warming, "--run_name=eval", "--device_microbatch_size=auto"],
            },
            {
                "name": "evalref",
                "inject": "",
                "args": [*warming, "--run_name=evalref", "--device_microbatch_size=1"],
            },
        ]
    result = launch(generated_auto["gpt2-speedup"], tmp_path, nproc, plan)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    if nproc <= 2:
        evaluated, reference = read_metrics(tmp_path, "eval"), read_metrics(
            tmp_path, "evalref"
        )
        assert [r["seq_len"] for r in evaluated] == [8, 16, 24]
        assert [r["val_loss"] for r in evaluated] == pytest.approx(
            [r["val_loss"] for r in reference], rel=1e-5
        )
        assert [r["loss"] for r in evaluated] == pytest.approx(
            [r["loss"] for r in reference], rel=1e-5
        )
        log = (tmp_path / "runs" / "eval" / "log.txt").read_text()
        assert (
            "retrying the evaluation at 1" in log
            and "1 for evaluation (sequence length 32)" in log
        )
    fixed = final_params(tmp_path, "fixed")
    for name in ("fwd", "bwd"):
        settled = [
            json.loads((tmp_path / "out" / f"{name}-rank{r}.json").read_text())[
                "settled"
            ]
            for r in range(nproc)
        ]
        # Settled once at the start and again at each longer warmup length, always at FOUND.
        assert all(
            sizes == settled[0] and set(sizes) == {FOUND} for sizes in settled
        ), settled
        assert [r["microbatch_size"] for r in read_metrics(tmp_path, name)] == [
            FOUND
        ] * 3
        log = (tmp_path / "runs" / name / "log.txt").read_text()
        assert "retrying the batch at" in log
        params = final_params(tmp_path, name)
        assert params.keys() == fixed.keys()
        for key, value in params.items():
            # FSDP and one process retry through the same code path as the fixed run: bitwise.
            # DDP's first step is reduced by hand (divide, then sum, as DDP's reducer does) instead
            # of in DDP's buckets: fp32 reduction order only, well below Adam's lr-sized steps.
            tolerance = 0.0 if parallelism != "ddp" else 1e-6
            assert torch.allclose(value, fixed[key], rtol=0, atol=tolerance), (
                name,
                key,
                (value - fixed[key]).abs().max().item(),
            )


def test_oom_at_every_size_fails_fast_with_one_error_and_no_checkpoint(
    generated_auto: dict[str, Path], tmp_path: Path
) -> None:
    plan = [
        {
            "name": "never",
            "inject": "ranks=1;above=0;phase=backward",
            "args": [
                *SMALL,
                "--parallelism=fsdp",
                "--run_name=never",
                "--device_microbatch_size=auto",
            ],
        }
    ]
    result = launch(generated_auto["gpt2-speedup"], tmp_path, 2, plan)
    assert result.returncode != 0
    assert (
        result.stderr.count(
            "error: out of memory at every device_microbatch_size down to 1"
        )
        == 1
    ), result.stderr
    checkpoints = tmp_path / "runs" / "never" / "checkpoints"
    assert not checkpoints.exists() or not any(checkpoints.iterdir())
    assert not (tmp_path / "runs" / "never" / "metrics.jsonl").exists()


def test_resume_reuses_the_found_size_without_searching(
    generated_auto: dict[str, Path], tmp_path: Path
) -> None:
    project = generated_auto[
        "gpt2-baseline"
    ]  # constant sequence length: nothing to re-arm on resume
    args = [a for a in SMALL if not a.startswith(("--max_duration", "--save_interval"))]
    args += ["--run_name=r", "--device_microbatch_size=auto", "--save_interval=2ba"]
    env = {**checkout_env(), microbatch.INJECT_ENV: "above=3"}  # 12 -> 6 -> 3

    def train(duration: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, str(project / "train.py"), *args, duration],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    first = train("--max_duration=2ba")
    assert first.returncode == 0, first.stderr
    assert (
        "retrying the batch at 3" in first.stdout
        and "microbatch size: 3 fits" in first.stdout
    )
    # The same run, longer: it resumes. A new search would start at 12 and log retries.
    second = train("--max_duration=4ba")
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout
    assert "microbatch size: 3 (found before, from the checkpoint)" in second.stdout
    assert "retrying" not in second.stdout and "starting at" not in second.stdout
    assert [r["microbatch_size"] for r in read_metrics(tmp_path, "r")] == [3, 3, 3, 3]
