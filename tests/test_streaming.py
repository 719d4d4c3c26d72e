"""Streaming data: litdata shards in a local folder or an S3 bucket, for causal_lm and
image_classification.

- The epoch order over shards (runtime/shards.py) is a seeded permutation that reads chunk
  by chunk and does not depend on the world size; a rank's share of a batch is a slice.
- `python data.py convert` writes shards; a causal LM trains from them in a bucket on a real
  S3 server process (moto) on 127.0.0.1, is killed (-9) inside a save, and resumes on 2 ranks
  from a fresh shard cache: the losses equal an uninterrupted 1-process run's (up to the
  order of reductions); an image project trains from a local shard folder, is killed, resumes
  bitwise.
- A bad shard folder (a chunk missing) and an empty bucket prefix: one `error:` line, exit 2.

litdata comes with README's test command (CI runs on torch 2.14.1 and torchvision 0.29.1),
without obstore, which refuses the plain-http endpoint of the tests' S3 server. Without
litdata these tests are skipped, except in CI, where they fail (`real_library`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from projects import convert_data as convert
from projects import project_modules, read_metrics, real_library
from runtime import shards
from test_storage import (
    s3,
    ok,
    error_lines,
    launch,
)  # noqa: F401 (s3: the server fixture)

real_library("litdata")

TESTS = Path(__file__).resolve().parent
STOP_AFTER = TESTS / "stop_after.py"
LM = [
    "--device=cpu",
    "--seq_len=32",
    "--global_batch_size=12",
    "--device_microbatch_size=3",
    "--eval_batches=1",
    "--dist_timeout=120",
]
IMAGE = [
    "--device=cpu",
    "--model=tiny",
    "--precision=fp32",
    "--global_batch_size=12",
    "--device_microbatch_size=2",
    "--bn_group_size=2",
    "--lr=0.2",
    "--lr_warmup=0.25dur",
    "--eval_batches=2",
    "--num_workers=1",
]


def losses(workdir: Path, run_name: str) -> dict[int, float]:
    return {
        r["step"]: r["loss"] for r in read_metrics(workdir, run_name) if "loss" in r
    }


@pytest.fixture(scope="module")
def lm_shards(
    generated: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A 150 kB text file as shards of small chunks (several per split)."""
    folder = tmp_path_factory.mktemp("lm")
    corpus = folder / "corpus.txt"
    source = Path(json.__file__).parent.parent
    corpus.write_text(
        ((source / "argparse.py").read_text() + (source / "typing.py").read_text())[
            :150_000
        ]
    )
    convert(
        generated["gpt2-baseline"],
        folder / "shards",
        f"--data={corpus}",
        "--chunk_bytes=64kB",
    )
    return folder / "shards"


def test_order_is_a_seeded_chunkwise_permutation() -> None:
    sizes = [5, 3, 7, 4, 6, 2, 5]
    order = shards.chunk_order(sizes, seed=1, epoch=0, group=2)
    assert sorted(order.tolist()) == list(range(sum(sizes)))
    assert np.array_equal(order, shards.chunk_order(sizes, seed=1, epoch=0, group=2))
    assert not np.array_equal(
        order, shards.chunk_order(sizes, seed=1, epoch=1, group=2)
    )
    assert not np.array_equal(
        order, shards.chunk_order(sizes, seed=2, epoch=0, group=2)
    )
    # Locality: the samples of each group of 2 chunks are consecutive in the order.
    chunk_of = np.repeat(np.arange(len(sizes)), sizes)[order]
    first = 0
    while first < len(order):
        group = set(chunk_of[first : first + 1])
        end = first
        while end < len(order) and len(group | {chunk_of[end]}) <= 2:
            group.add(chunk_of[end])
            end += 1
        assert (
            sum(sizes[c] for c in group) == end - first
        )  # whole chunks, then the next group
        first = end


