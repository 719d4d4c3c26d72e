"""The llm_finetune task with the hf_causal model pack: a tiny Llama built from LlamaConfig and a
BPE tokenizer trained here with `tokenizers` (real transformers code, nothing downloaded);
chat SFT learns and exports a folder that transformers loads and that answers as the run did;
answer-only targets; packed rows compute exactly what unpacked rows do; bad input.
HF_HUB_OFFLINE=1 in every subprocess."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from conftest import scaffold_cli  # noqa: E402
from scaffold.render import commit_all  # noqa: E402
from projects import (  # noqa: E402
    checkout_env,
    one_error_line,
    project_modules,
    read_metrics,
    run_train,
    run_train_apart,
)

SFT = "llm-sft"
SMALL = [
    "--seq_len=128",
    "--global_batch_size=8",
    "--device_microbatch_size=4",
    "--eval_batches=1",
    "--samples=2",
    "--sample_tokens=12",
]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": "A mutable sequence."},
    {"role": "user", "content": "And a tuple?"},
    {"role": "assistant", "content": "An immutable one."},
]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def samples(log: str) -> list[str]:
    return re.findall(r"sample: .* -> (.*)", log)


def save_without_template(project: Path, folder: Path) -> str:
    """`tiny` (random, seeded) saved with save_pretrained, its tokenizer without a chat
    template, as many base models come; returns the template it had."""
    with project_modules(project) as modules:
        data, model_py = modules["data"], modules["model"]
        tokenizer = model_py.load_tokenizer("tiny", data.topic_documents()[0])
        template = tokenizer.chat_template
        tokenizer.chat_template = None
        torch.manual_seed(0)
        model_py.load_model("tiny", tokenizer, 128, "sdpa").save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return template


def test_sft_learns_and_exports_what_transformers_loads(
    generated: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """The recipe CI trains end to end, from a save_pretrained folder whose tokenizer has
    no chat template (--chat_template=FILE gives it one): the answer loss falls, samples
    are logged, hf/ loads with AutoModelForCausalLM (the template kept), and README's
    `python sample.py --run=runs/NAME` answers the last sample's question as the run did
    (greedy, the same tokens)."""
    project = generated[SFT]
    template = save_without_template(project, tmp_path / "base")
    (tmp_path / "chat.jinja").write_text(template)
    args = (*SMALL, "--model=base", "--chat_template=chat.jinja")
    args = (*args, "--max_duration=12ba", "--eval_interval=6ba", "--run_name=sft")
    result = run_train(project, tmp_path, *args)
    assert result.returncode == 0, result.stderr
    evals = [r["val_loss"] for r in read_metrics(tmp_path, "sft") if "val_loss" in r]
    assert len(evals) == 2 and evals[1] < evals[0] - 0.1, evals
    log = (tmp_path / "runs" / "sft" / "log.txt").read_text()
    answers = samples(log)
    assert len(answers) == 4, log
    # The same answers in metrics.jsonl (and so the trackers), at each evaluation.
    logged = [r for r in read_metrics(tmp_path, "sft") if "val_loss" in r]
    assert [repr(r[f"sample/{i}"]) for r in logged for i in (0, 1)] == answers
    folder = tmp_path / "runs" / "sft" / "hf"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template == template and model.config.model_type == "llama"
    question = re.findall(r"sample: '(.*)' ->", log)[-1]
    run = tmp_path / "runs" / "sft"
    args = [f"--run={run}", f"--prompt={question}", "--temperature=0"]
    monkeypatch.setattr("sys.argv", ["sample.py", *args, "--max_new_tokens=12"])
    with project_modules(project) as modules:
        modules["sample"].main()
    first, printed = capsys.readouterr().out.split("\n", 1)
    assert first == f"sampling from {run / 'hf'} (chat prompt)"
    assert printed.endswith("\n" + "-" * 15 + "\n"), printed
    assert repr(printed[: -len("-" * 15) - 2]) == answers[-1]


def test_only_assistant_tokens_are_targets(generated: dict[str, Path]) -> None:
    with project_modules(generated[SFT]) as modules:
        data, model = modules["data"], modules["model"]
        tokenizer = model.load_tokenizer("tiny", data.topic_documents()[0])
        doc = data.chat_document(CONVERSATION, tokenizer, "test")
    targets = tokenizer.decode(doc.ids[doc.targets])
    assert targets == "A mutable sequence.<|end|>\nAn immutable one.<|end|>\n"
    assert tokenizer.decode(doc.ids) == tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False
    )


def tiny_pair(modules: dict, pairs: list) -> tuple:
    """`tiny`'s tokenizer trained on `pairs` and its model (seed 0), for evaluation."""
    words = [message["content"] for pair in pairs for message in pair]
    tokenizer = modules["model"].load_tokenizer("tiny", words)
    torch.manual_seed(0)
    return tokenizer, modules["model"].load_model("tiny", tokenizer, 256, "sdpa").eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager", "flex_attention"])
