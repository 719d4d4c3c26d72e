"""Tests for runtime.config: command-line and TOML parsing into a Config dataclass."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

import tomllib

from runtime import config
from runtime.config import ConfigError
from runtime.time import Time, TimeUnit


@dataclass
class Config:
    run_name: str = "baseline"  # name shown in logs
    batch_size: int = 32  # global batch size
    lr: float = 3e-4  # peak learning rate
    compile: bool = False  # wrap the model in torch.compile
    max_duration: Time = Time(10, TimeUnit.EPOCH)  # how long to train
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"  # autocast dtype
    micro_batch: int | Literal["auto"] = "auto"  # per-step micro batch, or auto
    amp: bool = True


def parse_error(argv: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        config.from_args(Config, argv)
    message = str(caught.value)
    assert "\n" not in message
    return message


def write(tmp_path: Path, text: str, name: str = "run.toml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------- coercion


def test_defaults_when_no_arguments() -> None:
    assert config.from_args(Config, []) == Config()


def test_all_argument_forms_and_types() -> None:
    cfg = config.from_args(
        Config,
        [
            "--run_name=exp 1",
            "--batch-size",
            "1_024",
            "--lr=0.1",
            "--compile",
            "--max_duration",
            "0.5dur",
        ],
    )
    assert cfg.run_name == "exp 1"
    assert cfg.batch_size == 1024
    assert cfg.lr == 0.1
    assert cfg.compile is True
    assert cfg.max_duration == Time(0.5, TimeUnit.DURATION)


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("true", True),
        ("FALSE", False),
        ("1", True),
        ("0", False),
        ("Yes", True),
        ("no", False),
        ("on", True),
        ("off", False),
    ],
)
def test_bool_words(word: str, expected: bool) -> None:
    assert config.from_args(Config, [f"--amp={word}"]).amp is expected
    # "--flag word" is understood too, not taken as a positional argument
    assert config.from_args(Config, ["--amp", word]).amp is expected


def test_bare_bool_flag_followed_by_another_option() -> None:
    cfg = config.from_args(Config, ["--compile", "--lr=1"])
    assert cfg.compile is True
    assert cfg.lr == 1.0


def test_float_accepts_ints_and_exponents() -> None:
    assert config.from_args(Config, ["--lr=2"]).lr == 2.0
    assert config.from_args(Config, ["--lr=1e-5"]).lr == 1e-5


def test_literal_field() -> None:
    assert config.from_args(Config, ["--precision=fp16"]).precision == "fp16"
    message = parse_error(["--precision=fp64"])
    assert "'fp64'" in message and "--precision" in message
    assert "'fp32', 'bf16', 'fp16'" in message


def test_int_or_auto_union() -> None:
    assert config.from_args(Config, ["--micro_batch=8"]).micro_batch == 8
    assert config.from_args(Config, ["--micro_batch", "auto"]).micro_batch == "auto"
    message = parse_error(["--micro_batch=lots"])
    assert "'lots'" in message and "'auto'" in message and "integer" in message


# ---------------------------------------------------------------- errors


def test_a_refused_value_says_its_own_fix_on_the_command_line_and_in_a_file(
    tmp_path: Path,
) -> None:
    refusals = {"batch_size": {"all": "no such size; give a number of samples"}}
    with pytest.raises(ConfigError) as caught:
        config.from_args(Config, ["--batch_size=all"], refusals)
    assert str(caught.value) == (
        "bad value 'all' for --batch_size: no such size; give a number of samples"
    )
    path = write(tmp_path, 'batch_size = "all"\n')
    with pytest.raises(ConfigError) as caught:
        config.from_args(Config, [f"--config={path}"], refusals)
    assert str(caught.value).endswith(": no such size; give a number of samples")
    # other refused values of the field keep the generic line
    with pytest.raises(ConfigError, match="expected an integer"):
        config.from_args(Config, ["--batch_size=many"], refusals)


def test_int_rejects_fraction() -> None:
    message = parse_error(["--batch_size=1.5"])
    assert "--batch_size" in message and "'1.5'" in message and "integer" in message


def test_bad_bool_value() -> None:
    message = parse_error(["--amp=maybe"])
    assert "'maybe'" in message and "true or false" in message


def test_bad_time_keeps_time_error_message() -> None:
    message = parse_error(["--max_duration=20bb"])
    assert "--max_duration" in message
    assert "unknown unit 'bb'" in message and "0.25dur" in message


def test_unknown_key_suggests_close_match() -> None:
    message = parse_error(["--learning-rat=1", "--lrr=1"])
    assert "'learning_rat'" in message
    message = parse_error(["--lrr=1"])
    assert "did you mean 'lr'?" in message and "--help" in message


def test_missing_value() -> None:
    assert "missing value for --lr" in parse_error(["--lr"])
    assert "missing value for --lr" in parse_error(["--lr", "--batch_size=2"])
    assert "missing value for --config" in parse_error(["--config"])


def test_positional_argument() -> None:
    message = parse_error(["extra"])
    assert "'extra'" in message and "--key=value" in message


def test_duplicate_key_even_with_dash_spelling() -> None:
    message = parse_error(["--max_duration=1ep", "--max-duration=2ep"])
    assert "duplicate" in message and "--max_duration" in message


@dataclass
class RequiredConfig:
    data_path: str  # where the shards live
    epochs: int = 1


def test_missing_required_field() -> None:
    with pytest.raises(ConfigError, match="--data_path"):
        config.from_args(RequiredConfig, [])
    assert config.from_args(RequiredConfig, ["--data-path=/d"]).data_path == "/d"


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--lrr=1"], "unknown config key"),
        (["--batch_size=x"], "bad value"),
        (["--lr"], "missing value"),
        (["stray"], "unexpected argument"),
        (["--lr=1", "--lr=2"], "duplicate"),
        (["--config=/nonexistent/run.toml"], "/nonexistent/run.toml"),
    ],
)
def test_parse_exits_2_with_one_line_on_stderr(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        config.parse(Config, argv)
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: ")
    assert fragment in lines[0]


def test_parse_defaults_to_sys_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.argv", ["train.py", "--lr=0.5"])
    assert config.parse(Config).lr == 0.5


# ---------------------------------------------------------------- TOML files


def test_config_file_with_command_line_override_winning(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        'run_name = "from-file"\nlr = 1\nbatch_size = 64\n'
        'max_duration = "500ba"\nmicro_batch = 4\ncompile = true\n',
    )
    # the override comes before --config and still wins
    cfg = config.from_args(Config, ["--lr=0.01", "--config", path])
    assert cfg.lr == 0.01
    assert cfg.run_name == "from-file"
    assert cfg.batch_size == 64
    assert cfg.max_duration == Time(500, TimeUnit.BATCH)
    assert cfg.micro_batch == 4
    assert cfg.compile is True
    assert isinstance(config.from_args(Config, [f"--config={path}"]).lr, float)


def test_config_file_strings_for_union_fields(tmp_path: Path) -> None:
    path = write(tmp_path, 'micro_batch = "16"\nprecision = "fp32"\n')
    cfg = config.from_args(Config, [f"--config={path}"])
    assert cfg.micro_batch == 16
    assert cfg.precision == "fp32"


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ('batch_size = "64"\n', ["'batch_size'", "integer"]),
        ("compile = 1\n", ["'compile'", "true or false"]),
        ("lr = true\n", ["'lr'", "number"]),
        ('max_duration = "3 weeks"\n', ["'max_duration'", "unknown unit"]),
        ('precision = "fp8"\n', ["'precision'", "'bf16'"]),
        ("lrr = 0.1\n", ["unknown config key 'lrr'", "did you mean 'lr'?"]),
        ("[section]\nlr = 1\n", ["'section'", "is a table", "flat"]),
        (
            "max-duration = '1ep'\nmax_duration = '2ep'\n",
            ["'max_duration' appears twice"],
        ),
        ("lr = = 1\n", ["invalid TOML"]),
    ],
)
def test_config_file_errors_name_file_and_key(
    tmp_path: Path, text: str, fragments: list[str]
) -> None:
    path = write(tmp_path, text)
    message = parse_error([f"--config={path}"])
    assert repr(path) in message
    for fragment in fragments:
        assert fragment in message


def test_missing_config_file(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.toml")
    message = parse_error(["--config", path])
    assert repr(path) in message and "not found" in message


def test_unreadable_config_file(tmp_path: Path) -> None:
    # a directory cannot be opened as a file, even as root
    message = parse_error([f"--config={tmp_path}"])
    assert repr(str(tmp_path)) in message and "cannot read" in message


# ---------------------------------------------------------------- help


def test_help_lists_fields_with_type_default_and_comment(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as caught:
        config.parse(Config, ["--lr=1", "--help"])
    assert caught.value.code == 0
    out = capsys.readouterr().out
    lr_line = next(
        line for line in out.splitlines() if line.strip().startswith("--lr ")
    )
    assert (
        "float" in lr_line and "0.0003" in lr_line and "peak learning rate" in lr_line
    )
    precision_line = next(line for line in out.splitlines() if "--precision" in line)
    assert "{fp32,bf16,fp16}" in precision_line and "autocast dtype" in precision_line
    assert "int | {auto}" in out
    assert "--amp" in out and "--config" in out


def test_field_comments_are_read_from_source_and_missing_source_is_tolerated() -> None:
    comments = config.field_comments(Config)
    assert comments["max_duration"] == "how long to train"
    assert "amp" not in comments
    dynamic = type(
        "Dynamic",
        (),
        {"__annotations__": {"x": int}, "x": 1, "__module__": "not_a_module"},
    )
    assert config.field_comments(dataclass(dynamic)) == {}


def test_help_for_required_field() -> None:
    text = config.format_help(RequiredConfig)
    line = next(line for line in text.splitlines() if "--data_path" in line)
    assert "required" in line and "where the shards live" in line


# ---------------------------------------------------------------- output


NASTY_STRINGS = [
    'say "hi"',
    "back\\slash",
    "two\nlines",
    "tab\there",
    "\x00\x1f\x7f",
    "ünïcode ☃",
    "'''",
    "",
]


@pytest.mark.parametrize("name", NASTY_STRINGS)
def test_to_toml_round_trips_nasty_strings(tmp_path: Path, name: str) -> None:
    cfg = Config(
        run_name=name,
        batch_size=7,
        lr=1e-5,
        compile=True,
        max_duration=Time(0.25, TimeUnit.DURATION),
        precision="fp16",
        micro_batch=3,
        amp=False,
    )
    text = config.to_toml(cfg)
    assert tomllib.loads(text)["run_name"] == name
    path = write(tmp_path, text)
    assert config.from_args(Config, ["--config", path]) == cfg


def test_to_toml_writes_time_as_string_and_auto_literal() -> None:
    table = tomllib.loads(config.to_toml(Config()))
    assert table["max_duration"] == "10ep"
    assert table["micro_batch"] == "auto"
    assert table["lr"] == 3e-4
