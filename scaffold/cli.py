"""The `scaffold` command line."""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from scaffold import __version__
from scaffold.catalog import load_algorithms, load_tasks
from scaffold.history import HistoryError
from scaffold.paths import template_dir
from scaffold.recipes import RecipeError, load_recipe, recipe_paths

if TYPE_CHECKING:
    from scaffold.upgrade import UpdateResult

app = typer.Typer(
    help="Generate plain, readable PyTorch training projects from recipes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)


def _print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """A table on a terminal; into a pipe or a file, one tab-separated line per row under
    a header line, nothing wrapped or cut: `grep` sees a whole row, `cut -f` a cell."""
    if out.is_terminal:
        table = Table(*header, box=None, show_edge=False)
        for row in rows:
            table.add_row(*row)
        # The first column names the row: never folded; the others wrap, never cut.
        table.columns[0].no_wrap = True
        table.columns[0].min_width = max(map(len, [header[0], *(r[0] for r in rows)]))
        for column in table.columns[1:]:
            column.overflow = "fold"
        out.print(table)
        return
    for row in (header, *rows):
        typer.echo("\t".join(row))  # rich would expand the tabs


def _fail(message: str, code: int = 2) -> typer.Exit:
    err.print(f"error: {message}", markup=False)
    return typer.Exit(code)


def _version_callback(show: bool) -> None:
    if show:
        out.print(f"scaffold {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],
        typer.Option(
            "--version",
            callback=_version_callback,
            is_eager=True,
            help="Print the version.",
        ),
    ] = None,
) -> None:
    """Generate plain, readable PyTorch training projects from recipes."""


@app.command()
def new(
    dest: Annotated[
        Path, typer.Argument(help="Folder to create (must not exist, or be empty).")
    ],
    recipe: Annotated[
        str,
        typer.Option(
            "--recipe",
            "-r",
            help="A recipe name (see `scaffold recipes`) or a recipe .toml path.",
        ),
    ] = "gpt2-speedup",
    set_: Annotated[
        Optional[list[str]],
        typer.Option(
            "--set",
            help="Override a recipe answer: key=value or algorithm.param=value (repeatable).",
        ),
    ] = None,
    name: Annotated[
        Optional[str],
        typer.Option("--name", help="Project name (default: the folder name)."),
    ] = None,
) -> None:
    """Generate a project from a recipe: black-formatted, git-initialised, ready to `python train.py`."""
    from scaffold.render import (
        new_project,
    )  # copier is slow to import; keep --help fast

    try:
        answers = new_project(recipe, dest, set_ or [], name)
    except (RecipeError, HistoryError) as error:
        raise _fail(str(error)) from None
    algorithms = ", ".join(answers["algorithms"]) or "none"
    out.print(
        f"created {dest} from recipe {answers['recipe']} (algorithms: {algorithms})",
        markup=False,
    )
    out.print(f"  cd {dest} && python train.py", markup=False)


def _report(result: "UpdateResult", done: str) -> None:
    """Print what an update changed; exit 1 when files hold conflict markers."""
    from scaffold.upgrade import HOW_TO_RESOLVE, describe

    if result.changes.empty:
        out.print(f"{done}: no file changed", markup=False)
        return
    out.print(f"{done}:", markup=False)
    for line in describe(result):
        out.print(line, markup=False)
    if result.dry_run:
        if result.diffstat:
            out.print(result.diffstat, markup=False)
        out.print(
            "dry run: nothing was written; run again without --dry-run to apply",
            markup=False,
        )
    else:
        out.print(
            "nothing is committed: review with `git status` and `git diff`, then commit",
            markup=False,
        )
    if result.changes.conflicted:
        count = len(result.changes.conflicted)
        verb = "conflict" if count > 1 else "conflicts"
        would = "would conflict" if result.dry_run else verb
        err.print(
            f"{count} file{'s' if count > 1 else ''} {would} with your edits: "
            f"{', '.join(result.changes.conflicted)}",
            markup=False,
        )
        if not result.dry_run:
            err.print(f"to resolve: {HOW_TO_RESOLVE}", markup=False)
        raise typer.Exit(1)


@app.command()
def upgrade(
    project: Annotated[
        Path, typer.Argument(help="The project folder (a clean git work tree).")
    ] = Path("."),
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would change; write nothing.")
    ] = False,
) -> None:
    """Merge this scaffold's template changes into a project, keeping your edits (3-way merge)."""
    from scaffold.upgrade import UpdateError
    from scaffold.upgrade import upgrade as run_upgrade

    try:
        result = run_upgrade(project, dry_run=dry_run)
    except (UpdateError, HistoryError) as error:
        raise _fail(str(error)) from None
    if result.old_version == result.new_version:
        out.print(
            f"{project} is already at template version {result.new_version}; nothing to upgrade",
            markup=False,
        )
        return
    verb = "would upgrade" if dry_run else "upgraded"
    _report(
        result,
        f"{verb} {project} from template {result.old_version} to {result.new_version}",
    )