def test_packed_rows_compute_what_unpacked_rows_do(
    generated: dict[str, Path], attention: str
) -> None:
    """The summed loss over every target, and its count, are the same with several
    conversations per row (positions restarting) as with one padded row each: no token
    attends across a document boundary, with SDPA's mask or FlexAttention's document
    blocks or eager attention's mask (--attention; forward only here: FlexAttention has
    no CPU backward)."""
    with project_modules(generated[SFT]) as modules:
        data, model_py = modules["data"], modules["model"]
        pairs = data.topic_pairs()[0][:24]
        tokenizer = model_py.load_tokenizer(
            "tiny", [m["content"] for p in pairs for m in p]
        )
        torch.manual_seed(0)
        model = model_py.load_model("tiny", tokenizer, 256, attention).eval()
        assert model.config._attn_implementation == attention
        docs = data.tokenize(pairs, tokenizer, "chat")
        losses = {}
        for packing in (True, False):
            rows = data.pack(docs, 256, tokenizer.pad_token_id, packing)
            batch = rows.take(slice(None))
            labels = batch.pop("labels")
            with torch.no_grad():
                logits = model(**batch, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(
                logits.flatten(0, 1), labels.flatten(), reduction="sum"
            )
            losses[packing] = (len(rows), int((labels != data.IGNORE).sum()), loss)
    assert losses[True][0] < losses[False][0] / 3  # several conversations per row
    assert losses[True][1] == losses[False][1]
    torch.testing.assert_close(losses[True][2], losses[False][2], rtol=1e-5, atol=0)


def test_cross_document_attention_would_change_the_loss(
    generated: dict[str, Path],
) -> None:
    """The test above can fail: the same packed rows with positions that do not restart
    (one causal sequence per row) give another loss."""
    with project_modules(generated[SFT]) as modules:
        data, model_py = modules["data"], modules["model"]
        pairs = data.topic_pairs()[0][:8]
        tokenizer = model_py.load_tokenizer(
            "tiny", [m["content"] for p in pairs for m in p]
        )
        torch.manual_seed(0)
        model = model_py.load_model("tiny", tokenizer, 256, "sdpa").eval()
        rows = data.pack(data.tokenize(pairs, tokenizer, "chat"), 256, 0, True)
        batch = rows.take(slice(None))
        labels = batch.pop("labels")
        with torch.no_grad():
            packed = model(**batch, use_cache=False).logits
            batch["position_ids"] = torch.arange(256).expand_as(labels)
            causal = model(**batch, use_cache=False).logits
    keep = labels != data.IGNORE
    assert (packed[keep] - causal[keep]).abs().max() > 1e-3


def huge_llama(project: Path, folder: Path) -> Path:
    """A 70B-parameter Llama's config (no weights) and the tiny tokenizer in `folder`."""
    transformers.LlamaConfig(
        hidden_size=8192,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        intermediate_size=28672,
        vocab_size=128256,
    ).save_pretrained(folder)
    with project_modules(project) as modules:
        tokenizer = modules["model"].load_tokenizer("tiny", ["some text"] * 4)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def refused(
    generated: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str], Path]]:
    """llm-sft's train.py with each bad input of the tests below, in one interpreter
    (runs that stop in setup import torch and transformers once). Each name: (workdir,
    result, the input's file or folder)."""
    project = generated[SFT]
    inputs = tmp_path_factory.mktemp("bad-input")
    good = [{"prompt": f"q{i}?", "response": f"answer {i}."} for i in range(40)]
    bad = [*good[:3], {"messages": [{"role": "user", "content": "hello?"}]}]
    data = write_jsonl(inputs / "bad.jsonl", bad)
    plain = inputs / "plain"
    save_without_template(project, plain)
    huge = huge_llama(project, inputs / "huge")
    runs = {
        "flex": ([*SMALL, "--attention=flex_attention"], inputs),
        "data": ([*SMALL, f"--data={data}", "--run_name=bad"], data),
        "plain": (
            [*SMALL, f"--model={plain}", "--max_duration=1ba", "--run_name=plain"],
            plain,
        ),
        "huge": ([*SMALL, f"--model={huge}", "--run_name=huge"], huge),
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        results = run_train_apart(
            project,
            tmp_path_factory.mktemp("work"),
            {name: args for name, (args, _) in runs.items()},
        )
    return {name: (*results[name], runs[name][1]) for name in runs}


def test_attention_kernels_that_cannot_run_here_are_one_line(
    generated: dict[str, Path], refused: dict
) -> None:
    """FlexAttention and FlashAttention train on CUDA only: a CPU run is refused before
    anything is read; a kernel transformers cannot load is named with the fix."""
    workdir, result, _ = refused["flex"]
    line = one_error_line(result, workdir)
    assert "attention=flex_attention trains on CUDA only" in line
    assert line.endswith("use --attention=auto")
    if importlib.util.find_spec("flash_attn") is not None:
        return  # installed: transformers would load it
    with project_modules(generated[SFT]) as modules:
        model_py = modules["model"]
        tokenizer = model_py.load_tokenizer("tiny", ["a few words to learn from"])
        with pytest.raises(
            model_py.ModelError, match=r"--attention=flash_attention_2:"
        ):
            model_py.load_model("tiny", tokenizer, 64, "flash_attention_2")


def test_a_model_without_sdpa_trains_with_its_own_attention(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """Gemma 2 has no SDPA kernel in transformers: the default --attention=auto keeps
    its eager attention and trains; asking it for sdpa is one line naming the fix."""
    project = generated[SFT]
    with project_modules(project) as modules:
        data, model_py = modules["data"], modules["model"]
        tokenizer = model_py.load_tokenizer("tiny", data.topic_documents()[0])
        config = transformers.Gemma2Config(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            max_position_embeddings=128,
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        torch.manual_seed(0)
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(
            tmp_path / "gemma"
        )
        tokenizer.save_pretrained(tmp_path / "gemma")
        folder = str(tmp_path / "gemma")
        assert (
            model_py.load_model(
                folder, tokenizer, 128, "auto"
            ).config._attn_implementation
            == "eager"
        )
        with pytest.raises(model_py.ModelError) as refused:
            model_py.load_model(folder, tokenizer, 128, "sdpa")
    assert str(refused.value).startswith("--attention=sdpa: Gemma2ForCausalLM")
    assert str(refused.value).endswith("; use --attention=auto")
    result = run_train(
        project,
        tmp_path,
        *SMALL,
        "--model=gemma",
        "--max_duration=2ba",
        "--run_name=gemma",
    )
    assert result.returncode == 0, result.stderr
    assert len([r for r in read_metrics(tmp_path, "gemma") if "loss" in r]) == 2


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_prompt_response_lines_and_bad_lines(
    generated: dict[str, Path], refused: dict, tmp_path: Path
) -> None:
    project = generated[SFT]
    workdir, result, path = refused["data"]
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {path} line 4: the conversation has no assistant turn, so nothing to "
        'learn; add a {"role": "assistant", "content": ...} message or drop the line'
    ]
    assert not (workdir / "runs" / "bad").exists()
    good = [{"prompt": f"q{i}?", "response": f"answer {i}."} for i in range(2)]
    path = write_jsonl(tmp_path / "notjson.jsonl", good)
    path.write_text(path.read_text() + "{oops\n")
    with project_modules(project) as modules:
        with pytest.raises(
            ValueError, match=f"^{re.escape(str(path))} line 3: not JSON"
        ):
            modules["data"].read_conversations(path)


def test_a_tokenizer_without_a_chat_template(refused: dict) -> None:
    """One line saying how to give it one (the test above trains with it), nothing
    written."""
    workdir, result, folder = refused["plain"]
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: --model={folder}: its tokenizer has no chat template; pass one with "
        "--chat_template=FILE (a Jinja template, e.g. the chat_template of an instruct "
        "model of its family), or train on plain text with --data_format=text"
    ]
    assert not (workdir / "runs" / "plain").exists()


@pytest.mark.slow
def test_continued_pretraining_recipe(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """Plain text, every token a target: the loss falls; hf/ loads."""
    project = generated["llm-continued-pretraining"]
    args = (*SMALL, "--max_duration=16ba", "--eval_interval=8ba", "--run_name=cpt")
    result = run_train(project, tmp_path, *args)
    assert result.returncode == 0, result.stderr
    evals = [r["val_loss"] for r in read_metrics(tmp_path, "cpt") if "val_loss" in r]
    assert evals[1] < evals[0] - 0.3, evals
    assert "sample:" not in (tmp_path / "runs" / "cpt" / "log.txt").read_text()
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "runs" / "cpt" / "hf")


LORA = "llm-lora"
LORA_SMALL = [*SMALL[:4], "--samples=1", "--sample_tokens=8", "--max_duration=2ba"]


def last_sample(workdir: Path, run_name: str) -> tuple[str, str]:
    log = (workdir / "runs" / run_name / "log.txt").read_text()
    return re.findall(r"sample: '(.*)' -> (.*)", log)[-1]


NOPE = (
    "--lora_targets=nope matches no module of the model; its linear layers are named "
    "down_proj,gate_proj,k_proj,lm_head,o_proj,q_proj,up_proj,v_proj (or use all-linear)"
)


def test_lora_targets_that_match_no_module(generated: dict[str, Path]) -> None:
    """The error names the model's linear layers (train.py's one line: the slow test)."""
    pytest.importorskip("peft")
    with project_modules(generated[LORA]) as modules:
        model_py = modules["model"]
        tokenizer = model_py.load_tokenizer("tiny", ["a few words"] * 4)
        model = model_py.load_model("tiny", tokenizer, 64, "sdpa")
        with pytest.raises(ValueError) as error:
            model_py.add_lora(model, 8, 16.0, 0.0, "nope")
    assert str(error.value) == NOPE


def sample_main(
    modules: dict, monkeypatch: pytest.MonkeyPatch, capsys, *args: str
) -> str:
    """`python sample.py ARGS` in this process: its greedy answer, as the log writes it."""
    monkeypatch.setattr("sys.argv", ["sample.py", "--temperature=0", *args])
    modules["sample"].main()
    return repr(capsys.readouterr().out.split("\n", 1)[1][: -len("-" * 15) - 2])


@pytest.mark.slow
def test_lora_checkpoints_adapters_and_exports_merged_or_adapter(
    generated: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    """Only the adapters are trained and checkpointed; hf/ holds the merged model
    (AutoModelForCausalLM) or the adapter (PeftModel on the base), and either answers as
    the run did, also through sample.py (an adapter on --base)."""
    peft = pytest.importorskip("peft")
    from torch.distributed.checkpoint import FileSystemReader

    project = generated[LORA]
    result = run_train(project, tmp_path, *LORA_SMALL, "--lora_targets=nope")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"error: {NOPE}"]
    assert not (tmp_path / "runs").exists()
    for export in ("merged", "adapter"):
        args = (*LORA_SMALL, "--eval_interval=2ba", f"--lora_export={export}")
        result = run_train(project, tmp_path, *args, f"--run_name={export}")
        assert result.returncode == 0, result.stderr
    # The checkpoint's model entry: the adapters' weights, nothing of the frozen model.
    step = tmp_path / "runs" / "merged" / "checkpoints" / "step-2"
    keys = FileSystemReader(str(step)).read_metadata().state_dict_metadata
    weights = [k for k in keys if k.startswith("model.")]
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), weights
    question, answer = last_sample(tmp_path, "merged")
    messages = [{"role": "user", "content": question}]
    folder = tmp_path / "runs" / "merged" / "hf"
    merged = transformers.AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    with project_modules(project) as modules:
        assert repr(modules["model"].respond(merged, tokenizer, messages, 8)) == answer
        # The adapter on its base: `tiny` is built from the seed, as the run built it.
        data, model_py = modules["data"], modules["model"]
        folder = tmp_path / "runs" / "adapter" / "hf"
        assert (folder / "adapter_config.json").is_file()
        texts = data.load_texts("", "", "chat", 42)
        tokenizer = model_py.load_tokenizer("tiny", texts.words())
        torch.manual_seed(42)
        base = model_py.load_model("tiny", tokenizer, 128, "sdpa")
        base.save_pretrained(tmp_path / "base")  # for sample.py below
        adapted = peft.PeftModel.from_pretrained(base, folder)
        question, answer = last_sample(tmp_path, "adapter")
        messages = [{"role": "user", "content": question}]
        assert repr(model_py.respond(adapted, tokenizer, messages, 8)) == answer
        # sample.py: the merged folder as is; the adapter only on a base it can load.
        run = tmp_path / "runs" / "adapter"
        args = (f"--run={run}", f"--prompt={question}", "--max_new_tokens=8")
        with pytest.raises(SystemExit) as exit:
            sample_main(modules, monkeypatch, capsys, *args)
        assert exit.value.code == 2
        assert (
            "is a LoRA adapter whose base model has no name" in capsys.readouterr().err
        )
        base_arg = f"--base={tmp_path / 'base'}"
        assert sample_main(modules, monkeypatch, capsys, *args, base_arg) == answer
        question, answer = last_sample(tmp_path, "merged")
        args = (f"--run={run.parent / 'merged'}", f"--prompt={question}")
        assert (
            sample_main(modules, monkeypatch, capsys, *args, "--max_new_tokens=8")
            == answer
        )
        # A checkpoint exported as README says (resumed into a run that ends there):
        # the merged run's step-2 adapters in peft's format answer as that run did.
        args = ("--config=runs/merged/config.toml", "--run_name=step-2")
        args += ("--load_path=runs/merged/checkpoints/step-2", "--max_duration=2ba")
        result = run_train(project, tmp_path, *args, "--lora_export=adapter")
        assert result.returncode == 0, result.stderr[-3000:]
        folder = tmp_path / "runs" / "step-2" / "hf"
        torch.manual_seed(42)  # the base, as the run built it
        base = model_py.load_model("tiny", tokenizer, 128, "sdpa")
        adapted = peft.PeftModel.from_pretrained(base, folder)
        messages = [{"role": "user", "content": question}]
        assert repr(model_py.respond(adapted, tokenizer, messages, 8)) == answer


