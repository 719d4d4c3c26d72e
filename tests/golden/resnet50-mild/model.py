"""ResNets for image classification, written out.

Two families (He et al. 2016, "Deep Residual Learning for Image Recognition"):
- ImageNet ResNets (`resnet18/34`: basic blocks; `resnet50/101`: bottleneck blocks):
  a 7x7 stride-2 stem and a max pool, four stages that halve the resolution and widen.
- CIFAR ResNets (`cifar-resnet20/56`: 6n+2 layers): a 3x3 stem, three stages of 16/32/64
  channels, parameter-free shortcuts (subsample, zero-pad channels: He et al.'s
  option A).
The last BatchNorm of every residual block starts with gamma = 0, so each block starts
as the identity (Goyal et al. 2017, "Accurate, Large Minibatch SGD").

BatchNorm here is "ghost" BatchNorm (see `BatchNorm2d`): statistics over fixed groups of
`bn_group_size` samples, so a training step does not depend on how the global batch is
split over ranks and microbatches.

`--model=torchvision:NAME` and `--model=timm:NAME` train a model of those libraries
instead (see `HubNet`; each library is optional and checked at start-up by
`check_model`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from runtime import quiet


@dataclass
class ResNetConfig:
    num_classes: int
    in_channels: int = 3
    block: Literal["basic", "bottleneck"] = "basic"
    layers: tuple[int, ...] = (2, 2, 2, 2)  # residual blocks per stage
    widths: tuple[int, ...] = (
        64,
        128,
        256,
        512,
    )  # channels per stage (bottleneck: inner)
    stem: Literal["imagenet", "cifar"] = "imagenet"
    bn_group_size: int = 32  # samples normalized together by each BatchNorm in training


Preset = Literal[
    "tiny",
    "cifar-resnet20",
    "cifar-resnet56",
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
]
CIFAR = dict(block="basic", widths=(16, 32, 64), stem="cifar")
# Architecture presets; the parameter counts are for 10 and 1000 classes respectively.
PRESETS: dict[Preset, dict] = {
    "tiny": dict(CIFAR, layers=(1, 1, 1), widths=(8, 16, 32)),  # 20k: tests, a CPU demo
    "cifar-resnet20": dict(CIFAR, layers=(3, 3, 3)),  # 0.27M
    "cifar-resnet56": dict(CIFAR, layers=(9, 9, 9)),  # 0.85M
    "resnet18": dict(block="basic", layers=(2, 2, 2, 2)),  # 11.7M
    "resnet34": dict(block="basic", layers=(3, 4, 6, 3)),  # 21.8M
    "resnet50": dict(block="bottleneck", layers=(3, 4, 6, 3)),  # 25.6M
    "resnet101": dict(block="bottleneck", layers=(3, 4, 23, 3)),  # 44.5M
}
# `--model=torchvision:NAME`, `--model=timm:NAME`, `--model=hf:FOLDER`: a model from a
# hub, by the module that builds it (any torchvision.models classification builder, any
# timm.create_model name, any Hugging Face AutoModelForImageClassification).
HUBS = {"torchvision": "torchvision.models", "timm": "timm", "hf": "transformers"}


# algorithm: blurpool
# BlurPool (Zhang 2019): strided convolutions and max pools blur before they
# subsample, so high frequencies do not alias. Parameters and checkpoint keys stay
# nn.Conv2d's and nn.MaxPool2d's (the filter is a fixed, unsaved buffer).
BLURPOOL_REPLACE_CONVS = True  # strided convolutions blur
BLURPOOL_REPLACE_MAXPOOLS = True  # max pools blur
BLURPOOL_BLUR_FIRST = True  # blur, then the strided convolution
BLURPOOL_MIN_CHANNELS = 16  # fewer input channels: a plain convolution


def blur_2d(
    x: torch.Tensor, kernel: torch.Tensor, stride: int | tuple = 1
) -> torch.Tensor:
    """Zhang 2019's anti-aliasing low-pass: each channel convolved with the 3x3
    binomial kernel [1 2 1]^T [1 2 1] / 16 (depthwise, zero-padded), then `stride`."""
    channels = x.shape[1]
    weight = kernel.to(x.dtype).expand(channels, 1, 3, 3)
    return F.conv2d(x, weight, stride=stride, padding=1, groups=channels)


def add_blur_kernel(layer: nn.Module) -> None:
    """The binomial kernel as `layer.blur_kernel`: a buffer (it moves with the model),
    not persistent (checkpoints hold the same keys with or without BlurPool)."""
    row = torch.tensor([1.0, 2.0, 1.0])
    kernel = (torch.outer(row, row) / 16).view(1, 1, 3, 3)
    layer.register_buffer("blur_kernel", kernel, persistent=False)


def blurs(in_channels: int, stride: int) -> bool:
    """Whether BlurPool blurs a convolution: strided, with enough input channels."""
    wide = in_channels >= BLURPOOL_MIN_CHANNELS
    return BLURPOOL_REPLACE_CONVS and stride > 1 and wide


class BlurConv2d(nn.Conv2d):
    """A strided convolution that blurs before subsampling. BLURPOOL_BLUR_FIRST: blur,
    then the strided convolution; else: the convolution at stride 1, then blur with
    the stride. nn.Conv2d's parameters and checkpoint keys; the same output shape."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        add_blur_kernel(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if BLURPOOL_BLUR_FIRST:
            return super().forward(blur_2d(x, self.blur_kernel))
        y = F.conv2d(
            x, self.weight, self.bias, 1, self.padding, self.dilation, self.groups
        )
        return blur_2d(y, self.blur_kernel, self.stride)


