#!/usr/bin/env python3
"""Build `scaffold/template-history.bundle`: one commit per release of this repo's `templates/`.

Run before building a release wheel (after tagging it):

    git tag v0.2.0 && python scripts/build_template_history.py && python -m build

For every tag `vX.Y.Z` of the repository, in version order, the bundle holds one commit whose
tree is exactly that tag's `templates/` folder, tagged `X.Y.Z` (the package version, which is
what projects record in `.copier-answers.yml`). Each commit's parent is the previous release, so
`git log` in the history reads as the template's changelog. Author, committer, dates and
messages are fixed, so the same tags give the same commits, hence the same bundle, on any
machine. The wheel ships the bundle; `scaffold` fetches its tags into
~/.cache/scaffold/template-history (scaffold/history.py), which is where copier finds the
version a project was generated with.

Self-contained on purpose (git and the standard library): a release tool must not depend on
the package it is about to build.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

RELEASE_TAG = re.compile(r"^v(\d+)\.(\d+)\.(\d+)$")
TEMPLATES = "templates"
# The same fixed identity and date scaffold's own history snapshots use (scaffold/history.py).
FIXED_IDENTITY = {
    "GIT_AUTHOR_NAME": "scaffold",
    "GIT_AUTHOR_EMAIL": "scaffold@localhost",
    "GIT_COMMITTER_NAME": "scaffold",
    "GIT_COMMITTER_EMAIL": "scaffold@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}


class BuildError(RuntimeError):
    pass


def git(*args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    # -c pack.threads=1: a single-threaded pack is byte-for-byte reproducible.
    result = subprocess.run(["git", "-c", "pack.threads=1", *args], cwd=cwd, capture_output=True,
                            text=True, env={**os.environ, **(env or {})})
    if result.returncode != 0:
        raise BuildError(f"git {' '.join(args)} failed in {cwd}: {result.stderr.strip()}")
    return result.stdout.strip()


def release_tags(repo: Path) -> list[tuple[str, str]]:
    """(tag, version) for every `vX.Y.Z` tag, oldest version first."""
    found = []
    for tag in git("tag", "--list", "v*", cwd=repo).split():
        match = RELEASE_TAG.match(tag)
        if match:
            found.append((tuple(int(part) for part in match.groups()), tag))
    return [(tag, tag[1:]) for _, tag in sorted(found)]


def templates_tree(repo: Path, tag: str) -> str | None:
    """The tree hash of `templates/` at a tag, or None when that release had none."""
    result = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{tag}^{{commit}}:{TEMPLATES}"],
                            cwd=repo, capture_output=True, text=True)
    return result.stdout.strip() or None


def build_bundle(repo: Path, output: Path) -> list[str]:
    """Write the bundle for every release of `repo` to `output`; returns the versions it holds."""
    releases = [(tag, version, templates_tree(repo, tag)) for tag, version in release_tags(repo)]
    skipped = [tag for tag, _, tree in releases if tree is None]
    if skipped:
        print(f"note: no {TEMPLATES}/ folder at {', '.join(skipped)}; not in the history", file=sys.stderr)
    releases = [(tag, version, tree) for tag, version, tree in releases if tree is not None]
    if not releases:
        raise BuildError(f"no release tag vX.Y.Z with a {TEMPLATES}/ folder in {repo}; tag a release first")
    with tempfile.TemporaryDirectory(prefix="template-history.") as scratch:
        work = Path(scratch)
        git("init", "--quiet", "--bare", cwd=work)
        # Only the release tags' objects are needed; the bundle keeps just the templates trees.
        git("fetch", "--quiet", "--no-tags", str(repo.resolve()),
            *(f"refs/tags/{tag}:refs/source/{tag}" for tag, _, _ in releases), cwd=work)
        parent: str | None = None
        for _, version, tree in releases:
            commit = git("commit-tree", tree, *(["-p", parent] if parent else []),
                         "-m", f"scaffold template {version}", cwd=work, env=FIXED_IDENTITY)
            git("tag", version, commit, cwd=work)
            parent = commit
        output.parent.mkdir(parents=True, exist_ok=True)
        partial = output.with_name(output.name + ".partial")
        git("bundle", "create", "--quiet", str(partial.resolve()),
            *(f"refs/tags/{version}" for _, version, _ in releases), cwd=work)
        os.replace(partial, output)  # a half-written bundle never takes the real one's place
    return [version for _, version, _ in releases]


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parent.parent
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=root, help="the scaffold git repository (default: this one)")
    parser.add_argument("--output", type=Path, default=root / "scaffold" / "template-history.bundle",
                        help="where to write the bundle (default: scaffold/template-history.bundle)")
    args = parser.parse_args(argv)
    try:
        versions = build_bundle(args.repo, args.output)
    except BuildError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.output} with template versions {', '.join(versions)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
