"""Experiment trackers: TensorBoard, MLflow and Weights & Biases behind one small interface.

Each is an optional extra (`pip install 'scaffold[tensorboard]'`, `[mlflow]`, `[wandb]`), imported
only when chosen (`--trackers=tensorboard,mlflow`). Only rank 0 opens them (the Monitor does).
They get the same metric names and steps as `metrics.jsonl`, and the resolved config as
hyperparameters; a string in a record goes as text (`text`) and an image file written
under the run folder as an image (`image`). A resumed run continues the same tracker run: the ids live in
`runs/<name>/trackers.json`, and TensorBoard hides what a crashed attempt logged after the
checkpoint (`purge_step`).

Where they write, by default:
- tensorboard: `runs/<name>/tensorboard/` (`tensorboard --logdir runs`)
- mlflow: `runs/mlflow.db`, one SQLite store for every run under `runs/` (`mlflow ui
  --backend-store-uri sqlite:///runs/mlflow.db`); `MLFLOW_TRACKING_URI` and
  `MLFLOW_EXPERIMENT_NAME` override.
- wandb: online when `WANDB_API_KEY` is set (or `wandb login` was run), else offline under
  `runs/<name>/wandb/` (`wandb sync` uploads it later); `WANDB_MODE`, `WANDB_PROJECT` override.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
import tomllib
import uuid
from pathlib import Path
from typing import Any, Protocol

# Each tracker's name is also the package it imports and the pip extra that installs it.
NAMES = ("tensorboard", "mlflow", "wandb")


def parse(text: str) -> list[str]:
    """`"tensorboard, mlflow"` -> `["tensorboard", "mlflow"]` (empty: none)."""
    return [name.strip().lower() for name in text.split(",") if name.strip()]


def check(text: str) -> str | None:
    """A one-line problem with the `trackers` setting (unknown name, package missing), or None."""
    for name in parse(text):
        if name not in NAMES:
            return f"trackers: unknown tracker {name!r}; choose from {', '.join(NAMES)} (comma-separated)"
        if importlib.util.find_spec(name) is None:
            return f"trackers={name} needs the {name} package: pip install {name} (or drop it from trackers)"
    return None


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def text(self, key: str, text: str, step: int) -> None: ...

    def image(self, key: str, path: Path, step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    def __init__(self, run_dir: Path, config_toml: str, step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # On resume, events an earlier attempt wrote after the checkpoint (step > `step`) are hidden.
        self.writer = SummaryWriter(
            str(run_dir / "tensorboard"), purge_step=step + 1 if step else None
        )
        if not step:
            self.writer.add_text(
                "config", "    " + config_toml.replace("\n", "\n    "), 0
            )

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def text(self, key: str, text: str, step: int) -> None:
        # Indented: TensorBoard shows it verbatim (as code), not as Markdown.
        self.writer.add_text(key, "    " + text.replace("\n", "\n    "), step)

    def image(self, key: str, path: Path, step: int) -> None:
        import numpy as np
        from PIL import Image

        pixels = np.asarray(Image.open(path).convert("RGB"))
        self.writer.add_image(key, pixels, step, dataformats="HWC")

    def close(self) -> None:
        self.writer.close()


class MLflowTracker:
    def __init__(
        self, run_dir: Path, config: dict[str, Any], run_id: str | None
    ) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        runs = run_dir.parent.resolve()
        uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{runs / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "scaffold")
        experiment = self.client.get_experiment_by_name(name)
        if experiment is None:
            experiment_id = self.client.create_experiment(
                name, artifact_location=(runs / "mlartifacts").as_uri()
            )
        else:
            experiment_id = experiment.experiment_id
        if run_id is not None and self._exists(run_id):
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(
                experiment_id, run_name=run_dir.name
            ).info.run_id
            params = [Param(key, str(value)[:6000]) for key, value in config.items()]
            self.client.log_batch(self.run_id, params=params)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(
            self.run_id, metrics=[Metric(k, v, now, step) for k, v in metrics.items()]
        )

    def text(self, key: str, text: str, step: int) -> None:
        self.client.log_text(self.run_id, text, f"{key}/step-{step}.txt")

    def image(self, key: str, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path), key)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    def __init__(
        self, run_dir: Path, config: dict[str, Any], run_id: str | None
    ) -> None:
        import wandb

        logged_in = bool(os.environ.get("WANDB_API_KEY")) or "api.wandb.ai" in _read(
            Path.home() / ".netrc"
        )
        mode = os.environ.get("WANDB_MODE") or ("online" if logged_in else "offline")
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "scaffold"),
            name=run_dir.name,
            id=run_id or uuid.uuid4().hex[:8],
            resume="allow",
            dir=str(run_dir),
            config=config,
            mode=mode,
        )
        self.run_id = self.run.id

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def text(self, key: str, text: str, step: int) -> None:
        self.run.log({key: text}, step=step)

    def image(self, key: str, path: Path, step: int) -> None:
        import wandb

        self.run.log({key: wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        self.run.finish()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


class Trackers:
    """The chosen trackers of one run (rank 0): `log` a record, `close` at the end."""

    def __init__(self, names: str, run_dir: Path, config_toml: str, step: int) -> None:
        self.trackers: list[Tracker] = []
        chosen = parse(names)
        if not chosen:
            return
        config = tomllib.loads(config_toml)
        state_path = run_dir / "trackers.json"
        state = json.loads(_read(state_path) or "{}")
        for name in chosen:
            if name == "tensorboard":
                self.trackers.append(TensorBoardTracker(run_dir, config_toml, step))
            elif name == "mlflow":
                tracker = MLflowTracker(run_dir, config, state.get("mlflow"))
                state["mlflow"] = tracker.run_id
                self.trackers.append(tracker)
            elif name == "wandb":
                wandb_tracker = WandbTracker(run_dir, config, state.get("wandb"))
                state["wandb"] = wandb_tracker.run_id
                self.trackers.append(wandb_tracker)
        state_path.write_text(json.dumps(state, indent=2) + "\n")

    def log(self, record: dict[str, Any], step: int) -> None:
        """Every number in `record` except the step itself, under its metrics.jsonl name;
        every string (a generated text) as text."""
        metrics = {
            k: float(v)
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        for tracker in self.trackers:
            tracker.log(metrics, step)
            for key, value in record.items():
                if isinstance(value, str):
                    tracker.text(key, value, step)

    def image(self, key: str, path: Path, step: int) -> None:
        """An image file (a PNG under the run folder) to every tracker, as `key`."""
        for tracker in self.trackers:
            tracker.image(key, path, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()
        self.trackers = []