class BlurMaxPool2d(nn.MaxPool2d):
    """Max pool at stride 1, then blur with the pool's stride (Zhang's MaxBlurPool)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        add_blur_kernel(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.max_pool2d(
            x,
            self.kernel_size,
            1,
            self.padding,
            self.dilation,
            ceil_mode=self.ceil_mode,
        )
        return blur_2d(y, self.blur_kernel, self.stride)


def use_blurpool(model: nn.Module) -> int:
    """A model built elsewhere (torchvision): its strided convolutions that `blurs`
    (zero padding) become BlurConv2d and its max pools BlurMaxPool2d, in place; returns
    how many. The presets build theirs as such (conv, max_pool)."""
    found = 0
    for module in list(model.modules()):
        if type(module) is nn.Conv2d:
            blur = blurs(module.in_channels, max(module.stride))
            blur, new_class = blur and module.padding_mode == "zeros", BlurConv2d
        elif type(module) is nn.MaxPool2d:
            blur, new_class = BLURPOOL_REPLACE_MAXPOOLS, BlurMaxPool2d
        else:
            continue
        if blur:
            module.__class__ = new_class  # same parameters, same state-dict keys
            add_blur_kernel(module)
            found += 1
    return found


# end algorithm: blurpool


def conv(
    c_in: int, c_out: int, kernel_size: int, stride: int = 1, padding: int = 0
) -> nn.Conv2d:
    """Every convolution of these ResNets: bias-free (a BatchNorm follows each one)."""
    # algorithm: blurpool
    # BlurPool: a strided convolution with enough input channels blurs first.
    if blurs(c_in, stride):
        return BlurConv2d(c_in, c_out, kernel_size, stride, padding, bias=False)
    # end algorithm: blurpool

    return nn.Conv2d(c_in, c_out, kernel_size, stride, padding, bias=False)


def max_pool(kernel_size: int, stride: int, padding: int) -> nn.MaxPool2d:
    """The ImageNet stem's max pool."""
    # algorithm: blurpool
    # BlurPool: the max at stride 1, then a blur that subsamples.
    if BLURPOOL_REPLACE_MAXPOOLS:
        return BlurMaxPool2d(kernel_size, stride, padding)
    # end algorithm: blurpool

    return nn.MaxPool2d(kernel_size, stride, padding)


