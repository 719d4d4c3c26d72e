"""The `scaffold` command line."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from scaffold import __version__
from scaffold.catalog import RecipeError, load_algorithms, load_recipe, recipe_paths
from scaffold.history import HistoryError
from scaffold.paths import template_dir

app = typer.Typer(
    help="Generate plain, readable PyTorch training projects from recipes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err = Console(stderr=True, highlight=False, soft_wrap=True)
out = Console(highlight=False, soft_wrap=True)


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
        typer.Option("--version", callback=_version_callback, is_eager=True, help="Print the version."),
    ] = None,
) -> None:
    """Generate plain, readable PyTorch training projects from recipes."""


@app.command()
def new(
    dest: Annotated[Path, typer.Argument(help="Folder to create (must not exist, or be empty).")],
    recipe: Annotated[
        str, typer.Option("--recipe", "-r", help="A recipe name (see `scaffold recipes`) or a recipe .toml path.")
    ] = "gpt2-speedup",
    set_: Annotated[
        Optional[list[str]],
        typer.Option("--set", help="Override a recipe answer: key=value or algorithm.param=value (repeatable)."),
    ] = None,
    name: Annotated[
        Optional[str], typer.Option("--name", help="Project name (default: the folder name).")
    ] = None,
) -> None:
    """Generate a project from a recipe: black-formatted, git-initialised, ready to `python train.py`."""
    from scaffold.render import new_project  # copier is slow to import; keep --help fast

    try:
        answers = new_project(recipe, dest, set_ or [], name)
    except (RecipeError, HistoryError) as error:
        raise _fail(str(error)) from None
    algorithms = ", ".join(answers["algorithms"]) or "none"
    out.print(f"created {dest} from recipe {answers['recipe']} (algorithms: {algorithms})", markup=False)
    out.print(f"  cd {dest} && python train.py", markup=False)


@app.command()
def recipes() -> None:
    """List the shipped recipes."""
    template = template_dir()
    table = Table("recipe", "algorithms", "description", box=None, show_edge=False)
    for name in recipe_paths(template):
        recipe = load_recipe(name, template)
        table.add_row(name, ", ".join(recipe.algorithms) or "-", recipe.description)
    out.print(table)


@app.command()
def algorithms() -> None:
    """List the algorithm catalog: what each does, where it hooks in, its hyperparameters."""
    table = Table("algorithm", "events", "hyperparameters", "summary", box=None, show_edge=False)
    for algorithm in load_algorithms(template_dir()).values():
        params = ", ".join(f"{p.name}={p.default}" for p in algorithm.hyperparameters.values())
        table.add_row(algorithm.name, ", ".join(algorithm.events), params or "-", algorithm.summary)
    out.print(table)


@app.command()
def export(
    source: Annotated[
        Path,
        typer.Argument(
            metavar="RUN_OR_CHECKPOINT",
            help="A run folder (runs/NAME: its newest complete checkpoint) or a step-N checkpoint.",
        ),
    ],
    out_file: Annotated[Path, typer.Argument(metavar="OUT", help="The .safetensors file to write.")],
) -> None:
    """Consolidate a sharded checkpoint's model weights into one safetensors file (no GPUs needed)."""
    from runtime.checkpoint import CheckpointError, export_safetensors  # torch: slow to import

    try:
        info = export_safetensors(source, out_file)
    except CheckpointError as error:
        raise _fail(str(error)) from None
    out.print(
        f"wrote {info['file']}: {info['tensors']} tensors ({info['numel']:,} values) "
        f"from {info['checkpoint']} (step {info['step']})",
        markup=False,
    )


def main() -> None:
    app()
