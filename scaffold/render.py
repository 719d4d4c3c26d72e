"""`scaffold new`: recipe -> copier answers -> a rendered, black-formatted, committed project.

The project is rendered into a temporary folder beside DEST and moved into place only once it
is complete and committed, so a failure never leaves a half-written project behind.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import copier

from scaffold import __version__
from scaffold.answers import resolve
from scaffold.history import HISTORY_SRC, TemplateRelease, git
from scaffold.paths import template_dir
from scaffold.recipes import RecipeError, apply_overrides, load_recipe


def bundle_path() -> Path:
    """The git bundle of released template versions shipped in the wheel (absent in a checkout)."""
    return Path(__file__).resolve().parent / "template-history.bundle"


def installed_release() -> TemplateRelease:
    """The templates shipped with this scaffold, under its own version."""
    return TemplateRelease(template_dir(), __version__, bundle_path())


def check_destination(dest: Path) -> None:
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise RecipeError(
            f"destination {dest} already exists and is not empty; choose a new "
            "folder (scaffold never overwrites files)"
        )


def render(
    answers: dict[str, Any], dest: Path, release: TemplateRelease | None = None
) -> str:
    """Render the release's templates into `dest` (which must not exist yet); returns the
    template version the project records (a development install's may be `X.Y.Z+dev.HASH`).
    """
    release = release or installed_release()
    version = release.prepare_history()
    render_version(answers, dest, version)
    return version


def render_version(answers: dict[str, Any], dest: Path, version: str) -> None:
    """Render template `version` of the template history with `answers` into `dest`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # copier's "dirty template" and similar notices
        copier.run_copy(
            HISTORY_SRC,
            str(dest),
            data=answers,
            vcs_ref=version,
            defaults=True,
            unsafe=True,  # the template's black filter is a jinja extension
            quiet=True,
        )


def commit_all(project: Path, message: str) -> None:
    """git init (if needed) and commit every file, with a fallback identity on bare machines."""
    if not (project / ".git").exists():
        git("init", "--quiet", cwd=project)
    identity: dict[str, str] = {}
    if not git("config", "user.email", cwd=project, check=False):
        identity = {
            "GIT_AUTHOR_NAME": "scaffold",
            "GIT_AUTHOR_EMAIL": "scaffold@localhost",
            "GIT_COMMITTER_NAME": "scaffold",
            "GIT_COMMITTER_EMAIL": "scaffold@localhost",
        }
    git("add", "--all", cwd=project)
    git("commit", "--quiet", "--no-verify", "-m", message, cwd=project, env=identity)


def new_project(
    recipe_name: str,
    dest: Path,
    overrides: list[str],
    name: str | None = None,
    release: TemplateRelease | None = None,
) -> dict[str, Any]:
    """Generate a project from a recipe into `dest`; returns the answers used."""
    release = release or installed_release()
    dest = dest.expanduser().absolute()
    check_destination(dest)
    template = release.template
    recipe = apply_overrides(load_recipe(recipe_name, template), overrides)
    answers = resolve(recipe, template, name or dest.name)
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        project = staging / "project"
        version = render(answers, project, release)
        commit_all(
            project,
            f"Generate {answers['project_name']} from recipe {recipe.name} "
            f"(scaffold {version})",
        )
        if dest.exists():
            dest.rmdir()  # empty (checked above); replaced atomically below
        os.replace(project, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return answers
