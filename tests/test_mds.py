"""MDS shards (mosaicml-streaming's `MDSWriter`, the format of Composer's data) as `--data`
of an image-classification and a causal-LM project: read through the real
`streaming.StreamingDataset`, in our order (runtime/shards.py), so a run killed with -9
resumes bitwise and a run killed on 2 ranks resumes on one (elastic). A bad shard folder is
one error line, exit 2.

The image shards hold the digits as mosaicml-streaming's vision datasets hold CIFAR-10:
columns `x` (a PIL image, png) and `y` (the class index). The LM shards hold the default
data's tokens as llm-foundry's convert_dataset_hf --concat_tokens writes them: rows of 64
tokens in a `tokens` column (ndarray:int32). Both zstd-compressed, many small shards.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from projects import (
    STOP_AFTER,
    checkout_env,
    convert_data,
    error_lines,
    one_error_line,
    run_killed,
    project_modules,
    read_metrics,
    real_library,
    run_train,
    running,
)
from test_image import assert_close, ok, small, torchrun, trajectory
from test_storage import s3, s3_env  # noqa: F401 (fixtures: the S3 server, its env)

streaming = real_library("streaming")

RECIPE = "cifar-resnet56-baseline"
LM_RECIPE = "gpt2-baseline"
BUSY_WORKERS = Path(__file__).resolve().parent / "busy_workers.py"
ROW = 64  # tokens per LM row (llm-foundry's max_seq_len)
LM = [
    "--model=tiny",
    "--seq_len=15",  # windows of 16: 4 a row
    "--global_batch_size=4",
    "--device_microbatch_size=2",
    "--eval_batches=1",
    "--dist_timeout=120",
    "--max_duration=4ba",
    "--eval_interval=2ba",
    "--save_interval=2ba",
]
# 4 steps of 12 digits at their own size, checkpoints at 2 and 4.
FOUR = [
    "--image_size=8",
    "--eval_resize=8",
    "--max_duration=4ba",
    "--eval_interval=2ba",
    "--save_interval=2ba",
]


@pytest.fixture(scope="module")
def project(generated: dict[str, Path]) -> Path:
    return generated[RECIPE]


@pytest.fixture(scope="module")
def digit_shards(project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The digits' train and val splits written by MDSWriter (x: png, y: int)."""
    root = tmp_path_factory.mktemp("mds")
    with project_modules(project) as found:
        images = found["data"].load_images("")
    for split in ("train", "val"):
        part = getattr(images, split)
        with streaming.MDSWriter(
            out=str(root / split),
            columns={"x": "png", "y": "int"},
            compression="zstd",
            size_limit=8000,  # ~60 samples a shard: an epoch spans many shards
        ) as writer:
            for pixels, label in zip(part.pixels, part.labels, strict=True):
                writer.write({"x": Image.fromarray(pixels[:, :, 0]), "y": int(label)})
    return root


def text_shards(root: Path) -> Path:
    """MDS shards of one `text` string per split: neither images nor tokens."""
    for split in ("train", "val"):
        with streaming.MDSWriter(out=str(root / split), columns={"text": "str"}) as out:
            out.write({"text": "no image, no tokens"})
    return root


@pytest.fixture
def shard_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Compressed shards expand into this run's own cache."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SCAFFOLD_SHARD_CACHE", str(cache))
    return cache


def test_mds_samples_are_the_written_images_in_our_order(
    project: Path, digit_shards: Path, shard_cache: Path
) -> None:
    """Sample i is the i-th image written (RGB, as ImageFolder images) with its label;
    an epoch visits every sample once, shard by shard, in an order seeded by (seed,
    epoch): the same order for the same seed, another for the next epoch."""
    with project_modules(project) as found:
        data = found["data"]
        digits = data.load_images("")
        mds = data.load_images(str(digit_shards))
        assert mds.classes == [str(c) for c in range(10)] and mds.kind == "folder"
        assert len(mds.train) == len(digits.train) and len(mds.val) == len(digits.val)
        assert len(mds.train.shards.chunk_sizes) > 10
        for i in (0, 77, len(mds.train) - 1):
            image, label = mds.train.sample(i)
            assert label == digits.train.labels[i]
            rgb = np.repeat(digits.train.pixels[i], 3, axis=-1)
            assert np.array_equal(np.asarray(image), rgb)
        order = data.Batches(mds, "train", 12, seed=42, image_size=8).order
        assert sorted(order) == list(range(len(mds.train)))
        again = data.Batches(mds, "train", 12, seed=42, image_size=8).order
        other = data.Batches(mds, "train", 12, seed=42, image_size=8, epoch=1).order
        assert np.array_equal(order, again) and not np.array_equal(order, other)


