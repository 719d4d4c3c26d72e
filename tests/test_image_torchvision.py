"""`--model=torchvision:NAME` in an image-classification project (model.py's `check_model`
and `TorchvisionNet`).

The real torchvision cannot be imported here: the registry's only release for torch 2.13 is a
CUDA build ("operator torchvision::nms does not exist" on the CPU torch) and installing a
working pair would replace torch. So:
- the failure path is tested for real: torchvision is not importable in this environment;
- the success path uses a STAND-IN `torchvision` package that this file writes into a temp
  folder put on PYTHONPATH. It has the two functions model.py calls,
  `models.get_model(name, weights=None, num_classes=...)` and `models.list_models(module)`,
  and builds a small real torchvision-shaped network (conv1, bn1, relu, layer1 = a Sequential
  of residual blocks, avgpool, fc; torch's own nn.BatchNorm2d layers). It says nothing about
  how real torchvision models train, only about how the generated loop builds, shards, steps,
  checkpoints and resumes whatever `get_model` returns.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from projects import checkout_env, project_modules, read_metrics, run_train
from scaffold.render import new_project
from test_image import assert_close, ok, small, torchrun, trajectory

RECIPE = "cifar-resnet56-baseline"
STOP_AFTER = Path(__file__).resolve().parent / "stop_after.py"

STAND_IN_MODELS = '''\
"""STAND-IN for torchvision.models, written by scaffold's tests/test_image_torchvision.py
(the real torchvision cannot be imported beside this CPU torch)."""

import torch.nn as nn


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x):
        return (x + self.bn(self.conv(x))).relu()


class TinyNet(nn.Module):
    def __init__(self, num_classes, norm=nn.BatchNorm2d):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = norm(8)
        self.relu = nn.ReLU()
        self.layer1 = nn.Sequential(Block(8), Block(8))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, num_classes)

    def forward(self, x):
        x = self.layer1(self.relu(self.bn1(self.conv1(x))))
        return self.fc(self.avgpool(x).flatten(1))


class Flat(nn.Module):  # BatchNorm1d: cannot be made ghost BatchNorm
    def __init__(self, num_classes):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.LazyLinear(16), nn.BatchNorm1d(16))
        self.fc = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.fc(self.body(x))


class StrideNet(nn.Module):  # a strided convolution and a max pool: what BlurPool blurs
    def __init__(self, num_classes):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(Block(16))
        self.down = nn.Conv2d(16, 32, 3, 2, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = self.layer1(self.maxpool(self.bn1(self.conv1(x)).relu()))
        return self.fc(self.bn2(self.down(x)).relu().mean((2, 3)))


BUILDERS = {"tinynet": TinyNet, "bn1dnet": Flat, "stridenet": StrideNet}


def list_models(module=None):
    return sorted(BUILDERS)


def get_model(name, weights=None, **config):
    assert weights is None, "the stand-in has no weights"
    return BUILDERS[name](**config)
'''


@pytest.fixture(scope="module")
def project(generated: dict[str, Path]) -> Path:
    return generated[RECIPE]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the stand-in `torchvision` package (put it on PYTHONPATH)."""
    root = tmp_path_factory.mktemp("stand_in")
    package = root / "torchvision"
    (package / "models").mkdir(parents=True)
    (package / "__init__.py").write_text(
        '"""STAND-IN torchvision (tests only)."""\nfrom . import models\n'
    )
    (package / "models" / "__init__.py").write_text(STAND_IN_MODELS)
    return root


def stand_in_env(stand_in: Path) -> dict[str, str]:
    env = checkout_env()
    return {"PYTHONPATH": os.pathsep.join([str(stand_in), env["PYTHONPATH"]])}


