"""Only live code, declared once: what a generated project holds is reachable by its config, and
what algorithm.toml declares (a hyperparameter's range and choices, the model code an algorithm
removes, what it makes of the model) is written nowhere else.

- A range is checked at run time by the check the template renders from its declaration (one
  `error:` line naming the key, the value and the range; exit status 2); no snippet repeats it.
- Every hyperparameter has one name: `<algorithm>.<name>` in a recipe and in `--set`,
  `<algorithm>_<name>` in train.py's Config; a Literal of choices is the declared one.
- No fence is empty or holds only comments: an algorithm that removes default code declares it
  (`replaces`), and neither the default nor a fence is written there.
- model.py's docstring names the architecture its algorithms give it; the Hugging Face GPT-2
  mapping (and train.py's `init_from`) exist only where GPT-2's layout holds the model; the
  attention's `attn_bias` and `layer_input` only where an algorithm fills them.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import jinja2
import pytest

from projects import project_modules
from scaffold.answers import resolve
from scaffold.catalog import load_algorithms, load_models, load_tasks
from scaffold.paths import template_dir
from scaffold.recipes import load_recipe
from scaffold.render import new_project

TEMPLATE = template_dir()
CATALOG = load_algorithms(TEMPLATE)
TASKS = load_tasks(TEMPLATE)
MODELS = load_models(TEMPLATE)
FENCE = re.compile(
    r"^([ ]*)# algorithm: (\w+)\n(.*?)^\1# end algorithm: \2$", re.S | re.M
)
# Settings under which a default project's setup() passes every check but the one under test
# (a tiny batch: BatchNorm groups of 2, as tests/test_packs.py trains them).
SMALL = {"global_batch_size": 4, "device_microbatch_size": 2, "device": "cpu"}
TASK_SETTINGS = {"image_classification": {"bn_group_size": 2}}


def first_home(name: str) -> tuple[str, str]:
    """The first task and model family the algorithm declares."""
    spec = CATALOG[name]
    task = spec.tasks[0]
    return task, next(
        f for f in TASKS[task].models if not spec.models or f in spec.models
    )


def ranged_fields(name: str) -> dict[str, str]:
    """Config field -> declared range, for an algorithm whose hyperparameters are Config fields."""
    spec = CATALOG[name]
    if "train.config" not in spec.spots:
        return {}
    return {
        f"{name}_{hp.name}": hp.range
        for hp in spec.hyperparameters.values()
        if hp.range
    }


@pytest.fixture(scope="module")
def alone(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every algorithm rendered alone (with what it requires) on its first task and family."""
    root = tmp_path_factory.mktemp("alone")
    projects = {}
    for name, spec in CATALOG.items():
        task, family = first_home(name)
        wanted = [name, *(needed for needed in spec.requires if needed != name)]
        recipe = root / f"{name}.toml"
        recipe.write_text(
            "\n".join(
                [
                    "[answers]",
                    f"task = {task!r}",
                    f"model_family = {family!r}",
                    f"model = {MODELS[family].presets[0]!r}",
                    *(f"[algorithms.{n}]" for n in wanted),
                ]
            )
            + "\n"
        )
        projects[name] = root / name
        new_project(str(recipe), projects[name], [], "p")
    return projects


@pytest.fixture(scope="module")
def recipes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("recipes")
    projects = {}
    for recipe in ("gpt2-baseline", "gpt2-modern"):
        projects[recipe] = root / recipe
        new_project(recipe, projects[recipe], [], "my-gpt")
    return projects


def fences(source: str, name: str | None = None) -> list[str]:
    """The bodies of the `# algorithm:` fences in `source` (of algorithm `name` only, if given)."""
    return [m[3] for m in FENCE.finditer(source) if name is None or m[2] == name]


# ---------------------------------------------------------------- declared once: ranges


def _aliases(tree: ast.AST, fields: set[str]) -> dict[str, str]:
    """Local names bound to a Config field (`delay = cfg.progressive_resizing_delay_fraction`)."""
    found = {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr in fields
        ):
            found[node.targets[0].id] = node.value.attr
    return found


def _field_of(node: ast.AST, fields: set[str], aliases: dict[str, str]) -> str | None:
    if isinstance(node, ast.Attribute) and node.attr in fields:
        return node.attr
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    return None


def _number(node: ast.AST) -> float | None:
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _number(node.operand)
        return None if value is None else -value
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return float(node.value)
    return None