def test_a_model_too_large_for_the_sharding(refused: dict) -> None:
    """A 70B-parameter Llama's config (no weights, huge_llama): one line naming the
    memory per rank, before any weight is read or anything written."""
    workdir, result, folder = refused["huge"]
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"error: --model={folder} needs about 1,051.3 GiB per rank for its fp32 weights, "
        "gradients and AdamW state over 1 rank(s), but a cpu here has "
    ), lines
    assert lines[0].endswith("or train LoRA adapters (scaffold set lora=true)")
    assert not (workdir / "runs" / "huge").exists()


def test_trainable_only_checkpoints_leave_frozen_weights_out(tmp_path: Path) -> None:
    """Checkpointer(trainable_only=True): the frozen weight and its tied alias are not
    saved and a resume leaves them as built; the trainable ones come back."""
    from torch.distributed.checkpoint import FileSystemReader

    from runtime import checkpoint
    from runtime.time import Progress

    def build() -> tuple:
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Embedding(8, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)
        )
        model[2].weight = model[0].weight  # tied, as an LM head
        model[0].weight.requires_grad_(False)
        trainable = [p for p in model.parameters() if p.requires_grad]
        return model, torch.optim.AdamW(trainable, lr=0.1)

    model, optimizer = build()
    model(torch.arange(8)).sum().backward()
    optimizer.step()
    progress = Progress(batches_per_epoch=4)
    progress.advance(samples=1, tokens=1)
    saver = checkpoint.Checkpointer(tmp_path, trainable_only=True)
    path = saver.save(dict(model=model, optimizer=optimizer, progress=progress))
    saver.close()
    keys = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    weights = sorted(k for k in keys if k.startswith("model."))
    assert weights == ["model.1.bias", "model.1.weight", "model.2.bias"], weights
    fresh, fresh_optimizer = build()
    embedding = fresh[0].weight.detach().clone()
    state = dict(model=fresh, optimizer=fresh_optimizer, progress=Progress(4))
    assert checkpoint.Checkpointer(tmp_path, trainable_only=True).resume(state)
    torch.testing.assert_close(fresh[1].weight, model[1].weight, rtol=0, atol=0)
    assert (
        torch.equal(fresh[0].weight, embedding) and fresh[2].weight is fresh[0].weight
    )