def test_lm_batches_from_shards_are_world_size_free(
    generated: dict[str, Path], lm_shards: Path
) -> None:
    with project_modules(generated["gpt2-baseline"]) as modules:
        data = modules["data"]
        tokens = data.load_tokens(str(lm_shards), seq_len=32)
        text = Path(
            json.loads((lm_shards / "meta.json").read_text())["source"].split(" ", 2)[2]
        ).read_bytes()
        assert tokens.vocab_size == 256 and len(tokens.train.chunk_sizes) >= 3
        assert len(tokens.train) == sum(
            c["dim"] // 33
            for c in json.loads((lm_shards / "train" / "index.json").read_text())[
                "chunks"
            ]
        )
        batches = data.Batches(tokens.train, 32, 12, seed=3)
        whole = batches.get(1, 4)
        assert whole.shape == (12, 33) and whole.dtype == torch.int64
        for row in whole:  # every window is 33 consecutive bytes of the text
            assert bytes(row.tolist()) in text
        for world in (2, 3):
            shares = [batches.get(1, 4, rank, world) for rank in range(world)]
            assert torch.equal(torch.cat(shares), whole)
        assert not torch.equal(batches.get(2, 4), whole)


def test_lm_trains_from_s3_shards_killed_then_resumed_on_two_ranks(
    generated: dict[str, Path], lm_shards: Path, s3: dict, tmp_path: Path
) -> None:  # noqa: F811
    """Upload the converted folder; the run reads only the bucket (its own shard cache)."""
    import s3fs

    env = {**s3["env"], "SCAFFOLD_STAGING": str(tmp_path / "staging")}
    fs = s3fs.S3FileSystem(
        endpoint_url=env["AWS_ENDPOINT_URL"],
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
    )
    fs.put(str(lm_shards), "ckpt/data/lm", recursive=True)
    train_py = generated["gpt2-baseline"] / "train.py"
    common = [
        *LM,
        "--data=s3://ckpt/data/lm",
        "--max_duration=5ba",
        "--save_interval=1ba",
        "--eval_interval=5ba",
    ]
    reference = ok(
        launch(
            1,
            train_py,
            *common,
            "--run_name=ref",
            cwd=tmp_path,
            env={**env, "SCAFFOLD_SHARD_CACHE": str(tmp_path / "cache-ref")},
        )
    )
    assert (
        "data: streaming dataset s3://ckpt/data/lm (litdata shards)" in reference.stdout
    )
    assert list(
        (tmp_path / "cache-ref").rglob("chunk-*.bin")
    )  # the chunks came from the bucket

    killed = launch(
        1,
        STOP_AFTER,
        "kill:3",
        train_py,
        *common,
        "--run_name=run",
        cwd=tmp_path,
        env={**env, "SCAFFOLD_SHARD_CACHE": str(tmp_path / "cache-1")},
    )
    assert killed.returncode != 0
    before = losses(tmp_path, "run")
    assert {1, 2} <= set(before) and all(
        before[s] == losses(tmp_path, "ref")[s] for s in before
    )
    resumed = ok(
        launch(
            2,
            train_py,
            *common,
            "--run_name=run",
            cwd=tmp_path,
            env={**env, "SCAFFOLD_SHARD_CACHE": str(tmp_path / "cache-2")},
        )
    )
    assert "at step 2 (saved on 1 rank(s), now 2)" in resumed.stdout
    ours, ref = losses(tmp_path, "run"), losses(tmp_path, "ref")
    assert sorted(ours) == [1, 2, 3, 4, 5]
    # Steps 3-5 ran on 2 ranks: the same batches, sums in another order.
    assert all(abs(ours[s] - ref[s]) < 1e-4 for s in ours), (ours, ref)
    assert ref[5] < ref[1]


