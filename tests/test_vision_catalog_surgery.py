"""Vision catalog, layer surgery in model.py (image_classification, resnet; issue 26):
weight_standardization and factorize. Each test checks the effect on the tiny ResNet the
project's model.py builds: every convolution's effective weight standardized per output
channel (the stored weights the plain model's), the factorized layers, their parameter
count, the break-even rule and the SVD initialisation's best-approximation property; and
that a project with them trains (the 2-rank FSDP2 run and the kill -9 resume are in
tests/test_catalog_resume.py's cases).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from projects import project_modules
from test_vision_catalog_model import models, render, train  # noqa: F401 (fixture)

FACTORIZE = {"min_channels": 16, "min_features": 8}


@pytest.fixture(scope="module")
def projects(
    tmp_path_factory: pytest.TempPathFactory, isolated_home: Path
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("surgery")
    return {
        "base": render(root, "base", {}),
        "weight_standardization": render(
            root, "weight_standardization", {"weight_standardization": {}}
        ),
        "factorize": render(root, "factorize", {"factorize": FACTORIZE}),
    }


def three_steps(project: Path, workdir: Path, monkeypatch, run: str) -> list[float]:
    """The project's losses over 3 training steps (in this process)."""
    args = ["--max_duration=3ba", "--device_microbatch_size=4"]
    return train(project, workdir, monkeypatch, *args, run=run)


def tiny(module) -> torch.nn.Module:
    torch.manual_seed(0)
    return module.ResNet(
        module.ResNetConfig(
            num_classes=10, in_channels=1, bn_group_size=2, **module.PRESETS["tiny"]
        )
    )


# ---------------------------------------------------------------- weight_standardization