def train(
    project: Path, workdir: Path, stand_in: Path, *args: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(project / "train.py"), "--device=cpu", *args],
        cwd=workdir,
        env={**checkout_env(), **stand_in_env(stand_in)},
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_error_line(result: subprocess.CompletedProcess[str], workdir: Path) -> str:
    """Exit 2, a single `error:` line on stderr, and no run folder written."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert not (workdir / "runs").exists()
    return lines[0]


def test_torchvision_that_does_not_import_is_one_line_exit_2(
    project: Path, tmp_path: Path
) -> None:
    """The real failure: this environment's torchvision is missing (or, installed from the
    registry, fails on the CPU torch). The line says what failed and how to fix it."""
    probe = subprocess.run(
        [sys.executable, "-c", "import torchvision"],
        capture_output=True,
        text=True,
        env=checkout_env(),
    )
    if probe.returncode == 0:
        pytest.skip(
            "torchvision imports in this environment: the failure path cannot happen here"
        )
    reason = (
        probe.stderr.strip().splitlines()[-1].split(": ", 1)[-1]
    )  # e.g. No module named 'torchvision'
    line = one_error_line(
        run_train(project, tmp_path, "--model=torchvision:resnet50"), tmp_path
    )
    assert "model=torchvision:resnet50 needs torchvision" in line and reason in line
    assert "pip install torch==2.14.1 torchvision==0.29.1" in line


def test_unknown_names_and_unsupported_batchnorm_are_one_line_exit_2(
    project: Path, stand_in: Path, tmp_path: Path
) -> None:
    line = one_error_line(
        train(project, tmp_path, stand_in, "--model=torchvision:resnet5O"), tmp_path
    )
    assert "no classification model 'resnet5O'" in line and "list_models" in line
    line = one_error_line(
        train(project, tmp_path, stand_in, "--model=resnet5O"), tmp_path
    )
    assert "not a preset" in line and "torchvision:NAME" in line
    line = one_error_line(
        train(project, tmp_path, stand_in, *small("--model=torchvision:bn1dnet")),
        tmp_path,
    )
    assert "BatchNorm1d" in line and "microbatch size" in line


def test_the_model_gets_ghost_batchnorm_and_block_units(
    project: Path, stand_in: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's BatchNorm2d layers are swapped for ghost BatchNorm (same keys and values), so
    a step does not depend on the microbatch size; grey images are repeated into RGB; the
    FSDP units are the residual blocks and the top-level layers with parameters."""
    monkeypatch.syspath_prepend(str(stand_in))
    sys.modules.pop("torchvision", None)
    sys.modules.pop("torchvision.models", None)
    try:
        import torchvision.models

        with project_modules(project) as found:
            model_module = found["model"]
            assert model_module.check_model("torchvision:tinynet") is None
            torch.manual_seed(0)
            reference = torchvision.models.get_model(
                "tinynet", weights=None, num_classes=10
            )
            torch.manual_seed(0)
            model = model_module.TorchvisionNet("tinynet", 10, bn_group_size=2)
            net = model.net
            assert isinstance(net.bn1, model_module.BatchNorm2d) and isinstance(
                net.layer1[1].bn, model_module.BatchNorm2d
            )
            assert not any(type(m) is torch.nn.BatchNorm2d for m in model.modules())
            expected = {f"net.{k}": v for k, v in reference.state_dict().items()}
            assert model.state_dict().keys() == expected.keys()
            assert all(
                torch.equal(model.state_dict()[k], v) for k, v in expected.items()
            )
            assert model.blocks == [
                net.conv1,
                net.bn1,
                net.layer1[0],
                net.layer1[1],
                net.fc,
            ]
            assert model.num_params() == sum(p.numel() for p in reference.parameters())

            images = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(1))
            labels = torch.arange(8) % 10

            def grads(micro: int) -> list[torch.Tensor]:
                model.zero_grad(set_to_none=True)
                for x, y in zip(images.split(micro), labels.split(micro)):
                    F.cross_entropy(model(x), y, reduction="sum").backward()
                model_module.clear_step_stats(model)
                return [p.grad.clone() for p in model.parameters()]

            whole, halves = grads(8), grads(2)
            for a, b in zip(whole, halves):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            # torch's BatchNorm (the reference net) would not give that: its statistics
            # are those of each forward pass.
            reference.zero_grad()
            F.cross_entropy(
                reference(images.expand(-1, 3, -1, -1)), labels, reduction="sum"
            ).backward()
            split = [p.grad.clone() for p in reference.parameters()]
            reference.zero_grad()
            for x, y in zip(images.split(2), labels.split(2)):
                F.cross_entropy(
                    reference(x.expand(-1, 3, -1, -1)), y, reduction="sum"
                ).backward()
            assert not torch.allclose(
                split[0], next(reference.parameters()).grad, atol=1e-4
            )
    finally:
        sys.modules.pop("torchvision", None)
        sys.modules.pop("torchvision.models", None)