def test_image_trains_from_local_shards_and_resumes_bitwise(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    project = generated["cifar-resnet56-baseline"]
    convert(
        project, tmp_path / "digits", "--chunk_bytes=16kB"
    )  # the default data: the digits
    meta = json.loads((tmp_path / "digits" / "meta.json").read_text())
    assert meta["kind"] == "digits" and meta["classes"] == [str(d) for d in range(10)]
    with project_modules(project) as modules:
        data = modules["data"]
        arrays, streamed = data.load_images(""), data.load_images(
            str(tmp_path / "digits")
        )
        assert len(streamed.train.shards.chunk_sizes) > 4
        assert (len(streamed.train), len(streamed.val)) == (
            len(arrays.train),
            len(arrays.val),
        )
        for i in (0, 700, 1436):  # PNG round trip: the same pixels and labels, in order
            pixels, label = streamed.train.sample(i)
            assert (
                np.array_equal(pixels, arrays.train.pixels[i])
                and label == arrays.train.labels[i]
            )
        whole = data.Batches(streamed, "train", 12, seed=3, image_size=8, epoch=1)
        shares = [
            data.Batches(
                streamed,
                "train",
                12,
                seed=3,
                image_size=8,
                epoch=1,
                rank=r,
                world_size=2,
            )[7]
            for r in (1, 0)
        ]
        assert torch.equal(torch.cat([shares[1][0], shares[0][0]]), whole[7][0])

    common = [
        *IMAGE,
        f"--data={tmp_path / 'digits'}",
        "--max_duration=4ba",
        "--save_interval=1ba",
        "--eval_interval=4ba",
    ]
    train_py = project / "train.py"
    ok(launch(1, train_py, *common, "--run_name=ref", cwd=tmp_path))
    killed = launch(
        1, STOP_AFTER, "kill:2", train_py, *common, "--run_name=run", cwd=tmp_path
    )
    assert killed.returncode != 0
    resumed = ok(launch(1, train_py, *common, "--run_name=run", cwd=tmp_path))
    assert "resumed from" in resumed.stdout and "at step 1" in resumed.stdout
    assert losses(tmp_path, "run") == losses(tmp_path, "ref")  # bitwise
    assert sorted(losses(tmp_path, "ref")) == [1, 2, 3, 4]


def test_bad_shard_folder_and_empty_prefix_are_one_line_exit_2(
    generated: dict[str, Path], lm_shards: Path, s3: dict, tmp_path: Path
) -> None:  # noqa: F811
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(lm_shards, broken)
    (broken / "train" / "chunk-0-2.bin").unlink()
    train_py = generated["gpt2-baseline"] / "train.py"
    for data, message in (
        (
            broken,
            f"error: --data={broken}: train/index.json names 1 chunk file(s) that are not there "
            "(chunk-0-2.bin, ...); copy the whole folder again",
        ),
        (
            "s3://ckpt/no-such-data",
            "error: --data=s3://ckpt/no-such-data: cannot read meta.json "
            "(FileNotFoundError: ",
        ),
    ):
        result = launch(
            1,
            train_py,
            *LM,
            f"--data={data}",
            "--max_duration=1ba",
            "--run_name=bad",
            cwd=tmp_path,
            env=s3["env"],
        )
        assert result.returncode == 2, result.stderr[-2000:]
        assert len(error_lines(result)) == 1 and error_lines(result)[0].startswith(
            message
        ), result.stderr
        assert "Traceback" not in result.stderr
        assert not (tmp_path / "runs").exists()


def test_a_read_that_loses_the_reader_race_is_read_again() -> None:
    """litdata's reader can raise KeyError while it unmaps the chunk it leaves (a bucket
    read on 2 ranks); the item was not read, so Shards reads it once more."""

    class Racy:
        def __init__(self) -> None:
            self.calls = 0

        def __getitem__(self, index: int) -> int:
            self.calls += 1
            if self.calls == 2:  # the first read of a new chunk
                raise KeyError(0)
            return index * 10

    dataset = Racy()
    split = shards.Shards("s3://b/lm/train", dataset, chunk_sizes=[1, 2])
    assert split.take(np.array([2, 1, 0])) == [20, 10, 0]
    assert dataset.calls == 4
    with pytest.raises(KeyError):  # a missing item stays an error
        shards.Shards("x", {}, chunk_sizes=[1])[0]
