"""End to end: generated projects pass their own tests, are black-clean, and reject bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import black
import pytest

from conftest import RECIPES
from projects import checkout_env, read_metrics, run_train, run_train_apart
from scaffold.catalog import EVENTS, load_algorithms, task_events
from scaffold.paths import template_dir
from scaffold.project import read_answers

# The projects' own tests in every run: README's main job (gpt2-speedup), one image and
# one text-classification recipe; the others with --slow. Their own tests differ only in
# answers, and other files cover every task in every run: test_vision_recipes,
# test_image, test_modern and test_text_classification train those recipes; BERT
# pretraining is killed -9 and resumed bitwise in test_catalog_resume and resumed
# elastically in test_masked_lm; the LLM and diffusion tasks (the slowest own tests: a
# process per run that imports transformers or diffusers) are killed with -9 and resumed
# bitwise in test_catalog_resume, and trained, exported and sampled in test_llm_finetune
# and test_diffusion.
OWN_TESTS_EVERY_RUN = (
    "gpt2-speedup",
    "cifar-resnet56-baseline",
    "bert-sst2-speedup",
)


@pytest.mark.parametrize(
    "recipe",
    [
        r if r in OWN_TESTS_EVERY_RUN else pytest.param(r, marks=pytest.mark.slow)
        for r in RECIPES
    ],
)
def test_generated_project_passes_its_own_tests(
    recipe: str, generated: dict[str, Path], project_copy
) -> None:
    """The project's smoke tests: the loss falls, and a killed-and-resumed run is bitwise identical."""
    project = project_copy(generated[recipe])
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=project,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout


GOLDEN = Path(__file__).parent / "golden"


# Every golden tree (what test_golden pins the generated projects to): the recipes and
# the answer variants (gpt2-baseline-tp).
@pytest.mark.parametrize("name", sorted(tree.name for tree in GOLDEN.iterdir()))
def test_generated_python_is_black_clean_and_readable(name: str) -> None:
    from scaffold.jinja_black import BLACK_MODE

    for path in (GOLDEN / name).rglob("*.py"):
        source = path.read_text()
        assert (
            black.format_str(source, mode=BLACK_MODE) == source
        ), f"{path.name} is not black-formatted"
        long = [line for line in source.splitlines() if len(line) > 88]
        assert not long, f"{path.name} has lines over 88 characters: {long}"


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_event_point_is_marked_in_order(
    recipe: str, generated: dict[str, Path]
) -> None:
    """The events where an algorithm of the project's task can act are marked, in loop
    order; the others (no algorithm acts at EPOCH_START, EPOCH_END or FIT_END) are not.
    """
    task = read_answers(generated[recipe])["task"]
    acting = task_events(load_algorithms(template_dir()), task)
    assert acting and not {"EPOCH_START", "EPOCH_END", "FIT_END"} & set(acting)
    events = [event for event in EVENTS if event in acting]
    lines = (generated[recipe] / "train.py").read_text().splitlines()
    marked = [
        line.strip().removeprefix("# event: ")
        for line in lines
        if line.strip().startswith("# event: ")
    ]
    # forward_backward(), above main(), holds the microbatch events; main() the others.
    microbatch = ("MICROBATCH_START", "AFTER_FORWARD", "LOSS")
    assert marked == [e for e in events if e in microbatch] + [
        e for e in events if e not in microbatch
    ]
    for i, line in enumerate(
        lines
    ):  # each marker is followed by a template-owned blank line
        if line.strip().startswith("# event: "):
            assert lines[i + 1] == "", f"no blank line after {line.strip()}"


def test_algorithm_blocks_are_fenced_and_placed(generated: dict[str, Path]) -> None:
    train = (generated["gpt2-speedup"] / "train.py").read_text()
    model = (generated["gpt2-speedup"] / "model.py").read_text()

    def events_of(source: str, name: str) -> list[str]:
        """The event each `# algorithm: name` block sits under (or MODULE for top-level code)."""
        found, event = [], "MODULE"
        for line in source.splitlines():
            stripped = line.strip()
            if stripped.startswith("# event: "):
                event = stripped.removeprefix("# event: ")
            elif line.startswith("def main"):
                event = "MODULE"
            if stripped == f"# algorithm: {name}":
                found.append(event if line.startswith(" ") else "MODULE")
        assert source.count(f"# algorithm: {name}\n") == source.count(
            f"# end algorithm: {name}\n"
        )
        return found

    # Config field, config check, helper function (module level), the batch truncation, a metric.
    assert events_of(train, "seq_length_warmup") == [
        "MODULE",
        "MODULE",
        "MODULE",
        "BATCH_START",
        "EVAL",
    ]
    # Config field, its declared range's check, the clipping, a metric.
    assert events_of(train, "gradient_clipping") == [
        "MODULE",
        "MODULE",
        "AFTER_BACKWARD",
        "EVAL",
    ]
    # train_sequence_length_scaling: its Config field, range check, the row split (a
    # module-level helper) and the split itself, per microbatch; the rest is in model.py.
    assert events_of(train, "alibi") == [
        "MODULE",
        "MODULE",
        "MODULE",
        "MICROBATCH_START",
    ]
    # imports (FlexAttention), helpers, token embedding only, the slopes (a buffer made
    # once, on the model's device), the bias (or block mask), the attention call; the
    # learned position embedding it removes is declared (`replaces`), not an empty fence
    assert len(events_of(model, "alibi")) == 6
    assert "wpe" not in model
    baseline = (generated["gpt2-baseline"] / "train.py").read_text()
    assert (
        "seq_length_warmup" not in baseline
        and "alibi" not in (generated["gpt2-baseline"] / "model.py").read_text()
    )


