"""`scaffold upgrade`, `scaffold add` and `scaffold remove`: copier updates that keep hand edits.

All three are one operation: copier re-renders the project's recorded template version with
its recorded answers (the merge base), renders the target version with the target answers,
and 3-way merges the difference into the user's files (DESIGN.md §8.5). `upgrade` changes the
version; `add`/`remove` change the `algorithms` answer at the project's current version.

Nothing is written before every precondition holds (a clean git tree, a scaffold answers file,
a version the template history holds, no downgrade); each refusal is an `UpdateError` whose
message names the problem and the fix. The result is left uncommitted for review in git.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import copier
from copier.errors import CopierError
from packaging.version import InvalidVersion, Version
from plumbum import local

from scaffold.answers import add_algorithm, DERIVED_ANSWERS, remove_algorithm, resolve
from scaffold.catalog import (
    Algorithm,
    CatalogError,
    load_algorithms,
    load_models,
    ModelFamily,
)
from scaffold.compare import Report, add_blockers, compare, remove_blockers
from scaffold.fence_removal import drop_algorithm
from scaffold.history import (
    HISTORY_SRC,
    TemplateRelease,
    export_version,
    has_version,
    history_path,
    known_versions,
)
from scaffold.project import ANSWERS_FILE, ProjectError, pristine_render, read_answers
from scaffold.recipes import parse_override, Recipe, RecipeError
from scaffold.render import installed_release

CONFLICT_START = "<<<<<<< "
CONFLICT_END = ">>>>>>> "
HOW_TO_RESOLVE = (
    "edit each conflicted file: keep what you want between <<<<<<< (your version), ||||||| (the "
    "old template), ======= and >>>>>>> (the new template), delete the markers, then `git add FILE`; "
    "`git checkout -m FILE` recreates the markers if you want to start over"
)


class UpdateError(RuntimeError):
    """The project cannot be updated as asked; nothing was written. The message says how to fix it."""


@dataclass(frozen=True)
class FileChanges:
    """What an update did to the project's files, from `git status` (paths relative to the project)."""

    modified: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    conflicted: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.modified or self.added or self.deleted or self.conflicted)


@dataclass(frozen=True)
class UpdateResult:
    project: Path
    old_version: str
    new_version: str
    changes: FileChanges
    dry_run: bool = False
    diffstat: str = (
        ""  # `git diff --stat` of a dry run (the real run leaves `git diff` to the user)
    )


@dataclass(frozen=True)
class ProjectState:
    """A project that passed the preflight: its answers, the template version it records, and
    the version the installed templates are held under (the release's, or a development
    install's `X.Y.Z+dev.HASH`)."""

    path: Path
    answers: dict[str, Any]
    version: str
    target: str


# --- preflight -------------------------------------------------------------------------------


def _git_probe(project: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], cwd=project, capture_output=True, text=True)


def _check_git_work_tree(project: Path) -> None:
    if not project.is_dir():
        raise UpdateError(
            f"{project} is not a folder; pass the folder of a scaffold project"
        )
    inside = _git_probe(project, "rev-parse", "--is-inside-work-tree")
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        raise UpdateError(
            f"{project} is not in a git work tree; scaffold merges template changes "
            "into git-tracked files only: run `git init && git add -A && git commit` first"
        )
    if _git_probe(project, "rev-parse", "--verify", "--quiet", "HEAD").returncode != 0:
        raise UpdateError(
            f"the git repository of {project} has no commit yet; commit your files first "
            "(git add -A && git commit)"
        )


def _check_clean(project: Path) -> None:
    # Untracked files count: copier's merge could overwrite them and `git checkout` could not undo it.
    status = _git_probe(
        project, "status", "--porcelain", "--untracked-files=all", "--", "."
    )
    if status.returncode != 0:
        raise UpdateError(f"git status failed in {project}: {status.stderr.strip()}")
    if status.stdout.strip():
        paths = [line[3:] for line in status.stdout.splitlines()]
        what = (
            f"{paths[0]}" if len(paths) == 1 else f"{len(paths)} paths, e.g. {paths[0]}"
        )
        raise UpdateError(
            f"{project} has uncommitted changes ({what}); commit or "
            "stash them first (git add -A && git commit, or git stash -u), so the update "
            "can be reviewed and undone in git"
        )


def _read_answers(project: Path) -> dict[str, Any]:
    try:
        return read_answers(project)
    except ProjectError as error:
        raise UpdateError(str(error)) from None


def _check_source(project: Path, answers: dict[str, Any]) -> None:
    source = answers.get("_src_path")
    if source != HISTORY_SRC and Path(str(source)).expanduser() != history_path():
        raise UpdateError(
            f"{project / ANSWERS_FILE} records template source {source!r}, not scaffold's "
            f"template history {HISTORY_SRC}; update this project with `copier update` "
            "instead"
        )