@app.command()
def add(
    algorithm: Annotated[
        str, typer.Argument(help="An algorithm name (see `scaffold algorithms`).")
    ],
    project: Annotated[
        Path, typer.Argument(help="The project folder (a clean git work tree).")
    ] = Path("."),
    set_: Annotated[
        Optional[list[str]],
        typer.Option(
            "--set", help="A hyperparameter of the algorithm: param=value (repeatable)."
        ),
    ] = None,
) -> None:
    """Add an algorithm to a project: its code is merged in, your edits are kept."""
    from scaffold.upgrade import UpdateError
    from scaffold.upgrade import add as run_add

    try:
        result = run_add(project, algorithm, set_ or [])
    except (UpdateError, HistoryError) as error:
        raise _fail(str(error)) from None
    _report(result, f"added {algorithm} to {project}")


@app.command()
def remove(
    algorithm: Annotated[str, typer.Argument(help="An algorithm in the project.")],
    project: Annotated[
        Path, typer.Argument(help="The project folder (a clean git work tree).")
    ] = Path("."),
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Remove the algorithm's blocks even where you edited or moved them.",
        ),
    ] = False,
) -> None:
    """Remove an algorithm from a project: its code is merged out, your other edits are kept."""
    from scaffold.upgrade import UpdateError
    from scaffold.upgrade import remove as run_remove

    try:
        result = run_remove(project, algorithm, force=force)
    except (UpdateError, HistoryError) as error:
        raise _fail(str(error)) from None
    _report(result, f"removed {algorithm} from {project}")


@app.command(name="set")
def set_(
    answers: Annotated[
        list[str],
        typer.Argument(
            help="Answers to change: key=value (e.g. auto_microbatching=true)."
        ),
    ],
    project: Annotated[
        Path,
        typer.Option("--project", help="The project folder (a clean git work tree)."),
    ] = Path("."),
) -> None:
    """Change a generation answer of a project: the code it changes is merged in, your edits are kept."""
    from scaffold.upgrade import UpdateError, set_answers

    try:
        result = set_answers(project, answers)
    except (UpdateError, HistoryError) as error:
        raise _fail(str(error)) from None
    _report(result, f"set {', '.join(answers)} in {project}")


@app.command()
def check(
    project: Annotated[Path, typer.Argument(help="The project folder.")] = Path("."),
) -> None:
    """Check your edits against the generated code: event markers, algorithm fences, Config fields.

    Exits 0 when `upgrade`, `add` and `remove` can proceed, 1 (with the reasons) when they cannot.
    """
    from scaffold.check import check as run_check
    from scaffold.project import ProjectError

    try:
        report = run_check(project)
    except (ProjectError, HistoryError) as error:
        raise _fail(str(error)) from None
    out.print(f"{project} (template {report.version})", markup=False)
    _print_table(
        ("algorithm", "status", "blocks", "where"),
        [
            (state.name, state.status, state.blocks or "-", state.detail or "-")
            for state in report.algorithms
        ],
    )
    markers = [m for m in report.markers if m.status != "present"]
    present = len(report.markers) - len(markers)
    out.print(
        f"event markers: {present} of {len(report.markers)} in place", markup=False
    )
    for marker in markers:
        out.print(f"  {marker.path}: {marker.name} {marker.status}", markup=False)
    if report.problems:
        for problem in report.problems:
            err.print(f"problem: {problem}", markup=False)
        err.print("upgrade, add and remove refuse until these are fixed", markup=False)
        raise typer.Exit(1)
    out.print("ok: upgrade, add and remove can proceed", markup=False)


@app.command()
def diff(
    project: Annotated[Path, typer.Argument(help="The project folder.")] = Path("."),
) -> None:
    """Show your changes against the code your template version generated, per algorithm and event."""
    from scaffold.diff import diff as run_diff
    from scaffold.project import ProjectError

    try:
        lines = run_diff(project)
    except (ProjectError, HistoryError) as error:
        raise _fail(str(error)) from None
    for line in lines:
        out.print(line, markup=False, highlight=False)


JSON_HELP = "Print JSON (one object per entry, every field whole) instead of a table."