class BatchNorm2d(nn.BatchNorm2d):
    """BatchNorm whose results depend on the global batch, not on how it is split.

    Training: every group of `group_size` consecutive samples is normalized with its
    own mean and variance ("ghost" BatchNorm, Hoffer et al. 2017). Torch's BatchNorm
    uses the whole forward pass instead, so its gradients change with the microbatch
    size and the number of ranks. Microbatches (and each rank's share) must be
    multiples of group_size.
    Running statistics (used in evaluation) are updated once per optimizer step by
    `update_running_stats`, from every group of the global batch (all microbatches and
    ranks), not once per forward pass as torch does.
    """

    def __init__(self, channels: int, group_size: int) -> None:
        super().__init__(channels)
        self.group_size = group_size
        # Sums over this step's groups: [means, variances, number of groups]. A plain
        # attribute, not a buffer: it is not saved, and DDP does not broadcast it.
        self.step_stats: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:
            # bf16 activations and parameters (FSDP's bf16 policy): normalize in fp32,
            # as autocast does, against the fp32 running statistics.
            weight, bias = self.weight.float(), self.bias.float()
            return self._normalize(x.float(), weight, bias).to(x.dtype)
        return self._normalize(x, self.weight, self.bias)

    def _normalize(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
    ) -> torch.Tensor:
        if not self.training:  # evaluation: the running statistics
            return F.batch_norm(
                x,
                self.running_mean,
                self.running_var,
                weight,
                bias,
                False,
                0.0,
                self.eps,
            )
        n, c, h, w = x.shape
        if n % self.group_size:
            raise ValueError(
                f"a training microbatch of {n} samples is not a multiple of "
                f"bn_group_size={self.group_size}"
            )
        k = n // self.group_size
        # k groups side by side as k * c channels of one batch of group_size samples:
        # one call of the native kernel normalizes every group with its own statistics
        # and (momentum 1) leaves each group's mean and unbiased variance in mean, var.
        grouped = x.view(k, self.group_size, c, h, w).transpose(0, 1)
        mean = torch.zeros(k * c, device=x.device)
        var = torch.ones(k * c, device=x.device)
        y = F.batch_norm(
            grouped.reshape(self.group_size, k * c, h, w),
            mean,
            var,
            weight.repeat(k),
            bias.repeat(k),
            training=True,
            momentum=1.0,
            eps=self.eps,
        )
        with torch.no_grad():
            count = torch.full((1,), float(k), device=x.device)
            stats = torch.cat([mean.view(k, c).sum(0), var.view(k, c).sum(0), count])
            self.step_stats = (
                stats if self.step_stats is None else self.step_stats + stats
            )
        return y.view(self.group_size, k, c, h, w).transpose(0, 1).reshape(n, c, h, w)


def clear_step_stats(model: nn.Module) -> None:
    """Forget the group statistics gathered so far (a new step, or a retried batch)."""
    for module in model.modules():
        if isinstance(module, BatchNorm2d):
            module.step_stats = None


