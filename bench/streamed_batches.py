"""Streaming data vs in-memory tokens: the cost of reading a causal LM's batches, same run.

    python bench/streamed_batches.py                      # 8 MB of text, 40 batches of 64 x 257 tokens
    python bench/streamed_batches.py --megabytes 32 --batches 100

Renders a gpt2-baseline project, writes the first --megabytes of the Python standard library's
source as a text file, converts it with the project's `python data.py convert` (litdata shards,
--chunk_bytes chunks) and reads the same global batches with the project's `Batches.get` from
1. the in-memory token array (the baseline), 2. the local shard folder, 3. the same shards in a
bucket on moto's S3 server on 127.0.0.1 with an empty cache (every chunk downloaded) and
4. again with that cache filled. Prints ms per batch and each ratio against the baseline.
Needs litdata (README), `moto[server]` and s3fs. moto serves objects from one Python process,
so the cold number measures our path plus moto, not a real store's network.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def per_batch_ms(batches, count: int) -> float:  # noqa: ANN001
    start = time.perf_counter()
    for index in range(count):
        batches.get(0, index)
    return (time.perf_counter() - start) / count * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=8)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--chunk_bytes", default="4MB")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(work)}
    project = work / "p"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "scaffold",
            "new",
            "--recipe",
            "gpt2-baseline",
            str(project),
        ],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
    )
    root = Path(sysconfig.get_paths()["stdlib"])
    text, size = [], 0
    for path in sorted(root.glob("*.py")):
        text.append(path.read_bytes())
        size += len(text[-1])
        if size >= args.megabytes * 1e6:
            break
    corpus = work / "corpus.txt"
    corpus.write_bytes(b"\n".join(text)[: int(args.megabytes * 1e6)])
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "data.py",
            "convert",
            str(work / "shards"),
            f"--data={corpus}",
            f"--chunk_bytes={args.chunk_bytes}",
        ],
        cwd=project,
        env=env,
        check=True,
        capture_output=True,
    )
    convert_s = time.perf_counter() - start

    port = free_port()
    aws = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        os.environ.update(aws)
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        import s3fs

        fs = s3fs.S3FileSystem()
        fs.mkdir("bench")
        fs.put(str(work / "shards"), "bench/shards", recursive=True)

        sys.path[:0] = [str(project), str(REPO)]
        data = importlib.import_module("data")
        rows = []
        tokens = data.load_tokens(str(corpus))
        baseline = per_batch_ms(
            data.Batches(tokens.train, args.seq_len, args.batch_size, 0), args.batches
        )
        rows.append(("in-memory tokens (baseline)", baseline))
        local = data.load_tokens(str(work / "shards"), seq_len=args.seq_len)
        rows.append(
            (
                "local shard folder",
                per_batch_ms(
                    data.Batches(local.train, args.seq_len, args.batch_size, 0),
                    args.batches,
                ),
            )
        )
        os.environ["SCAFFOLD_SHARD_CACHE"] = str(work / "cache")
        remote = data.load_tokens("s3://bench/shards", seq_len=args.seq_len)
        batches = data.Batches(remote.train, args.seq_len, args.batch_size, 0)
        rows.append(("s3 shards, empty cache", per_batch_ms(batches, args.batches)))
        rows.append(("s3 shards, cache filled", per_batch_ms(batches, args.batches)))
    finally:
        server.terminate()
        server.wait(30)
    chunks = len(local.train.chunk_sizes)
    print(
        f"{args.megabytes:g} MB of text -> {chunks} train chunks of ~{args.chunk_bytes} "
        f"(convert: {convert_s:.1f} s); {args.batches} batches of {args.batch_size} x {args.seq_len + 1} tokens"
    )
    print(f"{'source':<30} {'ms/batch':>9} {'vs baseline':>12}")
    for name, ms in rows:
        print(f"{name:<30} {ms:9.2f} {ms / baseline:11.2f}x")


if __name__ == "__main__":
    main()
