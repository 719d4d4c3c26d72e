"""The text_classification task with the hf model pack: a tiny random BERT saved with
`save_pretrained` and a WordPiece tokenizer trained here with `tokenizers` load through the real
`from_pretrained` path; fine-tuning raises accuracy; the result loads back with transformers;
data formats, the token cache, dynamic padding, FSDP units and bad input.
Nothing is downloaded (HF_HUB_OFFLINE=1 in every subprocess)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

import torch  # noqa: E402

from projects import project_modules, read_metrics, run_train  # noqa: E402

RECIPE = "bert-sst2"
SMALL = ["--max_seq_len=16", "--global_batch_size=8", "--device_microbatch_size=4", "--lr=3e-3"]
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
        rows.append({"sentence": f"{WORDS[i % 8]} {mood} {WORDS[(i * 5) % 8]} {mood}", "label": ["neg", "pos"][label]})
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


def pretrained_bert(folder: Path, vocab_size: int | None = None, dropout: float = 0.1) -> Path:
    """A tiny random BERT and a WordPiece tokenizer trained on the toy texts, saved like a hub model."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tokenizer.train_from_iterator([row["sentence"] for row in toy_rows()], trainer)
    fast = transformers.BertTokenizerFast(tokenizer_object=tokenizer)
    fast.save_pretrained(folder)
    config = transformers.BertConfig(
        vocab_size=vocab_size or len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64,
        hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout,
    )
    torch.manual_seed(0)
    transformers.BertForMaskedLM(config).save_pretrained(folder)  # a pretraining checkpoint: no classifier head
    return folder