def update_running_stats(
    model: nn.Module, reduce_sum: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """After the optimizer step: fold this step's mean group statistics into the running
    mean and variance (momentum 0.1, as torch). `reduce_sum` adds over ranks, in one
    collective for all layers, so every rank keeps the same running statistics."""
    norms = [
        m
        for m in model.modules()
        if isinstance(m, BatchNorm2d) and m.step_stats is not None
    ]
    if not norms:
        return
    total = reduce_sum(torch.cat([m.step_stats for m in norms]))
    offset = 0
    for m in norms:
        c = m.num_features
        mean, var = total[offset : offset + c], total[offset + c : offset + 2 * c]
        count = total[offset + 2 * c]
        offset += 2 * c + 1
        m.running_mean.lerp_(mean / count, m.momentum)
        m.running_var.lerp_(var / count, m.momentum)
        m.num_batches_tracked += 1
        m.step_stats = None


class ResidualBlock(nn.Module):
    """relu(residual(x) + shortcut(x)); BasicBlock and Bottleneck define the branch."""

    shortcut: nn.Module

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # y: the residual branch's output (an algorithm may skip or scale it)
        y = self.residual(x)
        return F.relu(y + self.shortcut(x))


class BasicBlock(ResidualBlock):
    """Two 3x3 convolutions; the shortcut adds the input back."""

    expansion = 1

    def __init__(
        self, c_in: int, width: int, stride: int, config: ResNetConfig
    ) -> None:
        super().__init__()
        g = config.bn_group_size
        self.conv1 = conv(c_in, width, 3, stride, 1)
        self.bn1 = BatchNorm2d(width, g)
        self.conv2 = conv(width, width, 3, 1, 1)
        self.bn2 = BatchNorm2d(width, g)
        self.bn2.last_in_block = True  # gamma starts at 0 (ResNet.init_weights)
        self.shortcut = shortcut(c_in, width, stride, config)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return self.bn2(self.conv2(y))


class Bottleneck(ResidualBlock):
    """1x1 down to `width`, 3x3 (strided: "ResNet v1.5"), 1x1 up to 4 x width."""

    expansion = 4

    def __init__(
        self, c_in: int, width: int, stride: int, config: ResNetConfig
    ) -> None:
        super().__init__()
        g, c_out = config.bn_group_size, width * self.expansion
        self.conv1 = conv(c_in, width, 1)
        self.bn1 = BatchNorm2d(width, g)
        self.conv2 = conv(width, width, 3, stride, 1)
        self.bn2 = BatchNorm2d(width, g)
        self.conv3 = conv(width, c_out, 1)
        self.bn3 = BatchNorm2d(c_out, g)
        self.bn3.last_in_block = True
        self.shortcut = shortcut(c_in, c_out, stride, config)

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        return self.bn3(self.conv3(y))


class PadShortcut(nn.Module):
    """He et al.'s option A: subsample by the stride, zero-pad the new channels."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.pad, self.stride = c_out - c_in, stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, :: self.stride, :: self.stride]
        return F.pad(x, (0, 0, 0, 0, self.pad // 2, self.pad - self.pad // 2))


def shortcut(c_in: int, c_out: int, stride: int, config: ResNetConfig) -> nn.Module:
    """The identity, or a map to the block's output shape: a parameter-free one on CIFAR
    ResNets, a strided 1x1 convolution and BatchNorm on ImageNet ResNets."""
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    if config.stem == "cifar":
        return PadShortcut(c_in, c_out, stride)
    return nn.Sequential(
        conv(c_in, c_out, 1, stride), BatchNorm2d(c_out, config.bn_group_size)
    )


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig) -> None:
        super().__init__()
        self.config = config
        block = BasicBlock if config.block == "basic" else Bottleneck
        c = config.widths[0]
        if config.stem == "imagenet":
            self.stem = nn.Sequential(
                conv(config.in_channels, c, 7, 2, 3),
                BatchNorm2d(c, config.bn_group_size),
                nn.ReLU(),
                max_pool(3, 2, 1),
            )
        else:
            self.stem = nn.Sequential(
                conv(config.in_channels, c, 3, 1, 1),
                BatchNorm2d(c, config.bn_group_size),
                nn.ReLU(),
            )
        # Every residual block in one list (FSDP shards them one by one); the first
        # block of each stage after the first halves the resolution.
        blocks = []
        for stage, (depth, width) in enumerate(zip(config.layers, config.widths)):
            for i in range(depth):
                stride = 2 if stage > 0 and i == 0 else 1
                blocks.append(block(c, width, stride, config))
                c = width * block.expansion
        self.blocks = nn.ModuleList(blocks)
        self.fc = nn.Linear(c, config.num_classes)
        self.init_weights()

    def init_weights(self) -> None:
        """He (Kaiming) normal convolutions; BatchNorm gamma 1 and beta 0, except the
        last one of each residual block, whose gamma is 0."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(
                    module.weight, mode="fan_out", nonlinearity="relu"
                )
            elif isinstance(module, BatchNorm2d):
                nn.init.constant_(
                    module.weight, 0.0 if hasattr(module, "last_in_block") else 1.0
                )
                nn.init.zeros_(module.bias)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits (batch, classes) for images (batch, channels, height, width)."""
        x = self.stem(images)
        for block in self.blocks:
            x = block(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def check_model(name: str) -> str | None:
    """None if `name` is a preset or a hub model (torchvision:NAME, timm:NAME,
    hf:FOLDER) that can be built here, else the problem in one line (checked at
    start-up, before anything is written)."""
    if name in PRESETS:
        return None
    hub, _, arch = name.partition(":")
    if hub not in HUBS:
        presets = ", ".join(PRESETS)
        return (
            f"model={name!r} is not a preset ({presets}), torchvision:NAME, timm:NAME "
            "nor hf:FOLDER"
        )
    try:  # optional: only hub models need their library
        library = importlib.import_module(HUBS[hub])
    except Exception as error:  # not installed, or built for another torch
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        return (
            f"model={name} needs {hub}, which fails to import ({reason}); install "
            f"{hub} built for this torch ({torch.__version__}) (CPU: e.g. pip install "
            "torch==2.14.1 torchvision==0.29.1 timm; CUDA: the pair for your CUDA from "
            "pytorch.org), or use a preset"
        )
    if hub == "torchvision" and arch not in library.list_models(module=library):
        return (
            f"model={name}: torchvision has no classification model {arch!r}; list "
            "them with python -c 'import torchvision.models as m; "
            "print(m.list_models(m))'"
        )
    if hub == "timm" and not library.is_model(arch):
        return (
            f"model={name}: timm has no model {arch!r}; list them with "
            "python -c 'import timm; print(timm.list_models())'"
        )
    if hub == "hf":
        return check_hf_model(name, arch)
    return None


def check_weights(name: str, weights: str) -> str | None:
    """None if model `name` reads pretrained `weights` ("": random ones), else the
    problem in one line."""
    if weights and name.partition(":")[0] not in ("torchvision", "timm"):
        return (
            f"weights={weights}: pretrained weights are read for torchvision:NAME "
            "and timm:NAME models (hf:FOLDER: the folder's); remove it or pick one"
        )
    return None


def check_hf_model(name: str, folder: str) -> str | None:
    """None if `folder` (or a Hub id already in the local cache) holds the config of an
    AutoModelForImageClassification, else the problem in one line."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(folder)
    except (OSError, ValueError) as error:
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        return (
            f"model={name}: no readable config.json in {folder!r} ({reason}); pass a "
            "folder written by save_pretrained"
        )
    if type(config) not in transformers.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING:
        return (
            f"model={name}: a {type(config).__name__} is not an image classifier "
            "(AutoModelForImageClassification); pass a ViT, ConvNeXt, ResNet... folder"
        )
    return None