def _recorded_version(project: Path, answers: dict[str, Any], history: Path) -> str:
    version = answers.get("_commit")
    if not version:
        raise UpdateError(
            f"{project / ANSWERS_FILE} records no template version (_commit); restore the "
            "file from git history"
        )
    version = str(version)
    if not has_version(history, version):
        known = ", ".join(sorted(known_versions(history), key=_sort_key)) or "none"
        if "+dev." in version:
            raise UpdateError(
                f"the project was generated with {version}, a development snapshot of scaffold's "
                f"templates that the template history does not hold (it has: {known}); run "
                "scaffold once from the development checkout that made it (it snapshots itself)"
            )
        raise UpdateError(
            f"the project was generated with scaffold template version {version}, which the "
            f"template history does not hold (it has: {known}); install a scaffold release "
            f"that knows it (pip install 'scaffold>={version}')"
        )
    return version


def _sort_key(version: str) -> tuple[int, Version | str]:
    try:
        return (1, Version(version))
    except InvalidVersion:
        return (0, version)


def _is_newer(version: str, than: str) -> bool:
    """Whether `version` is a later release than `than`. Local versions (development
    snapshots, `0.2.0+dev.HASH`) count as their release: snapshots of one version have no order.
    """
    try:
        return Version(version).public != Version(than).public and Version(
            version
        ) > Version(than)
    except InvalidVersion:
        return False  # not comparable: let copier decide


def check_code(state: ProjectState) -> Report:
    """`scaffold check` on a project that passed the preflight; refuses on what it cannot work around."""
    try:
        with pristine_render(state.answers, state.version) as pristine:
            report = compare(state.path, pristine, state.answers, state.version)
    except ProjectError as error:
        raise UpdateError(str(error)) from None
    if report.problems:
        more = (
            f" (and {len(report.problems) - 1} more)"
            if len(report.problems) > 1
            else ""
        )
        raise UpdateError(
            f"{report.problems[0]}{more}; nothing was changed: `scaffold check` lists what "
            "to fix, `scaffold diff` shows your changes"
        )
    return report


def preflight(project: Path, release: TemplateRelease) -> ProjectState:
    """Every check that can refuse, in the order a user fixes them; writes nothing to the project."""
    project = project.expanduser().absolute()
    _check_git_work_tree(project)
    answers = _read_answers(project)
    _check_source(project, answers)
    _check_clean(project)
    target = release.prepare_history()
    version = _recorded_version(project, answers, history_path())
    return ProjectState(project, answers, version, target)


# --- running copier --------------------------------------------------------------------------


@contextmanager
def _git_conflict_style_diff3() -> Iterator[None]:
    """Make copier's `git merge-file` write diff3 markers (with the old template's lines).

    copier runs git through plumbum, which copied os.environ when it was imported, so changing
    os.environ now would not reach git; plumbum's own environment does. GIT_CONFIG_COUNT adds
    to any config entries the user already passes this way instead of replacing them.
    """
    count = int(local.env.get("GIT_CONFIG_COUNT", "0") or 0)
    extra = {
        "GIT_CONFIG_COUNT": str(count + 1),
        f"GIT_CONFIG_KEY_{count}": "merge.conflictStyle",
        f"GIT_CONFIG_VALUE_{count}": "diff3",
    }
    with local.env(**extra):
        yield


