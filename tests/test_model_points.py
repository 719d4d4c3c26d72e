"""Model-changing algorithms live in model.py, not train.py (DESIGN §2): for every shipped
recipe, and for every algorithm rendered alone on each task and model family it declares
(test_packs.py applies `check_train_py` there), the generated train.py (read as a syntax
tree, never run) defines no class but `Config`, never writes torch._dynamo's
configuration inside main()'s loop, directly or through a function it calls there, and
keeps every algorithm's fence inside main() to a step of at most
MAX_FENCE_CODE_LINES code lines: longer logic is a function the fence calls.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from conftest import RECIPES

DYNAMO_CONFIG = "torch._dynamo.config"
MAX_FENCE_CODE_LINES = 6


def dotted(node: ast.AST) -> str:
    """`a.b.c` for a chain of attributes on a name; "" for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return f"{inner}.{node.attr}" if inner else ""
    return ""


def writes_dynamo_config(body: list[ast.stmt], writers: set[str]) -> bool:
    """Whether these statements set an attribute of torch._dynamo.config (also through a
    local name bound to it, setattr, or a method of it) or call a function in `writers`.
    """
    aliases = {DYNAMO_CONFIG}
    nodes = [node for stmt in body for node in ast.walk(stmt)]
    for node in nodes:  # `dynamo = torch._dynamo.config`
        if isinstance(node, ast.Assign) and dotted(node.value) == DYNAMO_CONFIG:
            aliases |= {dotted(target) for target in node.targets if dotted(target)}
    for node in nodes:
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        if any(
            isinstance(t, ast.Attribute) and dotted(t.value) in aliases for t in targets
        ):
            return True
        if isinstance(node, ast.Call):
            called = dotted(node.func)
            if called in writers or called.rpartition(".")[0] in aliases:
                return True
            if called == "setattr" and node.args and dotted(node.args[0]) in aliases:
                return True
    return False


def check_train_py(source: str) -> list[str]:
    """What is wrong with a generated train.py (empty: nothing)."""
    tree = ast.parse(source)
    problems = [
        f"defines class {node.name} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name != "Config"
    ]
    functions = {
        node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)
    }
    writers: set[str] = set()
    while (
        True
    ):  # functions that write the configuration, directly or through each other
        found = {
            name
            for name, node in functions.items()
            if writes_dynamo_config(node.body, writers)
        }
        if found <= writers:
            break
        writers |= found
    main = functions.get("main")
    if main is None:
        return [*problems, "has no main()"]
    for loop in ast.walk(main):
        if isinstance(loop, (ast.For, ast.While)) and writes_dynamo_config(
            loop.body, writers
        ):
            problems.append(
                f"writes {DYNAMO_CONFIG} inside main()'s loop at line {loop.lineno}"
            )
    # main()'s lines up to the next top-level statement: a fence may close after its last
    end = min((n.lineno - 1 for n in tree.body if n.lineno > main.lineno), default=None)
    lines = source.splitlines()[main.lineno - 1 : end]
    return problems + long_fences(lines, main.lineno)


def long_fences(lines: list[str], first_line: int) -> list[str]:
    """Fences among `lines` (main()'s) with over MAX_FENCE_CODE_LINES code lines."""
    problems = []
    name, start, code = "", 0, 0
    for number, line in enumerate(lines, first_line):
        text = line.strip()
        if text.startswith("# algorithm: "):
            name, start, code = text.removeprefix("# algorithm: "), number, 0
        elif text.startswith("# end algorithm: "):
            if code > MAX_FENCE_CODE_LINES:
                problems.append(
                    f"fence {name} in main() at line {start} has {code} code lines"
                )
            name = ""
        elif name and text and not text.startswith("#"):
            code += 1
    return problems


def test_the_check_finds_a_class_and_a_per_step_dynamo_write() -> None:
    """The checker is not vacuous: a train.py with a model class and per-step dynamo settings fails it."""
    before = """
import torch

class Config:
    pass

class BlurConv2d(torch.nn.Conv2d):
    pass

def static_compile(limit):
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = limit

def compile_for(limit):
    static_compile(limit)

def main():
    static_compile(8)  # once, before the loop: fine
    for step in range(3):
        compile_for(step)
    while True:
        torch._dynamo.config.automatic_dynamic_shapes = False
    # algorithm: mixup
    a = 1
    # a step's logic inline: seven code lines
    b = 2
    c = 3

    d = 4
    e = 5
    f = 6
    g = 7
    # end algorithm: mixup
"""
    problems = check_train_py(before)
    assert problems[0].startswith("defines class BlurConv2d")
    assert [p.split(" at line ")[0] for p in problems[1:]] == [
        f"writes {DYNAMO_CONFIG} inside main()'s loop"
    ] * 2 + ["fence mixup in main()"]
    assert problems[-1].endswith("has 7 code lines")
    assert (
        check_train_py(
            before.replace("compile_for(step)", "pass")
            .replace("    g = 7\n", "")
            .replace("torch._dynamo.config.automatic_dynamic_shapes = False", "break")
            .replace("class BlurConv2d(torch.nn.Conv2d):\n    pass\n", "")
        )
        == []
    )


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_leaves_train_py_without_classes_or_per_step_dynamo_config(
    recipe: str, generated: dict[str, Path]
) -> None:
    assert check_train_py((generated[recipe] / "train.py").read_text()) == []
