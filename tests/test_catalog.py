"""Recipes, the algorithm catalog and `scaffold new`'s handling of bad input."""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import scaffold_cli
from projects import checkout_env
from scaffold.answers import resolve
from scaffold.catalog import EVENTS, load_algorithms
from scaffold.paths import template_dir
from scaffold.recipes import (
    RecipeError,
    apply_overrides,
    load_recipe,
    parse_override,
    recipe_paths,
)

TEMPLATE = template_dir()


def resolved(
    recipe_text: str, tmp_path: Path, overrides: list[str] = (), name: str = "proj"
) -> dict:
    path = tmp_path / "recipe.toml"
    path.write_text(recipe_text)
    return resolve(
        apply_overrides(load_recipe(str(path), TEMPLATE), list(overrides)),
        TEMPLATE,
        name,
    )


def test_shipped_recipes_resolve_with_defaults_filled() -> None:
    speedup = resolve(load_recipe("gpt2-speedup", TEMPLATE), TEMPLATE, "my-gpt")
    # Catalog order: ALiBi's split follows sequence-length warmup's cut.
    assert list(speedup["algorithms"]) == [
        "gradient_clipping",
        "seq_length_warmup",
        "alibi",
    ]
    assert speedup["algorithms"]["alibi"] == {"train_sequence_length_scaling": 1.0}
    assert speedup["algorithms"]["seq_length_warmup"] == {
        "duration": "0.3dur",
        "min_len": 8,
    }
    assert speedup["algorithms"]["gradient_clipping"] == {
        "max_norm": 1.0,
        "clipping_type": "norm",
        "max_value": 1.0,
        "max_ratio": 0.01,
    }
    baseline = resolve(load_recipe("gpt2-baseline", TEMPLATE), TEMPLATE, "my-gpt")
    assert list(baseline["algorithms"]) == ["gradient_clipping"]
    assert (
        baseline["project_name"] == "my-gpt" and baseline["recipe"] == "gpt2-baseline"
    )


def test_algorithm_defaults_fill_missing_hyperparameters(tmp_path: Path) -> None:
    answers = resolved("[algorithms.seq_length_warmup]\nmin_len = 16\n", tmp_path)
    assert answers["algorithms"] == {
        "seq_length_warmup": {"duration": "0.3dur", "min_len": 16}
    }


def test_overrides_set_answers_and_hyperparameters(tmp_path: Path) -> None:
    answers = resolved(
        "[answers]\nlr = 1e-3\n[algorithms.seq_length_warmup]\n",
        tmp_path,
        ["lr=3e-4", "seq_length_warmup.duration=0.5dur", "model=gpt2"],
    )
    assert answers["lr"] == 3e-4 and answers["model"] == "gpt2"
    assert answers["algorithms"]["seq_length_warmup"]["duration"] == "0.5dur"


def test_parse_override_reads_toml_values() -> None:
    assert parse_override("lr=3e-4") == ("lr", 3e-4)
    assert parse_override("seq_len=256") == ("seq_len", 256)
    assert parse_override("model=gpt2-medium") == ("model", "gpt2-medium")
    with pytest.raises(RecipeError, match="key=value"):
        parse_override("lr")


@pytest.mark.parametrize(
    ("recipe_text", "overrides", "message"),
    [
        (
            "[algorithms.alibbi]\n",
            [],
            "unknown algorithm 'alibbi' (did you mean 'alibi'?)",
        ),
        ("[answers]\nlrr = 1.0\n", [], "unknown answer 'lrr' (did you mean 'lr'?)"),
        ("[answers]\nlr = 'fast'\n", [], "answer 'lr' = 'fast' must be of type float"),
        (
            "[answers]\nmodel = 'gpt5'\n",
            [],
            "answer 'model' = 'gpt5' is not a gpt preset",
        ),
        ("[answers]\nmax_duration = '10bb'\n", [], "unknown unit 'bb'"),
        ("[answers]\nrecipe = 'x'\n", [], "'recipe' is set by scaffold itself"),
        (
            "[algorithms.seq_length_warmup]\nmin_length = 3\n",
            [],
            "no hyperparameter 'min_length'",
        ),
        ("[algorithms.seq_length_warmup]\nduration = 3\n", [], "must be of type time"),
        ("colour = 'red'\n", [], "unknown top-level key 'colour'"),
        ("algorithms = ['alibi']\n", [], "write each algorithm as a table"),
        ("[answers\n", [], "is not valid TOML"),
        ("", ["alibi.x=1"], "algorithm 'alibi' is not in recipe"),
    ],
)
def test_bad_recipes_are_refused_with_the_fix(
    recipe_text: str, overrides: list[str], message: str, tmp_path: Path
) -> None:
    with pytest.raises(RecipeError) as error:
        resolved(recipe_text, tmp_path, overrides)
    assert message in str(error.value)