@pytest.mark.parametrize("name", [n for n in CATALOG if ranged_fields(n)])
def test_no_snippet_repeats_a_declared_range(name: str) -> None:
    """A hand-written check compares no field with a bound of its declared range: that check is
    rendered from algorithm.toml (the snippet holds only what a range cannot say)."""
    snippet = TEMPLATE / "algorithms" / name / "train.checks.py.jinja"
    if not snippet.exists():
        return
    ranges = ranged_fields(name)
    bounds = {
        field: {
            float(b) for b in re.findall(r"-?inf|-?[0-9.]+(?:e-?[0-9]+)?", interval)
        }
        for field, interval in ranges.items()
    }
    # Rendered with every algorithm selected, so that each conditional part is there.
    environment = jinja2.Environment()
    environment.filters["repr"] = repr
    spec = CATALOG[name]
    source = environment.from_string(snippet.read_text()).render(
        algorithms={other: {} for other in CATALOG},
        params=spec.params({}),
        hp=spec.hyperparameters,
    )
    assert "config.fail" in source, name
    tree = ast.parse(source)
    aliases = _aliases(tree, set(ranges))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for field in filter(
            None, (_field_of(op, set(ranges), aliases) for op in operands)
        ):
            numbers = {_number(op) for op in operands} - {None}
            assert not numbers & bounds[field], (
                f"{snippet.name} of {name} checks {field} against its declared range "
                f"{ranges[field]} by hand (line {node.lineno}): the template renders that check"
            )


