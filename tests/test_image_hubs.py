"""`--model=torchvision:NAME`, `--model=timm:NAME` and `--model=hf:FOLDER` in an
image-classification project (model.py's `check_model`, `hub_model` and `HubNet`), against
the real torchvision, timm and transformers (a tiny ViT saved by save_pretrained).

No stand-in: CI installs both (.ci/run, the README's test command); where one is missing
these tests are skipped outside CI and fail in CI (`real_library`). The models are the
libraries' own ResNet-18s on the 8x8 digits (11.7M parameters: a few seconds a step on a
CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from projects import (
    STOP_AFTER,
    error_lines,
    one_error_line,
    run_killed,
    project_modules,
    read_metrics,
    real_library,
    run_train,
)
from scaffold.render import new_project
from test_image import assert_close, ok, small, torchrun, trajectory

torchvision_models = real_library("torchvision.models")
timm = real_library("timm")

RECIPE = "cifar-resnet56-baseline"
# 4 steps of 12 digits, checkpoints at 2 and 4. ResNet-18's last stage sees the 8x8 digits
# as 1x1 pixels, so a BatchNorm group of 2 normalizes 2 values: rounding (another number of
# threads under torchrun, one rank's microbatches) then moves the loss by ~2% and SGD at
# lr 0.2 diverges. Groups of 6 (one microbatch per rank) and lr 0.02 keep runs comparable.
FOUR = [
    "--max_duration=4ba",
    "--eval_interval=2ba",
    "--save_interval=2ba",
    "--bn_group_size=6",
    "--device_microbatch_size=6",
    "--lr=0.02",
]
# Seconds a run of those may take: ResNet-18 (11.7M parameters, two checkpoints) on a busy
# 2-core machine (300 s ran out under a load average of 22).
SLOW = 900


@pytest.fixture(scope="module")
def project(generated: dict[str, Path]) -> Path:
    return generated[RECIPE]


def library_model(name: str, weights: str = "") -> torch.nn.Module:
    """The library's own model with 10 classes, as its documentation builds it."""
    hub, _, arch = name.partition(":")
    if hub == "timm":
        overlay = dict(file=weights) if weights else None
        return timm.create_model(
            arch,
            pretrained=bool(weights),
            pretrained_cfg_overlay=overlay,
            num_classes=10,
        )
    net = torchvision_models.get_model(arch, weights=None, num_classes=10)
    if weights:
        net.load_state_dict(torch.load(weights, weights_only=True))
    return net


def test_bad_hub_models_and_weights_are_one_line_exit_2(
    project: Path, tmp_path: Path
) -> None:
    runs = {
        "torchvision": ["--model=torchvision:resnet5O"],
        "timm": ["--model=timm:resnet5O"],
        "preset": ["--model=resnet5O"],
        "efficientnet": ["--model=timm:efficientnet_b0"],
        "tiny": ["--model=tiny", "--weights=w.pt"],
        "missing": ["--model=torchvision:resnet18", f"--weights={tmp_path / 'no.pt'}"],
    }
    line = error_lines(
        project, tmp_path / "work", {name: small(*a) for name, a in runs.items()}
    )
    assert "torchvision has no classification model 'resnet5O'" in line["torchvision"]
    assert "timm has no model 'resnet5O'" in line["timm"]
    assert "not a preset" in line["preset"]
    # timm's EfficientNet normalizes with BatchNormAct2d, which ghost BatchNorm does not
    # replace: its statistics would follow the microbatch size.
    refused = line["efficientnet"]
    assert "BatchNormAct2d" in refused and "microbatch size" in refused
    assert "pretrained weights are read for" in line["tiny"]
    assert "no.pt" in line["missing"]


