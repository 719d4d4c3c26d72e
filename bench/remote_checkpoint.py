"""Remote vs local checkpoints: save and resume throughput of runtime.checkpoint, same run.

    python bench/remote_checkpoint.py                  # 10M parameters + AdamW state (~120 MB)
    python bench/remote_checkpoint.py --params 50e6    # larger

Starts moto's S3 server (a separate process, `pip install 'moto[server]' s3fs`) on 127.0.0.1 and
saves / resumes the same model + AdamW state with `Checkpointer(folder)` on local disk and with
`Checkpointer("s3://bench/run")` (staged locally, uploaded with 8 threads), --repeats times
each; prints the median seconds and MB/s of each and the remote/local ratios, and the save
time of the alternative not taken (DCP's FsspecWriter writing straight to the store). moto keeps objects
in memory in one Python process, so this measures our staging + upload + download path and
s3fs's client overhead, not a real store's network.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime import checkpoint  # noqa: E402
from runtime.time import Progress  # noqa: E402


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def build(params: float) -> tuple[nn.Module, torch.optim.Optimizer]:
    width = 1024
    layers = max(1, round(params / (width * width)))
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()  # AdamW state exists
    return model, optimizer


def timed(run) -> float:  # noqa: ANN001
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure(
    folder: str, model: nn.Module, optimizer: torch.optim.Optimizer, repeats: int
) -> dict[str, float]:
    saves, loads = [], []
    for repeat in range(repeats):
        progress = Progress(batches_per_epoch=1000)
        for _ in range(repeat + 1):  # step-<repeat+1>: each save a new checkpoint
            progress.advance(samples=1, tokens=1)
        checkpointer = checkpoint.Checkpointer(folder, keep=1)
        state = {"model": model, "optimizer": optimizer, "progress": progress}
        saves.append(timed(lambda: checkpointer.save(state)))
        fresh = {
            "model": model,
            "optimizer": optimizer,
            "progress": Progress(batches_per_epoch=1000),
        }
        reader = checkpoint.Checkpointer(folder, keep=1)
        loads.append(timed(lambda: reader.resume(fresh)))
    return {"save": statistics.median(saves), "load": statistics.median(loads)}


def measure_direct(
    url: str, model: nn.Module, optimizer: torch.optim.Optimizer, repeats: int
) -> float:
    """The alternative not taken: DCP's FsspecWriter writing straight to the store (save only)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer)
    saves = []
    for repeat in range(repeats):
        writer = FsspecWriter(f"{url}/step-{repeat}", thread_count=2)
        saves.append(
            timed(
                lambda: dcp.save(
                    {"model": model_state, "optimizer": optimizer_state},
                    storage_writer=writer,
                    no_dist=True,
                )
            )
        )
    return statistics.median(saves)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=10e6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, optimizer = build(args.params)
    nbytes = sum(
        p.numel() * p.element_size() * 3 for p in model.parameters()
    )  # weights + 2 moments

    port = free_port()
    scratch = Path(tempfile.mkdtemp(prefix="scaffold-bench-"))
    env = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_CONFIG_FILE": str(scratch / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(scratch / "none"),
        "SCAFFOLD_STAGING": str(scratch / "staging"),
    }
    os.environ.update(env)
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        import fsspec

        fsspec.filesystem("s3").mkdir("bench")
        local = measure(str(scratch / "local"), model, optimizer, args.repeats)
        remote = measure("s3://bench/run", model, optimizer, args.repeats)
        direct = measure_direct("s3://bench/direct", model, optimizer, args.repeats)
    finally:
        server.terminate()
        server.wait(30)
    mb = nbytes / 1e6
    print(
        f"{mb:,.0f} MB of model + AdamW state, median of {args.repeats}, torch {torch.__version__}"
    )
    print("| | local disk | s3 (moto, 127.0.0.1) | remote / local time |")
    print("| --- | --- | --- | --- |")
    for key in ("save", "load"):
        print(
            f"| {key} | {local[key]:.2f} s ({mb / local[key]:,.0f} MB/s) | {remote[key]:.2f} s "
            f"({mb / remote[key]:,.0f} MB/s) | {remote[key] / local[key]:.2f}x |"
        )
    print(
        f"DCP's FsspecWriter straight to s3 (the alternative to staging): save {direct:.2f} s "
        f"({mb / direct:,.0f} MB/s), {direct / remote['save']:.2f}x the staged save's time"
    )


if __name__ == "__main__":
    main()