def _run_copier_update(
    project: Path, version: str | copier.VcsRef, data: dict[str, Any]
) -> None:
    with _git_conflict_style_diff3(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # copier's "dirty template" and similar notices
        try:
            copier.run_update(
                str(project),
                data=data,
                vcs_ref=version,
                defaults=True,
                skip_answered=True,
                overwrite=True,
                conflict="inline",  # never "rej" (DESIGN.md §12.1)
                unsafe=True,  # the template's black filter is a jinja extension
                quiet=True,
            )
        except CopierError as error:
            # The tree was clean before (preflight), so git can always undo a half-done update.
            raise UpdateError(
                f"copier could not update {project}: {error}; `git checkout -- . && "
                "git clean -fd` restores the last commit"
            ) from None


def _has_conflict_markers(path: Path) -> bool:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:  # deleted, or a folder
        return False
    return any(line.startswith(CONFLICT_START) for line in lines) and any(
        line.startswith(CONFLICT_END) for line in lines
    )


def file_changes(project: Path) -> FileChanges:
    """Classify `git status` of the project folder; files holding conflict markers are conflicted."""
    # Porcelain paths are relative to the repository root, whatever the working directory.
    prefix = _git_probe(project, "rev-parse", "--show-prefix").stdout.strip()
    status = _git_probe(
        project,
        "status",
        "--porcelain=v1",
        "-z",
        "--untracked-files=all",
        "--no-renames",
        "--",
        ".",
    )
    changes = FileChanges()
    for entry in filter(None, status.stdout.split("\0")):
        code, path = entry[:2], entry[3:].removeprefix(prefix)
        if "U" in code or code in ("AA", "DD") or _has_conflict_markers(project / path):
            changes.conflicted.append(path)
        elif code == "??" or "A" in code:
            changes.added.append(path)
        elif "D" in code:
            changes.deleted.append(path)
        else:
            changes.modified.append(path)
    return changes


def _diffstat(project: Path) -> str:
    # Untracked files are added with --intent-to-add so the stat counts the new files' lines too.
    # Against HEAD, so conflicted (unmerged) files count their real changes.
    _git_probe(project, "add", "--intent-to-add", "--all", "--", ".")
    return _git_probe(
        project, "diff", "HEAD", "--stat", "--relative", "--", "."
    ).stdout.rstrip()


@contextmanager
def _scratch_clone(project: Path) -> Iterator[Path]:
    """A throwaway clone of the project's repository; yields the project's folder inside it."""
    top = Path(_git_probe(project, "rev-parse", "--show-toplevel").stdout.strip())
    inside = project.resolve().relative_to(top.resolve())
    scratch = Path(tempfile.mkdtemp(prefix="scaffold-dry-run."))
    try:
        # --no-hardlinks: the real repository's files are not even linked to.
        clone = subprocess.run(
            [
                "git",
                "clone",
                "--quiet",
                "--no-hardlinks",
                str(top),
                str(scratch / "repo"),
            ],
            capture_output=True,
            text=True,
        )
        if clone.returncode != 0:
            raise UpdateError(
                f"could not clone {top} for the dry run: {clone.stderr.strip()}"
            )
        yield scratch / "repo" / inside
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _update(
    state: ProjectState,
    version: str | copier.VcsRef,
    data: dict[str, Any],
    dry_run: bool,
) -> tuple[FileChanges, str]:
    if not dry_run:
        _run_copier_update(state.path, version, data)
        return file_changes(state.path), ""
    with _scratch_clone(state.path) as clone:
        _run_copier_update(clone, version, data)
        return file_changes(clone), _diffstat(clone)


# --- the three commands ----------------------------------------------------------------------


def upgrade(
    project: Path, release: TemplateRelease | None = None, dry_run: bool = False
) -> UpdateResult:
    """Merge the template changes between the project's version and `release` into the project."""
    release = release or installed_release()
    state = preflight(project, release)
    if _is_newer(state.version, state.target):
        raise UpdateError(
            f"the project was generated with scaffold template {state.version}, newer than "
            f"this scaffold ({state.target}); upgrading would downgrade it: install "
            f"scaffold>={Version(state.version).public} (pip install -U scaffold)"
        )
    if state.version == state.target:
        return UpdateResult(
            state.path, state.version, state.target, FileChanges(), dry_run
        )
    check_code(state)
    try:
        catalog = load_algorithms(release.template)
    except CatalogError as error:
        raise UpdateError(str(error)) from None
    data = _recorded_values(state, catalog)
    changes, diffstat = _update(state, state.target, data, dry_run)
    return UpdateResult(
        state.path, state.version, state.target, changes, dry_run, diffstat
    )


def _recorded_values(
    state: ProjectState, catalog: dict[str, Algorithm]
) -> dict[str, Any]:
    """The project's algorithm answers with every option they lack filled in, so the
    upgraded answers name all of them as a fresh project's do: for an option newer than the
    project whose default differs from what it trained with, that value (`earlier`), else
    the default (what the project trained with); {} when nothing is missing."""
    recorded = state.answers.get("algorithms") or {}
    algorithms = {name: dict(params or {}) for name, params in recorded.items()}
    for name, params in algorithms.items():
        for option in getattr(catalog.get(name), "hyperparameters", {}).values():
            if option.name in params:
                continue
            if option.earlier is not None and _is_newer(
                option.earlier[0], state.version
            ):
                params[option.name] = option.earlier[1]
            else:
                params[option.name] = option.default
    return {"algorithms": algorithms} if algorithms != recorded else {}


AlgorithmChange = Callable[
    [dict[str, dict[str, Any]], dict[str, Algorithm], str, ModelFamily],
    dict[str, dict[str, Any]],
]


def _change_algorithms(
    project: Path,
    release: TemplateRelease | None,
    change: AlgorithmChange,
    blockers: Callable[[Report], list[str]] = lambda report: [],
    after: Callable[[Path], None] = lambda path: None,
) -> UpdateResult:
    """Re-render the project at its current version with new `algorithms` answers from `change`.

    `blockers` names what in the checked code stops this change (nothing is written then);
    `after` tidies the merged files before they are classified.
    """
    release = release or installed_release()
    state = preflight(project, release)
    history = history_path()
    with tempfile.TemporaryDirectory(prefix="scaffold-template.") as scratch:
        # The packs of the project's own version: the installed one may know other algorithms.
        template = export_version(history, state.version, Path(scratch))
        try:
            catalog, models = load_algorithms(template), load_models(template)
        except CatalogError:
            raise UpdateError(
                f"{state.path} is at template version {state.version}, whose algorithm "
                "catalog this scaffold cannot read; run `scaffold upgrade` first, "
                "commit, then add or remove algorithms"
            ) from None
    current = dict(state.answers.get("algorithms") or {})
    # Projects from before task packs (0.1.0) were GPT language models.
    task = str(state.answers.get("task", "causal_lm"))
    family = models.get(str(state.answers.get("model_family", "gpt")))
    try:
        if family is None:
            raise RecipeError(
                f"{state.path / ANSWERS_FILE} records model family "
                f"{state.answers.get('model_family')!r}, which template "
                f"{state.version} does not have; restore the file from git history"
            )
        algorithms = change(current, catalog, task, family)
    except RecipeError as error:
        raise UpdateError(str(error)) from None
    report = check_code(state)
    reasons = blockers(report)
    if reasons:
        raise UpdateError("\n".join(reasons))
    _update(state, copier.VcsRef.CURRENT, {"algorithms": algorithms}, dry_run=False)
    after(state.path)
    return UpdateResult(
        state.path, state.version, state.version, file_changes(state.path)
    )


def add(
    project: Path,
    algorithm: str,
    overrides: Sequence[str] = (),
    release: TemplateRelease | None = None,
) -> UpdateResult:
    """Add an algorithm (its hyperparameters from `param=value` overrides) and merge it into the files."""
    return _change_algorithms(
        project,
        release,
        lambda current, catalog, task, family: add_algorithm(
            current, algorithm, list(overrides), catalog, task, family
        ),
        lambda report: add_blockers(report, algorithm),
    )


def remove(
    project: Path,
    algorithm: str,
    release: TemplateRelease | None = None,
    force: bool = False,
) -> UpdateResult:
    """Remove an algorithm and merge its removal into the files.

    A block of the algorithm the user edited or moved would survive a 3-way merge as a conflict
    or as dangling code: without `force` that is refused (the message shows the block); with it,
    the algorithm's fenced blocks are removed whatever they hold.
    """

    def blockers(report: Report) -> list[str]:
        reasons = remove_blockers(report, algorithm)
        if not reasons or force:
            return []
        return [
            f"you changed {algorithm}'s code, so removing it would drop your edits:",
            *reasons,
            f"nothing was changed; to remove it anyway: scaffold remove {algorithm} --force "
            "(git keeps your version in the last commit)",
        ]

    return _change_algorithms(
        project,
        release,
        lambda current, catalog, *_: remove_algorithm(current, algorithm, catalog),
        blockers,
        (
            (lambda path: drop_algorithm(path, algorithm))
            if force
            else (lambda path: None)
        ),
    )


def describe(result: UpdateResult) -> list[str]:
    """Lines summarising an update for the terminal."""
    lines = []
    for label, paths in (
        ("modified", result.changes.modified),
        ("added", result.changes.added),
        ("deleted", result.changes.deleted),
        ("conflict", result.changes.conflicted),
    ):
        lines.extend(f"  {label:<9} {path}" for path in paths)
    return lines


def set_answers(
    project: Path, overrides: Sequence[str], release: TemplateRelease | None = None
) -> UpdateResult:
    """Change generation answers (`key=value`, e.g. `auto_microbatching=true`) and merge
    the project re-rendered with them into its files, keeping the user's edits."""
    release = release or installed_release()
    state = preflight(project, release)
    changed = dict(parse_override(text) for text in overrides)
    if not changed:
        raise UpdateError(
            "name an answer to change, e.g. `scaffold set auto_microbatching=true`"
        )
    kept = {
        key: value
        for key, value in state.answers.items()
        if not key.startswith("_") and key not in DERIVED_ANSWERS
    }
    recipe = Recipe(
        str(state.answers.get("recipe", "custom")),
        "",
        kept | changed,
        dict(state.answers.get("algorithms") or {}),
    )
    with tempfile.TemporaryDirectory(prefix="scaffold-template.") as scratch:
        template = export_version(history_path(), state.version, Path(scratch))
        try:  # every answer checked as `scaffold new` checks a recipe's
            answers = resolve(recipe, template, str(state.answers["project_name"]))
        except RecipeError as error:
            raise UpdateError(str(error).replace("recipe ", "answers of ", 1)) from None
    check_code(state)
    _update(
        state,
        copier.VcsRef.CURRENT,
        {key: answers[key] for key in changed},
        dry_run=False,
    )
    return UpdateResult(
        state.path, state.version, state.version, file_changes(state.path)
    )