@pytest.mark.parametrize("name", ["torchvision:resnet18", "timm:resnet18"])
def test_the_model_gets_ghost_batchnorm_and_its_own_blocks_as_units(
    project: Path, name: str
) -> None:
    """The library's model with its keys and initial values; torch's BatchNorm2d layers
    swapped for ghost BatchNorm, so a step does not depend on the microbatch size; the FSDP
    units are the library's residual blocks and the top-level layers with parameters."""
    with project_modules(project) as found:
        model_module = found["model"]
        assert model_module.check_model(name) is None
        torch.manual_seed(0)
        reference = library_model(name)
        torch.manual_seed(0)
        model = model_module.HubNet(name, 10, bn_group_size=2)
        net = model.net
        assert type(net) is type(reference)
        assert not any(type(m) is torch.nn.BatchNorm2d for m in model.modules())
        assert isinstance(net.layer4[1].bn2, model_module.BatchNorm2d)
        expected = {f"net.{k}": v for k, v in reference.state_dict().items()}
        assert model.state_dict().keys() == expected.keys()
        assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
        layers = [net.layer1, net.layer2, net.layer3, net.layer4]
        blocks = [block for layer in layers for block in layer]
        assert model.blocks == [net.conv1, net.bn1, *blocks, net.fc]

        images = torch.randn(8, 1, 8, 8, generator=torch.Generator().manual_seed(1))
        labels = torch.arange(8) % 10

        def grads(micro: int) -> list[torch.Tensor]:
            model.zero_grad(set_to_none=True)
            for x, y in zip(images.split(micro), labels.split(micro)):
                F.cross_entropy(model(x), y, reduction="sum").backward()
            model_module.clear_step_stats(model)
            return [p.grad.clone() for p in model.parameters()]

        # Equal up to rounding, which the last stage (1x1 pixels: groups of 2 values)
        # amplifies; torch's BatchNorm would differ by O(1).
        for a, b in zip(grads(8), grads(2), strict=True):
            assert (a - b).norm() <= 1e-3 * a.norm()


@pytest.mark.parametrize("name", ["torchvision:resnet18", "timm:resnet18"])
def test_fine_tuning_starts_from_the_libraries_own_model_with_those_weights(
    project: Path, tmp_path: Path, name: str
) -> None:
    """`--weights=FILE`: a saved state dict, read by the library's loading path. The first
    step's loss equals the library's own model with those weights on that batch (one
    BatchNorm group of the whole batch: ghost BatchNorm is then torch's)."""
    torch.manual_seed(7)  # not the run's seed: the run must read these weights
    weights = tmp_path / "pretrained.pt"
    torch.save(library_model(name).state_dict(), weights)
    batch = [
        "--global_batch_size=8",
        "--device_microbatch_size=8",
        "--bn_group_size=8",
    ]
    args = [*small(*batch, f"--model={name}"), f"--weights={weights}"]
    ok(run_train(project, tmp_path, *args, "--max_duration=1ba", "--run_name=ft"))
    first = read_metrics(tmp_path, "ft")[0]
    with project_modules(project) as found:
        data = found["data"]
        images = data.load_images("")
        pixels, labels, _ = data.Batches(images, "train", 8, seed=42, image_size=8)[0]
    # timm drops an ImageNet-sized classifier (its config says 1000 classes, not 10): the
    # new head draws its weights as in the run, after torch.manual_seed(seed).
    torch.manual_seed(42)
    reference = library_model(name, str(weights)).train()
    x = data.normalize(pixels, images).expand(-1, 3, -1, -1)
    with torch.no_grad():
        loss = F.cross_entropy(reference(x), labels).item()
    assert first["step"] == 1 and abs(first["loss"] - loss) <= 1e-5 * loss, (
        first["loss"],
        loss,
    )
    # Not what random weights give.
    ok(run_train(project, tmp_path, *args[:-1], "--max_duration=1ba", "--run_name=r"))
    assert abs(read_metrics(tmp_path, "r")[0]["loss"] - loss) > 1e-3


def test_torchvision_model_shards_and_resumes_elastically_after_kill_9(
    project: Path, tmp_path: Path
) -> None:
    """FSDP2 on 2 ranks equals one process; killed (-9) while saving step 4 it resumes on
    one process from step 2 (elastic) and the run ends as the uninterrupted one."""
    common = [*small("--model=torchvision:resnet18", *FOUR)]
    result = ok(run_train(project, tmp_path, *common, "--run_name=ref", timeout=SLOW))
    assert "model: torchvision:resnet18" in result.stdout
    reference = trajectory(tmp_path, "ref")
    assert [row[0] for row in reference] == [1, 2, 3, 4]
    sharded = [*common, "--parallelism=fsdp", "--run_name=cut"]
    killed = torchrun(
        2,
        STOP_AFTER,
        "kill:4",
        project / "train.py",
        *sharded,
        cwd=tmp_path,
        timeout=SLOW,
    )
    assert killed.returncode != 0, killed.stdout[-2000:] + killed.stderr[-3000:]
    before = trajectory(tmp_path, "cut")
    assert len(before) >= 2 and before[-1][0] <= 4, before
    assert_first_steps_close(before, reference)
    resumed = ok(run_train(project, tmp_path, *common, "--run_name=cut", timeout=SLOW))
    assert "resumed from" in resumed.stdout
    assert_first_steps_close(trajectory(tmp_path, "cut"), reference)


def assert_first_steps_close(ours: list[tuple], theirs: list[tuple]) -> None:
    """Losses, validation losses and accuracies of steps 1-3 equal up to rounding
    (relative 1e-4), and the same steps logged. torchvision's ResNet-18 (no zero-init of
    the last BatchNorm of a block, unlike timm's) on the 8x8 digits turns a 1e-7
    difference after step 2 into ~10% by step 4's validation, so step 4 is not compared;
    a resume that lost the momentum or resharded the weights wrongly moves step 3 by
    far more than 1e-4."""
    assert [row[0] for row in ours] == [row[0] for row in theirs[: len(ours)]]
    for mine, ref in zip(ours[:3], theirs[:3]):
        for a, b in zip(mine[1:], ref[1:], strict=True):
            assert (a is None) == (b is None), (mine, ref)
            assert a is None or abs(a - b) <= 1e-4 * abs(b), (mine, ref)


def test_timm_model_resumes_bitwise_after_kill_9_and_ddp_equals_one_process(
    project: Path, tmp_path: Path
) -> None:
    common = [*small("--model=timm:resnet18", *FOUR)]
    ok(run_train(project, tmp_path, *common, "--run_name=ref", timeout=SLOW))
    reference = trajectory(tmp_path, "ref")
    killed = run_killed(project, tmp_path, 4, *common, "--run_name=cut", timeout=SLOW)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = ok(run_train(project, tmp_path, *common, "--run_name=cut", timeout=SLOW))
    assert "resumed from" in resumed.stdout
    assert trajectory(tmp_path, "cut") == reference  # bitwise
    replicated = [*common, "--parallelism=ddp", "--run_name=ddp"]
    ok(torchrun(2, project / "train.py", *replicated, cwd=tmp_path, timeout=SLOW))
    assert_close(trajectory(tmp_path, "ddp"), reference)


@pytest.mark.parametrize("name", ["torchvision:resnet18", "timm:resnet18"])
def test_blurpool_and_squeeze_excite_change_hub_models_in_place(
    tmp_path: Path, isolated_home: Path, name: str
) -> None:
    """The library built the layers, so HubNet makes them blurring and gives the wide
    convolutions their gates in place: the library's keys and initial values, the gates
    under <conv>.se. Stochastic depth needs model.py's residual blocks: one error line
    (timm's own is its drop_path_rate)."""
    recipe = tmp_path / "r.toml"
    recipe.write_text(
        '[answers]\ntask = "image_classification"\n[algorithms.blurpool]\n'
        "[algorithms.squeeze_excite]\nlatent_channels = 0.25\nmin_channels = 128\n"
        "[algorithms.stochastic_depth]\n"
    )
    project = tmp_path / "p"
    new_project(str(recipe), project, [], "p")
    with project_modules(project) as found:
        model_module = found["model"]
        torch.manual_seed(0)
        reference = library_model(name)
        torch.manual_seed(0)
        model = model_module.HubNet(name, 10, bn_group_size=2)
        kinds = {name: type(m).__name__ for name, m in model.named_modules()}
        # Strided with >= 16 input channels (BlurPool's default): the 3x3 and 1x1
        # downsampling convolutions of layers 2-4; the stem's 3-channel one is not.
        assert kinds["net.maxpool"] == "BlurMaxPool2d"
        assert kinds["net.layer2.0.conv1"] == "BlurConv2d"
        assert kinds["net.layer4.0.downsample.0"] == "BlurConv2d"
        assert kinds["net.conv1"] == kinds["net.layer1.0.conv1"] == "Conv2d"
        gated = {
            name
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Conv2d) and hasattr(m, "se")
        }
        assert "net.layer3.0.conv2" in gated and "net.layer2.0.conv1" not in gated
        ours = model.state_dict()
        theirs = {f"net.{k}": v for k, v in reference.state_dict().items()}
        assert all(torch.equal(ours[k], v) for k, v in theirs.items())
        assert all(".se." in k for k in set(ours) - set(theirs))
        assert model(torch.randn(4, 1, 8, 8)).shape == (4, 10)
    line = one_error_line(
        run_train(project, tmp_path, *small(f"--model={name}")), tmp_path
    )
    assert line.startswith(
        "error: stochastic_depth drops the branches of model.py's residual blocks"
    )
    assert "drop_path_rate" in line


# ------------------------------------------------- Hugging Face: --model=hf:FOLDER


def tiny_vit(folder: Path, seed: int, image_size: int = 8) -> Path:
    """A tiny ViT for the 8x8 digits (4 patches of 4x4, 2 layers, 10 classes), saved
    by transformers' save_pretrained: the folder a user downloads or fine-tuned."""
    transformers = real_library("transformers")
    config = transformers.ViTConfig(
        image_size=image_size,
        patch_size=4,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=10,
    )
    torch.manual_seed(seed)
    transformers.ViTForImageClassification(config).save_pretrained(folder)
    return folder


def test_bad_hf_models_are_one_line_exit_2(project: Path, tmp_path: Path) -> None:
    transformers = real_library("transformers")

    text = tmp_path / "bert"
    transformers.BertConfig(
        hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8
    ).save_pretrained(text)
    vit = tiny_vit(tmp_path / "vit", seed=7)
    # A ViT for 16-pixel images on the 8-pixel digits: refused before the first step
    # (transformers would raise at the first forward), naming the size and the fix.
    vit16 = tiny_vit(tmp_path / "vit16", seed=7, image_size=16)
    runs = {
        "none": [f"--model=hf:{tmp_path / 'none'}"],
        "text": [f"--model=hf:{text}"],
        "weights": [f"--model=hf:{vit}", f"--weights={vit}/model.safetensors"],
        "size": [f"--model=hf:{vit16}"],
    }
    line = error_lines(
        project, tmp_path / "work", {name: small(*a) for name, a in runs.items()}
    )
    assert "no readable config.json" in line["none"]
    assert "BertConfig is not an image classifier" in line["text"]
    assert "(hf:FOLDER: the folder's)" in line["weights"]
    wrong_size = line["size"]
    assert "does not take the 8-pixel images this run feeds it" in wrong_size
    assert "pass the --image_size" in wrong_size


def test_progressive_resizing_on_a_fixed_size_vit_is_one_line_exit_2(
    generated: dict[str, Path], tmp_path: Path
) -> None:
    """Progressive resizing (cifar-resnet56-mild: initial_scale 0.5) feeds a ViT built
    for the 8-pixel digits 4-pixel images: refused in one line before the run folder
    exists (its `image_sides` snippet adds the smallest side to those HubNet tries),
    not by transformers' error at the first step. With initial_scale 1 it trains."""
    project = generated["cifar-resnet56-mild"]
    vit = tiny_vit(tmp_path / "vit", seed=7)
    args = small(f"--model=hf:{vit}", "--max_duration=1ba", "--eval_interval=1ba")
    refused = one_error_line(run_train(project, tmp_path, *args), tmp_path)
    assert refused.startswith(
        f"error: model=hf:{vit} does not take the 4-pixel images this run feeds it ("
    )
    assert "keep algorithms from resizing the images" in refused
    full = "--progressive_resizing_initial_scale=1.0"
    ok(run_train(project, tmp_path, *args, full, "--run_name=full"))
    assert [row[0] for row in trajectory(tmp_path, "full")] == [1]


