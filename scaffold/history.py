"""Template history: a local git repository holding one tagged commit per template version.

copier can only update a project from a git source whose history holds the version the
project was made with (DESIGN §6). Every scaffold run makes sure `~/.cache/scaffold/
template-history` exists and that the tag of the installed version points at a commit whose
tree is exactly the installed `templates/` folder (a wheel's shipped bundle is fetched first
when present; a development install snapshots itself). Projects record this path literally,
with `~`, so they stay valid for every user and machine.
"""

from __future__ import annotations

import fcntl
import io
import os
import subprocess
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HISTORY_SRC = "~/.cache/scaffold/template-history"
# Fixed identity and date: the same templates give the same commit on every machine.
_GIT_ENV = {
    "GIT_AUTHOR_NAME": "scaffold",
    "GIT_AUTHOR_EMAIL": "scaffold@localhost",
    "GIT_COMMITTER_NAME": "scaffold",
    "GIT_COMMITTER_EMAIL": "scaffold@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}


class HistoryError(RuntimeError):
    """The template history cannot be prepared; the message says why."""


def history_path() -> Path:
    return Path(HISTORY_SRC).expanduser()


def git(*args: str, cwd: Path, env: dict[str, str] | None = None, check: bool = True) -> str:
    result = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )
    if check and result.returncode != 0:
        raise HistoryError(f"git {' '.join(args)} failed in {cwd}: {result.stderr.strip()}")
    return result.stdout.strip()


@contextmanager
def _locked(repo: Path) -> Iterator[None]:
    """Serialise concurrent scaffold processes working on the same cache."""
    repo.parent.mkdir(parents=True, exist_ok=True)
    with open(repo.parent / "template-history.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _tree_of(template: Path, repo: Path) -> str:
    """The git tree hash of a folder's files (through a throwaway index; the repo is untouched)."""
    index = repo / ".git" / "scaffold-snapshot.index"
    env = {"GIT_INDEX_FILE": str(index), "GIT_WORK_TREE": str(template)}
    try:
        git("--git-dir", str(repo / ".git"), "add", "--all", "--force", ".", cwd=template, env=env)
        return git("--git-dir", str(repo / ".git"), "write-tree", cwd=template, env=env)
    finally:
        index.unlink(missing_ok=True)


def ensure_version(template: Path, version: str, bundle: Path | None = None) -> Path:
    """Make tag `version` in the history repo point at exactly `template`'s files; return the repo."""
    repo = history_path()
    with _locked(repo):
        if not (repo / ".git").is_dir():
            repo.mkdir(parents=True, exist_ok=True)
            git("init", "--quiet", cwd=repo)
        if bundle is not None and bundle.is_file():
            git("fetch", "--quiet", "--force", str(bundle), "refs/tags/*:refs/tags/*", cwd=repo)
        tree = _tree_of(template, repo)
        tagged = git("rev-parse", "--verify", "--quiet", f"refs/tags/{version}^{{tree}}", cwd=repo, check=False)
        if tagged != tree:
            parent = git("rev-parse", "--verify", "--quiet", f"refs/tags/{version}", cwd=repo, check=False)
            commit = git(
                "commit-tree", tree, *(["-p", parent] if parent else []),
                "-m", f"scaffold template {version}",
                cwd=repo, env=_GIT_ENV,
            )
            git("tag", "--force", version, commit, cwd=repo)
    return repo


@dataclass(frozen=True)
class TemplateRelease:
    """A templates folder published under a version: the installed one, or a test's copy.

    Everything that renders takes one of these instead of reading the installed package, so
    tests can build "0.1.0" and "0.2.0" from temporary folders without reinstalling anything.
    """

    template: Path
    version: str
    bundle: Path | None = None  # the wheel's shipped history, fetched first when present

    def prepare_history(self) -> Path:
        return ensure_version(self.template, self.version, self.bundle)


def known_versions(repo: Path) -> list[str]:
    """Every version tag in the history repo (unsorted: tags need not be valid versions)."""
    if not (repo / ".git").is_dir():
        return []
    return git("tag", "--list", cwd=repo).split()


def has_version(repo: Path, version: str) -> bool:
    found = git("rev-parse", "--verify", "--quiet", f"refs/tags/{version}^{{commit}}", cwd=repo, check=False)
    return bool(found)


def export_version(repo: Path, version: str, dest: Path) -> Path:
    """Write the templates folder of `version` into `dest` (e.g. to read its algorithm catalog)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", f"refs/tags/{version}"], cwd=repo, capture_output=True
    )
    if archive.returncode != 0:
        raise HistoryError(f"template version {version} cannot be read from {repo}: "
                           f"{archive.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest
