"""Vision catalog, model algorithms (image_classification, resnet): blurpool, channels_last,
squeeze_excite, stochastic_depth. Each test checks the effect: a checkerboard's aliasing energy,
the layers model.py builds blurring for each setting (with the plain model's initial weights),
memory formats inside the generated loop and losses equal to the contiguous model's, the exact
SE parameter formula, stochastic depth's drop probabilities, evaluation, and draws that survive a
resume, another microbatch size and another world size. The architecture lives in model.py
(issue 25): blurpool's and squeeze_excite's settings are its constants, set at generation and
refused there when out of range; train.py holds only stochastic depth's per-run rates and draws.

Projects use the `tiny` ResNet on the embedded digits; runs are a few steps, in this process
where possible (one torchrun launch for 2 ranks).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import scaffold_cli
from projects import checkout_env, project_modules
from scaffold.render import commit_all, new_project

ALL = {
    "blurpool": {"min_channels": 8},
    "squeeze_excite": {"latent_channels": 0.25, "min_channels": 8},
    "stochastic_depth": {"drop_rate": 0.5},
    "channels_last": {},
}
# A global batch of 8 in BatchNorm groups of 2: microbatches of 2, 4 or 8 give the same step.
RUN = [
    "--device=cpu",
    "--model=tiny",
    "--precision=fp32",
    "--global_batch_size=8",
    "--bn_group_size=2",
    "--lr=0.2",
    "--lr_warmup=0.25dur",
    "--eval_interval=1000ba",
    "--eval_batches=1",
    "--save_interval=1000ba",
    "--dist_timeout=120",
    "--num_workers=0",
]
TOLERANCE = (
    2e-5  # fp32 summation order (microbatches, ranks); steps move losses by ~1e-2
)


def run_args(*overrides: str) -> list[str]:
    """RUN with some keys given other values (a key given twice is an error)."""
    keys = {arg.split("=")[0] for arg in overrides}
    return [arg for arg in RUN if arg.split("=")[0] not in keys] + list(overrides)


def render(root: Path, name: str, algorithms: dict[str, dict]) -> Path:
    """An image_classification project (tiny ResNet) with these algorithms."""
    lines = [
        "[answers]",
        'task = "image_classification"',
        'model_family = "resnet"',
        'model = "tiny"',
    ]
    for algorithm, params in algorithms.items():
        lines.append(f"[algorithms.{algorithm}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in params.items()]
    recipe = root / f"{name}.toml"
    recipe.write_text("\n".join(lines) + "\n")
    new_project(str(recipe), root / name, [], name)
    return root / name


@pytest.fixture(scope="module")
def projects(
    tmp_path_factory: pytest.TempPathFactory, isolated_home: Path
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision")
    return {
        "base": render(root, "base", {}),
        "all": render(root, "all", ALL),
        "blurpool": render(root, "blurpool", {"blurpool": ALL["blurpool"]}),
        "squeeze_excite": render(
            root, "squeeze_excite", {"squeeze_excite": ALL["squeeze_excite"]}
        ),
        "channels_last": render(root, "channels_last", {"channels_last": {}}),
        "stochastic_depth": render(root, "stochastic_depth", {"stochastic_depth": {}}),
    }


@pytest.fixture
def models(projects: dict[str, Path]):
    """model.py of a project, by name (its module stays usable after the import is undone)."""

    def load(name: str):
        with project_modules(projects[name]) as loaded:
            return loaded["model"]

    return load


def same_weights(model: torch.nn.Module, plain: torch.nn.Module) -> bool:
    """`model` holds every parameter and buffer of `plain`, under the same key and with the
    same value (an algorithm built into model.py left the plain model's init alone)."""
    ours = model.state_dict()
    return all(
        key in ours and torch.equal(ours[key], value)
        for key, value in plain.state_dict().items()
    )


def train(
    project: Path,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    *args: str,
    run: str = "r",
) -> list[float]:
    """The generated train.py's main() in this process; the logged training losses."""
    workdir.mkdir(exist_ok=True)
    monkeypatch.chdir(workdir)
    with project_modules(project) as loaded:
        monkeypatch.setattr(
            sys, "argv", ["train.py", f"--run_name={run}", *run_args(*args)]
        )
        try:
            loaded["train"].main()
        finally:
            from runtime import dist

            dist.shutdown()
    lines = (workdir / "runs" / run / "metrics.jsonl").read_text().splitlines()
    return [row["loss"] for row in map(json.loads, lines) if "loss" in row]


def imagenet_like(model, min_width: int = 8):
    """A small ImageNet-style ResNet (7x7 stride-2 stem, max pool, 1x1 strided shortcuts)."""
    config = model.ResNetConfig(
        num_classes=10,
        in_channels=3,
        block="basic",
        layers=(1, 1, 1, 1),
        widths=(min_width, 2 * min_width, 4 * min_width, 8 * min_width),
        stem="imagenet",
        bn_group_size=2,
    )
    torch.manual_seed(0)
    return model.ResNet(config)


# ---------------------------------------------------------------- blurpool


def checkerboard(channels: int, size: int) -> torch.Tensor:
    grid = torch.arange(size)
    board = (
        (grid[:, None] + grid[None, :]) % 2 * 2 - 1
    ).float()  # +1/-1: the Nyquist tone
    return board.expand(2, channels, size, size).clone()


@pytest.mark.parametrize("blur_first", [True, False])
def test_blurpool_removes_a_checkerboards_aliasing_and_keeps_shapes(
    models, blur_first: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = models("blurpool")  # BLURPOOL_MIN_CHANNELS = 8
    monkeypatch.setattr(model, "BLURPOOL_BLUR_FIRST", blur_first)
    torch.manual_seed(0)
    plain = torch.nn.Conv2d(16, 8, 3, 2, 1, bias=False)
    blurred = model.conv(16, 8, 3, 2, 1)  # strided, 16 input channels: built blurring
    assert (
        type(blurred) is model.BlurConv2d
        and type(model.conv(16, 8, 3, 1, 1)) is torch.nn.Conv2d
    )
    blurred.load_state_dict(plain.state_dict())
    x = checkerboard(16, 16)
    # Subsampled by 2, the checkerboard aliases to a constant; the binomial blur has a
    # zero at the Nyquist frequency, so away from the zero-padded border nothing is left.
    energy = plain(x)[:, :, 1:-1, 1:-1].pow(2).mean()
    left = blurred(x)[:, :, 1:-1, 1:-1].pow(2).mean()
    assert energy > 0.1 and left < 1e-10 * energy
    # A constant image passes the blur unchanged (the kernel sums to 1).
    flat = torch.ones(2, 16, 16, 16)
    torch.testing.assert_close(
        blurred(flat)[:, :, 1:-1, 1:-1], plain(flat)[:, :, 1:-1, 1:-1]
    )
    # Same output shapes as the plain layers, odd and even sizes, convs and max pools, also
    # when turned blurring in place (torchvision's layers: use_blurpool).
    for layer in (
        lambda: torch.nn.Conv2d(16, 4, 3, 2, 1),
        lambda: torch.nn.Conv2d(16, 4, 1, 2),
        lambda: torch.nn.Conv2d(16, 4, 7, 2, 3),
        lambda: torch.nn.MaxPool2d(3, 2, 1),
    ):
        for size in (7, 8, 15):
            x = torch.randn(2, 16, size, size)
            reference, swapped = layer(), torch.nn.Sequential(layer())
            assert model.use_blurpool(swapped) == 1
            assert swapped(x).shape == reference(x).shape
    for size in (7, 8, 15):
        x = torch.randn(2, 16, size, size)
        assert model.max_pool(3, 2, 1)(x).shape == torch.nn.MaxPool2d(3, 2, 1)(x).shape


def replaced(model) -> set[str]:
    return {
        name for name, m in model.named_modules() if type(m).__name__.startswith("Blur")
    }


def test_blurpool_builds_what_its_flags_and_min_channels_say(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, base = models("blurpool"), models("base")
    # widths 8/16/32/64: strided convs are the stem (3 input channels), the first conv and
    # the 1x1 shortcut of stages 2-4 (inputs 8, 16, 32); one max pool in the stem.
    monkeypatch.setattr(model, "BLURPOOL_MIN_CHANNELS", 16)
    blurred, plain = imagenet_like(model), imagenet_like(base)
    assert replaced(blurred) == {
        "stem.3",
        "blocks.2.conv1",
        "blocks.2.shortcut.0",
        "blocks.3.conv1",
        "blocks.3.shortcut.0",
    }
    # The plain model's keys and initial values (the same RNG draws, in the same order): a
    # plain model's checkpoint loads strictly, and the blur filters are not saved.
    assert set(blurred.state_dict()) == set(plain.state_dict()) and same_weights(
        blurred, plain
    )
    blurred.load_state_dict(plain.state_dict(), strict=True)
    assert blurred(torch.randn(2, 3, 32, 32)).shape == (2, 10)

    monkeypatch.setattr(model, "BLURPOOL_MIN_CHANNELS", 3)
    monkeypatch.setattr(model, "BLURPOOL_REPLACE_MAXPOOLS", False)
    blurred = imagenet_like(model)
    assert len(replaced(blurred)) == 7 and "stem.0" in replaced(
        blurred
    )  # the stem conv (3 in) too
    assert "stem.3" not in replaced(blurred) and same_weights(blurred, plain)
    monkeypatch.setattr(model, "BLURPOOL_MIN_CHANNELS", 0)
    monkeypatch.setattr(model, "BLURPOOL_REPLACE_MAXPOOLS", True)
    monkeypatch.setattr(model, "BLURPOOL_REPLACE_CONVS", False)
    assert replaced(imagenet_like(model)) == {"stem.3"}
    # CIFAR ResNets: parameter-free shortcuts, so only the stage-opening 3x3 convs.
    monkeypatch.setattr(model, "BLURPOOL_MIN_CHANNELS", 16)
    monkeypatch.setattr(model, "BLURPOOL_REPLACE_CONVS", True)
    tiny = model.ResNet(
        model.ResNetConfig(
            num_classes=10, in_channels=1, bn_group_size=2, **model.PRESETS["tiny"]
        )
    )
    assert replaced(tiny) == {"blocks.2.conv1"}


# ---------------------------------------------------------------- channels_last


def test_channels_last_in_the_loop_and_losses_equal_the_contiguous_model(
    projects: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[bool, bool]] = []
    original = None

    def recording(self, images):
        if self.training:
            convs = [p for p in self.parameters() if p.dim() == 4]
            seen.append(
                (
                    images.is_contiguous(memory_format=torch.channels_last),
                    all(
                        p.is_contiguous(memory_format=torch.channels_last)
                        for p in convs
                    ),
                )
            )
        return original(self, images)

    args = ["--max_duration=3ba", "--device_microbatch_size=4"]
    with project_modules(projects["channels_last"]) as loaded:
        original = loaded["model"].ResNet.forward
        monkeypatch.setattr(loaded["model"].ResNet, "forward", recording)
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(
            sys, "argv", ["train.py", "--run_name=cl", *run_args(*args)]
        )
        try:
            loaded["train"].main()
        finally:
            from runtime import dist

            dist.shutdown()
    # 3 steps of 2 microbatches: every training forward saw NHWC inputs and weights.
    assert seen == [(True, True)] * 6
    rows = (tmp_path / "runs" / "cl" / "metrics.jsonl").read_text().splitlines()
    nhwc = [json.loads(row)["loss"] for row in rows]
    nchw = train(projects["base"], tmp_path, monkeypatch, *args, run="base")
    assert (
        len(nhwc) == 3
        and max(abs(a - b) for a, b in zip(nhwc, nchw, strict=True)) <= 1e-5
    )
    assert (
        abs(nchw[0] - nchw[-1]) > 1e-3
    )  # the steps moved the loss: a meaningful comparison
    # FSDP2 refuses non-contiguous parameters: under fsdp only the inputs go NHWC.
    fsdp = subprocess.run(
        [
            sys.executable,
            str(projects["channels_last"] / "train.py"),
            *run_args(*args, "--parallelism=fsdp"),
            "--run_name=fsdp",
        ],
        cwd=tmp_path,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    rows = (tmp_path / "runs" / "fsdp" / "metrics.jsonl").read_text().splitlines()
    sharded = [json.loads(row)["loss"] for row in rows]
    assert max(abs(a - b) for a, b in zip(sharded, nchw, strict=True)) <= 1e-5


# ---------------------------------------------------------------- squeeze_excite


def test_squeeze_excite_adds_exactly_the_se_parameters_and_gates_in_0_1(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, base = models("squeeze_excite"), models("base")  # latent_channels 0.25

    def tiny(module):
        torch.manual_seed(0)
        return module.ResNet(
            module.ResNetConfig(
                num_classes=10, in_channels=1, bn_group_size=2, **module.PRESETS["tiny"]
            )
        )

    # tiny (widths 8/16/32): convs with min(in, out) >= 16 are blocks.1.conv2 (16->16),
    # blocks.2.conv1 (16->32) and blocks.2.conv2 (32->32); each gate adds 2 * C * L.
    plain = tiny(base)
    monkeypatch.setattr(model, "SQUEEZE_EXCITE_MIN_CHANNELS", 16)
    gated = tiny(model)  # L = C / 4: 4, 8, 8
    assert (
        gated.num_params() - plain.num_params() == 2 * 16 * 4 + 2 * 32 * 8 + 2 * 32 * 8
    )
    monkeypatch.setattr(model, "SQUEEZE_EXCITE_LATENT_CHANNELS", 6)
    counted = tiny(model)  # L = 6 each
    assert counted.num_params() - plain.num_params() == 2 * 6 * (16 + 32 + 32)
    monkeypatch.setattr(model, "SQUEEZE_EXCITE_MIN_CHANNELS", 33)
    assert tiny(model).num_params() == plain.num_params()
    # The convolutions' own keys and initial values are the plain model's (the gates draw
    # their weights after the model's); the new keys live under <conv>.se.
    new_keys = set(gated.state_dict()) - set(plain.state_dict())
    assert same_weights(gated, plain)
    assert new_keys and all(".se." in key for key in new_keys)

    conv = gated.blocks[2].conv2
    x = torch.randn(4, 32, 5, 5) * 50  # large inputs: saturated gates stay in [0, 1]
    gates = conv.se.gates(x)
    assert gates.shape == (4, 32) and gates.min() >= 0 and gates.max() <= 1
    assert (gates > 0.99).any() or (gates < 0.01).any()
    y = torch.randn(4, 32, 5, 5)
    plain_out = torch.nn.functional.conv2d(y, conv.weight, padding=1)
    torch.testing.assert_close(
        conv(y), plain_out * conv.se.gates(plain_out)[:, :, None, None]
    )
    # A model built elsewhere (torchvision's layers) gets its gates in place.
    assert (
        model.use_squeeze_excite(
            torch.nn.Sequential(torch.nn.Conv2d(8, 40, 1), torch.nn.Conv2d(40, 40, 1))
        )
        == 1
    )


# ---------------------------------------------------------------- stochastic_depth


def tiny_model(model, block: str = "basic"):
    torch.manual_seed(0)
    preset = dict(model.PRESETS["tiny"], block=block)
    net = model.ResNet(
        model.ResNetConfig(num_classes=10, in_channels=1, bn_group_size=2, **preset)
    )
    for bn in net.modules():  # gamma 1 everywhere: every residual branch matters
        if isinstance(bn, model.BatchNorm2d):
            torch.nn.init.ones_(bn.weight)
    return net


@pytest.mark.parametrize("block", ["basic", "bottleneck"])
def test_stochastic_depth_at_rate_1_skips_the_deepest_block_in_training_only(
    models, block: str
) -> None:
    net = tiny_model(models("stochastic_depth"), block)
    depth = net.stochastic_depth  # model.py's, applied by every block's forward
    assert all(b.stochastic_depth is depth for b in net.blocks)
    depth.schedule(1.0, "linear", "block")
    deepest = net.blocks[-1]
    calls = []
    original = deepest.residual
    deepest.residual = lambda x: calls.append(1) or original(x)
    x = torch.randn(4, 1, 8, 8)
    kept = [0] * len(net.blocks)
    for step in range(20):
        depth.start_step(0, step, 1.0, 4, 0, 4, torch.device("cpu"))
        kept = [n + k for n, k in zip(kept, depth.keep)]
        net(x)
    assert calls == []  # skipped in every training step
    assert kept[-1] == 0 and all(0 < n < 20 for n in kept[:-1])  # rates 1/3, 2/3: drawn
    net.eval()
    out = net(x)
    assert len(calls) == 1  # evaluation runs it
    # ...as the plain block: evaluation with stochastic depth equals the model without it
    # (the base project's model.py), whose weights and keys it has.
    plain = tiny_model(models("base"), block).eval()
    assert same_weights(net, plain) and set(net.state_dict()) == set(plain.state_dict())
    torch.testing.assert_close(out, plain(x))


def test_stochastic_depth_probabilities_follow_the_distribution(models) -> None:
    model = models("stochastic_depth")
    linear = tiny_model(model).stochastic_depth  # 3 blocks
    assert linear.max_rates == [
        0.0,
        0.0,
        0.0,
    ]  # until build_model sets them: the plain blocks
    linear.schedule(0.3, "linear", "block")
    assert linear.max_rates == pytest.approx([0.1, 0.2, 0.3])
    uniform = tiny_model(model).stochastic_depth
    uniform.schedule(0.3, "uniform", "block")
    assert uniform.max_rates == pytest.approx([0.3, 0.3, 0.3])
    # Measured over many steps: each block drops at its rate (3 sigma of 4000 draws < 0.022).
    steps = 4000
    drops = torch.zeros(3)
    for step in range(steps):
        linear.start_step(7, step, 1.0, 8, 0, 8, torch.device("cpu"))
        drops += torch.tensor([not k for k in linear.keep], dtype=torch.float)
    assert (drops / steps - torch.tensor([0.1, 0.2, 0.3])).abs().max() < 0.022
    # Warmup: half-way through drop_warmup, half the rates; kept branches scaled 1/(1-p).
    linear.start_step(7, 0, 0.5, 8, 0, 8, torch.device("cpu"))
    assert linear.rates == pytest.approx([0.05, 0.1, 0.15])
    for index, keep in enumerate(linear.keep):
        expected = 1 / (1 - linear.rates[index]) if keep else 0.0
        assert float(linear.scales[index, 0]) == pytest.approx(expected)


def test_build_model_schedules_stochastic_depth_from_the_config(models) -> None:
    """train.py builds the model with model.build_model, which sets the drop rates from
    the Config's stochastic_depth_* fields (no step in train.py's main() does)."""
    model = models("stochastic_depth")
    cfg = SimpleNamespace(
        model="tiny",
        weights="",
        bn_group_size=2,
        stochastic_depth_drop_rate=0.3,
        stochastic_depth_drop_distribution="uniform",
        stochastic_depth_mode="sample",
    )
    net = model.build_model(cfg, ["a", "b"], 1, [8], torch.device("cpu"))
    assert net.stochastic_depth.max_rates == pytest.approx([0.3, 0.3, 0.3])
    assert net.stochastic_depth.mode == "sample"


def test_stochastic_depth_draws_are_a_function_of_seed_step_block_and_global_sample(
    models,
) -> None:
    model = models("stochastic_depth")
    cpu = torch.device("cpu")

    def sample_mode():
        depth = model.StochasticDepth(3)
        depth.schedule(0.5, "uniform", "sample")
        return depth

    one = sample_mode()
    one.start_step(3, 11, 1.0, 8, 0, 8, cpu)
    again = sample_mode()
    again.start_step(3, 11, 1.0, 8, 0, 8, cpu)
    assert torch.equal(one.scales, again.scales)  # a fresh process: the same draws
    # Rank 1 of 2 holds samples 4..7 of the global batch: the same decisions for them.
    rank1 = sample_mode()
    rank1.start_step(3, 11, 1.0, 8, 4, 4, cpu)
    assert torch.equal(rank1.scales, one.scales[:, 4:])
    other = sample_mode()
    other.start_step(3, 12, 1.0, 8, 0, 8, cpu)
    assert not torch.equal(other.scales, one.scales)  # another step, other draws
    assert set(one.scales.flatten().tolist()) == {0.0, 2.0}


def test_stochastic_depth_warmup_ramps_the_rates_in_the_loop(
    projects: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    train(
        projects["stochastic_depth"],
        tmp_path,
        monkeypatch,
        "--max_duration=4ba",
        "--device_microbatch_size=4",
        "--stochastic_depth_drop_warmup=0.5dur",
        "--stochastic_depth_drop_rate=0.4",
        run="warm",
    )
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "warm" / "metrics.jsonl")
        .read_text()
        .splitlines()
    ]
    # Steps start at 0, 1/4, 2/4, 3/4 of training: the rates ramp 0, 1/2, 1, 1 of drop_rate.
    assert [row["drop_rate"] for row in rows] == pytest.approx([0.0, 0.2, 0.4, 0.4])


class Stop(BaseException):
    """Ends a run right after a save, like a job whose allocation ran out."""


def test_stochastic_depth_resumes_and_ignores_the_microbatch_size(
    projects: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sample mode at a high rate: 4 steps straight == 2 steps, cut off, resumed (bitwise);
    microbatches of 2 == 8 (within fp32 summation order); and the drops change the losses.
    """
    project = projects["stochastic_depth"]
    common = [
        "--max_duration=4ba",
        "--stochastic_depth_mode=sample",
        "--stochastic_depth_drop_rate=0.7",
        "--save_interval=2ba",
    ]
    straight = train(
        project,
        tmp_path,
        monkeypatch,
        *common,
        "--device_microbatch_size=2",
        run="straight",
    )

    import runtime.checkpoint as checkpoint

    save = checkpoint.Checkpointer.save

    def save_then_stop(self, state, *args, **kwargs):
        path = save(self, state, *args, **kwargs)
        if state["progress"].batch == 2:
            self.wait()
            raise Stop
        return path

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save_then_stop)
    with pytest.raises(Stop) as cut:
        train(
            project,
            tmp_path,
            monkeypatch,
            *common,
            "--device_microbatch_size=2",
            run="cut",
        )
    cut = None  # the traceback's frames hold the run lock's file: drop them
    gc.collect()
    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    resumed = train(
        project, tmp_path, monkeypatch, *common, "--device_microbatch_size=2", run="cut"
    )
    assert len(resumed) == 4 and resumed == straight
    whole = train(
        project,
        tmp_path,
        monkeypatch,
        *common,
        "--device_microbatch_size=8",
        run="whole",
    )
    assert max(abs(a - b) for a, b in zip(whole, straight, strict=True)) <= TOLERANCE
    no_drops = [arg.replace("=0.7", "=0.0") for arg in common]
    plain = train(
        project,
        tmp_path,
        monkeypatch,
        *no_drops,
        "--device_microbatch_size=2",
        run="plain",
    )
    assert (
        max(abs(a - b) for a, b in zip(plain, straight, strict=True)) > 100 * TOLERANCE
    )


def test_stochastic_depth_two_ranks_equal_one_process(
    projects: dict[str, Path], tmp_path: Path
) -> None:
    """FSDP2 on 2 ranks (block mode: skipped blocks' parameters get no gradient; sample mode:
    each rank's samples keyed by their global index) against one process."""
    project = projects["stochastic_depth"]
    for mode in ("block", "sample"):
        common = run_args(
            "--max_duration=3ba",
            "--device_microbatch_size=2",
            f"--stochastic_depth_mode={mode}",
            "--stochastic_depth_drop_rate=0.6",
            "--seed=1",
        )
        one = subprocess.run(
            [
                sys.executable,
                str(project / "train.py"),
                *common,
                f"--run_name=one-{mode}",
            ],
            cwd=tmp_path,
            env=checkout_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert one.returncode == 0, one.stderr[-3000:]
        two = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(project / "train.py"),
                *common,
                f"--run_name=two-{mode}",
            ],
            cwd=tmp_path,
            env=checkout_env(),
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert two.returncode == 0, two.stderr[-3000:]
        losses = {}
        for run in ("one", "two"):
            lines = (
                (tmp_path / "runs" / f"{run}-{mode}" / "metrics.jsonl")
                .read_text()
                .splitlines()
            )
            losses[run] = [json.loads(line)["loss"] for line in lines]
        assert len(losses["one"]) == 3
        assert (
            max(abs(a - b) for a, b in zip(losses["one"], losses["two"], strict=True))
            <= TOLERANCE
        ), mode


def test_stochastic_depth_block_mode_with_ddp_is_refused(
    projects: dict[str, Path], tmp_path: Path
) -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(projects["stochastic_depth"] / "train.py"),
            *RUN,
            "--parallelism=ddp",
            "--max_duration=1ba",
        ],
        cwd=tmp_path,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith("error: stochastic_depth_mode=block skips")
    )
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- together, and add/remove


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        (
            "--stochastic_depth_drop_rate=1.5",
            "error: stochastic_depth_drop_rate=1.5 is outside its range [0, 1]",
        ),
        (
            "--stochastic_depth_drop_warmup=64sp",
            "error: stochastic_depth_drop_warmup: '64sp' cannot be compared",
        ),
    ],
)
def test_bad_hyperparameters_are_one_error_line(
    arg: str,
    message: str,
    projects: dict[str, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys,
) -> None:
    with pytest.raises(SystemExit) as stopped:
        train(projects["all"], tmp_path, monkeypatch, "--max_duration=2ba", arg)
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().startswith(message)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            "blurpool.min_channels=-1",
            "error: blurpool.min_channels = -1 is outside its range [0, inf)",
        ),
        (
            "squeeze_excite.latent_channels=0",
            "error: squeeze_excite.latent_channels = 0.0 is outside its range (0, inf)",
        ),
    ],
)
def test_bad_architecture_settings_are_refused_when_generating(
    setting: str, message: str, tmp_path: Path
) -> None:
    """blurpool's and squeeze_excite's settings are model.py constants: checked by `scaffold new`."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[answers]\ntask = "image_classification"\n[algorithms.blurpool]\n[algorithms.squeeze_excite]\n'
    )
    made = scaffold_cli(
        "new", "--recipe", str(recipe), str(tmp_path / "p"), "--set", setting
    )
    assert made.returncode == 2 and made.stderr.strip().startswith(message), made.stderr
    assert not (tmp_path / "p").exists()


def test_all_four_together_train(
    projects: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    args = ["--max_duration=2ba", "--device_microbatch_size=4", "--eval_interval=2ba"]
    losses = train(projects["all"], tmp_path, monkeypatch, *args)
    assert len(losses) == 2 and all(loss == loss for loss in losses)
    # The same under FSDP2 (a group of one process): model surgery happens before sharding,
    # the blur filters are unsaved buffers, the SE gates are sharded with their blocks.
    fsdp = subprocess.run(
        [
            sys.executable,
            str(projects["all"] / "train.py"),
            *run_args(*args, "--parallelism=fsdp"),
            "--run_name=fsdp",
        ],
        cwd=tmp_path,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    rows = (tmp_path / "runs" / "fsdp" / "metrics.jsonl").read_text().splitlines()
    sharded = [json.loads(row)["loss"] for row in rows if "loss" in json.loads(row)]
    assert max(abs(a - b) for a, b in zip(sharded, losses, strict=True)) <= 1e-5
    # The architecture is model.py's: build_model sets stochastic depth's rates, then
    # train.py converts the finished model to channels last at MODEL; blurpool and
    # squeeze_excite are not in train.py at all, stochastic depth only for its steps.
    train_py = (projects["all"] / "train.py").read_text()
    at_model = train_py[train_py.index("# event: MODEL") :]
    at_model = at_model[: at_model.index("# event: OPTIMIZER")]
    assert "# algorithm: channels_last\n" in at_model
    assert "# algorithm: stochastic_depth\n" not in at_model
    assert (
        "# algorithm: blurpool" not in train_py
        and "# algorithm: squeeze_excite" not in train_py
    )
    model_py = (projects["all"] / "model.py").read_text()
    fences = {name: model_py.count(f"# algorithm: {name}\n") for name in ALL}
    assert fences == {
        "blurpool": 4,
        "squeeze_excite": 3,
        "stochastic_depth": 5,
        "channels_last": 0,
    }
    built = model_py[model_py.index("def build_model(") :]
    assert "model.stochastic_depth.schedule(" in built[: built.index("return model")]


def test_add_and_remove_stochastic_depth_on_a_hand_edited_project(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = tmp_path / "cnn"
    made = scaffold_cli("new", "--recipe", "cifar-resnet56-baseline", str(project))
    assert made.returncode == 0, made.stderr
    train_py = project / "train.py"
    text = train_py.read_text()
    edits = [
        ("    beta2: float = 0.999  # adamw\n", "    beta2: float = 0.99  # adamw\n"),
        (
            "            inputs = data.normalize(pixels, images)\n",
            "            inputs = data.normalize(pixels, images)\n"
            "            inputs = inputs.contiguous()  # hand edit: inside the loop\n",
        ),
    ]
    for old, new in edits:
        assert text.count(old) == 1
        text = text.replace(old, new)
    train_py.write_text(text)
    commit_all(project, "hand edits")
    edited = train_py.read_text()
    plain_model = (project / "model.py").read_text()

    added = scaffold_cli(
        "add", "stochastic_depth", str(project), "--set", "mode=sample"
    )
    assert added.returncode == 0, added.stderr
    with_depth = train_py.read_text()
    assert (
        "inputs = inputs.contiguous()  # hand edit" in with_depth
        and "beta2: float = 0.99 " in with_depth
    )
    # config, checks, functions, BATCH_START, MICROBATCH_START, metrics; the rest
    # (the drop schedule included, in build_model) in model.py
    assert with_depth.count("# algorithm: stochastic_depth\n") == 6
    assert (project / "model.py").read_text().count(
        "# algorithm: stochastic_depth\n"
    ) == 5
    assert 'stochastic_depth_mode: Literal["block", "sample"] = "sample"' in with_depth
    losses = train(
        project,
        tmp_path / "work",
        monkeypatch,
        "--max_duration=2ba",
        "--device_microbatch_size=4",
    )
    assert len(losses) == 2
    commit_all(project, "stochastic depth")
    removed = scaffold_cli("remove", "stochastic_depth", str(project))
    assert removed.returncode == 0, removed.stderr
    assert (
        train_py.read_text() == edited
        and (project / "model.py").read_text() == plain_model
    )