def test_convert_writes_mds_shards_of_the_same_images(
    project: Path, shard_cache: Path, tmp_path: Path
) -> None:
    """`python data.py convert OUT --format mds`: MDSWriter's shards (x: the PNG's bytes,
    y: the label) and meta.json; read back, the digits are the same arrays in the same
    order, augmented as digits (meta.json's kind), and a run trains on them."""
    shards = tmp_path / "shards"
    convert_data(project, shards, "--format=mds", "--chunk_bytes=16kB")
    index = json.loads((shards / "train" / "index.json").read_text())
    assert len(index["shards"]) > 4
    assert index["shards"][0]["column_names"] == ["x", "y"]
    with project_modules(project) as found:
        data = found["data"]
        digits, mds = data.load_images(""), data.load_images(str(shards))
        assert (mds.kind, mds.classes, mds.channels) == ("digits", digits.classes, 1)
        assert len(mds.train) == len(digits.train) and len(mds.val) == len(digits.val)
        for i in (0, 200, len(mds.val) - 1):
            pixels, label = mds.val.sample(i)
            assert np.array_equal(pixels, digits.val.pixels[i])
            assert label == digits.val.labels[i]
    run = [*small(), f"--data={shards}", "--max_duration=2ba", "--eval_interval=2ba"]
    result = ok(run_train(project, tmp_path, *run, "--run_name=converted"))
    assert f"data: streaming dataset {shards} (MDS shards)" in result.stdout
    assert [row[0] for row in trajectory(tmp_path, "converted")] == [1, 2]


def test_mds_run_resumes_bitwise_after_kill_9_and_elastically_from_2_ranks(
    project: Path, digit_shards: Path, shard_cache: Path, tmp_path: Path
) -> None:
    common = [*small(), f"--data={digit_shards}", *FOUR]
    killed_and_resumed(project, tmp_path, common)


def killed_and_resumed(project: Path, tmp_path: Path, common: list[str]) -> None:
    """4 steps from MDS shards, checkpoints at 2 and 4: killed (-9) inside save 4 and
    resumed, bitwise the uninterrupted run; on 2 ranks (each reading its share of every
    batch through StreamingDataset) killed inside save 4, resumed on one process from
    step 2, equal to it up to rounding (elastic)."""
    result = ok(run_train(project, tmp_path, *common, "--run_name=ref"))
    assert "MDS shards" in result.stdout
    reference = trajectory(tmp_path, "ref")
    assert [row[0] for row in reference] == [1, 2, 3, 4]
    killed = run_killed(project, tmp_path, 4, *common, "--run_name=cut")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = ok(run_train(project, tmp_path, *common, "--run_name=cut"))
    assert "resumed from" in resumed.stdout
    assert trajectory(tmp_path, "cut") == reference  # bitwise
    replicated = [*common, "--parallelism=ddp", "--run_name=two"]
    killed = torchrun(
        2, STOP_AFTER, "kill:4", project / "train.py", *replicated, cwd=tmp_path
    )
    assert killed.returncode != 0, killed.stdout[-2000:] + killed.stderr[-3000:]
    resumed = ok(run_train(project, tmp_path, *common, "--run_name=two"))
    assert "resumed from" in resumed.stdout
    assert_close(trajectory(tmp_path, "two"), reference)


