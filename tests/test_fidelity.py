"""Faithful to the sources: every speed-up figure in a card, recipe or README names
where it comes from."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TEMPLATES = REPO / "templates"
# A ratio ("1.6x", "1.16-1.19x", "~1.5x") or a time-to-accuracy claim.
FIGURE = re.compile(r"\b\d+(\.\d+)?x\b|\d+(\.\d+)? minutes")
# What a citation looks like: a file of a named repository, a paper, our bench.
SOURCE = re.compile(
    r"README|docs/|\.yaml|\.py\b|bench/|arXiv|et al\.|modded-nanogpt|measured|arithmetic",
    re.IGNORECASE,
)


def paragraphs(path: Path) -> list[str]:
    """A card's bullets, a recipe's comment header, a README's paragraphs and bullets."""
    text = path.read_text()
    if path.suffix == ".toml":
        header = [line[1:] for line in text.splitlines() if line.startswith("#")]
        return [" ".join(header)] + re.findall(r'description = "(.*)"', text)
    return [p for p in re.split(r"\n\s*\n|\n(?=\s*- )", text) if p.strip()]


FILES = [
    *sorted(TEMPLATES.glob("algorithms/*/card.md")),
    *sorted(TEMPLATES.glob("recipes/*.toml")),
    REPO / "README.md",  # bench/README.md: our measurements, each under its command
]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_speed_up_figure_names_its_source(path: Path) -> None:
    unsourced = [
        p.strip()[:200]
        for p in paragraphs(path)
        if FIGURE.search(p) and not SOURCE.search(p)
    ]
    assert not unsourced, unsourced


# A generated project has no bench/ and no tracker: what its files cite from scaffold's
# measurements says whose they are, and no issue number of ours (another project's, named,
# is a citation: "Composer's LayerFreezing cannot resume: its issue 1002").
BARE_BENCH = re.compile(r"bench/\S+")
SCAFFOLDS = re.compile(r"scaffold's\s+(`python\s+)?`?bench/|in scaffold's repository")
OUR_ISSUE = re.compile(r"(?<!its )(?<!pytorch )\bissues? #?\d+", re.IGNORECASE)


def test_generated_files_cite_scaffolds_bench_by_name_and_no_issue_of_ours() -> None:
    problems = []
    for path in sorted((REPO / "tests" / "golden").rglob("*")):
        if not path.is_file() or ".git" in path.parts:
            continue
        for paragraph in paragraphs(path):
            if OUR_ISSUE.search(paragraph) or (
                BARE_BENCH.search(paragraph) and not SCAFFOLDS.search(paragraph)
            ):
                problems.append(f"{path.relative_to(REPO)}: {paragraph.strip()[:160]}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the fidelity table

TABLE = REPO / "docs" / "fidelity.md"
VERDICT = re.compile(
    r"(Same|Option \(default|Deliberate difference: |Difference: |Not a Composer)"
)


def table_rows() -> dict[str, str]:
    """docs/fidelity.md's rows: algorithm -> its "Differences from Composer" cell."""
    rows = {}
    for line in TABLE.read_text().splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
        if len(cells) == 4 and (TEMPLATES / "algorithms" / cells[0]).is_dir():
            rows[cells[0]] = cells[3]
    return rows


def card_differences(name: str) -> str:
    """A card's "Differences from Composer" bullet, its lines joined."""
    card = (TEMPLATES / "algorithms" / name / "card.md").read_text()
    found = re.search(
        r"^- \*\*Differences from Composer\.\*\* (.*?)(?=^- |\Z)", card, re.M | re.S
    )
    assert found, f"{name}'s card has no Differences from Composer bullet"
    return " ".join(found.group(1).split())


def test_every_algorithm_has_a_row_with_a_verdict() -> None:
    rows = table_rows()
    algorithms = {path.name for path in (TEMPLATES / "algorithms").iterdir()}
    assert set(rows) == algorithms
    assert not [name for name, cell in rows.items() if not VERDICT.match(cell)]


@pytest.mark.parametrize(
    "name", sorted(p.name for p in (TEMPLATES / "algorithms").iterdir())
)
def test_each_cards_differences_equal_the_table(name: str) -> None:
    assert card_differences(name) == table_rows()[name]


COMPOSER_RECIPES = [
    path
    for path in sorted(TEMPLATES.glob("recipes/*.toml"))
    if 'model_family = "resnet"' in path.read_text() or path.stem == "bert-sst2"
]


@pytest.mark.parametrize("path", COMPOSER_RECIPES, ids=lambda p: p.stem)
def test_recipes_cite_the_composer_yaml_they_follow_and_list_differences(
    path: Path,
) -> None:
    """ResNet and BERT recipes name Composer's yaml, and what differs from it: for the
    ResNets its initialisation and its DecoupledSGDW on every parameter at least."""
    header = paragraphs(path)[0]
    assert re.search(r"composer/yamls/\S+\.yaml", header), header
    assert re.search(r"differen", header, re.IGNORECASE), header
    if 'model_family = "resnet"' in path.read_text():
        assert "fan_in" in header and "DecoupledSGDW" in header, header
        # The precision it states against Composer's AMP is the one it sets.
        precision = tomllib.loads(path.read_text())["answers"]["precision"]
        words = " ".join(header.split())
        stated = {"fp32": "fp32 (TF32 tensor cores on a GPU) where", "amp_bf16": "bf16"}
        assert stated[precision] in words and "AMP" in words, (precision, words)
        assert precision == "amp_bf16" or "bf16 autocast where" not in words, words
