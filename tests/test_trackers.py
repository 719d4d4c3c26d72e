"""Trackers, read back with each tracker's own library: TensorBoard's EventAccumulator, MLflow's
MlflowClient, W&B's offline run file (its protobuf records). A resumed run continues the same run.
"""

from __future__ import annotations

import glob
import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from projects import checkout_env
from runtime import trackers
from runtime.trackers import Trackers

CONFIG = 'run_name = "exp"\nlr = 0.002\nmax_duration = "6ba"\n'


def log_steps(
    names: str,
    run_dir: Path,
    steps: range,
    offset: float,
    resume_step: int = 0,
    image: str = "",
) -> None:
    """Log `steps`; with `image` (a PNG), the last step also has a text and the image."""
    opened = Trackers(names, run_dir, CONFIG, step=resume_step)
    for step in steps:
        text = {"generate/0": "def f"} if image and step == steps[-1] else {}
        record = {"step": step, "epoch": 0, "loss": offset + step, "lr": 0.1}
        opened.log(record | text, step)
    if image:
        opened.image("images/val", Path(image), steps[-1])
    opened.close()


def test_check_names_and_packages(monkeypatch) -> None:
    assert trackers.check("") is None and trackers.parse(" TensorBoard , mlflow ") == [
        "tensorboard",
        "mlflow",
    ]
    assert "unknown tracker 'comet'" in trackers.check("tensorboard,comet")
    monkeypatch.setattr(trackers.importlib.util, "find_spec", lambda name: None)
    assert "pip install wandb" in trackers.check("wandb")


def test_tensorboard_reads_back_and_resume_replaces_the_crashed_tail(
    tmp_path: Path,
) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "runs" / "exp"
    run_dir.mkdir(parents=True)
    log_steps(
        "tensorboard", run_dir, range(1, 6), offset=0.0
    )  # crashed after step 5 ...
    log_steps(
        "tensorboard", run_dir, range(3, 7), offset=100.0, resume_step=2
    )  # ... resumed at 2
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert {"loss", "lr", "epoch"} <= set(events.Tags()["scalars"])
    loss = [(e.step, e.value) for e in events.Scalars("loss")]
    assert loss == [(1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0), (5, 105.0), (6, 106.0)]
    assert (
        "lr = 0.002"
        in events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    )


def test_mlflow_reads_back_and_resume_appends_to_the_same_run(
    tmp_path: Path, monkeypatch
) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "runs" / "exp"
    run_dir.mkdir(parents=True)
    log_steps("mlflow", run_dir, range(1, 4), offset=0.0)
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    log_steps("mlflow", run_dir, range(4, 6), offset=0.0, resume_step=3)
    assert json.loads((run_dir / "trackers.json").read_text())["mlflow"] == run_id
    client = MlflowClient(
        tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    )  # the default store
    runs = client.search_runs([client.get_experiment_by_name("scaffold").experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # one run, not two
    run = runs[0]
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    assert run.data.params["lr"] == "0.002" and run.data.params["max_duration"] == "6ba"
    history = sorted(
        (m.step, m.value) for m in client.get_metric_history(run_id, "loss")
    )
    assert history == [(s, float(s)) for s in range(1, 6)]
    assert not (tmp_path / "mlruns").exists()  # nothing outside runs/


def read_wandb_records(path: str) -> list:
    """The records of a .wandb file: W&B's LevelDB-style log (32 KiB blocks, 7-byte headers)
    of `wandb.proto` Record messages."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, chunks, records = Path(path).read_bytes(), 7, 32768, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = pb.Record()
            record.ParseFromString(chunks)
            records.append(record)
            chunks = b""
    return records


def test_wandb_offline_run_files_and_resume_keeps_the_id(
    tmp_path: Path, monkeypatch
) -> None:
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc login: offline
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "runs" / "exp"
    run_dir.mkdir(parents=True)
    # Each attempt in a process of its own, as a crashed and resumed training run is.
    attempt = (
        "import sys; from pathlib import Path; from test_trackers import log_steps; "
        "log_steps('wandb', Path(sys.argv[1]), range(int(sys.argv[2]), int(sys.argv[3])), 0.0, int(sys.argv[4]), sys.argv[5])"
    )
    env = {
        **checkout_env(),
        "PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).parent), checkout_env()["PYTHONPATH"]]
        ),
    }
    from PIL import Image

    Image.new("RGB", (7, 5), (200, 10, 30)).save(tmp_path / "grid.png")
    for first, end, resume_step, image in ((1, 4, 0, ""), (4, 6, 3, "grid.png")):
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                attempt,
                str(run_dir),
                str(first),
                str(end),
                str(resume_step),
                str(tmp_path / image) if image else "",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        if first == 1:
            run_id = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    files = sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(
        f.endswith(f"run-{run_id}.wandb") for f in files
    )  # the same run id
    history, config, media = [], {}, {}
    for path in files:
        for record in read_wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                history.append((record.history.step.num, items["loss"]))
                media.update({k: v for k, v in items.items() if "/" in k})
            elif kind == "run":
                config.update(
                    {u.key: json.loads(u.value_json) for u in record.run.config.update}
                )
    assert history == [(s, float(s)) for s in range(1, 6)]
    assert config["lr"] == 0.002 and config["run_name"] == "exp"
    # Step 5's text and image (a file of the run, the same pixels).
    assert media["generate/0"] == "def f" and media["images/val/_type"] == "image-file"
    stored = Path(files[-1]).parent / "files" / media["images/val/path"]
    assert Image.open(stored).convert("RGB").getpixel((3, 2)) == (200, 10, 30)


def test_texts_and_images_read_back_in_tensorboard_and_mlflow(
    tmp_path: Path, monkeypatch
) -> None:
    """A string in a record (the generate monitor's texts) is text, and `image` sends a
    PNG (image_visualizer's grid): TensorBoard holds both, MLflow as artifacts."""
    pytest.importorskip("tensorboard")
    pytest.importorskip("mlflow")
    import numpy as np
    from mlflow.tracking import MlflowClient
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "runs" / "exp"
    run_dir.mkdir(parents=True)
    pixels = np.arange(5 * 7 * 3, dtype=np.uint8).reshape(5, 7, 3) * 2
    Image.fromarray(pixels).save(run_dir / "grid.png")
    opened = Trackers("tensorboard,mlflow", run_dir, CONFIG, step=0)
    opened.log({"step": 3, "loss": 1.5, "generate/0": "def f(x):\n  return"}, 3)
    opened.image("images/val", run_dir / "grid.png", 3)
    opened.close()

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"images": 0})
    events.Reload()
    [text] = events.Tensors("generate/0/text_summary")
    assert text.step == 3
    assert text.tensor_proto.string_val[0].decode() == "    def f(x):\n      return"
    [image] = events.Images("images/val")
    assert image.step == 3 and (image.width, image.height) == (7, 5)
    decoded = Image.open(io.BytesIO(image.encoded_image_string))
    assert np.array_equal(np.asarray(decoded.convert("RGB")), pixels)

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    local = Path(client.download_artifacts(run_id, "", str(tmp_path / "down")))
    assert (local / "generate/0/step-3.txt").read_text() == "def f(x):\n  return"
    assert np.array_equal(np.asarray(Image.open(local / "images/val/grid.png")), pixels)
    assert [m.value for m in client.get_metric_history(run_id, "loss")] == [1.5]