BAD_CONFIGS = {
    "unit": (["--max_duration=10bb"], "unknown unit 'bb'"),
    "key": (["--lrr=1e-3"], "unknown config key 'lrr' (did you mean 'lr'?)"),
    "int": (["--seq_len=abc"], "seq_len"),
    "model": (["--model=gpt5"], "gpt2-medium"),
    "batch": (["--global_batch_size=0"], "global_batch_size=0 must be at least 1"),
    "dur": (["--max_duration=0.5dur"], "max_duration"),
    "warmup": (["--lr_warmup=64sp"], "lr_warmup"),  # samples against batches
    "data": (["--data=/no/such/corpus"], "no such file or folder"),
    "min_len": (
        ["--seq_length_warmup_min_len=999"],
        "seq_length_warmup_min_len=999",
    ),
    "config": (["--config", "/no/such.toml"], "/no/such.toml"),
}


@pytest.fixture(scope="module")
def setup_runs(
    generated: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """gpt2-speedup's train.py with each bad config, and with --help: runs that stop in
    setup, in one interpreter (torch imported once). Each name: (workdir, result)."""
    runs = {name: args for name, (args, _) in BAD_CONFIGS.items()}
    return run_train_apart(
        generated["gpt2-speedup"],
        tmp_path_factory.mktemp("setup-runs"),
        {**runs, "help": ["--help"]},
    )


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_train_rejects_bad_config_with_one_line_and_exit_2(
    case: str, setup_runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]
) -> None:
    workdir, result = setup_runs[case]
    message = BAD_CONFIGS[case][1]
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    ), result.stderr
    assert not (workdir / "runs").exists()  # nothing written


def test_train_help_lists_every_key(
    setup_runs: dict[str, tuple[Path, subprocess.CompletedProcess[str]]],
) -> None:
    _, result = setup_runs["help"]
    assert result.returncode == 0
    for key in (
        "run_name",
        "max_duration",
        "global_batch_size",
        "device_microbatch_size",
        "seq_len",
        "model",
        "lr",
        "save_interval",
        "eval_interval",
        "log_interval",
        "seed",
        "data",
    ):
        assert key in result.stdout


def test_run_outputs_and_config_file(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """runs/<name>/ holds the resolved config, the source that ran, a log, metrics and checkpoints."""
    (tmp_path / "run.toml").write_text(
        'run_name = "fromfile"\nseq_len = 32\nglobal_batch_size = 4\n'
        'max_duration = "6ba"\nsave_interval = "2ba"\neval_batches = 1\n'
    )
    result = run_train(
        generated["gpt2-speedup"],
        tmp_path,
        "--config",
        "run.toml",
        "--eval_interval=3ba",
        "--save_num_checkpoints_to_keep=2",
    )
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "fromfile"
    assert 'max_duration = "6ba"' in (run / "config.toml").read_text()
    assert (run / "train.py").read_text() == (
        generated["gpt2-speedup"] / "train.py"
    ).read_text()
    assert "torch" in (run / "log.txt").read_text()
    records = read_metrics(tmp_path, "fromfile")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in records if "val_loss" in r] == [3, 6]
    for record in records:
        assert {"step", "loss", "lr", "tokens_per_s"} <= set(record)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "step-4",
        "step-6",
    ]  # keep 2
    # Rerunning the finished run resumes at its end and trains no further.
    again = run_train(generated["gpt2-speedup"], tmp_path, "--config", "run.toml")
    assert again.returncode == 0 and "resumed from" in again.stdout
    assert [r["step"] for r in read_metrics(tmp_path, "fromfile")] == [1, 2, 3, 4, 5, 6]