def test_check_ranges_is_one_line_naming_key_value_and_range(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from dataclasses import dataclass

    from runtime import config

    @dataclass
    class Cfg:
        a_p: float = 0.5
        a_n: int = 3

    config.check_ranges(Cfg(), a_p="[0, 1)", a_n="[1, inf)")  # inside: nothing happens
    for cfg, key, interval in (
        (Cfg(a_p=1.0), "a_p=1.0", "[0, 1)"),
        (Cfg(a_n=0), "a_n=0", "[1, inf)"),
        (Cfg(a_p=float("nan")), "a_p=nan", "[0, 1)"),
    ):
        with pytest.raises(SystemExit) as exited:
            config.check_ranges(cfg, a_p="[0, 1)", a_n="[1, inf)")
        assert exited.value.code == 2
        assert capsys.readouterr().err.splitlines() == [
            f"error: {key} is outside its range {interval}"
        ]
    with pytest.raises(ValueError, match="not an interval"):
        config.in_range(1, "0..1")


def outside(interval: str, kind: str) -> list[float]:
    """Values just outside each finite end of `interval`."""
    match = re.fullmatch(r"([\[(])\s*(\S+)\s*,\s*(\S+)\s*([\])])", interval)
    assert match, interval
    step = 1 if kind == "int" else 1e-3
    values = []
    low, high = float(match[2]), float(match[3])
    if math.isfinite(low):
        values.append(low - step if match[1] == "[" else low)
    if math.isfinite(high):
        values.append(high + step if match[4] == "]" else high)
    return [int(v) if kind == "int" else v for v in values]


def out_of_range_cases() -> list[tuple[str, str, float]]:
    cases = []
    for name in CATALOG:
        for field, interval in ranged_fields(name).items():
            kind = CATALOG[name].hyperparameters[field.removeprefix(f"{name}_")].type
            cases += [(name, field, value) for value in outside(interval, kind)]
    return cases


def config_fields(project: Path, name: str) -> dict[str, str]:
    """The Config fields (name -> annotation) that algorithm `name`'s fence declares in
    `project`'s train.py."""
    train = (project / "train.py").read_text()
    config = train[train.index("class Config") : train.index("\ndef ")]
    block = "\n".join(fences(config, name))
    return dict(re.findall(r"^\s*(\w+): (.+?) = ", block, re.M))


@pytest.mark.parametrize(("name", "field", "value"), out_of_range_cases())
def test_a_declared_range_is_checked_at_run_time(
    name: str,
    field: str,
    value: float,
    alone: dict[str, Path],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each algorithm rendered alone: a value just outside a declared range (each finite end)
    stops setup() with the rendered check's one line, exit status 2, before anything starts.
    A hyperparameter whose field this render does not write (another mode's limit, chosen
    at generation: gradient_clipping's max_value) is nowhere in its code."""
    task, _ = first_home(name)
    interval = ranged_fields(name)[field]
    if field not in config_fields(alone[name], name):
        assert f"cfg.{field}" not in (alone[name] / "train.py").read_text()
        return
    with project_modules(alone[name]) as modules:
        train = modules["train"]
        cfg = train.Config(**SMALL, **TASK_SETTINGS.get(task, {}), **{field: value})
        with pytest.raises(SystemExit) as exited:
            train.setup(cfg)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {field}={value!r} is outside its range {interval}"
    ]


def test_the_check_is_rendered_in_the_algorithms_fence_from_its_declaration(
    alone: dict[str, Path],
) -> None:
    """setup()'s fence of each algorithm opens with one `config.check_ranges(cfg, field="range", ...)`
    naming every declared range, in declaration order; none where nothing is declared.
    """
    for name in CATALOG:
        ranges = ranged_fields(name)
        train = (alone[name] / "train.py").read_text()
        setup = next(
            node
            for node in ast.parse(train).body
            if isinstance(node, ast.FunctionDef) and node.name == "setup"
        )
        calls = [
            node
            for node in ast.walk(setup)
            if isinstance(node, ast.Call)
            and ast.unparse(node.func) == "config.check_ranges"
            # the algorithm's own fields (the task checks its fields in the same way)
            and all(kw.arg.startswith(f"{name}_") for kw in node.keywords)
        ]
        written = config_fields(alone[name], name)
        ranges = {field: r for field, r in ranges.items() if field in written}
        if not ranges:
            assert not calls, name
            continue
        assert len(calls) == 1, name
        assert [ast.unparse(arg) for arg in calls[0].args] == ["cfg"]
        assert {kw.arg: kw.value.value for kw in calls[0].keywords} == ranges, name
        body = fences(ast.get_source_segment(train, setup), name)
        assert len(body) == 1 and body[0].lstrip().startswith(
            "config.check_ranges("
        ), name


def test_every_hyperparameter_has_one_name_and_its_declared_choices(
    alone: dict[str, Path],
) -> None:
    """An algorithm's Config fields are `<name>_<hyperparameter>` (recipes and --set:
    `<name>.<hyperparameter>`); a hyperparameter without a field in a render is decided at
    generation (gradient_clipping's clipping_type, and the other modes' limits) and read
    nowhere in its code; a field of a hyperparameter with choices is the Literal of those
    choices."""
    for name, spec in CATALOG.items():
        if "train.config" not in spec.spots:
            continue
        train = (alone[name] / "train.py").read_text()
        fields = config_fields(alone[name], name)
        declared = {f"{name}_{hp}" for hp in spec.hyperparameters}
        assert fields and set(fields) <= declared, name
        assert not [f for f in declared - set(fields) if f"cfg.{f}" in train], name
        for hp in spec.hyperparameters.values():
            if f"{name}_{hp.name}" not in fields:
                continue
            if hp.choices:
                assert fields[
                    f"{name}_{hp.name}"
                ] == f"Literal[{', '.join(map(repr, hp.choices))}]".replace("'", '"'), (
                    name,
                    hp.name,
                )


def test_scaffold_new_refuses_every_declared_range(tmp_path: Path) -> None:
    """The same declaration at generation time: every range refuses a value just outside it."""
    from scaffold.recipes import RecipeError, Recipe

    for name, spec in CATALOG.items():
        task, family = first_home(name)
        for hp in spec.hyperparameters.values():
            if not hp.range:
                continue
            for value in outside(hp.range, hp.type):
                recipe = Recipe(
                    "r",
                    "",
                    {"task": task, "model_family": family},
                    {name: {hp.name: value}},
                )
                with pytest.raises(
                    RecipeError, match=re.escape(f"is outside its range {hp.range}")
                ):
                    resolve(recipe, TEMPLATE, "p")


# ---------------------------------------------------------------- only live code


def test_no_fence_is_empty_or_holds_only_comments(
    alone: dict[str, Path], recipes: dict[str, Path]
) -> None:
    for project in [*alone.values(), *recipes.values()]:
        for path in project.rglob("*.py"):
            for body in fences(path.read_text()):
                code = [
                    line
                    for line in body.splitlines()
                    if line.strip() and not line.strip().startswith("#")
                ]
                assert (
                    code
                ), f"{path.relative_to(project.parent)}: a fence with no code:\n{body}"


def test_a_replaced_default_is_gone_without_a_fence(alone: dict[str, Path]) -> None:
    for name, spec in CATALOG.items():
        model = (alone[name] / "model.py").read_text()
        if "model.gpt.position_embedding" in spec.replaces:
            assert "wpe" not in model, name
        if "model.gpt.head" in spec.replaces:
            assert "self.lm_head.weight = self.wte.weight" not in model, name
            assert not re.search(r"\btied", model, re.I), name
    baseline = (alone["gradient_clipping"] / "model.py").read_text()
    assert (
        "self.wpe = nn.Embedding" in baseline
        and "self.lm_head.weight = self.wte.weight" in baseline
    )


def test_attention_inputs_exist_only_where_an_algorithm_fills_them(
    alone: dict[str, Path], recipes: dict[str, Path]
) -> None:
    for recipe, project in recipes.items():
        model = (project / "model.py").read_text()
        assert "attn_bias" not in model and "layer_input" not in model, recipe
    alibi = (alone["alibi"] / "model.py").read_text()
    assert "attn_bias" in alibi and "layer_input" not in alibi
    value_embeddings = (alone["value_embeddings"] / "model.py").read_text()
    assert "layer_inputs[i]" in value_embeddings and "attn_bias" not in value_embeddings
    # The blocks' outputs are kept only for an algorithm that changes a block's input.
    for recipe, project in recipes.items():
        assert "outputs.append" not in (project / "model.py").read_text(), recipe
    unet = (alone["unet_skips"] / "model.py").read_text()
    assert "outputs.append(x)" in unet and "outputs[mirror]" in unet


def _docstring(project: Path) -> str:
    return " ".join(
        ast.get_docstring(ast.parse((project / "model.py").read_text())).split()
    )


def test_model_docstring_names_the_architecture_its_algorithms_give_it(
    recipes: dict[str, Path],
) -> None:
    baseline, modern = _docstring(recipes["gpt2-baseline"]), _docstring(
        recipes["gpt2-modern"]
    )
    assert baseline.startswith(
        "GPT-2 language model: pre-LayerNorm blocks, learned position embeddings, "
        "GELU MLP, output head tied to the token embedding."
    )
    assert "This is GPT-2's layout" in baseline
    resolved = resolve(load_recipe("gpt2-modern", TEMPLATE), TEMPLATE, "p")[
        "algorithms"
    ]
    phrases = [CATALOG[name].describe(params) for name, params in resolved.items()]
    assert (
        len([phrase for phrase in phrases if phrase]) == 5
    )  # gradient_clipping, muon: none
    for phrase in filter(None, phrases):
        assert phrase in modern, phrase
    for default in (r"learned position", r"GELU", r"\btied"):
        assert not re.search(default, modern), default
    assert modern.startswith("GPT language model:")
    assert "logits soft-capped at 30.0" in modern
    assert (
        "GPT-2's layout cannot hold it (changed by logit_softcap, qk_norm, relu_squared, rotary, zero_init)"
        in modern
    )


def test_every_model_changing_gpt_algorithm_describes_itself() -> None:
    for name, spec in CATALOG.items():
        points = [
            p for p in spec.model_points("gpt") if p not in ("imports", "functions")
        ]
        assert bool(points) == bool(spec.architecture), name


def test_gpt2_mapping_and_init_from_only_where_the_layout_fits(
    recipes: dict[str, Path], alone: dict[str, Path]
) -> None:
    mapping = ("def from_hf_gpt2", "def to_hf_gpt2", "HF_BLOCK_NAMES")
    baseline = recipes["gpt2-baseline"]
    assert all(name in (baseline / "model.py").read_text() for name in mapping)
    assert "init_from: str" in (baseline / "train.py").read_text()
    for name, spec in CATALOG.items():
        if "causal_lm" not in spec.tasks:
            continue
        model, train = (alone[name] / "model.py").read_text(), (
            alone[name] / "train.py"
        ).read_text()
        fits = not [
            p
            for p in spec.model_points("gpt")
            if p not in ("imports", "functions", "init", "layer_norm")
        ]
        assert all(m in model for m in mapping) == fits, name
        assert ("init_from" in train) == fits and ("from runtime import" in train), name
        assert "HF_LAYOUT_CHANGES" not in model + train
    modern = recipes["gpt2-modern"]
    assert not any(m in (modern / "model.py").read_text() for m in mapping)
    assert "init_from" not in (modern / "train.py").read_text()


def test_flops_count_the_weights_that_multiply(recipes: dict[str, Path]) -> None:
    """6N counts no embedding table (a lookup): the tied token embedding once, as the head's
    matmul; an untied one (zero_init) not at all, its head fully."""
    for recipe, tied in (("gpt2-baseline", True), ("gpt2-modern", False)):
        with project_modules(recipes[recipe]) as modules:
            m = modules["model"]
            config = m.GPTConfig(vocab_size=256, max_seq_len=64, **m.PRESETS["tiny"])
            model = m.GPT(config)
            tables = sum(
                x.weight.numel()
                for x in model.modules()
                if isinstance(x, m.nn.Embedding)
            )
            n = model.num_params() - tables + (256 * config.n_embd if tied else 0)
            assert (
                model.flops_per_token(64)
                == 6 * n + 12 * config.n_layer * 64 * config.n_embd
            ), recipe