def hub_model(name: str, num_classes: int, weights: str) -> nn.Module:
    """The library's own model for `torchvision:NAME` or `timm:NAME`, with `num_classes`
    outputs; pretrained weights from the local file `weights` (a state dict: "" for
    random ones), read through each library's own loading path, nothing downloaded:
    - torchvision: get_model(NAME, weights=None, num_classes=...), then its state dict
      loaded as torchvision's `weights=` does (torch.load, load_state_dict); tensors
      whose shape differs from the model's (an ImageNet head on 10 classes) keep their
      new initialisation, as timm does;
    - timm: create_model(NAME, pretrained=True, pretrained_cfg_overlay=dict(file=...)):
      timm adapts the first convolution and drops the classifier when num_classes
      differs from the pretrained config's (1000 for ImageNet weights);
    - hf:FOLDER: AutoModelForImageClassification.from_pretrained(FOLDER): the folder
      holds the weights (`weights` is not used); a classifier of another number of
      classes is initialised anew (ignore_mismatched_sizes).
    """
    hub, _, arch = name.partition(":")
    if hub == "hf":
        # Where torchao is installed, transformers' models import it, which prints
        # deprecation lines about torchao on stderr: hide those lines and nothing else.
        quiet.torchao_import_warnings()
        import transformers  # checked by check_model at start-up

        # The loop's log says what happens: no progress bars, no load reports.
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        return transformers.AutoModelForImageClassification.from_pretrained(
            arch,
            id2label={i: str(i) for i in range(num_classes)},
            ignore_mismatched_sizes=True,
            dtype=torch.float32,  # our precision settings cast it, as they do ours
        )
    if hub == "timm":
        import timm  # checked importable by check_model at start-up

        overlay = dict(file=weights) if weights else None
        return timm.create_model(
            arch,
            pretrained=bool(weights),
            pretrained_cfg_overlay=overlay,
            num_classes=num_classes,
        )
    import torchvision.models

    net = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    if weights:
        state = torch.load(weights, map_location="cpu", weights_only=True)
        ours = net.state_dict()
        new = [k for k, v in state.items() if k in ours and v.shape != ours[k].shape]
        net.load_state_dict(
            {k: v for k, v in state.items() if k not in new}, strict=not new
        )
    return net


def use_ghost_batchnorm(module: nn.Module, group_size: int) -> None:
    """Replace torch's BatchNorm2d layers inside `module` by this file's ghost
    BatchNorm2d, in place: same parameters, buffers, eps, momentum and state-dict keys.
    """
    for name, child in module.named_children():
        plain = type(child) is nn.BatchNorm2d
        usable = plain and child.affine and child.track_running_stats
        if usable and child.momentum is not None:
            ghost = BatchNorm2d(child.num_features, group_size)
            ghost.eps, ghost.momentum = child.eps, child.momentum
            ghost.load_state_dict(child.state_dict())
            setattr(module, name, ghost)
        else:
            use_ghost_batchnorm(child, group_size)


def check_image_side(name: str, net: nn.Module, side: int) -> None:
    """Raises ValueError (one line) if `net` refuses side x side images (the data's, or
    an algorithm's: train.py's `image_sides`): a model built for one input size (a
    ViT's position embeddings) would otherwise stop the run with a traceback at its
    first step. One image's forward in eval mode: nothing changes."""
    training = net.training
    try:
        with torch.no_grad():
            net.eval()(torch.zeros(1, 3, side, side))
    except (RuntimeError, ValueError, AssertionError) as error:
        reason = (str(error).splitlines() or [type(error).__name__])[0]
        raise ValueError(
            f"model={name} does not take the {side}-pixel images this run feeds it "
            f"({reason}); pass the --image_size (and --eval_image_size) it was built "
            "for, keep algorithms from resizing the images, or use another model"
        ) from None
    finally:
        net.train(training)


