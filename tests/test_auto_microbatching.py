"""The out-of-memory search is generated only where it was asked for: a plain project
refuses `--device_microbatch_size=auto` in one line naming the command that adds it, and
`scaffold set auto_microbatching=true` merges it in, keeping the user's edits.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import scaffold_cli
from projects import read_metrics, run_train
from scaffold.render import commit_all

TINY = [
    "--model=tiny",
    "--seq_len=32",
    "--global_batch_size=8",
    "--max_duration=2ba",
    "--eval_interval=2ba",
    "--eval_batches=1",
    "--save_interval=2ba",
]


def test_a_plain_project_refuses_auto_in_one_line_naming_the_command(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    # Its Config advertises only what it accepts: a size, not auto.
    source = (generated["gpt2-baseline"] / "train.py").read_text()
    assert "    device_microbatch_size: int = " in source
    result = run_train(
        generated["gpt2-baseline"], tmp_path, *TINY, "--device_microbatch_size=auto"
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert (
        len(lines) == 1 and "scaffold set auto_microbatching=true" in lines[0]
    ), result.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_scaffold_set_merges_the_search_in_and_keeps_edits(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    project = tmp_path / "my-gpt"
    subprocess.run(
        ["cp", "-r", str(generated["gpt2-baseline"]), str(project)], check=True
    )
    train_py = project / "train.py"
    edit = "    torch.manual_seed(cfg.seed)  # the same on every rank: identical initial weights\n"
    assert train_py.read_text().count(edit) == 1
    train_py.write_text(
        train_py.read_text().replace(edit, edit + "    print('hand edit')\n")
    )
    commit_all(project, "hand edit")

    result = scaffold_cli("set", "auto_microbatching=true", cwd=project)

    assert result.returncode == 0, result.stderr
    source = train_py.read_text()
    assert "print('hand edit')" in source and "<<<<<<<" not in source
    assert "for attempt in microbatching.attempts(" in source
    assert '    device_microbatch_size: int | Literal["auto"] = "auto"' in source
    assert "auto_microbatching: true" in (project / ".copier-answers.yml").read_text()
    trained = run_train(
        project, tmp_path, *TINY, "--device_microbatch_size=auto", "--run_name=a"
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "hand edit" in trained.stdout
    assert [row["microbatch_size"] for row in read_metrics(tmp_path, "a")] == [8, 8]


def test_scaffold_set_refuses_an_unknown_answer_and_writes_nothing(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    project = tmp_path / "my-gpt"
    subprocess.run(
        ["cp", "-r", str(generated["gpt2-baseline"]), str(project)], check=True
    )
    before = (project / "train.py").read_text()
    result = scaffold_cli("set", "auto_microbatchin=true", cwd=project)
    assert result.returncode == 2
    assert "auto_microbatching" in result.stderr  # the close match is suggested
    assert (project / "train.py").read_text() == before