@app.command()
def recipes(
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """List the shipped recipes."""
    template = template_dir()
    shipped = [load_recipe(name, template) for name in recipe_paths(template)]
    if as_json:
        out.print_json(data=[dataclasses.asdict(recipe) for recipe in shipped])
        return
    _print_table(
        ("recipe", "algorithms", "description"),
        [
            (recipe.name, ", ".join(recipe.algorithms) or "-", recipe.description)
            for recipe in shipped
        ],
    )


@app.command()
def algorithms(
    task: Annotated[
        Optional[str],
        typer.Option("--task", help="Only the algorithms that apply to this task."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """List the algorithm catalog by name: what each does, where it hooks in, its hyperparameters."""
    template = template_dir()
    tasks = load_tasks(template)
    if task is not None and task not in tasks:
        close = difflib.get_close_matches(task, list(tasks), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise _fail(f"unknown task '{task}'{hint}; tasks: {', '.join(tasks)}")
    listed = sorted(
        (
            algorithm
            for algorithm in load_algorithms(template).values()
            if task is None or task in algorithm.tasks
        ),
        key=lambda algorithm: algorithm.name,
    )
    if as_json:
        out.print_json(
            data=[
                {**dataclasses.asdict(algorithm), "events": list(algorithm.events)}
                for algorithm in listed
            ]
        )
        return
    rows = []
    for algorithm in listed:
        params = ", ".join(
            f"{p.name}={p.default}"
            + (f" in {p.range}" if p.range else "")
            + (f" of {'|'.join(map(str, p.choices))}" if p.choices else "")
            for p in algorithm.hyperparameters.values()
        )
        rows.append(
            (
                algorithm.name,
                ", ".join(algorithm.events),
                ", ".join(algorithm.tasks),
                params or "-",
                algorithm.hub_models or "-",
                algorithm.summary,
            )
        )
    _print_table(
        ("algorithm", "events", "tasks", "hyperparameters", "hub models", "summary"),
        rows,
    )


@app.command()
def export(
    source: Annotated[
        str,
        typer.Argument(
            metavar="RUN_OR_CHECKPOINT",
            help="A run folder (runs/NAME: its newest complete checkpoint) or a step-N checkpoint; "
            "local or a URL (s3://bucket/run/checkpoints, with s3fs installed).",
        ),
    ],
    out_path: Annotated[
        Path,
        typer.Argument(
            metavar="OUT",
            help="The .safetensors file to write; with --format hf, a folder.",
        ),
    ],
    format_: Annotated[
        str,
        typer.Option(
            "--format",
            help="safetensors: the model's own weights in one file; hf: a "
            "Hugging Face folder (config.json + model.safetensors): GPT2LMHeadModel "
            "(causal_lm projects with learned positions) or BertForMaskedLM with the "
            "run's tokenizer (masked_lm projects with BERT's layout).",
        ),
    ] = "safetensors",
    run_config: Annotated[
        Optional[Path],
        typer.Option(
            "--run-config",
            help="--format hf: the run's config.toml (default: beside a local run).",
        ),
    ] = None,
    project: Annotated[
        Optional[Path],
        typer.Option(
            "--project",
            help="--format hf: the project whose model.py trained the run "
            "(default: the folder holding runs/, else the current one).",
        ),
    ] = None,
    entry: Annotated[
        str,
        typer.Option(
            "--entry",
            help="The checkpoint entry to export (e.g. model, ema); default: the one the run named "
            "(the EMA weights when ema is on with ema_export), else model.",
        ),
    ] = "",
) -> None:
    """Consolidate a sharded checkpoint's model weights into one safetensors file, or a Hugging
    Face GPT-2 folder (no GPUs needed)."""
    from runtime.checkpoint import (
        CheckpointError,
        export_safetensors,
    )  # torch: slow to import

    if format_ not in ("safetensors", "hf"):
        raise _fail(f"--format={format_}: use safetensors or hf")
    try:
        if format_ == "hf":
            from runtime.hf import export_gpt2

            info = export_gpt2(source, out_path, run_config=run_config, project=project)
            what = f"{info['folder']} (config.json, model.safetensors)"
        else:
            info = export_safetensors(source, out_path, entry)
            what = f"{info['file']} (state entry '{info['entry']}')"
    except CheckpointError as error:
        raise _fail(str(error)) from None
    out.print(
        f"wrote {what}: {info['tensors']} tensors ({info['numel']:,} values) "
        f"from {info['checkpoint']} (step {info['step']})",
        markup=False,
    )


@app.command()
def plot(
    runs: Annotated[
        list[Path],
        typer.Argument(metavar="RUN...", help="Run folders (runs/NAME) to overlay."),
    ],
    output: Annotated[
        Path, typer.Option("--output", "-o", help="The PNG to write.")
    ] = Path("runs.png"),
    x: Annotated[
        str,
        typer.Option(
            "--x", help="x axis: step, tokens, samples or time (training seconds)."
        ),
    ] = "step",
) -> None:
    """Plot loss, validation loss, learning rate and throughput of one or more runs in one PNG."""
    from scaffold.plot import PlotError, write_plot

    try:
        written = write_plot(runs, output, x)
    except PlotError as error:
        raise _fail(str(error)) from None
    out.print(f"wrote {written}: {', '.join(str(run) for run in runs)}", markup=False)


def main() -> None:
    app()