def test_sigterm_saves_and_the_rerun_continues_bitwise_into_the_same_tracker(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """Pre-emption and trackers on llm-sft (one process): SIGTERM once step 2 is logged:
    the run finishes its step, saves and exits 0 (before step 6); the rerun resumes and logs the uninterrupted run's
    losses bitwise, and TensorBoard holds each step once, as metrics.jsonl."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import (
        EventAccumulator,
    )

    project = generated[SFT]
    args = ["--seq_len=64", "--global_batch_size=4", "--device_microbatch_size=4"]
    args += ["--eval_batches=1", "--samples=0", "--max_duration=6ba"]
    args += ["--eval_interval=3ba", "--save_interval=1000ba"]
    reference = run_train(project, tmp_path, *args, "--run_name=whole")
    assert reference.returncode == 0, reference.stderr[-3000:]
    command = [sys.executable, str(project / "train.py"), "--device=cpu", *args]
    command += ["--run_name=pre", "--trackers=tensorboard"]
    first = subprocess.Popen(
        command, cwd=tmp_path, env=checkout_env(), stdout=subprocess.PIPE, text=True
    )
    metrics = tmp_path / "runs" / "pre" / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert first.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    # Paused so the signal lands mid-run however fast the steps are here.
    os.kill(first.pid, signal.SIGSTOP)
    os.kill(first.pid, signal.SIGTERM)
    os.kill(first.pid, signal.SIGCONT)
    output, _ = first.communicate(timeout=240)
    assert first.returncode == 0, output[-3000:]
    stopped = re.search(r"stopped by SIGTERM after step (\d+), saved", output)
    assert stopped and 2 <= int(stopped[1]) < 6, output[-3000:]
    checkpoint = tmp_path / "runs" / "pre" / "checkpoints" / f"step-{stopped[1]}"
    assert (checkpoint / "COMPLETE").exists()

    second = run_train(
        project, tmp_path, *args, "--run_name=pre", "--trackers=tensorboard"
    )
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resumed from {checkpoint.relative_to(tmp_path)}" in second.stdout
    keys = ("step", "loss", "val_loss")
    rows = read_metrics(tmp_path, "pre")
    assert [[r.get(k) for k in keys] for r in rows] == [
        [r.get(k) for k in keys] for r in read_metrics(tmp_path, "whole")
    ]
    events = EventAccumulator(str(tmp_path / "runs" / "pre" / "tensorboard"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("loss")]
    assert logged == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]


@pytest.mark.slow
def test_scaffold_set_lora_and_back(generated: dict[str, Path], tmp_path: Path) -> None:
    """`scaffold set lora=true` on an llm-sft project writes what `scaffold new --set
    lora=true` writes; check and diff are clean; it trains adapters (runs/ inside the
    project: .gitignore keeps them out of the next `scaffold set`); `lora=false` restores
    the original files, and the LoRA run's checkpoint is refused in one line."""
    pytest.importorskip("peft")
    project = tmp_path / "my-gpt"
    subprocess.run(["cp", "-r", str(generated[SFT]), str(project)], check=True)
    result = scaffold_cli("set", "lora=true", cwd=project)
    assert result.returncode == 0, result.stderr
    fresh = tmp_path / "fresh" / "my-gpt"
    made = scaffold_cli("new", "--recipe", SFT, "--set", "lora=true", str(fresh))
    assert made.returncode == 0, made.stderr
    for name in ("train.py", "model.py", "README.md", ".copier-answers.yml"):
        assert (project / name).read_text() == (fresh / name).read_text(), name
    commit_all(project, "lora")
    for command in ("check", "diff"):
        result = scaffold_cli(command, str(project))
        assert result.returncode == 0, result.stdout + result.stderr
    assert (
        "ok: upgrade, add and remove can proceed"
        in scaffold_cli("check", str(project)).stdout
    )
    assert result.stdout == ""  # diff: no edits
    args = [*LORA_SMALL, "--eval_interval=2ba", "--run_name=a"]
    trained = run_train(project, project, *args)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "LoRA rank 8 on all-linear" in trained.stdout

    result = scaffold_cli("set", "lora=false", cwd=project)
    assert result.returncode == 0, result.stderr
    for name in ("train.py", "model.py", "README.md"):
        assert (project / name).read_text() == (generated[SFT] / name).read_text()
    commit_all(project, "no lora")
    assert scaffold_cli("check", str(project)).returncode == 0
    again = run_train(project, project, *args)
    assert again.returncode == 2
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "was saved from a different model" in lines[0]


def test_scaffold_export_format_hf_names_the_way_to_export(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "config.toml").write_text('model = "tiny"\n')
    out = tmp_path / "hf"
    project = str(generated[SFT])
    result = scaffold_cli(
        "export", str(run), str(out), "--format=hf", f"--project={project}"
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "--load_path=CHECKPOINT --max_duration=STEPba" in result.stderr
    assert not out.exists()
