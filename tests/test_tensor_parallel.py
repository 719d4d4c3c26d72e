"""Tensor parallelism (the `tensor_parallel` answer, --tensor_parallel=N): a generated
gpt2-baseline, and a GPT with the architecture variants that have a plan, train split over
tensor-parallel ranks as one process does; it composes with FSDP2 on the data dimension,
resumes its 2-D checkpoints on other layouts, and refuses the layouts and models its plan
does not cover in one line.

Four torchrun launches in all (CI time): dp2 x tp2 (the uninterrupted reference, which
saves at step 3), tp2 (the variants), and the resumes of its step-3 checkpoint at dp4 and dp2; the
one-process runs and every refusal share one interpreter (run_train_many).

Tolerances: the split layers sum their matmuls' partial products in another order (a
rowwise layer's all-reduce adds two halves of each dot product), the vocabulary-split loss
adds its log-sum-exp over ranks, and FSDP2 averages gradients over another number of
ranks: each step's result moves by a few fp32 ulps, which AdamW carries on (DESIGN.md
§12.2 measured ~5e-7 on losses for a change of world size). Over 6 such steps the
losses agreed within 2.6e-6 (measured); the variants' tp2 run (ALiBi, GLU, ...) agreed
with its one process within 3.7e-6 over 4 steps (measured); the assertions allow 1e-5.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import scaffold_new_many
from projects import (
    checkout_env,
    one_error_line,
    project_modules,
    read_metrics,
    run_train_many,
    torchrun,
)

STEPS = 4
SAVED = 2  # the step whose checkpoint the resumes start from
ARGS = [
    "--model=tiny",
    "--seq_len=32",
    "--global_batch_size=8",
    "--device_microbatch_size=2",
    f"--max_duration={STEPS}ba",
    f"--eval_interval={SAVED}ba",
    "--eval_batches=1",
    f"--save_interval={SAVED}ba",
    "--save_num_checkpoints_to_keep=0",
    "--dist_timeout=60",
    # A small corpus: each rank reads it in milliseconds (the default, Python's standard
    # library source, takes seconds a rank).
    f"--data={Path(__file__).resolve().parents[1] / 'DESIGN.md'}",
]
REL = 1e-5
# The variants' runs save at the end only (no resume from them: one save less a run).
VARIANT_ARGS = [
    f"--save_interval={STEPS}ba" if arg.startswith("--save_interval=") else arg
    for arg in ARGS
]


# The GPT pack's architecture variants that run under the plan (algorithm.toml
# tensor_parallel = true), in one project: ALiBi (each rank its heads' slopes and bias;
# rows cut in 4 pieces), QK-norm, a gated MLP (fc and gate split by the same hidden
# units), zero-init projections and an untied head, soft-capped vocabulary-split logits,
# and a sequence-length warmup (lengths 8, 16, 24 over the steps, pieces of 2, 4, 6: each
# split by sequence parallelism). Rotary, ALiBi's alternative, is checked in-process.
VARIANTS = """
description = "gpt2-baseline with the architecture variants that run under tensor parallelism"
[answers]
tensor_parallel = true
[algorithms.alibi]
[algorithms.qk_norm]
[algorithms.gated_linear_units]
[algorithms.zero_init]
[algorithms.logit_softcap]
[algorithms.seq_length_warmup]
duration = "1dur"
[algorithms.gradient_clipping]
"""


@pytest.fixture(scope="module")
def projects(tmp_path_factory: pytest.TempPathFactory, isolated_home: Path) -> dict:
    """gpt2-baseline with and without the answer; gpt2-modern with it (muon has no
    plan); the variants with it."""
    root = tmp_path_factory.mktemp("tensor-parallel")
    recipe = root / "variants.toml"
    recipe.write_text(VARIANTS)
    made = {
        "tp": ("gpt2-baseline", ["--set", "tensor_parallel=true"]),
        "plain": ("gpt2-baseline", []),
        "modern": ("gpt2-modern", ["--set", "tensor_parallel=true"]),
        "variants": (str(recipe), []),
        "gains": (str(recipe), ["--set", "qk_norm.gain=true"]),
    }
    dests = {name: root / name / name for name in made}
    scaffold_new_many(
        {
            dests[name]: ["--recipe", recipe, *extra]
            for name, (recipe, extra) in made.items()
        }
    )
    return dests


def losses(rows: list[dict], key: str = "loss") -> dict[int, float]:
    return {row["step"]: row[key] for row in rows if key in row}


def assert_close(ours: dict, theirs: dict, what: str) -> None:
    assert ours.keys() == theirs.keys(), (what, ours, theirs)
    assert list(ours.values()) == pytest.approx(list(theirs.values()), rel=REL), what


def test_trains_as_one_process_and_resumes_on_other_layouts(
    projects: dict, tmp_path: Path
) -> None:
    project = projects["tp"]
    train = project / "train.py"

    def launch(nproc: int, *args: str) -> None:
        result = torchrun(tmp_path, nproc, train, "--device=cpu", *ARGS, *args)
        assert result.returncode == 0, result.stderr[-3000:]

    # dp2 x tp2: the uninterrupted reference; it saves at step SAVED.
    launch(4, "--tensor_parallel=2", "--run_name=full")
    saved = tmp_path / "runs" / "full" / "checkpoints" / f"step-{SAVED}"
    assert saved.is_dir()
    # tp2 with activation checkpointing (applied after the plan, torchtitan's order), on
    # the variants' project.
    variants = projects["variants"] / "train.py"
    result = torchrun(
        tmp_path,
        2,
        variants,
        "--device=cpu",
        *VARIANT_ARGS,
        "--tensor_parallel=2",
        "--activation_checkpointing=true",
        "--run_name=tp2",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    launch(4, f"--load_path={saved}", "--run_name=dp4")
    launch(2, f"--load_path={saved}", "--run_name=dp2")
    one = run_train_many(
        {
            "one": (project, tmp_path, [*ARGS, "--run_name=one"]),
            "variants": (
                projects["variants"],
                tmp_path,
                [*VARIANT_ARGS, "--run_name=variants"],
            ),
            "resumed": (
                project,
                tmp_path,
                [*ARGS, f"--load_path={saved}", "--run_name=resumed"],
            ),
        }
    )
    for name, result in one.items():
        assert result.returncode == 0, (name, result.stderr[-3000:])

    runs = {
        name: read_metrics(tmp_path, name)
        for name in ("full", "tp2", "dp4", "dp2", "one", "resumed", "variants")
    }
    # Layer splitting, alone (tp2, with the variants) and with FSDP2 (dp2 x tp2), trains
    # as one process does.
    for name, reference in (("tp2", "variants"), ("full", "one")):
        for key in ("loss", "val_loss", "grad_norm", "seq_len"):
            assert_close(
                losses(runs[name], key), losses(runs[reference], key), f"{name} {key}"
            )
    assert set(losses(runs["tp2"], "seq_len").values()) == {8, 16, 24}
    # The 2-D checkpoint resumes at dp4, dp2 and one process where it was saved (the data
    # position kept: the same samples), with the uninterrupted run's losses.
    after = {step: loss for step, loss in losses(runs["full"]).items() if step > SAVED}
    for name in ("dp4", "dp2", "resumed"):
        assert [row["step"] for row in runs[name]] == list(range(SAVED + 1, STEPS + 1))
        assert [row["samples"] for row in runs[name]] == [
            row["samples"] for row in runs["full"][SAVED:]
        ]
        assert_close(losses(runs[name]), after, name)
        assert_close(
            losses(runs[name], "val_loss"),
            {STEPS: losses(runs["full"], "val_loss")[STEPS]},
            f"{name} val_loss",
        )


def test_refusals(
    projects: dict, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad layouts and models: one line each, exit 2, nothing written; and the answer
    where no plan exists. One interpreter for all runs."""
    tp, plain, modern = projects["tp"], projects["plain"], projects["modern"]
    runs = {
        "world": (tp, ["--tensor_parallel=2"]),
        "zero": (tp, ["--tensor_parallel=0"]),
        "ddp": (tp, ["--tensor_parallel=2", "--parallelism=ddp"]),
        "hybrid": (tp, ["--tensor_parallel=2", "--sharding_strategy=HYBRID_SHARD"]),
        "compile": (tp, ["--tensor_parallel=2", "--compile=model"]),
        "plain": (plain, ["--tensor_parallel=2"]),
    }
    for name in runs:
        (tmp_path / name).mkdir()
    results = run_train_many(
        {
            name: (project, tmp_path / name, args)
            for name, (project, args) in runs.items()
        }
    )
    lines = {name: one_error_line(results[name], tmp_path / name) for name in runs}
    assert "does not divide the world size 1" in lines["world"]
    assert "tensor_parallel=0" in lines["zero"]
    for name in ("ddp", "hybrid"):
        assert "composes with FSDP2 on the data dimension only" in lines[name]
    assert "--compile=true" in lines["compile"]
    assert "scaffold set tensor_parallel=true" in lines["plain"]

    # The model's own refusals (sizes, variants), from model.py without a launch.
    with project_modules(tp) as modules:
        model_py = modules["model"]

        def problem(tp: int, vocab: int = 256, **sizes: object) -> str | None:
            cfg = SimpleNamespace(
                **(dict(model="tiny", seq_len=32, dropout=0.0, init_from="") | sizes)
            )
            model = model_py.build_model(cfg, vocab, "cpu")
            return model_py.tensor_parallel_problem(model, tp)

        assert problem(2) is None and problem(4) is None
        assert "n_head=4" in problem(8)
        assert "seq_len=33" in problem(2, seq_len=33)
        assert "vocab_size=257" in problem(2, vocab=257)
        assert "dropout" in problem(2, dropout=0.1)
    with project_modules(modern) as modules:
        cfg = SimpleNamespace(model="tiny", seq_len=32, dropout=0.0)
        model = modules["model"].build_model(cfg, 256, "cpu")
        why = modules["model"].tensor_parallel_problem(model, 2)
        assert "no plan for muon;" in why
    # QK-norm's gains are shared by all heads, each rank would train them on its own.
    with project_modules(projects["gains"]) as modules:
        cfg = SimpleNamespace(model="tiny", seq_len=32, dropout=0.0)
        model = modules["model"].build_model(cfg, 256, "cpu")
        assert modules["model"].tensor_parallel_problem(model, 1) is None
        why = modules["model"].tensor_parallel_problem(model, 2)
        assert "no plan for qk_norm's gains" in why and "\n" not in why
    # The warmup's lengths, and ALiBi's pieces of rows, must split over the ranks
    # (sequence parallel): setup() refuses them at tp=4 as rank 0 of a launch of 4 does,
    # before it joins the process group (no launch needed). min_len=10; then the
    # default 8, whose pieces (1/4) are 2 long.
    refused = {
        "--seq_length_warmup_min_len=10": "seq_length_warmup_min_len=10 and the lengths",
        "--seq_length_warmup_min_len=8": "alibi cuts rows to lengths [2, 4, 6, 8,",
    }
    with (
        project_modules(projects["variants"]) as modules,
        pytest.MonkeyPatch.context() as env,
    ):
        env.setenv("WORLD_SIZE", "4")
        env.chdir(tmp_path)
        for arg, expected in refused.items():
            argv = ["train.py", "--device=cpu", "--tensor_parallel=4", arg]
            env.setattr(sys, "argv", argv)
            capsys.readouterr()
            with pytest.raises(SystemExit) as stop:
                modules["train"].main()
            line = capsys.readouterr().err.strip()
            assert stop.value.code == 2 and "\n" not in line, line
            assert expected in line and "tensor_parallel=4" in line, line
        assert not (tmp_path / "runs").exists()

    # The answer needs a model pack with a plan, and no out-of-memory search.
    for recipe, extra in (
        ("cifar-resnet56-baseline", []),
        ("gpt2-baseline", ["--set", "auto_microbatching=true"]),
    ):
        dest = tmp_path / f"new-{recipe}"
        result = subprocess.run(
            [sys.executable, "-m", "scaffold", "new", "--recipe", recipe]
            + ["--set", "tensor_parallel=true", *extra, str(dest)],
            capture_output=True,
            text=True,
            env=checkout_env(),
            cwd=Path(__file__).resolve().parents[1],
        )
        assert result.returncode == 2, result.stderr
        line = result.stderr.strip()
        assert (
            line.startswith("error: ")
            and "\n" not in line
            and "tensor_parallel" in line
        )
        assert not dest.exists()