def test_fine_tunes_a_saved_model_and_the_result_loads_with_transformers(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    model_dir = pretrained_bert(tmp_path / "bert")
    data = write_jsonl(tmp_path / "reviews.jsonl", toy_rows())
    result = run_train(generated[RECIPE], tmp_path, *SMALL, f"--model={model_dir}", f"--data={data}",
                       "--run_name=ft", "--max_duration=24ba", "--eval_interval=12ba")
    assert result.returncode == 0, result.stderr
    assert "labels: neg, pos" in result.stdout and "3 FSDP units" in result.stdout
    evals = [r for r in read_metrics(tmp_path, "ft") if "accuracy" in r]
    assert len(evals) == 2 and evals[-1]["accuracy"] > 0.75 and evals[-1]["f1"] > 0.75, evals

    # The saved folder is a transformers model + tokenizer that predicts what it learned.
    saved = tmp_path / "runs" / "ft" / "hf"
    model = transformers.AutoModelForSequenceClassification.from_pretrained(saved).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(saved)
    assert model.config.id2label == {0: "neg", 1: "pos"}
    rows = toy_rows(40)
    encoded = tokenizer([r["sentence"] for r in rows], padding=True, truncation=True, max_length=16, return_tensors="pt")
    with torch.no_grad():
        predicted = model(**encoded).logits.argmax(-1).tolist()
    accuracy = np.mean([model.config.id2label[p] == r["label"] for p, r in zip(predicted, rows)])
    assert accuracy > 0.75, accuracy
    # The token cache was written beside the data, keyed by tokenizer and max length.
    assert len(list((tmp_path / ".scaffold-cache").glob("tokens-*.npz"))) == 2


def test_bad_input_is_one_line_and_writes_nothing(generated: dict[str, Path], tmp_path: Path) -> None:
    model_dir = pretrained_bert(tmp_path / "bert")
    small_vocab = pretrained_bert(tmp_path / "small-vocab", vocab_size=50)
    rows = toy_rows(40)
    no_label = write_csv(tmp_path / "no_label.csv", [{"sentence": r["sentence"], "y": 1} for r in rows])
    out_of_range = write_csv(tmp_path / "range.csv", [{"sentence": r["sentence"], "label": i % 3} for i, r in enumerate(rows)])
    empty = write_csv(tmp_path / "empty.csv", [{"sentence": "" if i == 7 else r["sentence"], "label": 0} for i, r in enumerate(rows)])
    good = write_csv(tmp_path / "good.csv", rows)
    cases = {
        "no_label": ([f"--data={no_label}"], "has no column 'label' (it has: sentence, y); set --label_column"),
        "range": ([f"--data={out_of_range}", "--num_labels=2"], "label 2 in column 'label' is outside 0..1"),
        "empty": ([f"--data={empty}"], "row 8: empty 'sentence'"),
        "hub": ([f"--data={good}", "--model=no-such-org/no-such-model"], "--model=no-such-org/no-such-model: cannot load"),
        "mismatch": ([f"--data={good}", f"--model={small_vocab}"], "the tokenizer and the model do not belong together"),
    }
    for name, (args, expected) in cases.items():
        workdir = tmp_path / name
        workdir.mkdir()
        result = run_train(generated[RECIPE], workdir, *SMALL, f"--run_name={name}", *args)
        assert result.returncode == 2, (name, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], (name, lines)
        assert not (workdir / "runs").exists(), name
    assert not (tmp_path / ".scaffold-cache").exists()  # nothing half-written beside the data
    assert model_dir.is_dir()


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
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:90]),
                          "validation": datasets.Dataset.from_list(rows[90:])}).save_to_disk(str(folder))
    with project_modules(generated[RECIPE]) as modules:
        data, model = modules["data"], modules["model"]
        loaded = [data.load_texts(str(p), "", "", "label", 0, 42) for p in (csv_path, jsonl_path, parquet_path)]
        for other in loaded[1:]:  # the same rows and the same seeded validation share
            assert other.train.texts == loaded[0].train.texts and (other.val.labels == loaded[0].val.labels).all()
        assert loaded[0].label_names == ["neg", "pos"] and len(loaded[0].val.texts) == 10
        saved = data.load_texts(str(folder), "", "", "label", 0, 42)
        assert saved.train.texts == [r["sentence"] for r in rows[:90]] and len(saved.val.texts) == 10

        # Tokenised once: the second call reads the cache; another max length is another key.
        tokenizer = model.load_tokenizer("tiny", loaded[0].train.texts)
        first = data.tokenize(loaded[0].train, tokenizer, 16, tmp_path / "cache", ["k"])
        monkeypatch.setattr(type(tokenizer), "__call__", lambda *a, **k: pytest.fail("tokenised again"))
        again = data.tokenize(loaded[0].train, tokenizer, 16, tmp_path / "cache", ["k"])
        assert (again.ids == first.ids).all() and len(list((tmp_path / "cache").iterdir())) == 1
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
        bert = transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=50, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32))
        assert [type(b).__name__ for b in blocks_of(bert)] == ["BertEmbeddings"] + ["BertLayer"] * 3
        gpt2 = transformers.GPT2ForSequenceClassification(transformers.GPT2Config(
            vocab_size=50, n_embd=16, n_layer=2, n_head=2, n_positions=32))
        assert [type(b).__name__ for b in blocks_of(gpt2)] == ["GPT2Block"] * 2


def test_early_stopping_counts_patience_in_time_units(generated: dict[str, Path]) -> None:
    with project_modules(generated[RECIPE]) as modules:
        from runtime.time import Progress, Time

        stopper = modules["train"].EarlyStopping("accuracy", Time.parse("3ba"), Time.parse("100ba"))
        progress = Progress(batches_per_epoch=10)
        stops = []
        for accuracy in [0.5, 0.6, 0.6, 0.55, 0.6, 0.7, 0.7]:
            progress.advance(samples=8, tokens=80)
            stops.append(stopper.should_stop({"accuracy": accuracy, "val_loss": 1.0}, progress))
        assert stops == [False, False, False, False, True, False, False]
        restored = modules["train"].EarlyStopping("accuracy", Time.parse("3ba"), Time.parse("100ba"))
        restored.load_state_dict(stopper.state_dict())  # what a checkpoint holds
        progress.advance(samples=8, tokens=80)
        assert restored.should_stop({"accuracy": 0.1, "val_loss": 1.0}, progress) is False
        progress.advance(samples=8, tokens=80)
        assert restored.should_stop({"accuracy": 0.1, "val_loss": 1.0}, progress) is True
