"""Template history: a local git repository holding one tagged commit per template version.

copier can only update a project from a git source whose history holds the version the
project was made with (DESIGN.md §8.1). Every scaffold run makes sure `~/.cache/scaffold/
template-history` exists and holds the installed `templates/` folder under a version tag (a
wheel's shipped bundle is fetched first when present; a development install snapshots
itself). Projects record this path literally, with `~`, so they stay valid for every user
and machine.

A version tag is never moved once it exists: projects record it as the merge base of every
later update, so moving it would silently change what `scaffold upgrade` merges. A
development install whose templates differ from its version's tag snapshots them under a
PEP 440 local version instead, `0.2.0+dev.<tree hash>`, and renders under that.
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


def git(
    *args: str, cwd: Path, env: dict[str, str] | None = None, check: bool = True
) -> str:
    result = subprocess.run(
        ["git", *args],
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
    )
    if check and result.returncode != 0:
        raise HistoryError(
            f"git {' '.join(args)} failed in {cwd}: {result.stderr.strip()}"
        )
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
        git(
            "--git-dir",
            str(repo / ".git"),
            "add",
            "--all",
            "--force",
            ".",
            cwd=template,
            env=env,
        )
        return git("--git-dir", str(repo / ".git"), "write-tree", cwd=template, env=env)
    finally:
        index.unlink(missing_ok=True)


def dev_version(version: str, tree: str) -> str:
    """The local version of a development snapshot: `0.2.0+dev.0123456789ab` (its tree hash)."""
    return f"{version}+dev.{tree[:12]}"


def _tree_at(repo: Path, tag: str) -> str:
    """The tree hash of a tag's commit ("" when there is no such tag)."""
    return git(
        "rev-parse",
        "--verify",
        "--quiet",
        f"refs/tags/{tag}^{{tree}}",
        cwd=repo,
        check=False,
    )


def _fetch_bundle(repo: Path, bundle: Path) -> None:
    """Add the bundle's release tags that the history lacks; existing tags stay where they are."""
    git(
        "fetch",
        "--quiet",
        "--force",
        "--no-tags",
        str(bundle),
        "refs/tags/*:refs/scaffold-bundle/*",
        cwd=repo,
    )
    fetched = git(
        "for-each-ref",
        "--format=%(refname:lstrip=2) %(objectname)",
        "refs/scaffold-bundle/",
        cwd=repo,
    )
    for line in fetched.splitlines():
        tag, commit = line.split()
        if not git(
            "rev-parse",
            "--verify",
            "--quiet",
            f"refs/tags/{tag}",
            cwd=repo,
            check=False,
        ):
            git("update-ref", f"refs/tags/{tag}", commit, "", cwd=repo)


def ensure_version(template: Path, version: str, bundle: Path | None = None) -> str:
    """Put `template`'s files into the history repo; return the version tag that holds them.

    That is `version` when its tag holds exactly these files, or when there is no such tag
    yet (a development install snapshots itself); otherwise, for a development install whose
    templates differ from the tagged ones, `dev_version(version, tree)`. No tag is moved.
    """
    repo = history_path()
    with _locked(repo):
        if not (repo / ".git").is_dir():
            repo.mkdir(parents=True, exist_ok=True)
            git("init", "--quiet", cwd=repo)
        if bundle is not None and bundle.is_file():
            _fetch_bundle(repo, bundle)
        tree = _tree_of(template, repo)
        tagged = _tree_at(repo, version)
        if tagged == tree:
            return version
        tag, parent = version, ""
        if tagged:  # the release's templates differ from these: a development snapshot
            tag, parent = dev_version(version, tree), f"refs/tags/{version}"
            if _tree_at(repo, tag) == tree:
                return tag
        commit = git(
            "commit-tree",
            tree,
            *(["-p", parent] if parent else []),
            "-m",
            f"scaffold template {tag}",
            cwd=repo,
            env=_GIT_ENV,
        )
        git("tag", tag, commit, cwd=repo)
    return tag


@dataclass(frozen=True)
class TemplateRelease:
    """A templates folder published under a version: the installed one, or a test's copy.

    Everything that renders takes one of these instead of reading the installed package, so
    tests can build "0.1.0" and "0.2.0" from temporary folders without reinstalling anything.
    """

    template: Path
    version: str
    bundle: Path | None = (
        None  # the wheel's shipped history, fetched first when present
    )

    def prepare_history(self) -> str:
        """Make the history hold these templates; returns the version to render them under."""
        return ensure_version(self.template, self.version, self.bundle)


def known_versions(repo: Path) -> list[str]:
    """Every version tag in the history repo (unsorted: tags need not be valid versions)."""
    if not (repo / ".git").is_dir():
        return []
    return git("tag", "--list", cwd=repo).split()


def has_version(repo: Path, version: str) -> bool:
    found = git(
        "rev-parse",
        "--verify",
        "--quiet",
        f"refs/tags/{version}^{{commit}}",
        cwd=repo,
        check=False,
    )
    return bool(found)


def export_version(repo: Path, version: str, dest: Path) -> Path:
    """Write the templates folder of `version` into `dest` (e.g. to read its algorithm catalog)."""
    archive = subprocess.run(
        ["git", "archive", "--format=tar", f"refs/tags/{version}"],
        cwd=repo,
        capture_output=True,
    )
    if archive.returncode != 0:
        raise HistoryError(
            f"template version {version} cannot be read from {repo}: "
            f"{archive.stderr.decode(errors='replace').strip()}"
        )
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest
