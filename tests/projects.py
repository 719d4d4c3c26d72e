"""Helpers to import and run the modules of a generated project from the tests."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

PROJECT_MODULES = ("train", "model", "data")


@contextmanager
def project_modules(project: Path) -> Iterator[dict[str, ModuleType]]:
    """Import a generated project's train/model/data modules (fresh, and forgotten afterwards)."""
    saved = {name: sys.modules.pop(name) for name in PROJECT_MODULES if name in sys.modules}
    sys.path.insert(0, str(project))
    try:
        yield {name: importlib.import_module(name) for name in PROJECT_MODULES}
    finally:
        sys.path.remove(str(project))
        for name in PROJECT_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def run_train(project: Path, workdir: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """`python train.py ARGS` in `workdir` (runs/ lands there), on the CPU."""
    return subprocess.run(
        [sys.executable, str(project / "train.py"), "--device=cpu", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_metrics(workdir: Path, run_name: str) -> list[dict]:
    path = workdir / "runs" / run_name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]