class ModelConfig(Protocol):
    """The fields of train.py's Config that choose the model."""

    model: str  # a preset, torchvision:NAME, timm:NAME or hf:FOLDER
    weights: str
    bn_group_size: int


def build_model(
    cfg: ModelConfig,
    classes: Sequence[str],
    in_channels: int,
    image_sides: Iterable[int],
    device: torch.device,
) -> ResNet | HubNet:
    """A preset ResNet, or a torchvision, timm or HF model fitted to the loop (see
    HubNet) that takes every one of `image_sides`, on `device`. ValueError, OSError or
    RuntimeError (one line) for a hub model it refuses: BatchNorm it cannot make ghost,
    bad weights, other image sizes."""
    if cfg.model not in PRESETS:
        hub = HubNet(
            cfg.model, len(classes), cfg.bn_group_size, cfg.weights, image_sides
        )
        return hub.to(device)
    config = ResNetConfig(
        num_classes=len(classes),
        in_channels=in_channels,
        bn_group_size=cfg.bn_group_size,
        **PRESETS[cfg.model],
    )
    model = ResNet(config)

    return model.to(device)


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """The optimizer's parameter groups: conv and linear weights (first) decayed by
    `weight_decay`, BatchNorm parameters and biases undecayed."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


class HubNet(nn.Module):
    """A torchvision, timm or Hugging Face classification model
    (`--model=torchvision:resnet50`, `--model=timm:resnet18`, `--model=hf:FOLDER`),
    built by its library (`hub_model`; pretrained weights from a local file or the
    folder, or random ones) and fitted to this loop:
    - its BatchNorm2d layers become ghost BatchNorm (`use_ghost_batchnorm`), so a step
      does not depend on the microbatch size or the number of ranks, as with ResNet;
      a model with other BatchNorm layers (1d, 3d, timm's BatchNormAct2d, no running
      statistics) is refused;
    - grey images (the digits) are repeated into the 3 channels the hubs expect;
    - `blocks` (FSDP2 units, activation checkpointing, compilation): the children of
      its top-level containers (torchvision ResNet's and timm ResNet's layer1..4
      blocks, the stages of `features` in VGG, MobileNet, EfficientNet, ConvNeXt, a
      ViT's `blocks`) and its other top-level children with parameters; a Hugging
      Face model's: its first layer list (ViT's `vit.layers`, ResNet's
      `resnet.encoder.stages`); what is in none of them stays with the root;
    - a Hugging Face model returns its output object: `forward` returns its logits.
    Its weights are under `net.` in the state dict: `model.net` is the library's model.
    """

    def __init__(
        self,
        name: str,
        num_classes: int,
        bn_group_size: int,
        weights: str = "",
        image_sides: Iterable[int] = (),
    ) -> None:
        super().__init__()
        self.net = hub_model(name, num_classes, weights)
        self.hf = name.startswith("hf:")
        for side in sorted(set(image_sides)):
            check_image_side(name, self.net, side)
        use_ghost_batchnorm(self.net, bn_group_size)
        plain = {
            type(m).__name__
            for m in self.net.modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and not isinstance(m, BatchNorm2d)
        }
        if plain:
            raise ValueError(
                f"{name} has {', '.join(sorted(plain))} layers whose "
                "statistics would depend on the microbatch size and the number of "
                "ranks; pick another model or edit HubNet in model.py"
            )

        # algorithm: blurpool
        # BlurPool: the hub built these layers; swap them for their blurring kind.
        use_blurpool(self.net)
        # end algorithm: blurpool

    @property
    def blocks(self) -> list[nn.Module]:
        if self.hf:
            layers = (m for m in self.net.modules() if isinstance(m, nn.ModuleList))
            return list(next(layers, [self.net]))
        units = []
        for child in self.net.children():
            containers = (nn.Sequential, nn.ModuleList)
            members = child.children() if isinstance(child, containers) else [child]
            units += [m for m in members if next(m.parameters(), None) is not None]
        return units

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Class logits (batch, classes) for images (batch, channels, height, width)."""
        if images.shape[1] == 1:  # grey: the same image in red, green and blue
            images = images.expand(-1, 3, -1, -1)
        return self.net(images).logits if self.hf else self.net(images)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