def test_hf_vit_trains_from_its_folder_with_its_weights(
    project: Path, tmp_path: Path
) -> None:
    """`--model=hf:FOLDER`: transformers' own model read by from_pretrained(FOLDER). The
    first loss equals that model's on batch 0, not a random ViT's; the FSDP units are
    its encoder layers; the output object's logits are what the loop trains on."""
    transformers = real_library("transformers")
    folder = tiny_vit(tmp_path / "vit", seed=7)
    name = f"hf:{folder}"
    args = small(
        "--global_batch_size=8", "--device_microbatch_size=8", f"--model={name}"
    )
    result = ok(
        run_train(project, tmp_path, *args, "--max_duration=1ba", "--run_name=ft")
    )
    assert f"model: {name}" in result.stdout
    first = read_metrics(tmp_path, "ft")[0]
    with project_modules(project) as found:
        data, model_module = found["data"], found["model"]
        assert model_module.check_model(name) is None
        images = data.load_images("")
        pixels, labels, _ = data.Batches(images, "train", 8, seed=42, image_size=8)[0]
        model = model_module.HubNet(name, 10, bn_group_size=2)
        assert model.blocks == list(model.net.vit.layers)
    x = data.normalize(pixels, images).expand(-1, 3, -1, -1)
    reference = transformers.AutoModelForImageClassification.from_pretrained(folder)
    torch.manual_seed(42)
    random = transformers.ViTForImageClassification(reference.config)
    with torch.no_grad():
        loss = F.cross_entropy(reference.train()(x).logits, labels).item()
        other = F.cross_entropy(random.train()(x).logits, labels).item()
    assert first["step"] == 1 and abs(first["loss"] - loss) <= 1e-5 * loss, (
        first["loss"],
        loss,
    )
    assert abs(other - loss) > 1e-3


def test_hf_vit_resumes_bitwise_after_kill_9_and_fsdp_auto_equals_one_process(
    project: Path, generated_auto: dict[str, Path], tmp_path: Path
) -> None:
    """Killed (-9) inside save 4 and resumed: bitwise. FSDP2 on 2 ranks with
    auto-microbatching (the project generated with it) under an injected out-of-memory
    error halves the microbatch 6 -> 4 -> 2 and equals the one-process run (a ViT has
    no BatchNorm: its steps do not depend on the split)."""
    name = f"hf:{tiny_vit(tmp_path / 'vit', seed=7)}"
    common = small(f"--model={name}", *FOUR)
    ok(run_train(project, tmp_path, *common, "--run_name=ref"))
    reference = trajectory(tmp_path, "ref")
    assert [row[0] for row in reference] == [1, 2, 3, 4]
    killed = run_killed(project, tmp_path, 4, *common, "--run_name=cut", timeout=SLOW)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = ok(run_train(project, tmp_path, *common, "--run_name=cut"))
    assert "resumed from" in resumed.stdout
    assert trajectory(tmp_path, "cut") == reference  # bitwise
    # The search halves through multiples of bn_group_size: groups of 2 (no BatchNorm
    # here to use them) let it reach 2.
    auto = {"--device_microbatch_size=6": "--device_microbatch_size=auto"}
    auto["--bn_group_size=6"] = "--bn_group_size=2"
    searched = [auto.get(arg, arg) for arg in FOUR]
    sharded = small(f"--model={name}", *searched, "--parallelism=fsdp")
    result = ok(
        torchrun(
            2,
            generated_auto[RECIPE] / "train.py",
            *sharded,
            "--run_name=fsdp",
            cwd=tmp_path,
            env={"SCAFFOLD_INJECT_OOM": "ranks=1;above=2;phase=backward"},
            timeout=SLOW,
        )
    )
    assert "retrying the batch at 2" in result.stdout
    assert {r["microbatch_size"] for r in read_metrics(tmp_path, "fsdp")} == {2}
    assert_close(trajectory(tmp_path, "fsdp"), reference)
