"""Sampling from a trained language model: `sample.py` and the GPT's key/value cache.

The cache is checked against the plain forward (same logits, one forward per new token) in
the three GPT recipes' models (learned positions, ALiBi, rotary); sample.py reads a run's
newest checkpoint, one step folder, an exported safetensors file, the entry a run exports
(EMA's), a checkpoint sharded over 2 ranks, and a Hugging Face GPT-2 folder, where its greedy
text equals transformers' own `generate`. `--init_from` with `vocab_size=0` takes the
checkpoint's vocabulary. Bad input is one line. Nothing is downloaded (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from projects import checkout_env, project_modules, run_train, run_train_apart

RUN = [
    "--seq_len=32",
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--eval_interval=1000ba",
    "--eval_batches=1",
    "--save_interval=2ba",
    "--save_num_checkpoints_to_keep=0",
]
# Drawn (a few steps of training make greedy text all spaces), reproducibly: --seed.
DRAWN = ["--max_new_tokens=24", "--prompt=def ", "--seed=3", "--temperature=1"]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def run_sample(
    project: Path, workdir: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(project / "sample.py"), "--device=cpu", *args],
        cwd=workdir,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def sampled(result: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """(the 'sampling from' line, the text) of a successful sample.py run."""
    assert result.returncode == 0, result.stderr[-3000:]
    source, text = result.stdout.split("\n", 1)
    assert source.startswith("sampling from ")
    return source, text


def one_line_error(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, (result.stdout[-2000:], result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert expected in lines[0], lines


@pytest.mark.parametrize("recipe", ["gpt2-baseline", "gpt2-speedup", "gpt2-modern"])
def test_the_cache_gives_the_plain_forwards_logits_one_forward_per_token(
    generated: dict[str, Path], recipe: str
) -> None:
    """A prompt, then one token at a time through the cache: the logits of the forward over
    the whole sequence (within float rounding); generate() makes one forward per new token,
    each of one token after the prompt, and reads the newest half again when full."""
    with project_modules(generated[recipe]) as modules:
        m = modules["model"]
        torch.manual_seed(0)
        model = m.GPT(m.GPTConfig(256, max_seq_len=16, **m.PRESETS["tiny"])).eval()
        with torch.no_grad():
            for param in model.parameters():  # zero_init's zeros: make every path count
                param.add_(torch.randn_like(param), alpha=0.05)
            tokens = torch.randint(
                0, 256, (2, 12), generator=torch.Generator().manual_seed(1)
            )
            whole = model(tokens)
            cache = [m.LayerCache() for _ in model.blocks]
            pieces = [model(tokens[:, :5], cache)]
            pieces += [model(tokens[:, i : i + 1], cache) for i in range(5, 12)]
        torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=0, atol=2e-5)

        lengths: list[int] = []
        model.register_forward_pre_hook(
            lambda _, args: lengths.append(args[0].shape[1])
        )
        out = model.generate(tokens[:, :5], 30, temperature=0)
        # Prompt 5, one token per forward until 16 are cached, then the newest 8 again.
        assert lengths == [5] + [1] * 11 + [8] + [1] * 8 + [8] + [1] * 8
        # Greedy through the cache = greedy by plain forwards over the same windows.
        with torch.no_grad():
            expected, start = tokens[:, :5], 0
            for _ in range(30):
                logits = model(expected[:, start:])
                expected = torch.cat((expected, logits[:, -1:].argmax(-1)), dim=1)
                if expected.shape[1] - start > 16:
                    start = expected.shape[1] - 8
        assert torch.equal(out, expected)


def test_train_shows_a_sample_and_sample_py_reads_every_checkpoint_form(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """`python train.py` ends with a sample; sample.py reads the run's newest checkpoint,
    a step folder, the exported file (same text as the checkpoint it came from), and the
    entry the run exports (EMA's: `Checkpointer.export`), or the one --entry names."""
    from runtime import checkpoint
    from runtime.time import Progress

    project = generated["gpt2-speedup"]
    trained = run_train(project, tmp_path, *RUN, "--max_duration=4ba", "--run_name=a")
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "a sample (python sample.py --help for more):" in trained.stdout

    newest = sampled(run_sample(project, tmp_path, "--run=runs/a", *DRAWN))
    assert newest[0].endswith("step-4 (step 4, entry model)")
    assert newest[1].startswith("def ") and len(newest[1]) > len("def \n---")
    step2 = sampled(
        run_sample(project, tmp_path, "--checkpoint=runs/a/checkpoints/step-2", *DRAWN)
    )
    assert "(step 2, entry model)" in step2[0] and step2[1] != newest[1]
    checkpoint.export_safetensors(tmp_path / "runs" / "a", tmp_path / "a.safetensors")
    exported = run_sample(
        project, tmp_path, "--checkpoint=a.safetensors", "--run=runs/a", *DRAWN
    )
    assert sampled(exported)[1] == newest[1]

    # A run whose checkpoint holds an average beside the model and exports it (as EMA
    # does): the average (here step 2's weights) is what sample.py reads by default.
    with project_modules(project) as modules:
        m = modules["model"]
        weights = {
            step: checkpoint.read_weights(tmp_path / f"runs/a/checkpoints/step-{step}")[
                0
            ]
            for step in (2, 4)
        }
        models = {}
        for name, step in (("model", 4), ("ema", 2)):
            models[name] = m.GPT(m.GPTConfig(256, 32, **m.PRESETS["tiny"]))
            models[name].load_state_dict(weights[step])
        progress = Progress(batches_per_epoch=100)
        progress.advance(samples=4, tokens=128)
        saver = checkpoint.Checkpointer(tmp_path / "runs/b/checkpoints", export="ema")
        saver.save({**models, "progress": progress})
    shutil.copy(tmp_path / "runs/a/config.toml", tmp_path / "runs/b/config.toml")
    average = sampled(run_sample(project, tmp_path, "--run=runs/b", *DRAWN))
    assert "entry ema" in average[0] and average[1] == step2[1]
    live = sampled(
        run_sample(project, tmp_path, "--run=runs/b", "--entry=model", *DRAWN)
    )
    assert "entry model" in live[0] and live[1] == newest[1]


def test_sample_reads_a_checkpoint_sharded_over_2_ranks(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """FSDP2 on 2 ranks: no sample at the end (one process only); sample.py assembles the
    shards without a process group, the same text as from the exported file."""
    from runtime import checkpoint

    project = generated["gpt2-baseline"]
    result = subprocess.run(
        [
            sys.executable,
            *("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"),
            *(str(project / "train.py"), "--device=cpu", "--dist_timeout=60"),
            *RUN,
            "--max_duration=2ba",
            "--run_name=two",
        ],
        cwd=tmp_path,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "a sample" not in result.stdout
    shards = list((tmp_path / "runs/two/checkpoints/step-2").glob("*.distcp"))
    assert len(shards) >= 2, shards
    from_shards = sampled(run_sample(project, tmp_path, "--run=runs/two", *DRAWN))
    checkpoint.export_safetensors(tmp_path / "runs/two", tmp_path / "two.safetensors")
    from_file = run_sample(
        project, tmp_path, "--checkpoint=two.safetensors", "--run=runs/two", *DRAWN
    )
    assert sampled(from_file)[1] == from_shards[1]


def test_sample_from_a_hugging_face_gpt2_folder_equals_transformers_generate(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """nanoGPT's `init_from='gpt2'`: the weights of a GPT2LMHeadModel folder through
    model.py's mapping and cache give transformers' own greedy continuation."""
    transformers = pytest.importorskip("transformers")
    from test_gpt2_hf import gpt2_folder

    folder = gpt2_folder(tmp_path / "gpt2")
    result = run_sample(
        generated["gpt2-baseline"],
        tmp_path,
        "--init_from=gpt2",
        "--tokenizer=bytes",
        "--temperature=0",
        "--max_new_tokens=24",
        "--prompt=def ",
    )
    text = sampled(result)[1].split("\n---------------")[0]
    hf_model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
    prompt = torch.tensor([list(b"def ")])
    with torch.no_grad():
        hf_out = hf_model.generate(
            prompt,
            max_new_tokens=24,
            do_sample=False,
            attention_mask=torch.ones_like(prompt),
            pad_token_id=0,
        )
    expected = bytes(hf_out[0].tolist()).decode(errors="replace")
    assert text == expected
    # Without a tokenizer in the folder and no --tokenizer: one line naming the flag.
    refused = run_sample(generated["gpt2-baseline"], tmp_path, "--init_from=gpt2")
    one_line_error(refused, "--tokenizer=")


def test_init_from_with_vocab_size_0_takes_the_checkpoints_vocabulary(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """.bin token ids without meta.pkl imply GPT-2's padded vocabulary (50304); with
    --init_from and the default vocab_size=0 the model takes the checkpoint's instead (as
    nanoGPT does), where it was refused before ('pass --vocab_size=300')."""
    pytest.importorskip("transformers")
    from test_gpt2_hf import gpt2_folder

    gpt2_folder(tmp_path / "gpt2", vocab_size=300)
    rng = np.random.default_rng(0)
    rng.integers(0, 300, 4000).astype(np.uint16).tofile(tmp_path / "train.bin")
    rng.integers(0, 300, 800).astype(np.uint16).tofile(tmp_path / "val.bin")
    result = run_train(
        generated["gpt2-baseline"],
        tmp_path,
        *RUN,
        "--max_duration=1ba",
        "--init_from=gpt2",
        "--data=train.bin",
        "--run_name=bin",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # GPT-2 token ids: no sample without a tokenizer, and the line says what to pass.
    assert "no sample: " in result.stdout and "--tokenizer=" in result.stdout
    from runtime import checkpoint

    weights = checkpoint.read_weights(tmp_path / "runs/bin")[0]
    assert weights["wte.weight"].shape[0] == 300
    refused = run_sample(generated["gpt2-baseline"], tmp_path, "--run=runs/bin")
    one_line_error(refused, "--tokenizer=FOLDER")


def test_sample_refuses_bad_input_in_one_line(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    cases = {
        "nothing": ([], "nothing to sample from; pass --run"),
        "no_config": (["--run=runs/none"], "no config.toml in runs/none"),
        "no_run": (["--checkpoint=x.safetensors"], "also pass --run="),
        "empty": (["--run=r", "--prompt="], "prompt is empty"),
        # Only where GPT-2's layout holds the model is there an init_from (ALiBi: none).
        "init_from": (["--init_from=x"], "init_from"),
    }
    # Runs that stop before sampling: one interpreter for all (torch imported once).
    results = run_train_apart(
        generated["gpt2-speedup"],
        tmp_path,
        {name: args for name, (args, _) in cases.items()},
        script="sample.py",
    )
    for name, (_, expected) in cases.items():
        one_line_error(results[name][1], expected)
