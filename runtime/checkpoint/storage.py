"""Checkpoints in object storage: any fsspec URL (`s3://`, `gs://`, `oci://`, `memory://`, ...).

A remote checkpoint has the local layout (`<url>/step-<N>/`, the `COMPLETE` marker written
last). It is staged: DCP writes each rank's shards to a local folder, each rank uploads its
own files, and rank 0 writes the marker once every rank's upload has returned, so the marker
never precedes any rank's data. Resuming downloads one checkpoint to a local folder and loads
it with the local reader (the same checks, no pickles). Why staged and not DCP's fsspec
writer: the local writer's checks (every item written, files as long as the metadata says)
apply unchanged, and a store that fails mid-upload leaves a folder without a marker, never
a half-written file that a reader trusts.

The backend comes from the URL's scheme (`s3://` needs s3fs, `gs://` gcsfs, `oci://` ocifs);
credentials and endpoints come from the backend's own environment and config files
(AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, ~/.aws/...), never from the run's config.
"""

from __future__ import annotations

import hashlib
import os
import re
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from runtime.checkpoint.layout import MARKER, METADATA, STEP_DIR, CheckpointError

_URL = re.compile(r"([a-z][a-z0-9+.-]*)://(.*)", re.IGNORECASE)


def is_remote(location: Path | str) -> bool:
    """True for a URL other than file://, whose folders are plain local paths."""
    match = _URL.fullmatch(str(location))
    return bool(match) and match.group(1).lower() != "file"


def local_path(location: Path | str) -> Path:
    """A local folder from a path or a file:// URL."""
    text = str(location)
    return (
        Path(text[len("file://") :])
        if text.lower().startswith("file://")
        else Path(text)
    )


def redact(url: str) -> str:
    """The URL without a `user:secret@` part, for messages and logs."""
    return re.sub(r"^([a-z][a-z0-9+.-]*://)[^/@]*@", r"\1", url, flags=re.IGNORECASE)


def staging_root(url: str, rank: int) -> Path:
    """Where this rank stages saves to and downloads into: $SCAFFOLD_STAGING or the temp dir."""
    base = Path(
        os.environ.get("SCAFFOLD_STAGING")
        or Path(tempfile.gettempdir()) / "scaffold-staging"
    )
    return base / hashlib.sha256(redact(url).encode()).hexdigest()[:16] / f"rank{rank}"


class Remote:
    """A checkpoints folder at an fsspec URL: list, upload, download, mark, delete."""

    def __init__(self, url: str) -> None:
        try:
            from fsspec.core import url_to_fs
        except ImportError as error:
            raise CheckpointError(
                f"{redact(url)}: remote checkpoints need fsspec (pip install fsspec "
                "and the backend: s3fs, gcsfs or ocifs)"
            ) from error
        self.url = url.rstrip("/")
        try:
            self.fs, self.root = url_to_fs(self.url)
        except (ImportError, ValueError) as error:
            raise CheckpointError(f"{redact(url)}: {error}") from error
        self.root = self.root.rstrip("/")
        self._protocol = self.url.split("://", 1)[0]

    def __str__(self) -> str:
        return redact(self.url)

    def join(self, *parts: str) -> str:
        return "/".join((self.root, *parts))

    def url_of(self, path: str) -> str:
        return f"{self._protocol}://{path}"

    def display(self, path: str) -> str:
        return redact(self.url_of(path))

    def steps(self, folder: str | None = None) -> list[tuple[int, str]]:
        """(step, path) of every step-<N> folder under `folder` (default: the root), oldest first."""
        folder = folder or self.root
        self.fs.invalidate_cache(folder)  # other ranks and processes write here
        if not self.fs.exists(folder):
            return []
        found = []
        for entry in self.fs.ls(folder, detail=True):
            match = STEP_DIR.fullmatch(entry["name"].rstrip("/").rsplit("/", 1)[-1])
            if match and entry.get("type") == "directory":
                found.append((int(match.group(1)), entry["name"].rstrip("/")))
        return sorted(found)

    def is_complete(self, path: str) -> bool:
        return bool(self.fs.exists(f"{path}/{MARKER}"))

    def latest(self, folder: str | None = None) -> str | None:
        complete = self.complete_newest_first(folder)
        return complete[0] if complete else None

    def complete_newest_first(self, folder: str | None = None) -> list[str]:
        steps = reversed(self.steps(folder))
        return [path for _, path in steps if self.is_complete(path)]

    def remove(self, path: str) -> None:
        """Delete a step folder, the marker first (a kill mid-delete leaves it incomplete)."""
        if self.fs.exists(f"{path}/{MARKER}"):
            self.fs.rm(f"{path}/{MARKER}")
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache(path)

    def remove_incomplete(self) -> list[str]:
        removed = [path for _, path in self.steps() if not self.is_complete(path)]
        for path in removed:
            self.remove(path)
        return removed

    def rotate(self, keep: int, current: str) -> None:
        if keep > 0:
            complete = [path for _, path in self.steps() if self.is_complete(path)]
            for old in (old for old in complete[:-keep] if old != current):
                self.remove(old)

    def check_writable(self) -> None:
        """List the folder, then write a small object into it and delete it: what a save
        does, so the store's error (credentials, permissions, a missing bucket, an endpoint
        that does not answer) comes now, not at the first save. Nothing stays behind."""
        self.steps()
        probe = self.join(
            f".scaffold-access-check-{socket.gethostname()}-{os.getpid()}"
        )
        self.fs.pipe_file(probe, b"")
        self.fs.rm(probe)

    def upload(self, local: Path, path: str, threads: int = 8) -> None:
        """Every file of the local folder `local` into `path`, in parallel."""
        files = sorted(
            p for p in local.iterdir() if p.is_file() and not p.name.endswith(".tmp")
        )
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for done in [
                pool.submit(self.fs.put_file, str(f), f"{path}/{f.name}") for f in files
            ]:
                done.result()

    def mark_complete(self, path: str, step: int) -> None:
        self.fs.pipe_file(f"{path}/{MARKER}", f"step {step}\n".encode())

    def resolve(self, path: str) -> str:
        """A complete step folder from a step-<N> URL, a checkpoints folder or a run folder."""
        name = path.rstrip("/").rsplit("/", 1)[-1]
        self.fs.invalidate_cache()
        if (
            self.is_complete(path)
            or STEP_DIR.fullmatch(name)
            or self.fs.exists(f"{path}/{METADATA}")
        ):
            if not self.is_complete(path):
                raise CheckpointError(
                    f"{self.display(path)} is not a complete checkpoint (no {MARKER} "
                    "marker): its save was interrupted or it does not exist"
                )
            return path
        for folder in (path, f"{path}/checkpoints"):
            found = self.latest(folder)
            if found is not None:
                return found
        raise CheckpointError(
            f"{self.display(path)} holds no complete checkpoint (no step-<N> folder "
            f"with a {MARKER} marker in it or in its checkpoints/)"
        )

    def download(self, path: str, local: Path, threads: int = 8) -> Path:
        """A remote step folder into `local/<its name>` (replaced); returns the local folder."""
        target = local / path.rstrip("/").rsplit("/", 1)[-1]
        target.mkdir(parents=True, exist_ok=True)
        for stale in target.iterdir():
            stale.unlink()
        names = [
            entry.rstrip("/").rsplit("/", 1)[-1]
            for entry in self.fs.ls(path, detail=False)
        ]
        with ThreadPoolExecutor(max_workers=threads) as pool:
            jobs = [
                pool.submit(self.fs.get_file, f"{path}/{name}", str(target / name))
                for name in names
            ]
            for done in jobs:
                done.result()
        return target