def test_weight_standardization_standardizes_every_convolution_per_output_channel(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, base = models("weight_standardization"), models("base")
    plain, standardized = tiny(base), tiny(model)
    convs = [m for m in standardized.modules() if isinstance(m, torch.nn.Conv2d)]
    plain_convs = [m for m in plain.modules() if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == len(plain_convs) > 5
    for conv, before in zip(convs, plain_convs, strict=True):
        weight = conv.weight.flatten(1)  # what forward uses
        torch.testing.assert_close(weight.mean(1), torch.zeros(len(weight)))
        torch.testing.assert_close(
            weight.std(1, unbiased=False), torch.ones(len(weight)), atol=1e-4, rtol=0
        )
        # the stored parameter is the plain model's initial weight, under a new key
        stored = conv.parametrizations.weight.original
        assert torch.equal(stored, before.weight)
        assert not torch.allclose(conv.weight, before.weight, atol=1e-3)
        x = torch.randn(2, conv.in_channels, 6, 6)
        standard = (before.weight - before.weight.mean((1, 2, 3), keepdim=True)) / (
            before.weight.var((1, 2, 3), keepdim=True, unbiased=False) + 1e-10
        ).sqrt()
        torch.testing.assert_close(
            conv(x),
            torch.nn.functional.conv2d(x, standard, None, conv.stride, conv.padding),
        )
    # the gradient reaches the stored weight through the standardization
    standardized(torch.randn(4, 1, 8, 8)).sum().backward()
    assert convs[0].parametrizations.weight.original.grad.abs().sum() > 0
    keys = [k for k in standardized.state_dict() if "parametrizations" in k]
    assert len(keys) == len(convs)
    # the last n convolutions (module order) stay plain; a hub model's are changed too
    monkeypatch.setattr(model, "WEIGHT_STANDARDIZATION_N_LAST_LAYERS_IGNORE", 2)
    ignored = [m for m in tiny(model).modules() if isinstance(m, torch.nn.Conv2d)]
    assert [hasattr(m, "parametrizations") for m in ignored] == [True] * (
        len(convs) - 2
    ) + [False] * 2
    hub = torch.nn.Sequential(torch.nn.Conv1d(3, 4, 3), torch.nn.Conv2d(4, 4, 1))
    monkeypatch.setattr(model, "WEIGHT_STANDARDIZATION_N_LAST_LAYERS_IGNORE", 0)
    assert model.use_weight_standardization(hub) == 2


def test_weight_standardization_trains(
    projects: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    losses = three_steps(projects["weight_standardization"], tmp_path, monkeypatch, "r")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    base = three_steps(projects["base"], tmp_path, monkeypatch, "base")
    assert losses != base  # same seed, same data: the standardization is what differs


# ---------------------------------------------------------------- factorize


def conv_params(c_in: int, c_out: int, latent: int, k: int = 3) -> tuple[int, int]:
    """(plain, factorized) parameter counts of a bias-free k x k convolution."""
    return c_in * c_out * k * k, c_in * latent * k * k + latent * c_out + c_out


def test_factorize_replaces_the_wide_layers_and_counts_their_parameters(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, base = models("factorize"), models("base")  # min_channels 16, min_features 8
    plain, factorized = tiny(base), tiny(model)
    kinds = {
        name: type(m).__name__
        for name, m in factorized.named_modules()
        if type(m).__name__.startswith("Factorized")
    }
    # tiny (widths 8/16/32): 3x3 convolutions with min(in, out) >= 16 are
    # blocks.1.conv2 (16->16), blocks.2.conv1 (16->32), blocks.2.conv2 (32->32), to
    # 0.25 * min(in, out) = 4, 4, 8 latent channels. fc (32 -> 10 classes): the default latent_features
    # 128 is a count above its break-even rank (7), so it stays whole.
    assert kinds == {
        "blocks.1.conv2": "FactorizedConv2d",
        "blocks.2.conv1": "FactorizedConv2d",
        "blocks.2.conv2": "FactorizedConv2d",
    }
    saved = sum(
        a - b
        for a, b in (
            conv_params(16, 16, 4),
            conv_params(16, 32, 4),
            conv_params(32, 32, 8),
        )
    )
    assert plain.num_params() - factorized.num_params() == saved > 0
    assert factorized(torch.randn(4, 1, 8, 8)).shape == (4, 10)
    # a fraction: fc's latent is 0.25 * 10 = 2 <= 7, so it is factorized too
    monkeypatch.setattr(model, "FACTORIZE_LATENT_FEATURES", 0.25)
    fc = tiny(model).fc
    assert type(fc).__name__ == "FactorizedLinear"
    assert (fc.first.weight.shape, fc.second.weight.shape) == ((2, 32), (10, 2))
    monkeypatch.setattr(model, "FACTORIZE_LINEARS", False)
    monkeypatch.setattr(model, "FACTORIZE_CONVS", False)
    assert tiny(model).num_params() == plain.num_params()


def test_factorize_only_where_it_saves_multiply_adds(models) -> None:
    model = models("factorize")
    # a 64 x 64 Linear (or 1x1 convolution): break-even 32, so at most 31
    assert model.factorizing_saves(64, 64, 31)
    assert not model.factorizing_saves(64, 64, 32)
    # 3x3: fan_in 9 * 16 = 144, out 16: 144 * 16 / 160 = 14.4 -> 14
    assert model.factorizing_saves(144, 16, 14)
    assert not model.factorizing_saves(144, 16, 15)
    assert model.latent_size(0.25, 16, 40) == 4 and model.latent_size(0.01, 16, 40) == 1
    assert model.latent_size(6.0, 16, 40) == 6
    # grouped and subclassed convolutions stay whole
    assert model.factorized(torch.nn.Conv2d(64, 64, 3, groups=2)) is None
    assert model.factorized(torch.nn.Conv2d(64, 64, 3)) is not None

    class Sub(torch.nn.Conv2d):
        pass

    assert model.factorized(Sub(64, 64, 3)) is None
    # a model built elsewhere (a hub's layers) is changed in place
    hub = torch.nn.Sequential(torch.nn.Conv2d(300, 300, 1), torch.nn.Linear(300, 300))
    assert model.use_factorize(hub) == 2
    assert [type(m).__name__ for m in hub] == ["FactorizedConv2d", "FactorizedLinear"]


def test_factorize_svd_init_is_the_best_low_rank_approximation(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = models("factorize")
    monkeypatch.setattr(model, "FACTORIZE_INIT", "svd")
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 16)
    x = torch.randn(5, 24)
    # full rank: the original layer's function
    full = model.FactorizedLinear(linear, 16)
    torch.testing.assert_close(full(x), linear(x), atol=1e-5, rtol=1e-5)
    # rank 4: the error is the discarded singular values' (Eckart-Young)
    low = model.FactorizedLinear(linear, 4)
    product = low.second.weight @ low.first.weight
    s = torch.linalg.svdvals(linear.weight.detach())
    error = torch.linalg.matrix_norm(product - linear.weight.detach()) ** 2
    torch.testing.assert_close(error, (s[4:] ** 2).sum(), rtol=1e-4, atol=1e-6)
    assert torch.equal(low.second.bias, linear.bias)
    # a strided, padded convolution at full rank (fan_in 3*3*6 = 54 > 12 out)
    conv = torch.nn.Conv2d(6, 12, 3, stride=2, padding=1, bias=False)
    pair = model.FactorizedConv2d(conv, 12)
    images = torch.randn(2, 6, 9, 9)
    torch.testing.assert_close(pair(images), conv(images), atol=1e-5, rtol=1e-5)
    # random (Composer's): fresh layers, not derived from the weight
    monkeypatch.setattr(model, "FACTORIZE_INIT", "random")
    fresh = model.FactorizedLinear(linear, 16)
    assert not torch.allclose(fresh(x), linear(x), atol=1e-2)


def test_factorize_trains_and_saves_the_pairs(
    projects: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    losses = three_steps(projects["factorize"], tmp_path, monkeypatch, "r")
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    # the run trained the factorized model: its logged parameter count
    log = (tmp_path / "runs" / "r" / "log.txt").read_text()
    with project_modules(projects["factorize"]) as loaded:
        count = tiny(loaded["model"]).num_params()
    with project_modules(projects["base"]) as loaded:
        assert tiny(loaded["model"]).num_params() > count
    assert f"model: tiny, {count:,} parameters" in log