def test_trains_resumes_and_shards_a_torchvision_model(
    project: Path, stand_in: Path, tmp_path: Path
) -> None:
    """4 steps on the digits; a run cut off after its step-2 checkpoint and restarted equals an
    uninterrupted one bitwise; FSDP2 on 2 ranks equals one process (ghost BatchNorm)."""
    common = [
        *small("--model=torchvision:tinynet"),
        "--max_duration=4ba",
        "--eval_interval=2ba",
        "--save_interval=2ba",
    ]
    result = ok(train(project, tmp_path, stand_in, *common, "--run_name=ref"))
    assert "model: torchvision:tinynet" in result.stdout
    reference = trajectory(tmp_path, "ref")
    assert [row[0] for row in reference] == [1, 2, 3, 4]

    env = {**checkout_env(), **stand_in_env(stand_in)}
    subprocess.run(
        [
            sys.executable,
            str(STOP_AFTER),
            "2",
            str(project / "train.py"),
            "--device=cpu",
            *common,
            "--run_name=cut",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert [r["step"] for r in read_metrics(tmp_path, "cut")] == [1, 2]
    resumed = ok(train(project, tmp_path, stand_in, *common, "--run_name=cut"))
    assert "resumed from" in resumed.stdout
    assert trajectory(tmp_path, "cut") == reference

    ok(
        torchrun(
            2,
            project / "train.py",
            *common,
            "--parallelism=fsdp",
            "--run_name=fsdp",
            cwd=tmp_path,
            env=stand_in_env(stand_in),
        )
    )
    assert_close(trajectory(tmp_path, "fsdp"), reference)


def test_blurpool_and_squeeze_excite_change_a_torchvision_model_in_model_py(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_home: Path
) -> None:
    """torchvision builds the layers, so TorchvisionNet (model.py) makes them blurring and gives
    the wide convolutions their gates in place: torchvision's keys and initial values, the gates
    under <conv>.se. Stochastic depth needs model.py's residual blocks: one error line.
    """
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[answers]\ntask = "image_classification"\n[algorithms.blurpool]\n'
        "[algorithms.squeeze_excite]\nlatent_channels = 0.25\nmin_channels = 16\n"
        "[algorithms.stochastic_depth]\n"
    )
    project = tmp_path / "p"
    new_project(str(recipe), project, [], "p")
    assert "# algorithm: blurpool" not in (project / "train.py").read_text()
    monkeypatch.syspath_prepend(str(stand_in))
    sys.modules.pop("torchvision", None)
    sys.modules.pop("torchvision.models", None)
    try:
        import torchvision.models

        with project_modules(project) as found:
            model_module = found["model"]
            torch.manual_seed(0)
            reference = torchvision.models.get_model(
                "stridenet", weights=None, num_classes=10
            )
            torch.manual_seed(0)
            model = model_module.TorchvisionNet("stridenet", 10, bn_group_size=2)
            kinds = {name: type(m).__name__ for name, m in model.named_modules()}
            assert (
                kinds["net.maxpool"] == "BlurMaxPool2d"
                and kinds["net.down"] == "BlurConv2d"
            )
            assert kinds["net.conv1"] == "Conv2d"  # not strided
            # min(in, out) >= 16: the block's 16->16 convolution and the 16->32 one
            gated = {
                name
                for name, m in model.named_modules()
                if isinstance(m, torch.nn.Conv2d) and hasattr(m, "se")
            }
            assert gated == {"net.layer1.0.conv", "net.down"}
            ours, theirs = model.state_dict(), {
                f"net.{k}": v for k, v in reference.state_dict().items()
            }
            assert all(torch.equal(ours[k], v) for k, v in theirs.items())
            assert set(ours) - set(theirs) and all(
                ".se." in k for k in set(ours) - set(theirs)
            )
            assert model(torch.randn(4, 1, 8, 8)).shape == (4, 10)
    finally:
        sys.modules.pop("torchvision", None)
        sys.modules.pop("torchvision.models", None)
    line = one_error_line(
        train(project, tmp_path, stand_in, *small("--model=torchvision:stridenet")),
        tmp_path,
    )
    assert line.startswith(
        "error: stochastic_depth drops the branches of model.py's residual blocks"
    )