def test_unknown_recipe_lists_the_known_ones() -> None:
    with pytest.raises(RecipeError) as error:
        load_recipe("gpt2-speedupp", TEMPLATE)
    assert "did you mean 'gpt2-speedup'" in str(error.value)
    assert "gpt2-baseline" in str(error.value)


@pytest.mark.parametrize("name", ["2fast", "my gpt", "", "a/b", "x" * 65])
def test_bad_project_names_are_refused(name: str, tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="not a valid name"):
        resolved("", tmp_path, name=name)


def test_conflicts_and_requirements_are_enforced(tmp_path: Path) -> None:
    template = tmp_path / "template"
    shutil.copytree(TEMPLATE, template)
    alibi_meta = template / "algorithms" / "alibi" / "algorithm.toml"
    alibi_meta.write_text(
        alibi_meta.read_text().replace(
            "conflicts = []", 'conflicts = ["seq_length_warmup"]'
        )
    )
    clip_meta = template / "algorithms" / "gradient_clipping" / "algorithm.toml"
    clip_meta.write_text(
        clip_meta.read_text().replace("requires = []", 'requires = ["alibi"]')
    )
    recipe = tmp_path / "r.toml"
    recipe.write_text("[algorithms.alibi]\n[algorithms.seq_length_warmup]\n")
    with pytest.raises(RecipeError, match="'alibi' and 'seq_length_warmup' conflict"):
        resolve(load_recipe(str(recipe), template), template, "p")
    recipe.write_text("[algorithms.gradient_clipping]\n")
    with pytest.raises(RecipeError, match="'gradient_clipping' requires 'alibi'"):
        resolve(load_recipe(str(recipe), template), template, "p")


def test_every_algorithm_is_complete() -> None:
    """Each catalog entry has a summary, known events, and typed hyperparameters with defaults."""
    for algorithm in load_algorithms(TEMPLATE).values():
        assert algorithm.summary and algorithm.paper and algorithm.tasks, algorithm.name
        assert algorithm.spots and set(algorithm.events) <= set(EVENTS), algorithm.name
        # an image algorithm says what it does to torchvision/timm/HF models
        image = "image_classification" in algorithm.tasks
        assert bool(algorithm.hub_models) == image, algorithm.name
        for hp in algorithm.hyperparameters.values():
            assert hp.type in ("int", "float", "bool", "str", "time") and hp.help, (
                algorithm.name,
                hp.name,
            )


# ---------------------------------------------------------------- the command line


def test_cli_lists_recipes_and_algorithms() -> None:
    recipes = scaffold_cli("recipes")
    assert recipes.returncode == 0
    assert "gpt2-speedup" in recipes.stdout and "gpt2-baseline" in recipes.stdout
    algorithms = scaffold_cli("algorithms")
    assert algorithms.returncode == 0
    image = scaffold_cli("algorithms", "--task", "image_classification")
    rows = {line.split("\t")[0]: line.split("\t") for line in image.stdout.splitlines()}
    assert rows["algorithm"][4] == "hub models"
    assert rows["blurpool"][4] == "surgery" and rows["stochastic_depth"][4] == "refused"
    assert rows["mixup"][4] == "any"
    for name in (
        "alibi",
        "seq_length_warmup",
        "gradient_clipping",
        "BATCH_START",
        "min_len=8",
    ):
        assert name in algorithms.stdout