def test_kill_9_with_busy_data_workers_then_an_immediate_restart_resumes(
    project: Path, digit_shards: Path, shard_cache: Path, tmp_path: Path
) -> None:
    """Killed (-9) after its step-2 save while its two DataLoader workers are busy with
    the next batches (tests/busy_workers.py): the workers die with it, rather than
    finish their ten minutes of work first, and the same command started at once
    resumes from step 2. (That a forked child keeps no lock on the run is
    tests/test_runlock.py's.)"""
    common = [*small(), f"--data={digit_shards}", *FOUR, "--num_workers=2"]
    pids = tmp_path / "workers.txt"
    train = [project / "train.py", "--device=cpu", *common, "--run_name=k"]
    with open(
        tmp_path / "killed.txt", "w"
    ) as output:  # not a pipe the workers keep open
        killed = subprocess.run(
            [sys.executable, BUSY_WORKERS, "2", pids, *train],
            cwd=tmp_path,
            env=checkout_env(),
            stdout=output,
            stderr=subprocess.STDOUT,
            timeout=300,
        )
    assert killed.returncode == -9, (tmp_path / "killed.txt").read_text()[-3000:]
    workers = set(map(int, pids.read_text().split()))
    assert len(workers) == 2
    try:
        resumed = ok(run_train(project, tmp_path, *common, "--run_name=k"))
        assert "resumed from runs/k/checkpoints/step-2 at step 2" in resumed.stdout
        assert not [pid for pid in workers if running(pid)]
    finally:
        for pid in workers:
            if running(pid):
                os.kill(pid, signal.SIGKILL)


def test_mds_image_shards_train_from_s3(
    project: Path, digit_shards: Path, shard_cache: Path, s3_env: dict, tmp_path: Path
) -> None:
    """The same shards uploaded to a bucket (moto): StreamingDataset fetches them with
    the store's usual credentials and endpoint (AWS_ENDPOINT_URL), and the run takes
    the same steps as from the folder, bitwise."""
    import s3fs

    env = s3_env["env"]
    bucket = s3fs.S3FileSystem(
        endpoint_url=env["AWS_ENDPOINT_URL"],
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
    )
    bucket.put(str(digit_shards), "ckpt/data/mds-digits", recursive=True)
    run = [*small(), *FOUR[:2], "--max_duration=2ba", "--eval_interval=2ba"]
    ok(run_train(project, tmp_path, *run, f"--data={digit_shards}", "--run_name=here"))
    url = "s3://ckpt/data/mds-digits"
    ok(run_train(project, tmp_path, *run, f"--data={url}", "--run_name=s3"))
    assert trajectory(tmp_path, "s3") == trajectory(tmp_path, "here")


