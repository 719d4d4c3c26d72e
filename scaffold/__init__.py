"""scaffold: generate plain PyTorch training projects from recipes (the generator; never imported by them)."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path


def _version() -> str:
    try:
        return metadata.version("scaffold")
    except metadata.PackageNotFoundError:
        # Running from a source checkout that was never installed: the one declared version.
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


__version__ = _version()
