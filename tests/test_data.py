"""The generated data.py: every --data source, the held-out split, and the resumable order."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from projects import project_modules, read_metrics, run_train


@pytest.fixture(scope="module")
def data(generated: dict[str, Path]):
    with project_modules(generated["gpt2-baseline"]) as modules:
        yield modules["data"]


def test_default_data_is_the_stdlib_source(data) -> None:
    tokens = data.load_tokens("")
    assert tokens.vocab_size == 256 and "standard library" in tokens.source
    assert len(tokens.train) > 1_000_000  # megabytes of real Python
    text = bytes(tokens.train[:200_000]).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    assert len(tokens.val) == pytest.approx(
        0.02 * (len(tokens.train) + len(tokens.val)), rel=0.01
    )
    again = data.load_tokens("")
    assert np.array_equal(
        tokens.train[:10_000], again.train[:10_000]
    )  # deterministic order


def test_text_file_and_folder(data, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello world\n" * 1000)
    single = data.load_tokens(str(corpus))
    assert bytes(single.train[:12]) == b"hello world\n"
    assert len(single.train) + len(single.val) == 12_000
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("a" * 500)
    (folder / "sub" / "b.md").write_text("b" * 500)
    (folder / ".hidden").write_text("h" * 500)
    both = data.load_tokens(str(folder))
    joined = bytes(both.train) + bytes(both.val)
    assert (
        joined.count(b"a") == 500 and joined.count(b"b") == 500 and b"h" not in joined
    )


def test_uint16_bin_with_and_without_val_bin(data, tmp_path: Path) -> None:
    ids = (np.arange(10_000) * 7919 % 50_000).astype(np.uint16)
    ids.tofile(tmp_path / "train.bin")
    tail = data.load_tokens(str(tmp_path / "train.bin"))
    assert tail.vocab_size == 50304
    assert np.array_equal(np.concatenate([tail.train, tail.val]), ids)
    np.arange(300, dtype=np.uint16).tofile(tmp_path / "val.bin")
    split = data.load_tokens(str(tmp_path / "train.bin"))
    assert np.array_equal(split.train, ids) and np.array_equal(
        split.val, np.arange(300)
    )
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="odd number of bytes"):
        data.load_tokens(str(tmp_path / "odd.bin"))


def test_missing_path_is_a_clear_error(data) -> None:
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        data.load_tokens("/no/such/corpus")


def test_batch_order_is_seeded_resumable_and_rank_independent(data) -> None:
    tokens = np.arange(10_001, dtype=np.uint16)
    batches = data.Batches(tokens, seq_len=10, batch_size=8, seed=3)
    assert batches.num_samples == 1000 and batches.batches_per_epoch == 125
    first = batches.get(epoch=0, index=5)
    # Any batch is a pure function of (seed, epoch, index): a fresh object gives the same one.
    assert torch.equal(first, data.Batches(tokens, 10, 8, seed=3).get(0, 5))
    assert not torch.equal(first, data.Batches(tokens, 10, 8, seed=4).get(0, 5))
    assert not torch.equal(batches.get(1, 5), first)  # a new permutation each epoch
    # Windows are contiguous runs of seq_len + 1 tokens, targets shifted by one.
    assert first.shape == (8, 11) and torch.all(first[:, 1:] - first[:, :-1] == 1)
    # Ranks split the global batch into contiguous shares that add up to it.
    shares = [batches.get(0, 5, rank, 4) for rank in range(4)]
    assert torch.equal(torch.cat(shares), first)
    # An epoch visits every window exactly once.
    starts = torch.cat([batches.get(2, i)[:, 0] for i in range(125)])
    assert sorted(starts.tolist()) == list(range(0, 10_000, 10))


def test_too_little_data_is_a_clear_error(data) -> None:
    with pytest.raises(ValueError, match="fewer than one global batch"):
        data.Batches(np.arange(50, dtype=np.uint16), seq_len=10, batch_size=8, seed=0)


def test_training_on_a_user_text_file(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 2000)
    result = run_train(
        generated["gpt2-speedup"],
        tmp_path,
        f"--data={corpus}",
        "--seq_len=32",
        "--global_batch_size=8",
        "--max_duration=20ba",
        "--eval_interval=10ba",
        "--eval_batches=2",
        "--run_name=fox",
        "--lr=0.01",
    )
    assert result.returncode == 0, result.stderr
    records = read_metrics(tmp_path, "fox")
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert val[-1] < val[0] < 6.0  # a repetitive text is learned fast


def nanogpt_char_data(folder: Path, text: str) -> dict:
    """nanoGPT's shakespeare_char layout: train.bin, val.bin (uint16) and meta.pkl."""
    chars = sorted(set(text))
    meta = {
        "vocab_size": len(chars),
        "itos": dict(enumerate(chars)),
        "stoi": {c: i for i, c in enumerate(chars)},
    }
    ids = np.array([meta["stoi"][c] for c in text], dtype=np.uint16)
    split = int(0.9 * len(ids))
    ids[:split].tofile(folder / "train.bin")
    ids[split:].tofile(folder / "val.bin")
    (folder / "meta.pkl").write_bytes(pickle.dumps(meta))
    return meta


