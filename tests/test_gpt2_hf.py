"""Hugging Face GPT-2 weights in (`train.py --init_from`) and out (`scaffold export --format hf`).

A tiny random GPT2LMHeadModel of the `tiny` preset's sizes is saved with `save_pretrained` and read
back through transformers' real `from_pretrained`; the generated model's logits equal GPT-2's
(within 1e-5) after the conversion in, after training and the conversion out, and round trip.
Architectures GPT-2's layout cannot hold have neither the mapping nor `init_from` (both are
generated only where the layout fits), and export refuses them with one line, nothing written.
Nothing is downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import safetensors.torch  # noqa: E402
import torch  # noqa: E402

from conftest import scaffold_cli  # noqa: E402
from projects import (
    checkout_env,
    project_modules,
    read_metrics,
    run_train,
    run_train_many,
)  # noqa: E402

SEQ = (
    32  # the runs' seq_len; the checkpoints have 64 positions (cut to 32 on the way in)
)
RUN = [
    "--seq_len=32",
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--eval_interval=1000ba",
    "--eval_batches=1",
    "--save_interval=1000ba",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def gpt2_folder(
    folder: Path,
    n_layer: int = 4,
    n_head: int = 4,
    n_embd: int = 128,
    vocab_size: int = 256,
    seed: int = 0,
) -> Path:
    """A random GPT2LMHeadModel saved like a hub model (`tiny`'s sizes by default), biases and
    LayerNorms randomised too so that every weight's mapping is checked."""
    config = transformers.GPT2Config(
        vocab_size=vocab_size,
        n_positions=64,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    model.save_pretrained(folder)
    return folder


def corpus(path: Path) -> Path:
    """Byte-level text (vocabulary 256, as the checkpoints') that loads in no time."""
    path.write_text(
        "".join(
            f"line {i}: the quick brown fox jumps over the lazy dog {i * 7}\n"
            for i in range(600)
        )
    )
    return path


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(tokens).logits


def our_logits(
    modules: dict, weights: dict[str, torch.Tensor], tokens: torch.Tensor
) -> torch.Tensor:
    m = modules["model"]
    config = m.GPTConfig(
        vocab_size=weights["wte.weight"].shape[0],
        max_seq_len=weights["wpe.weight"].shape[0],
        **m.PRESETS["tiny"],
    )
    model = m.GPT(config).eval()
    model.load_state_dict(weights)
    with torch.no_grad():
        return model(tokens)


def checkpoint_weights(
    workdir: Path, run: str, tmp_path: Path
) -> dict[str, torch.Tensor]:
    from runtime.checkpoint import export_safetensors

    out = tmp_path / f"{run}.safetensors"
    export_safetensors(workdir / "runs" / run, out)
    return safetensors.torch.load_file(out)


def one_line_error(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
    ), lines


def test_conversion_in_gives_gpt2s_logits(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """from_hf_gpt2 (model.py) on what from_pretrained read: the same function as GPT2LMHeadModel."""
    from runtime import hf

    folder = gpt2_folder(tmp_path / "gpt2")
    tokens = torch.randint(0, 256, (3, SEQ), generator=torch.Generator().manual_seed(1))
    with project_modules(generated["gpt2-baseline"]) as modules:
        m = modules["model"]
        config = m.GPTConfig(vocab_size=256, max_seq_len=SEQ, **m.PRESETS["tiny"])
        state = m.from_hf_gpt2(*hf.read_gpt2(str(folder)), config)
        ours = our_logits(modules, state, tokens)
        # Conv1D weights are (in, out): ours are their transposes; the table is cut to SEQ rows.
        hf_state = transformers.GPT2LMHeadModel.from_pretrained(folder).state_dict()
        assert torch.equal(
            state["blocks.1.attn.qkv.weight"],
            hf_state["transformer.h.1.attn.c_attn.weight"].t(),
        )
        assert state["wpe.weight"].shape == (SEQ, 128)
        assert state["lm_head.weight"] is state["wte.weight"]
    theirs = hf_logits(folder, tokens)
    assert (ours - theirs).abs().max().item() < 1e-5
    assert theirs.std() > 0.1  # not a degenerate comparison


def test_init_from_train_export_and_round_trip(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    project = generated["gpt2-baseline"]
    folder = gpt2_folder(tmp_path / "gpt2")
    data = corpus(tmp_path / "corpus.txt")
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))

    # In, then out, untouched (lr=0: AdamW's decoupled decay is lr * wd = 0): GPT-2's own logits.
    result = run_train(
        project,
        tmp_path,
        *RUN,
        f"--data={data}",
        f"--init_from={folder}",
        "--lr=0",
        "--max_duration=1ba",
        "--run_name=still",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"init_from={folder}: read" in result.stdout
    exported = scaffold_cli(
        "export",
        "--format",
        "hf",
        "runs/still",
        str(tmp_path / "still-hf"),
        "--project",
        str(project),
        cwd=tmp_path,
    )
    assert exported.returncode == 0, exported.stderr
    assert (
        hf_logits(tmp_path / "still-hf", tokens) - hf_logits(folder, tokens)
    ).abs().max().item() < 1e-5

    # Trained from GPT-2's weights for 2 steps: the export's logits are the trained model's.
    result = run_train(
        project,
        tmp_path,
        *RUN,
        f"--data={data}",
        f"--init_from={folder}",
        "--max_duration=2ba",
        "--run_name=tuned",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    first_loss = read_metrics(tmp_path, "tuned")[0]["loss"]
    exported = scaffold_cli(
        "export",
        "--format",
        "hf",
        str(tmp_path / "runs" / "tuned"),
        str(tmp_path / "tuned-hf"),
        "--project",
        str(project),
    )
    assert exported.returncode == 0, exported.stderr
    assert "from" in exported.stdout and "(step 2)" in exported.stdout
    weights = checkpoint_weights(tmp_path, "tuned", tmp_path)
    with project_modules(project) as modules:
        trained = our_logits(modules, weights, tokens)
        # Round trip: the exported folder read back in is the checkpoint, bitwise.
        from runtime import hf

        m = modules["model"]
        config = m.GPTConfig(vocab_size=256, max_seq_len=SEQ, **m.PRESETS["tiny"])
        back = m.from_hf_gpt2(*hf.read_gpt2(str(tmp_path / "tuned-hf")), config)
    assert all(torch.equal(back[name], weights[name]) for name in weights)
    assert (
        hf_logits(tmp_path / "tuned-hf", tokens) - trained
    ).abs().max().item() < 1e-5
    assert not torch.allclose(
        trained, hf_logits(folder, tokens), atol=1e-3
    )  # it did train

    # The first step's loss is GPT-2's on that batch, not a random init's: a run without init_from differs.
    fresh = run_train(
        project,
        tmp_path,
        *RUN,
        f"--data={data}",
        "--max_duration=1ba",
        "--run_name=fresh",
    )
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert abs(read_metrics(tmp_path, "fresh")[0]["loss"] - first_loss) > 1e-3

    # A resumed run takes its weights from its checkpoint: init_from is not even read.
    result = run_train(
        project,
        tmp_path,
        *RUN,
        f"--data={data}",
        f"--init_from={tmp_path / 'gone'}",
        "--max_duration=3ba",
        "--run_name=tuned",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert ": not read" in result.stdout and "resumed from" in result.stdout
    assert [row["step"] for row in read_metrics(tmp_path, "tuned")] == [1, 2, 3]


def test_refusals_are_one_line_and_write_nothing(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    data = corpus(tmp_path / "corpus.txt")
    tiny = gpt2_folder(tmp_path / "gpt2")
    other = gpt2_folder(tmp_path / "two-layers", n_layer=2)
    wide_vocab = gpt2_folder(tmp_path / "vocab", vocab_size=300)
    # A GPT project does not need transformers unless init_from is used; then one line says how.
    blocker = tmp_path / "no-transformers" / "transformers"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'transformers'\", "
        "name='transformers')\n"
    )
    cases = {
        "preset": (
            "gpt2-baseline",
            [f"--init_from={tiny}", "--model=small"],
            "{'n_layer': 4, 'n_head': 4, 'n_embd': 128}, the model {'n_layer': 6, 'n_head': 6, "
            "'n_embd': 384}: pass --model=tiny",
        ),
        "no-preset": (
            "gpt2-baseline",
            [f"--init_from={other}"],
            "add a preset of those sizes to PRESETS",
        ),
        # vocab_size=0 would take the checkpoint's 300 (test_sample.py); a given one must match.
        "vocab": (
            "gpt2-baseline",
            [f"--init_from={wide_vocab}", "--vocab_size=256"],
            "the checkpoint has 300 tokens, the model 256",
        ),
        "missing": (
            "gpt2-baseline",
            [f"--init_from={tmp_path / 'nothing'}"],
            "no Hugging Face model there",
        ),
        # No init_from where GPT-2's layout cannot hold the model (alibi, rotary: no wpe).
        "alibi": (
            "gpt2-speedup",
            [f"--init_from={tiny}"],
            "unknown config key 'init_from'",
        ),
        "rotary": (
            "gpt2-modern",
            [f"--init_from={tiny}"],
            "unknown config key 'init_from'",
        ),
        "no-transformers": (
            "gpt2-baseline",
            [f"--init_from={tiny}"],
            "needs transformers: pip install 'scaffold[hf]'",
        ),
    }
    for name in cases:
        (tmp_path / "work" / name).mkdir(parents=True)
    # One interpreter for the runs that share this checkout's environment (imports once).
    results = run_train_many(
        {
            name: (
                generated[recipe],
                tmp_path / "work" / name,
                [*RUN, f"--data={data}", f"--run_name={name}", *args],
            )
            for name, (recipe, args, _) in cases.items()
            if name != "no-transformers"
        }
    )
    recipe, args, _ = cases["no-transformers"]
    results["no-transformers"] = subprocess.run(
        [
            sys.executable,
            str(generated[recipe] / "train.py"),
            "--device=cpu",
            *RUN,
            f"--data={data}",
            "--run_name=no-transformers",
            *args,
        ],
        cwd=tmp_path / "work" / "no-transformers",
        env={
            **checkout_env(),
            "PYTHONPATH": f"{blocker.parent}:{checkout_env()['PYTHONPATH']}",
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    for name, (_, _, expected) in cases.items():
        one_line_error(results[name], expected)
        assert not (tmp_path / "work" / name / "runs").exists(), name

    # Without init_from, a GPT project's modules do not import transformers.
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, train, model; print('transformers' in sys.modules)",
        ],
        cwd=generated["gpt2-baseline"],
        env=checkout_env(),
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "False", probe.stderr

    # Export refuses what GPT2LMHeadModel cannot hold, from the run's config and its project's model.py.
    expected = (
        "GPT2LMHeadModel cannot hold this model: its algorithms change GPT-2's layout"
    )
    for recipe in ("gpt2-speedup", "gpt2-modern"):
        run = tmp_path / recipe / "runs" / "r"
        run.mkdir(parents=True)
        (run / "config.toml").write_text('model = "tiny"\n')
        result = scaffold_cli(
            "export",
            "--format",
            "hf",
            str(run),
            str(tmp_path / recipe / "out"),
            "--project",
            str(generated[recipe]),
        )
        one_line_error(result, expected)
        assert "export it with --format safetensors" in result.stderr
        assert not (tmp_path / recipe / "out").exists()


def test_the_mapping_and_init_from_exist_only_where_gpt2s_layout_fits(
    generated: dict[str, Path],
) -> None:
    """gpt2-baseline (GPT-2's layout) has the Hugging Face mapping, init_from and its loading; the
    recipes whose algorithms change the layout have none of it, and their model.py's docstring
    says which algorithms change it."""
    mapping = (
        "def from_hf_gpt2",
        "def to_hf_gpt2",
        "HF_BLOCK_NAMES",
        "def hf_gpt2_names",
    )
    baseline = generated["gpt2-baseline"]
    model, train = (baseline / "model.py").read_text(), (
        baseline / "train.py"
    ).read_text()
    data = (baseline / "data.py").read_text()
    assert all(name in model for name in mapping)
    # train.py has the setting; model.py's build_model reads the weights, data.py the
    # checkpoint's vocabulary size.
    assert "init_from: str" in train and "init=not resumes" in train
    assert "from_hf_gpt2(*hf.read_gpt2(cfg.init_from)" in model
    assert "hf.gpt2_vocab_size(cfg.init_from" in data
    assert "HF_LAYOUT_CHANGES" not in model + train
    for recipe, changed_by in (
        ("gpt2-speedup", "alibi"),
        ("gpt2-modern", "logit_softcap, qk_norm, relu_squared"),
    ):
        model = (generated[recipe] / "model.py").read_text()
        train = (generated[recipe] / "train.py").read_text()
        data = (generated[recipe] / "data.py").read_text()
        assert not any(name in model for name in mapping), recipe
        assert not any("init_from" in text for text in (model, train, data)), recipe
        assert not any(
            "from runtime import" in line and "hf" in line
            for line in (model + data).splitlines()
        ), recipe
        runtime_names = {
            name.strip()
            for line in train.splitlines()
            if line.startswith("from runtime import ")
            for name in line.removeprefix("from runtime import ").split(",")
        }
        assert {"checkpoint", "parallel"} <= runtime_names and "hf" not in runtime_names
        assert "HF_LAYOUT_CHANGES" not in model + train
        docstring = " ".join(model.split('"""')[1].split())
        assert (
            f"GPT-2's layout cannot hold it (changed by {changed_by}" in docstring
        ), docstring
