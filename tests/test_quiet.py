"""runtime.quiet: with torchao installed (the float8 extra), importing transformers, peft
or diffusers prints notices about torchao on stderr (torch's pytree Enum deprecation,
diffusers' missing torchao tensor classes). A generated project's refusal is still its one
`error:` line, and its model libraries import silently; every other record of those
loggers is still printed. The processes run without TORCH_LOGS and DIFFUSERS_VERBOSITY,
as a user's do: nothing in the environment hides the notices."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from projects import checkout_env, real_library
from runtime import quiet

USER_ENV = {
    name: value
    for name, value in checkout_env().items()
    if name not in ("TORCH_LOGS", "DIFFUSERS_VERBOSITY")
}
UNKNOWN = "error: unknown config key 'bogus'; run with --help to list keys"
# After the project's model.py (or runtime.hf), its libraries' model classes: the
# imports that bring torchao in.
MODEL_CLASSES = """
import sys
sys.path.insert(0, sys.argv[1])
import model
import transformers
transformers.AutoModelForSequenceClassification, transformers.LlamaForCausalLM
"""
EXPORT = """
from runtime import hf
hf._transformers().GPT2LMHeadModel
"""


def record(logger: logging.Logger, msg: str, *args: object) -> logging.LogRecord:
    return logger.makeRecord(logger.name, logging.WARNING, "x.py", 1, msg, args, None)


def test_only_torchaos_notices_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    pytree = logging.getLogger(quiet.PYTREE_ENUM[0])
    diffusers = logging.getLogger(quiet.DIFFUSERS_TORCHAO[0])
    for logger in (pytree, diffusers):  # as in a fresh process (restored afterwards)
        monkeypatch.setattr(logger, "filters", [])
    template = (
        "%s is an Enum subclass and is now natively supported by torch.compile as an "
        "opaque value type. Calling register_constant() on Enum subclasses is "
        "deprecated and will be an error in a future release."
    )
    Theirs = enum.Enum("KernelPreference", "AUTO")
    Theirs.__module__ = "torchao.quantization.quantize_.common.kernel_preference"
    Ours = enum.Enum("Ours", "A")
    torchao_tensors = "Unable to import `torchao` Tensor objects. This may affect ..."
    records = {
        "torchao's enum": (pytree, record(pytree, template, Theirs)),
        "a user's enum": (pytree, record(pytree, template, Ours)),
        "another pytree warning": (pytree, record(pytree, "%s is odd", Theirs)),
        "diffusers' torchao": (diffusers, record(diffusers, torchao_tensors)),
        "another diffusers warning": (diffusers, record(diffusers, "a real one")),
    }
    before = {name: bool(log.filter(r)) for name, (log, r) in records.items()}
    quiet.torchao_import_warnings()
    quiet.torchao_import_warnings()  # a second call adds nothing
    after = {name: bool(log.filter(r)) for name, (log, r) in records.items()}
    assert before == dict.fromkeys(records, True)
    assert after == {
        "torchao's enum": False,
        "a user's enum": True,
        "another pytree warning": True,
        "diffusers' torchao": False,
        "another diffusers warning": True,
    }
    for logger in (pytree, diffusers):
        assert sum(isinstance(f, quiet.DropRecord) for f in logger.filters) == 1
        assert logger.level == logging.NOTSET and not logger.handlers


def test_refusals_are_one_line_and_model_libraries_import_silently(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """Each in its own interpreter (torchao is imported once per process): the refusal
    of a project whose model.py imports peft (llm-lora) and diffusers (sd-baseline); the
    hf pack's model.py, then transformers' model classes; `scaffold export`'s
    runtime.hf, then GPT-2's."""
    for library in ("torchao", "transformers", "peft", "diffusers"):
        real_library(library)
    commands = {
        "llm-lora": [str(generated["llm-lora"] / "train.py"), "--bogus=1"],
        "sd-baseline": [str(generated["sd-baseline"] / "train.py"), "--bogus=1"],
        "bert-sst2": ["-c", MODEL_CLASSES, str(generated["bert-sst2"])],
        "export": ["-c", EXPORT],
    }
    running = {
        name: subprocess.Popen(
            [sys.executable, *args],
            cwd=tmp_path,
            env=USER_ENV,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, args in commands.items()
    }
    results = {
        name: (p.communicate(timeout=300), p.returncode) for name, p in running.items()
    }
    assert {
        name: (err.splitlines(), code) for name, ((_, err), code) in results.items()
    } == {
        "llm-lora": ([UNKNOWN], 2),
        "sd-baseline": ([UNKNOWN], 2),
        "bert-sst2": ([], 0),
        "export": ([], 0),
    }
    assert not (tmp_path / "runs").exists()