class Payload:
    """A pickle that runs code when loaded by pickle.load (creates a file)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def test_meta_pkl_gives_the_vocabulary(data, tmp_path: Path) -> None:
    meta = nanogpt_char_data(
        tmp_path, "to be or not to be, that is the question. " * 50
    )
    tokens = data.load_tokens(str(tmp_path / "train.bin"))
    assert tokens.vocab_size == meta["vocab_size"] == 15 and "meta.pkl" in tokens.source
    # --vocab_size overrides it (and meta.pkl is not read); too small for the ids: refused.
    assert data.load_tokens(str(tmp_path / "train.bin"), vocab_size=64).vocab_size == 64
    with pytest.raises(ValueError, match="holds token id 14; use --vocab_size=15"):
        data.load_tokens(str(tmp_path / "train.bin"), vocab_size=10)
    # A meta.pkl too small for the ids, or without vocab_size: named, with the fix.
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 5}))
    with pytest.raises(
        ValueError, match="says vocab_size=5 but the data holds token id 14"
    ):
        data.load_tokens(str(tmp_path / "train.bin"))
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps({"itos": {0: "a"}}))
    with pytest.raises(ValueError, match="no positive integer vocab_size"):
        data.load_tokens(str(tmp_path / "train.bin"))
    # Without meta.pkl: GPT-2's vocabulary, padded to a multiple of 64.
    (tmp_path / "meta.pkl").unlink()
    assert data.load_tokens(str(tmp_path / "train.bin")).vocab_size == 50304
    np.array([0, 60_000] * 50, dtype=np.uint16).tofile(tmp_path / "train.bin")
    assert (
        data.load_tokens(str(tmp_path / "train.bin")).vocab_size == 60_032
    )  # 938 * 64


def test_a_meta_pkl_that_would_run_code_is_refused(data, tmp_path: Path) -> None:
    nanogpt_char_data(tmp_path, "abcdefgh" * 100)
    marker = tmp_path / "pwned"
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ValueError, match=r"meta.pkl: refused \(it names posix.mkdir\)"):
        data.load_tokens(str(tmp_path / "train.bin"))
    assert not marker.exists()
    (tmp_path / "meta.pkl").write_bytes(b"\x80\x04garbage")  # truncated: refused too
    with pytest.raises(ValueError, match="meta.pkl: refused"):
        data.load_tokens(str(tmp_path / "train.bin"))


def test_training_honours_meta_pkl_and_refuses_a_bad_one(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    data_dir = tmp_path / "chars"
    data_dir.mkdir()
    nanogpt_char_data(data_dir, "the quick brown fox jumps over the lazy dog. " * 400)
    args = (
        f"--data={data_dir / 'train.bin'}",
        "--seq_len=32",
        "--global_batch_size=4",
        "--max_duration=2ba",
        "--eval_batches=1",
    )
    result = run_train(generated["gpt2-baseline"], tmp_path, *args, "--run_name=chars")
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "runs" / "chars" / "log.txt").read_text()
    assert "vocabulary from" in log
    # tiny preset with 29 tokens: the embeddings are 29 x 128, not 50304 x 128.
    params = int(log.split("model: tiny, ")[1].split(" parameters")[0].replace(",", ""))
    assert params < 900_000
    marker = tmp_path / "pwned"
    (data_dir / "meta.pkl").write_bytes(pickle.dumps(Payload(marker)))
    result = run_train(generated["gpt2-baseline"], tmp_path, *args, "--run_name=evil")
    assert result.returncode == 2
    assert (
        result.stderr.strip().count("\n") == 0
        and "refused (it names posix.mkdir)" in result.stderr
    )
    assert not marker.exists() and not (tmp_path / "runs" / "evil").exists()