def test_gpt2_weights_map_both_ways(projects: dict) -> None:
    """The plan's q, k, v layers are thirds of GPT2LMHeadModel's c_attn: init_from and
    `scaffold export --format hf` keep working, and the exported model computes the same
    logits in transformers."""
    transformers = pytest.importorskip("transformers")
    with project_modules(projects["tp"]) as modules:
        m = modules["model"]
        torch.manual_seed(0)
        cfg = SimpleNamespace(model="tiny", seq_len=32, dropout=0.0, init_from="")
        model = m.build_model(cfg, 256, "cpu")
        for param in model.parameters():  # biases too, so that every third is checked
            param.data.normal_(0.0, 0.02)
        hf_config, hf_weights = m.to_hf_gpt2(model.state_dict(), model.config)
        theirs = transformers.GPT2LMHeadModel(transformers.GPT2Config(**hf_config))
        theirs.load_state_dict(hf_weights, strict=False)
        idx = torch.randint(0, 256, (2, 32))
        with torch.no_grad():
            expected = theirs.eval()(idx).logits
            assert torch.allclose(model(idx), expected, atol=1e-5)
        back = m.from_hf_gpt2(hf_config, hf_weights, model.config)
        for name, tensor in model.state_dict().items():
            assert torch.equal(back[name], tensor), name


def test_rotary_acts_on_each_head_alone(projects: dict) -> None:
    """Under the plan a rank rotates only its heads' q and k: rotary must give each head
    what it gives that head among all of them (the same angles for every head)."""
    with project_modules(projects["modern"]) as modules:
        rotary = modules["model"].rotary
        torch.manual_seed(0)
        q = torch.randn(2, 4, 8, 16)  # (batch, head, seq, head_dim)
        for start in (0, 5):  # sampling with a cache: positions after the cached ones
            whole = rotary(q, base=10000.0, fraction=0.5, start=start)
            half = rotary(q[:, 2:], base=10000.0, fraction=0.5, start=start)
            assert torch.equal(whole[:, 2:], half)
            assert not torch.equal(whole, q)