def listed(stdout: str) -> list[list[str]]:
    """A piped listing's rows: one tab-separated line each, below the header line."""
    return [line.split("\t") for line in stdout.splitlines()[1:]]


@pytest.mark.parametrize("task", [None, "causal_lm"])
def test_piped_algorithms_are_one_whole_line_each_by_name(task: str | None) -> None:
    """`scaffold algorithms | grep NAME` finds an algorithm's whole row in an 80-column
    terminal: nothing cut with "…", nothing wrapped onto a next line; by name."""
    catalog = load_algorithms(TEMPLATE)
    names = sorted(n for n, a in catalog.items() if task is None or task in a.tasks)
    args = ("--task", task) if task else ()
    result = scaffold_cli("algorithms", *args, columns=80)
    assert result.returncode == 0, result.stderr
    assert "…" not in result.stdout
    assert result.stdout.splitlines()[0].split("\t") == [
        "algorithm",
        "events",
        "tasks",
        "hyperparameters",
        "hub models",
        "summary",
    ]
    rows = listed(result.stdout)
    assert [row[0] for row in rows] == names
    for name, events, tasks, params, _, summary in rows:
        assert events == ", ".join(catalog[name].events)
        assert tasks == ", ".join(catalog[name].tasks)
        for param, hp in catalog[name].hyperparameters.items():
            assert f"{param}={hp.default}" in params
        assert summary == catalog[name].summary
    as_json = json.loads(scaffold_cli("algorithms", *args, "--json").stdout)
    assert [entry["name"] for entry in as_json] == names
    alibi = next(entry for entry in as_json if entry["name"] == "alibi")
    assert alibi["events"] == list(catalog["alibi"].events)
    assert alibi["hyperparameters"]["train_sequence_length_scaling"]["default"] == 0.25


def test_piped_recipes_are_one_whole_line_each_by_name() -> None:
    names = sorted(recipe_paths(TEMPLATE))
    result = scaffold_cli("recipes", columns=80)
    assert result.returncode == 0, result.stderr
    rows = listed(result.stdout)
    assert [row[0] for row in rows] == names
    for name, algorithms, description in rows:
        recipe = load_recipe(name, TEMPLATE)
        assert algorithms == (", ".join(recipe.algorithms) or "-")
        assert description == recipe.description
    as_json = json.loads(scaffold_cli("recipes", "--json").stdout)
    assert [entry["name"] for entry in as_json] == names
    speedup = next(entry for entry in as_json if entry["name"] == "gpt2-speedup")
    assert speedup["algorithms"] == load_recipe("gpt2-speedup", TEMPLATE).algorithms


def on_terminal(*args: str, columns: int) -> str:
    """The `scaffold` command line's output on a terminal `columns` wide (a pseudo-terminal)."""
    leader, follower = pty.openpty()
    command = subprocess.Popen(
        [sys.executable, "-m", "scaffold", *args],
        stdout=follower,
        stderr=subprocess.DEVNULL,
        env={**checkout_env(), "COLUMNS": str(columns)},
    )
    os.close(follower)
    output = b""
    while True:  # read as it comes: a full pseudo-terminal would block the command
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the command closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(leader)
    assert command.wait(timeout=60) == 0
    return re.sub(r"\x1b\[[0-9;]*m", "", output.decode())


def test_a_narrow_terminal_wraps_the_catalog_and_cuts_no_name() -> None:
    text = on_terminal("algorithms", columns=80)
    assert "…" not in text
    first_cells = {line.split()[0] for line in text.splitlines() if line.strip()}
    assert set(load_algorithms(TEMPLATE)) <= first_cells


@pytest.mark.parametrize("command", [[], ["new"], ["recipes"], ["algorithms"]])
def test_every_command_has_help(command: list[str]) -> None:
    result = scaffold_cli(*command, "--help")
    assert result.returncode == 0 and "Usage" in result.stdout