def test_bad_mds_folders_are_one_line_exit_2(
    project: Path, digit_shards: Path, shard_cache: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "missing"
    shutil.copytree(digit_shards, missing)
    (missing / "val" / "shard.00001.mds.zstd").unlink()
    text = text_shards(tmp_path / "text")
    broken = tmp_path / "broken"
    shutil.copytree(digit_shards, broken)
    index = json.loads((broken / "train" / "index.json").read_text())
    del index["shards"][0]["samples"]
    (broken / "train" / "index.json").write_text(json.dumps(index))
    # Runs that stop in setup: one interpreter for the three (imports once).
    line = error_lines(
        project,
        tmp_path / "work",
        {
            name: [*small(), f"--data={data}", *FOUR]
            for name, data in (("missing", missing), ("text", text), ("broken", broken))
        },
    )
    assert line["missing"] == (
        f"error: --data={missing}: val/index.json names 1 shard file(s) that are not "
        "there (shard.00001.mds.zstd, ...); copy the whole folder again"
    )
    assert line["text"] == (
        f"error: --data={text}: train/ has columns text; image MDS shards need x (the "
        "image) and y (its class index)"
    )
    assert line["broken"].startswith(
        f"error: --data={broken}: train/index.json is not an MDS index (KeyError: "
    )


# ------------------------------------------------------------- causal LM: tokens rows


@pytest.fixture(scope="module")
def lm_project(generated: dict[str, Path]) -> Path:
    return generated[LM_RECIPE]


@pytest.fixture(scope="module")
def token_shards(
    lm_project: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, np.ndarray, int]:
    """The default data's first tokens as MDS rows of ROW tokens, written as llm-foundry's
    convert_dataset_hf --concat_tokens writes them (MDSWriter, columns {'tokens':
    'ndarray:int32'}, one row a sample; compression zstd); (folder, the train tokens
    written, the vocabulary size)."""
    root = tmp_path_factory.mktemp("mds-lm")
    with project_modules(lm_project) as found:
        tokens = found["data"].load_tokens("")
    for split, rows in (("train", 200), ("val", 8)):
        ids = getattr(tokens, split)[: rows * ROW].astype(np.int32)
        with streaming.MDSWriter(
            out=str(root / split),
            columns={"tokens": "ndarray:int32"},
            compression="zstd",
            size_limit=4000,  # ~15 rows a shard
        ) as writer:
            for row in ids.reshape(rows, ROW):
                writer.write({"tokens": row})
    return root, tokens.train[: 200 * ROW], tokens.vocab_size


def test_mds_token_rows_train_resume_bitwise_and_elastically(
    lm_project: Path, token_shards: tuple, shard_cache: Path, tmp_path: Path
) -> None:
    """A row of 64 tokens holds 64 // (seq_len + 1) windows, back to back: 1 at
    seq_len 32 (llm-foundry's reading), 4 at seq_len 15; item i is window i % 4 of row
    i // 4, and an epoch visits every window once. Runs at seq_len 15 killed (-9) on
    1 process resume bitwise, on 2 ranks resume on 1 as the uninterrupted run."""
    root, written, vocab_size = token_shards
    with project_modules(lm_project) as found:
        data = found["data"]
        tokens = data.load_tokens(str(root), vocab_size, seq_len=32)
        assert len(tokens.train) == 200 and len(tokens.val) == 8
        batch = data.windows(tokens.train, np.array([5, 0]), 32)
        assert batch.tolist() == [
            written[5 * ROW : 5 * ROW + 33].tolist(),
            written[:33].tolist(),
        ]
        tokens = data.load_tokens(str(root), vocab_size, seq_len=15)
        assert len(tokens.train) == 800 and len(tokens.val) == 32
        batch = data.windows(tokens.train, np.array([23, 0, 4]), 15)
        starts = [5 * ROW + 3 * 16, 0, ROW]
        assert batch.tolist() == [written[i : i + 16].tolist() for i in starts]
        order = data.Batches(tokens.train, 15, 4, seed=1).order(0)
        assert sorted(order) == list(range(800))
        with pytest.raises(ValueError, match="the split's rows differ in length"):
            data.window({"tokens": np.arange(40)}, 15, 2)
    common = [*LM, f"--data={root}", f"--vocab_size={vocab_size}"]
    killed_and_resumed(lm_project, tmp_path, common)


def test_bad_mds_token_shards_are_one_line_exit_2(
    lm_project: Path, token_shards: tuple, shard_cache: Path, tmp_path: Path
) -> None:
    root, _, vocab_size = token_shards

    windows_of_65 = [arg.replace("--seq_len=15", "--seq_len=64") for arg in LM]
    labels = tmp_path / "labels"
    for split in ("train", "val"):
        with streaming.MDSWriter(out=str(labels / split), columns={"y": "int"}) as out:
            out.write({"y": 1})
    text = text_shards(tmp_path / "text")
    # Runs that stop in setup: one interpreter for the four (imports once).
    line = error_lines(
        lm_project,
        tmp_path / "work",
        {
            "no_vocab": [*LM, f"--data={root}"],
            "short": [*windows_of_65, f"--data={root}", f"--vocab_size={vocab_size}"],
            "labels": [*LM, f"--data={labels}", "--vocab_size=256"],
            "text": [*LM, f"--data={text}", "--vocab_size=100"],
        },
    )
    assert "pass --vocab_size" in line["no_vocab"]
    assert line["short"] == (
        f"error: --data={root}: rows of 64 tokens are shorter than a window of "
        "seq_len + 1 = 65; use --seq_len=63 or less"
    )
    assert "with pre-tokenized rows in `tokens` (llm-foundry's" in line["labels"]
    assert "holds text, read as bytes; use 256 or more" in line["text"]


def test_convert_lm_to_mds_trains_at_any_seq_len_and_resumes_bitwise(
    lm_project: Path, shard_cache: Path, tmp_path: Path
) -> None:
    """`python data.py convert OUT --format mds` of a text file: MDS rows of
    PIECE_TOKENS tokens (`tokens`, uint16) and meta.json; read at seq_len 32 and 63,
    window i is the text's tokens from (i // k) * PIECE_TOKENS + (i % k) * (seq_len +
    1), k = PIECE_TOKENS // (seq_len + 1). A run on them killed (-9) inside its save
    of step 4 resumes bitwise. Converting shards again is one error line."""
    with project_modules(lm_project) as found:
        source = bytes(found["data"].load_tokens("").train[:150_000])
    text = tmp_path / "text.txt"
    text.write_bytes(source)
    root = tmp_path / "mds"
    convert_data(
        lm_project, root, f"--data={text}", "--format=mds", "--chunk_bytes=20kB"
    )
    index = json.loads((root / "train" / "index.json").read_text())
    assert len(index["shards"]) > 2
    assert index["shards"][0]["column_names"] == ["tokens"]
    assert index["shards"][0]["column_encodings"] == ["ndarray:uint16"]
    with project_modules(lm_project) as found:
        data = found["data"]
        plain = np.asarray(data.load_tokens(str(text)).train)
        row = data.PIECE_TOKENS
        for seq_len in (32, 63):
            tokens = data.load_tokens(str(root), seq_len=seq_len)
            per_row = row // (seq_len + 1)
            assert tokens.vocab_size == 256 and tokens.train.per_sample == per_row
            assert len(tokens.train) == len(plain) // row * per_row
            ids = np.array([0, per_row - 1, per_row + 2, len(tokens.train) - 1])
            starts = [i // per_row * row + i % per_row * (seq_len + 1) for i in ids]
            expected = [plain[i : i + seq_len + 1].tolist() for i in starts]
            assert data.windows(tokens.train, ids, seq_len).tolist() == expected
    common = [*LM, f"--data={root}"]
    result = ok(run_train(lm_project, tmp_path, *common, "--run_name=ref"))
    assert f"data: MDS shards {root} (tokens)" in result.stdout
    killed = run_killed(lm_project, tmp_path, 4, *common, "--run_name=cut")
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = ok(run_train(lm_project, tmp_path, *common, "--run_name=cut"))
    assert "resumed from" in resumed.stdout
    assert trajectory(tmp_path, "cut") == trajectory(tmp_path, "ref")  # bitwise
    again = subprocess.run(
        [sys.executable, "data.py", "convert", str(tmp_path / "x"), f"--data={root}"],
        cwd=lm_project,
        env=checkout_env(),
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and not (tmp_path / "x").exists()
    assert again.stderr.splitlines() == [
        f"error: --data={root} is already a streaming dataset of tokens; train on it "
        "as it is"
    ]


def test_mds_text_rows_are_the_texts_bytes(
    lm_project: Path, shard_cache: Path, tmp_path: Path
) -> None:
    """llm-foundry's text shards (a `text` column): each split is its rows' UTF-8 bytes
    joined by newlines, in the written order (byte tokens, vocabulary 256, as a text
    file); a run trains on them."""
    root = tmp_path / "text"
    with project_modules(lm_project) as found:
        source = bytes(found["data"].load_tokens("").train[:40_000])
    lines = source.decode(errors="replace").splitlines()
    texts = {"train": lines[:-40], "val": lines[-40:]}
    for split, rows in texts.items():
        with streaming.MDSWriter(
            out=str(root / split), columns={"text": "str"}, size_limit=3000
        ) as writer:
            for row in rows:
                writer.write({"text": row})
    assert len(json.loads((root / "train" / "index.json").read_text())["shards"]) > 2
    with project_modules(lm_project) as found:
        tokens = found["data"].load_tokens(str(root), seq_len=32)
    assert tokens.vocab_size == 256 and "(text, as bytes)" in tokens.source
    for split, rows in texts.items():
        expected = "\n".join(rows).encode()
        assert bytes(getattr(tokens, split)) == expected
    result = ok(run_train(lm_project, tmp_path, *LM, f"--data={root}"))
    assert "(text, as bytes)" in result.stdout


# ------------------------------------------------ text classification: MDS rows


def write_text_shards(root: Path, rows: list[dict], split: str) -> None:
    """Rows as MDSWriter writes a labelled text set: a str column and an int label
    (numbered as the CSV's string labels are: neg 0, pos 1)."""
    with streaming.MDSWriter(
        out=str(root / split),
        columns={"sentence": "str", "label": "int"},
        compression="zstd",
        size_limit=600,  # a few rows a shard
    ) as writer:
        for row in rows:
            writer.write({**row, "label": ["neg", "pos"].index(row["label"])})


def test_mds_text_rows_train_as_the_same_rows_in_csv_files(
    generated: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bert-sst2 with --data=MDS shards (train/, val/: sentence, label) trains exactly
    as with the same rows as --data/--val_data CSV files: the same losses and
    accuracies, step by step; so do the shards `python data.py convert OUT
    --data=train.csv --val_data=val.csv` writes (text, label ids), which read back as
    the same texts and label ids. A --val_data beside shards, and shards that are not
    MDS, are one error line each."""
    from test_text_classification import pretrained_bert, toy_rows, write_csv

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    project = generated["bert-sst2"]
    rows = toy_rows(85)
    train, val = rows[:80], rows[80:]
    mds = tmp_path / "mds"
    write_text_shards(mds, train, "train")
    write_text_shards(mds, val, "val")
    assert len(json.loads((mds / "train" / "index.json").read_text())["shards"]) > 2
    args = [
        f"--model={pretrained_bert(tmp_path / 'bert', dropout=0.0)}",
        "--max_seq_len=16",
        "--global_batch_size=8",
        "--device_microbatch_size=4",
        "--lr=3e-3",
        "--max_duration=4ba",
        "--eval_interval=2ba",
    ]
    files = [
        f"--data={write_csv(tmp_path / 'train.csv', train)}",
        f"--val_data={write_csv(tmp_path / 'val.csv', val)}",
    ]
    ok(run_train(project, tmp_path, *args, *files, "--run_name=csv"))
    shards_run = ok(
        run_train(project, tmp_path, *args, f"--data={mds}", "--run_name=mds")
    )
    assert f"{mds} (text: sentence, label: label)" in shards_run.stdout
    keys = ("step", "loss", "val_loss", "accuracy")
    ours, theirs = (read_metrics(tmp_path, run) for run in ("mds", "csv"))
    assert [[m.get(k) for k in keys] for m in ours] == [
        [m.get(k) for k in keys] for m in theirs
    ]
    assert sum("accuracy" in m for m in ours) == 2
    converted = tmp_path / "converted"
    convert_data(project, converted, *files, "--chunk_bytes=1kB")
    index = json.loads((converted / "train" / "index.json").read_text())
    assert len(index["shards"]) > 2
    assert index["shards"][0]["column_names"] == ["label", "text"]
    with project_modules(project) as found:
        load = found["data"].load_texts
        back = load(str(converted), "", "", "label", 0, 42)
        csv = load(
            files[0].split("=", 1)[1], files[1].split("=", 1)[1], "", "label", 0, 42
        )
    for split in ("train", "val"):
        got, want = getattr(back, split), getattr(csv, split)
        assert got.texts == want.texts and got.labels.tolist() == want.labels.tolist()
    args_mds = [*args, f"--data={converted}", "--run_name=converted"]
    ok(run_train(project, tmp_path, *args_mds))
    converted_run = read_metrics(tmp_path, "converted")
    assert [[m.get(k) for k in keys] for m in converted_run] == [
        [m.get(k) for k in keys] for m in theirs
    ]

    bad = tmp_path / "bad"
    bad.mkdir()
    both = run_train(project, bad, *args, f"--data={mds}", files[1])
    assert "holds its own val/ split; remove --val_data" in one_error_line(both, bad)
    litdata_like = tmp_path / "litdata"
    litdata_like.mkdir()
    (litdata_like / "meta.json").write_text("{}")
    wrong = run_train(project, bad, *args, f"--data={litdata_like}")
    assert "no MDS index in train/" in one_error_line(wrong, bad)


# ------------------------------------------------ diffusion: image-caption MDS rows


def write_caption_shards(root: Path, split: str, rows: list[dict], kind: str) -> None:
    """Rows of mosaicml/diffusion's columns: `image` (`kind`: bytes of an image file,
    or an image MDS stores as png/pil/jpeg) and `caption`; a few rows a shard."""
    columns = {"image": kind, "caption": "str"}
    with streaming.MDSWriter(
        out=str(root / split), columns=columns, compression="zstd", size_limit=2000
    ) as writer:
        for row in rows:
            writer.write(row)


def test_mds_image_captions_train_as_the_same_images_in_jsonl(
    generated: dict[str, Path],
    tmp_path: Path,
    shard_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sd-baseline with --data=MDS shards of the captioned digits (train/: `image` as
    png file bytes, val/: a pil image; `caption`) reads the same pixels and captions
    as the same images given as JSON Lines (--data, --val_data), and trains to the same
    losses and validation losses, step by step. Shards without those columns, an empty
    split and an image that does not decode are one error line each. `python data.py
    convert OUT` of the JSON Lines writes shards that read back as the same images."""
    from test_diffusion import SMALL, write_jsonl

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    project = generated["sd-baseline"]
    (tmp_path / "img").mkdir()
    mds, jsonl = tmp_path / "mds", {}
    with project_modules(project) as found:
        load = found["data"].load_captioned
        digits = load("", "", 16, 0)
        for split, count, kind in (("train", 40, "bytes"), ("val", 8, "pil")):
            source = getattr(digits, split)
            files, rows = [], []
            for i in range(count):
                image = Image.fromarray(source.images[i])
                image.save(tmp_path / "img" / f"{split}{i}.png")
                caption = source.captions[i]
                files.append({"file": f"img/{split}{i}.png", "caption": caption})
                content = (tmp_path / "img" / f"{split}{i}.png").read_bytes()
                rows.append({"image": content if kind == "bytes" else image})
                rows[-1]["caption"] = caption
            write_caption_shards(mds, split, rows, kind)
            jsonl[split] = write_jsonl(tmp_path / f"{split}.jsonl", files)
        assert len(json.loads((mds / "train" / "index.json").read_text())["shards"]) > 2
        ours = load(str(mds), "", 16, 0)
        theirs = load(str(jsonl["train"]), str(jsonl["val"]), 16, 0)
        for split in ("train", "val"):
            got, want = getattr(ours, split), getattr(theirs, split)
            assert got.captions == want.captions and len(got.captions) > 1
            np.testing.assert_array_equal(got.images, want.images)
        empty = tmp_path / "empty"
        write_caption_shards(empty, "train", rows, "pil")
        write_caption_shards(empty, "val", [], "pil")
        with pytest.raises(ValueError, match="val/ holds no samples; write some"):
            load(str(empty), "", 16, 0)
        broken = tmp_path / "broken"
        write_caption_shards(
            broken, "train", [{"image": b"no", "caption": "x"}], "bytes"
        )
        write_caption_shards(broken, "val", rows, "pil")
        with pytest.raises(ValueError, match="train/ sample 0: the image does not"):
            load(str(broken), "", 16, 0)

    args = [*SMALL, "--max_duration=2ba", "--eval_interval=2ba"]
    files = [f"--data={jsonl['train']}", f"--val_data={jsonl['val']}"]
    converted = tmp_path / "converted"
    with project_modules(project) as found:  # data.py's CLI: the text test's
        data = found["data"]
        data.convert(str(jsonl["train"]), str(converted), "1kB", str(jsonl["val"]), 16)
        back = data.load_captioned(str(converted), "", 16, 0)
    index = json.loads((converted / "train" / "index.json").read_text())
    assert len(index["shards"]) > 2
    assert index["shards"][0]["column_names"] == ["caption", "image"]
    for split in ("train", "val"):
        got, want = getattr(back, split), getattr(theirs, split)
        assert got.captions == want.captions
        np.testing.assert_array_equal(got.images, want.images)
    ok(run_train(project, tmp_path, *args, *files, "--run_name=jsonl"))
    ok(run_train(project, tmp_path, *args, f"--data={mds}", "--run_name=mds"))
    keys = ("step", "loss", "val_loss")
    ours, theirs = (read_metrics(tmp_path, run) for run in ("mds", "jsonl"))
    assert [[m.get(k) for k in keys] for m in ours] == [
        [m.get(k) for k in keys] for m in theirs
    ]
    assert [m["step"] for m in ours if "val_loss" in m] == [2]

    bad = tmp_path / "bad"
    bad.mkdir()
    text = text_shards(tmp_path / "text")
    assert one_error_line(run_train(project, bad, *args, f"--data={text}"), bad) == (
        f"error: --data={text}: train/ has columns text; image-caption MDS shards "
        "need image and caption (mosaicml/diffusion's); write them with those columns"
    )
