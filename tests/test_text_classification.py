"""The text_classification task with the hf model pack: a tiny random BERT saved with
`save_pretrained` and a WordPiece tokenizer trained here with `tokenizers` load through the real
`from_pretrained` path; fine-tuning raises accuracy; the result loads back with transformers;
data formats, the token cache, dynamic padding, FSDP units and bad input.
Nothing is downloaded (HF_HUB_OFFLINE=1 in every subprocess)."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import torch  # noqa: E402

from projects import (  # noqa: E402
    assert_same_series,
    checkout_env,
    hand_counted_forward_flops,
    project_modules,
    read_metrics,
    run_train,
    run_train_apart,
)

RECIPE = "bert-sst2"
SMALL = [
    "--max_seq_len=16",
    "--global_batch_size=8",
    "--device_microbatch_size=4",
    "--lr=3e-3",
]
WORDS = ["movie", "plot", "actors", "music", "story", "ending", "film", "scenes"]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def toy_rows(count: int = 240) -> list[dict]:
    """Separable reviews: the label is in the words ('good ...' pos, 'bad ...' neg)."""
    rows = []
    for i in range(count):
        label = i % 2
        mood = ["bad awful dull", "good great fine"][label].split()[i % 3]
        rows.append(
            {
                "sentence": f"{WORDS[i % 8]} {mood} {WORDS[(i * 5) % 8]} {mood}",
                "label": ["neg", "pos"][label],
            }
        )
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def pretrained_bert(
    folder: Path, vocab_size: int | None = None, dropout: float = 0.1
) -> Path:
    """A tiny random BERT and a WordPiece tokenizer trained on the toy texts, saved like a hub model."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    )
    tokenizer.train_from_iterator([row["sentence"] for row in toy_rows()], trainer)
    fast = transformers.BertTokenizerFast(tokenizer_object=tokenizer)
    fast.save_pretrained(folder)
    config = transformers.BertConfig(
        vocab_size=vocab_size or len(fast),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(0)
    transformers.BertForMaskedLM(config).save_pretrained(
        folder
    )  # a pretraining checkpoint: no classifier head
    return folder


def test_fine_tunes_a_saved_model_and_the_result_loads_with_transformers(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = pretrained_bert(tmp_path / "bert")
    data = write_jsonl(tmp_path / "reviews.jsonl", toy_rows())
    result = run_train(
        generated[RECIPE],
        tmp_path,
        *SMALL,
        f"--model={model_dir}",
        f"--data={data}",
        "--run_name=ft",
        "--max_duration=24ba",
        "--eval_interval=12ba",
    )
    assert result.returncode == 0, result.stderr
    assert "labels: neg, pos" in result.stdout and "3 FSDP units" in result.stdout
    # The FLOPs MFU divides by, per token of a 16-token sequence: every weight matrix, and
    # per layer the two attention products (QK^T and the weighted sum: 4 * 16^2 * width).
    logged = float(
        re.search(r"model: (\S+) training FLOPs per token", result.stdout).group(1)
    )
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(
        model_dir, num_labels=2
    )
    tokens = torch.ones(1, 16, dtype=torch.long)
    forward = (
        hand_counted_forward_flops(reference, input_ids=tokens) + 2 * 4 * 16**2 * 32
    )
    assert abs(logged - 3 * forward / 16) <= 1e-3 * logged, (logged, 3 * forward / 16)
    evals = [r for r in read_metrics(tmp_path, "ft") if "accuracy" in r]
    assert (
        len(evals) == 2 and evals[-1]["accuracy"] > 0.75 and evals[-1]["f1"] > 0.75
    ), evals

    # The saved folder is a transformers model + tokenizer that predicts what it learned.
    saved = tmp_path / "runs" / "ft" / "hf"
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        saved
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(saved)
    assert model.config.id2label == {0: "neg", 1: "pos"}
    rows = toy_rows(40)
    encoded = tokenizer(
        [r["sentence"] for r in rows],
        padding=True,
        truncation=True,
        max_length=16,
        return_tensors="pt",
    )
    with torch.no_grad():
        predicted = model(**encoded).logits.argmax(-1).tolist()
    accuracy = np.mean(
        [model.config.id2label[p] == r["label"] for p, r in zip(predicted, rows)]
    )
    assert accuracy > 0.75, accuracy
    # The token cache was written beside the data, keyed by tokenizer and max length.
    assert len(list((tmp_path / ".scaffold-cache").glob("tokens-*.npz"))) == 2


def test_bad_input_is_one_line_and_writes_nothing(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = pretrained_bert(tmp_path / "bert")
    small_vocab = pretrained_bert(tmp_path / "small-vocab", vocab_size=50)
    rows = toy_rows(40)
    no_label = write_csv(
        tmp_path / "no_label.csv", [{"sentence": r["sentence"], "y": 1} for r in rows]
    )
    out_of_range = write_csv(
        tmp_path / "range.csv",
        [{"sentence": r["sentence"], "label": i % 3} for i, r in enumerate(rows)],
    )
    empty = write_csv(
        tmp_path / "empty.csv",
        [
            {"sentence": "" if i == 7 else r["sentence"], "label": 0}
            for i, r in enumerate(rows)
        ],
    )
    good = write_csv(tmp_path / "good.csv", rows)
    cases = {
        "no_label": (
            [f"--data={no_label}"],
            "has no column 'label' (it has: sentence, y); set --label_column",
        ),
        "range": (
            [f"--data={out_of_range}", "--num_labels=2"],
            "label 2 in column 'label' is outside 0..1",
        ),
        "empty": ([f"--data={empty}"], "row 8: empty 'sentence'"),
        "hub": (
            [f"--data={good}", "--model=no-such-org/no-such-model"],
            "--model=no-such-org/no-such-model: cannot load",
        ),
        "mismatch": (
            [f"--data={good}", f"--model={small_vocab}"],
            "the tokenizer and the model do not belong together",
        ),
    }
    # Runs that stop in setup: one interpreter for all (imports once), each in its folder.
    results = run_train_apart(
        generated[RECIPE],
        tmp_path,
        {
            name: [*SMALL, f"--run_name={name}", *args]
            for name, (args, _) in cases.items()
        },
    )
    for name, (args, expected) in cases.items():
        workdir, result = results[name]
        assert result.returncode == 2, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert (
            len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
        ), (name, lines)
        assert not (workdir / "runs").exists(), name
    assert not (
        tmp_path / ".scaffold-cache"
    ).exists()  # nothing half-written beside the data
    assert model_dir.is_dir()


def test_a_folder_whose_weights_do_not_fit_its_model_is_refused(
    generated: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A folder whose weights lack some of its encoder's tensors, or hold them in another
    shape, would fine-tune with those tensors random and no word said (transformers
    initialises them): one line, exit 2, nothing written. (A masked LM's folder, with no
    pooler and no classifier, loads: test_fine_tunes_a_saved_model_...) train.main() in
    this process."""
    from safetensors.torch import load_file, save_file

    good = write_csv(tmp_path / "good.csv", toy_rows(40))
    cases = {
        "missing": (lambda k, v: None if ".layer.1." in k else v, "16 of"),
        "shape": (lambda k, v: v[:, :16] if k.endswith("query.weight") else v, "2 of"),
    }
    with project_modules(generated[RECIPE]) as found:
        for name, (change, expected) in cases.items():
            folder = pretrained_bert(tmp_path / name)
            weights = load_file(folder / "model.safetensors")
            changed = {k: change(k, v) for k, v in weights.items()}
            save_file(
                {k: v.contiguous() for k, v in changed.items() if v is not None},
                folder / "model.safetensors",
            )
            workdir = tmp_path / f"work-{name}"
            workdir.mkdir()
            monkeypatch.chdir(workdir)
            argv = ["train.py", "--device=cpu", *SMALL, f"--data={good}"]
            monkeypatch.setattr("sys.argv", [*argv, f"--model={folder}"])
            capsys.readouterr()
            try:
                with pytest.raises(SystemExit) as exited:
                    found["train"].main()
            finally:
                found["train"].dist.shutdown()
            lines = capsys.readouterr().err.strip().splitlines()
            assert exited.value.code == 2, lines
            assert len(lines) == 1 and lines[0].startswith("error: "), lines
            assert (
                f"{expected} its encoder's tensors are not in its weights" in lines[0]
            )
            assert "would start random" in lines[0], lines[0]
            assert not (workdir / "runs").exists(), name


def test_data_formats_cache_key_and_dynamic_padding(
    generated: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    rows = toy_rows(100)
    csv_path = write_csv(tmp_path / "t.csv", rows)
    jsonl_path = write_jsonl(tmp_path / "t.jsonl", rows)
    import pyarrow
    import pyarrow.parquet

    parquet_path = tmp_path / "t.parquet"
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(rows), parquet_path)
    folder = tmp_path / "saved"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows[:90]),
            "validation": datasets.Dataset.from_list(rows[90:]),
        }
    ).save_to_disk(str(folder))
    with project_modules(generated[RECIPE]) as modules:
        data, model = modules["data"], modules["model"]
        loaded = [
            data.load_texts(str(p), "", "", "label", 0, 42)
            for p in (csv_path, jsonl_path, parquet_path)
        ]
        for other in loaded[1:]:  # the same rows and the same seeded validation share
            assert (
                other.train.texts == loaded[0].train.texts
                and (other.val.labels == loaded[0].val.labels).all()
            )
        assert (
            loaded[0].label_names == ["neg", "pos"] and len(loaded[0].val.texts) == 10
        )
        saved = data.load_texts(str(folder), "", "", "label", 0, 42)
        assert (
            saved.train.texts == [r["sentence"] for r in rows[:90]]
            and len(saved.val.texts) == 10
        )

        # Tokenised once: the second call reads the cache; another max length is another key.
        tokenizer = model.load_tokenizer("tiny", loaded[0].train.texts)
        first = data.tokenize(loaded[0].train, tokenizer, 16, tmp_path / "cache", ["k"])
        monkeypatch.setattr(
            type(tokenizer), "__call__", lambda *a, **k: pytest.fail("tokenised again")
        )
        again = data.tokenize(loaded[0].train, tokenizer, 16, tmp_path / "cache", ["k"])
        assert (again.ids == first.ids).all() and len(
            list((tmp_path / "cache").iterdir())
        ) == 1
        monkeypatch.undo()
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        data.tokenize(loaded[0].train, tokenizer, 4, tmp_path / "cache", ["k"])
        assert len(list((tmp_path / "cache").iterdir())) == 2

        # Dynamic padding: a batch is as wide as its longest text; two ranks' shares make one batch.
        batches = data.Batches(first, 8, 42, tokenizer.pad_token_id)
        whole = batches.get(1, 3)
        rows_ = batches.order(1)[24:32]
        assert whole["input_ids"].shape == (8, first.lengths(rows_).max())
        assert (whole["attention_mask"].sum(1).numpy() == first.lengths(rows_)).all()
        halves = [batches.get(1, 3, rank, 2) for rank in (0, 1)]
        for key in whole:
            assert torch.equal(torch.cat([h[key] for h in halves]), whole[key])


def test_fsdp_units_come_from_no_split_modules(generated: dict[str, Path]) -> None:
    with project_modules(generated[RECIPE]) as modules:
        blocks_of = modules["model"].transformer_blocks
        bert = transformers.BertForSequenceClassification(
            transformers.BertConfig(
                vocab_size=50,
                hidden_size=16,
                num_hidden_layers=3,
                num_attention_heads=2,
                intermediate_size=32,
            )
        )
        assert [type(b).__name__ for b in blocks_of(bert)] == ["BertEmbeddings"] + [
            "BertLayer"
        ] * 3
        gpt2 = transformers.GPT2ForSequenceClassification(
            transformers.GPT2Config(
                vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32
            )
        )
        assert [type(b).__name__ for b in blocks_of(gpt2)] == ["GPT2Block"] * 2


def test_early_stopping_on_accuracy_saves_says_why_exports_and_a_rerun_trains_no_further(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """The shared runtime.early_stop on this task's metrics: lr=0 keeps accuracy flat from the
    first evaluation (step 1), so with mode max and patience 3ba the run stops at step 4 of 30,
    saves a checkpoint there, says why, writes hf/; a rerun trains no further."""
    data = write_csv(tmp_path / "toy.csv", toy_rows())
    args = (
        *SMALL[:3],
        f"--data={data}",
        "--max_duration=30ba",
        "--run_name=plateau",
        "--lr=0",
        "--eval_interval=1ba",
        "--save_interval=100ba",
        "--early_stop_metric=accuracy",
        "--early_stop_mode=max",
        "--early_stop_patience=3ba",
    )
    result = run_train(generated[RECIPE], tmp_path, *args)
    assert result.returncode == 0, result.stderr
    assert [r["step"] for r in read_metrics(tmp_path, "plateau")] == [1, 2, 3, 4]
    assert "early stopping: on accuracy (maximize" in result.stdout
    assert "early stopping at step 4: accuracy has not improved" in result.stdout
    run = tmp_path / "runs" / "plateau"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-4"]
    assert (run / "hf" / "config.json").is_file()
    again = run_train(generated[RECIPE], tmp_path, *args)
    assert again.returncode == 0, again.stderr
    assert "nothing to train" in again.stdout
    assert [r["step"] for r in read_metrics(tmp_path, "plateau")] == [1, 2, 3, 4]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-4"]


def test_sigterm_saves_and_stops_a_second_start_is_refused_and_a_rerun_continues_bitwise(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """Pre-emption and the run lock on this task: SIGTERM finishes the step, saves, says so and
    exits 0 without exporting hf/ (the run is not done); while the run lives, a second start of
    it is refused (exit 2, nothing changed); the same command then continues it bitwise.
    """
    import os
    import signal
    import subprocess
    import sys
    import time

    from projects import checkout_env

    data = write_csv(tmp_path / "toy.csv", toy_rows())
    args = [
        *SMALL,
        f"--data={data}",
        "--max_duration=20ba",
        "--eval_interval=1000ba",
        "--save_interval=1000ba",
        "--log_interval=1ba",
    ]
    project = generated[RECIPE]
    whole = run_train(project, tmp_path, *args, "--run_name=whole")
    assert whole.returncode == 0, whole.stderr
    command = [
        sys.executable,
        str(project / "train.py"),
        "--device=cpu",
        *args,
        "--run_name=pre",
    ]
    first = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=checkout_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        metrics = tmp_path / "runs" / "pre" / "metrics.jsonl"
        deadline = time.monotonic() + 240
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
            assert first.poll() is None, "training ended before the signal"
            assert time.monotonic() < deadline, "no metrics"
            time.sleep(0.05)
        os.kill(first.pid, signal.SIGSTOP)  # paused mid-run, holding the run lock
        second = run_train(project, tmp_path, *args, "--run_name=pre")
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert (
            len(lines) == 1
            and lines[0].startswith("error: ")
            and f"pid {first.pid}" in lines[0]
        ), lines
        os.kill(first.pid, signal.SIGTERM)  # delivered when it goes on
        os.kill(first.pid, signal.SIGCONT)
        output, _ = first.communicate(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0, output[-3000:]
    stopped = [r["step"] for r in read_metrics(tmp_path, "pre")][-1]
    assert stopped < 20 and f"stopped by SIGTERM after step {stopped}, saved" in output
    run = tmp_path / "runs" / "pre"
    assert (run / "checkpoints" / f"step-{stopped}" / "COMPLETE").is_file()
    assert not (run / "hf").exists()  # exported when the run finishes

    again = run_train(project, tmp_path, *args, "--run_name=pre")
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout and (run / "hf" / "config.json").is_file()

    def trajectory(run_name: str) -> list[tuple]:
        return [
            (r["step"], r["loss"], r["lr"]) for r in read_metrics(tmp_path, run_name)
        ]

    assert trajectory("pre") == trajectory("whole")


def test_trackers_profiler_and_storage_errors(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """--trackers and --profile are checked up front (exit 2, nothing written) and work; a
    checkpoint storage failure is one `error:` line and exit status 1."""
    import json

    project = generated[RECIPE]
    data = write_csv(tmp_path / "toy.csv", toy_rows())
    base = (*SMALL, f"--data={data}", "--eval_interval=2ba")
    refusals = {
        "--trackers=tensorboard,comet": "unknown tracker 'comet'",
        "--profile=5ba": "START:END",
        "--early_stop_min_delta=-1": "early_stop_min_delta=-1.0 must be >= 0",
    }
    # Runs that stop in setup: one interpreter for the three (imports once).
    results = run_train_apart(
        project,
        tmp_path / "refused",
        {bad: [*base, "--early_stop_metric=f1", bad] for bad in refusals},
    )
    for bad, message in refusals.items():
        workdir, result = results[bad]
        assert result.returncode == 2 and message in result.stderr, (bad, result.stderr)
        assert not (workdir / "runs").exists()

    trackers = ["--trackers=tensorboard"] if _installed("tensorboard") else []
    result = run_train(
        project,
        tmp_path,
        *base,
        "--max_duration=4ba",
        "--run_name=watched",
        "--profile=1ba:3ba",
        "--log_interval=2ba",
        *trackers,
    )
    assert result.returncode == 0, result.stderr
    records = read_metrics(tmp_path, "watched")
    assert [r["step"] for r in records] == [2, 4] and all(
        r["rss_gb"] > 0 for r in records
    )
    assert "profile: steps 2-3 recorded in" in result.stdout
    trace = json.loads(
        (tmp_path / "runs" / "watched" / "profile" / "rank0.trace.json").read_text()
    )
    assert any(
        e.get("name", "").startswith("Optimizer.step#AdamW")
        for e in trace["traceEvents"]
    )
    if trackers:
        from tensorboard.backend.event_processing.event_accumulator import (
            EventAccumulator,
        )

        events = EventAccumulator(str(tmp_path / "runs" / "watched" / "tensorboard"))
        events.Reload()
        assert [(e.step, round(e.value, 5)) for e in events.Scalars("accuracy")] == [
            (r["step"], round(r["accuracy"], 5)) for r in records
        ]

    (tmp_path / "blocker").write_text("a file where a folder is wanted")
    failed = run_train(
        project,
        tmp_path,
        *base,
        "--max_duration=1ba",
        "--run_name=stored",
        f"--save_folder={tmp_path / 'blocker' / 'ck'}",
    )
    assert failed.returncode == 1, failed.stderr[-3000:]
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "error: checkpoint step-1 was not saved"
    ), lines


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


@pytest.mark.slow
def test_compile_matches_eager_with_a_hugging_face_model(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """--compile=true compiles each transformer layer's forward in place: losses match eager
    (dynamic padding: the varying length recompiles once), and the checkpoint and hf/ keys are
    unchanged (a cold compile costs tens of seconds on this machine: slow). Dropout is off:
    compiled dropout draws its masks from inductor's own generator, other masks than eager's.
    """
    project = generated[RECIPE]
    data = write_csv(tmp_path / "toy.csv", toy_rows())
    model = pretrained_bert(tmp_path / "bert", dropout=0.0)
    args = (
        *SMALL,
        f"--data={data}",
        f"--model={model}",
        "--max_duration=4ba",
        "--eval_interval=2ba",
    )
    eager = run_train(project, tmp_path, *args, "--run_name=eager")
    assert eager.returncode == 0, eager.stderr
    compiled = run_train(
        project, tmp_path, *args, "--run_name=compiled", "--compile=true", timeout=600
    )
    assert compiled.returncode == 0, compiled.stderr
    assert (
        "compile = true" in (tmp_path / "runs" / "compiled" / "config.toml").read_text()
    )
    reference = read_metrics(tmp_path, "eager")
    ours = read_metrics(tmp_path, "compiled")
    for key in ("loss", "val_loss", "accuracy"):
        assert_same_series(
            [r.get(key) for r in ours], [r.get(key) for r in reference], 1e-4, key
        )
    a = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "runs" / "compiled" / "hf"
    )
    b = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "runs" / "eager" / "hf"
    )
    assert list(a.state_dict()) == list(b.state_dict())


@pytest.mark.slow
def test_the_offline_demo_learns_from_the_defaults(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """`python train.py` with no flag: tiny BERT, the embedded stdlib lines, the recipe's 3 epochs,
    lr=auto (demo_lr for tiny): validation accuracy rises well above chance (50%, balanced labels).
    One thread per process: the shared test machine is oversubscribed (the run is the same).
    """
    result = subprocess.run(
        [sys.executable, str(generated[RECIPE] / "train.py"), "--device=cpu"],
        cwd=tmp_path,
        env={**checkout_env(), "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "prose or code" in result.stdout
    evals = [r for r in read_metrics(tmp_path, RECIPE) if "accuracy" in r]
    accuracy, val_loss = [r["accuracy"] for r in evals], [r["val_loss"] for r in evals]
    assert (
        len(evals) == 3 and accuracy[0] > 0.65 and accuracy[-1] > 0.8
    ), accuracy  # measured: .88, .88, .92
    assert val_loss[-1] < val_loss[0], val_loss
    assert (
        "lr = 0.001" in (tmp_path / "runs" / RECIPE / "config.toml").read_text()
    )  # demo_lr, resolved