def test_cli_version_comes_from_package_metadata() -> None:
    from importlib import metadata

    result = scaffold_cli("--version")
    assert (
        result.returncode == 0
        and result.stdout.strip() == f"scaffold {metadata.version('scaffold')}"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--recipe", "nope"], "unknown recipe 'nope'"),
        (["--recipe", "./missing.toml"], "does not exist"),
        (["--set", "lrr=1"], "unknown answer 'lrr'"),
        (["--set", "seq_length_warmup.min_len=x"], "must be of type int"),
        (["--set", "max_duration=ten"], "bad Time string 'ten'"),
        (["--name", "9lives"], "not a valid name"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line_and_leaves_nothing(
    args: list[str], message: str, tmp_path: Path
) -> None:
    dest = tmp_path / "out" / "proj"
    result = scaffold_cli("new", str(dest), *args)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    ), result.stderr
    assert not dest.exists()
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_cli_refuses_a_non_empty_destination_and_touches_nothing(
    tmp_path: Path,
) -> None:
    dest = tmp_path / "proj"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    result = scaffold_cli("new", str(dest))
    assert result.returncode == 2 and "already exists and is not empty" in result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["proj"]
    assert [p.name for p in dest.iterdir()] == ["notes.txt"] and (
        dest / "notes.txt"
    ).read_text() == "mine"


def test_cli_fills_an_existing_empty_destination(tmp_path: Path) -> None:
    dest = tmp_path / "proj"
    dest.mkdir()
    result = scaffold_cli("new", str(dest), "--recipe", "gpt2-baseline")
    assert result.returncode == 0, result.stderr
    assert (dest / "train.py").is_file() and (dest / ".git").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "proj"
    ]  # no staging folder left


def test_cli_accepts_a_recipe_file(tmp_path: Path) -> None:
    recipe = tmp_path / "mine.toml"
    recipe.write_text(
        'description = "mine"\n[answers]\nseq_len = 64\n[algorithms.seq_length_warmup]\nmin_len = 16\n'
    )
    dest = tmp_path / "proj"
    result = scaffold_cli("new", str(dest), "--recipe", str(recipe))
    assert result.returncode == 0, result.stderr
    train = (dest / "train.py").read_text()
    assert (
        "seq_len: int = 64" in train and "seq_length_warmup_min_len: int = 16" in train
    )
    assert "# algorithm: gradient_clipping" not in train
    assert "recipe: mine" in (dest / ".copier-answers.yml").read_text()


def test_user_strings_are_escaped_not_pasted(tmp_path: Path) -> None:
    dest = tmp_path / "proj"
    result = scaffold_cli("new", str(dest), "--set", "lr_warmup=10ba", "--name", "q_x")
    assert result.returncode == 0, result.stderr
    recipe = tmp_path / "evil.toml"
    recipe.write_text('[answers]\nmodel = "tiny\\"; import os"\n')
    result = scaffold_cli("new", str(tmp_path / "evil"), "--recipe", str(recipe))
    assert result.returncode == 2 and "is not a gpt preset" in result.stderr


# ---------------------------------------------------------------- declarations in algorithm.toml


@pytest.mark.parametrize(
    ("algorithm", "old", "new", "message"),
    [
        # `replaces` names default code a snippet does not already stand for
        (
            "rotary",
            'replaces = ["model.gpt.position_embedding"]',
            'replaces = ["model.gpt.embed"]',
            "replaces 'model.gpt.embed'",
        ),
        (
            "rotary",
            'replaces = ["model.gpt.position_embedding"]',
            'replaces = ["train.checks"]',
            "replaces 'train.checks'",
        ),
        # the architecture phrase is formatted with the algorithm's own hyperparameters
        (
            "logit_softcap",
            "soft-capped at {cap}",
            "soft-capped at {limit}",
            "architecture names 'limit'",
        ),
        # choices hold the default, and are of the declared type
        (
            "augmix",
            'default = "all"',
            'default = "most"',
            "its default 'most' is not one of its choices",
        ),
        (
            "augmix",
            'choices = ["all", "safe", "original"]',
            'choices = ["all", 2]',
            "must be of type str",
        ),
        # `earlier` (the value older projects trained with, kept by `scaffold upgrade`)
        (
            "alibi",
            'earlier = { until = "0.3.0", value = 1.0 }',
            'earlier = { since = "0.3.0", value = 1.0 }',
            "has earlier = {'since': '0.3.0', 'value': 1.0}",
        ),
        (
            "randaugment",
            'earlier = { until = "0.3.0", value = "original" }',
            'earlier = { until = "0.3.0", value = "first" }',
            "has earlier value 'first'",
        ),
        # hub_models: one of the kinds, backed by the snippet that does or refuses it
        (
            "mixup",
            'hub_models = "any"',
            'hub_models = "all"',
            "hub_models = 'all'; an image_classification algorithm declares one of",
        ),
        (
            "channels_last",
            'hub_models = "any"',
            'hub_models = "surgery"',
            "hub_models = 'surgery'",  # no model.resnet.hub snippet
        ),
        (
            "label_smoothing",
            'hub_models = "any"',
            'hub_models = "refused"',
            "hub_models = 'refused'",  # no train.checks snippet refuses them
        ),
    ],
)
def test_malformed_declarations_are_catalog_errors(
    algorithm: str, old: str, new: str, message: str, tmp_path: Path
) -> None:
    from scaffold.catalog import CatalogError

    template = tmp_path / "template"
    shutil.copytree(TEMPLATE, template)
    toml = template / "algorithms" / algorithm / "algorithm.toml"
    assert old in toml.read_text()
    toml.write_text(toml.read_text().replace(old, new, 1))
    with pytest.raises(CatalogError, match=re.escape(message)):
        load_algorithms(template)


def test_declared_spots_replaces_and_checks() -> None:
    """`spots` holds the snippets, the declared `replaces`, and train.checks where a Config
    field has a declared range (its check is rendered); `params` fills declared defaults in.
    """
    catalog = load_algorithms(TEMPLATE)
    rotary = catalog["rotary"]
    assert "model.gpt.position_embedding" in rotary.spots and rotary.replaces == (
        "model.gpt.position_embedding",
    )
    assert "MODEL" in rotary.events
    assert (
        "train.checks" in catalog["label_smoothing"].spots
    )  # no snippet: only the declared range
    assert not (
        TEMPLATE / "algorithms" / "label_smoothing" / "train.checks.py.jinja"
    ).exists()
    assert (
        "train.checks" not in catalog["logit_softcap"].spots
    )  # a range, but no Config field
    assert catalog["ema"].params({"half_life": "5ba"}) == {
        "half_life": "5ba",
        "update_interval": "1ba",
        "start": 0.0,
        "export": True,
    }
    assert (
        catalog["stochastic_depth"].hyperparameters["mode"].literal
        == "Literal['block', 'sample']"
    )


def test_cli_add_refuses_a_value_out_of_range_with_one_line_and_changes_nothing(
    tmp_path: Path,
) -> None:
    dest = tmp_path / "proj"
    assert scaffold_cli("new", str(dest), "--recipe", "gpt2-baseline").returncode == 0
    result = scaffold_cli("add", "seq_length_warmup", str(dest), "--set", "min_len=0")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: seq_length_warmup.min_len = 0 is outside its range [1, inf); fix the recipe or the --set value"
    ]
    status = subprocess.run(
        ["git", "status", "--porcelain"], cwd=dest, capture_output=True, text=True
    )
    assert status.stdout == ""


def test_host_templates_name_no_algorithm() -> None:
    """Tasks, models and the common spine name no algorithm (as a string a template could
    test, e.g. `"mixup" in algorithms`): an algorithm is its folder, placed by its
    snippets' file names, and speaks of itself only there."""
    root = template_dir()
    names = {
        folder.name for folder in (root / "algorithms").iterdir() if folder.is_dir()
    }
    quoted = re.compile("[\"'](" + "|".join(map(re.escape, sorted(names))) + ")[\"']")
    hosts = [
        path
        for path in root.rglob("*")
        if path.is_file()
        and path.relative_to(root).parts[0] not in ("algorithms", "recipes")
    ]
    named = [
        f"{path.relative_to(root)}: {match.group(1)}"
        for path in hosts
        for match in quoted.finditer(path.read_text(errors="replace"))
    ]
    assert named == []
