"""Training data: labelled images, their augmentations, and a resumable batch order.

The default data is real and offline: scikit-learn's handwritten digits (1,797 8x8
grey-scale images, 10 classes; `pip install scikit-learn`), read from the CSV file the
package ships, without importing it. A fixed 20% of it is held out for validation.
`--data=PATH` takes
- an ImageFolder tree: `PATH/train/<class>/*.jpg|png|...` and `PATH/val/<class>/...`,
  decoded with Pillow (ImageNet laid out this way works as is);
- the CIFAR-10 binary distribution, the folder `cifar-10-batches-bin` (raw bytes:
  nothing is unpickled);
- a streaming dataset: litdata shards in a folder or at a URL (`s3://bucket/data`) of
  encoded images and labels, written by `python data.py convert OUT --data=...` from any
  of the above (see `convert` and runtime/shards.py). Its meta.json names the classes
  and the augmentation; the order is shuffled chunk by chunk, still a pure function of
  (seed, epoch, batch index) on any number of ranks;
- MDS shards (train/ and val/) written by mosaicml-streaming's MDSWriter with columns
  `x` (image) and `y` (class index), as Composer's vision datasets are (`mds_images`),
  in the same order.

Augmentation: random-resized crop and horizontal flip for ImageFolder data (evaluation:
resize the short side to eval_resize, centre crop), or with crop="pad" CIFAR's: the
whole image resized to image_size, padded by 4, cropped back and flipped (evaluation:
the whole image at image_size); pad-and-crop and flip for
CIFAR; pad-and-crop (no flip: a mirrored digit is another digit) for the digits; then
the per-sample augmentations train.py passes in (`augment`, in order). Every random
choice is drawn from a generator seeded by (seed, epoch, sample index), and epoch e
visits the samples in a permutation seeded by (seed, e): any batch is a pure function of
(seed, epoch, batch index), on any number of ranks, in any DataLoader worker, after any
resume.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import importlib.util
import io
import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from PIL import Image

from runtime import dist, shards

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
CIFAR_FILES = [f"data_batch_{i}.bin" for i in range(1, 6)]
CIFAR_RECORD = 1 + 32 * 32 * 3  # label byte, then 1024 red, 1024 green, 1024 blue bytes
CIFAR_CLASSES = "airplane automobile bird cat deer dog frog horse ship truck".split()
# Per-channel mean and standard deviation of the pixels (0..1) used to normalize.
IMAGENET_STATS = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
CIFAR_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
DIGITS_VAL_FRACTION = 0.2
# A per-sample augmentation of a training image: (uint8 pixels H x W x C, the sample's
# generator) -> uint8 pixels, H x W x C, or V x H x W x C for V views of the sample.
Augment = Callable[[np.ndarray, np.random.Generator], np.ndarray]


@dataclass
class Split:
    """One split: images in memory (uint8, N x H x W x C), image files on disk, or
    encoded images with their labels in streaming shards."""

    labels: np.ndarray | None  # int64 class indices (shards: stored with each image)
    pixels: np.ndarray | None = None
    files: list[Path] | None = None
    shards: shards.Shards | None = None

    def __len__(self) -> int:
        return len(self.shards) if self.shards is not None else len(self.labels)

    def sample(self, i: int) -> tuple[np.ndarray | Image.Image, int]:
        """Image i (decoded) and its label."""
        if self.shards is None:
            return self.image(i), int(self.labels[i])
        item = self.shards[i]
        if "x" in item:  # MDS: streaming's vision datasets (an image), ours (bytes)
            image, label = item["x"], int(item["y"])
        else:  # litdata: the image file's bytes
            image, label = item["image"], int(item["label"])
        if isinstance(image, bytes):
            image = Image.open(io.BytesIO(image))
        with image:
            if self.pixels is None:  # decoded like files: RGB, any size
                return image.convert("RGB"), label
            pixels = np.asarray(image)  # like arrays: H x W x C uint8
        return pixels.reshape(*pixels.shape[:2], -1), label

    def image(self, i: int) -> np.ndarray | Image.Image:
        if self.pixels is not None:
            return self.pixels[i]
        path = self.files[i]
        try:
            with Image.open(path) as image:
                return image.convert("RGB")
        except OSError as error:
            raise ValueError(
                f"cannot decode image {path}: {error}; remove or replace it"
            ) from error


@dataclass
class ImageData:
    train: Split
    val: Split
    classes: list[str]
    channels: int
    kind: str  # digits | cifar | folder: which augmentation applies
    mean: tuple[float, ...]
    std: tuple[float, ...]
    source: str  # where the images came from, for the log

    @property
    def on_disk(self) -> bool:
        """Decoding happens per sample: worth DataLoader worker processes."""
        return self.train.files is not None or self.train.shards is not None

    def describe(self) -> list[str]:
        """Where the images came from and how many there are, for the log."""
        return [
            f"data: {self.source}",
            f"images: {len(self.train):,} train, {len(self.val):,} validation, "
            f"{len(self.classes)} classes",
        ]


class DataConfig(Protocol):
    """The fields of train.py's Config that choose and batch the images."""

    data: str
    seed: int
    global_batch_size: int
    device_microbatch_size: int | str
    bn_group_size: int
    image_size: int
    train_crop: str
    eval_image_size: int
    eval_resize: int
    eval_batches: int
    num_workers: int


def check(cfg: DataConfig, world_size: int) -> str | None:
    """None if the sizes in `cfg` can batch images on `world_size` ranks, else the
    problem in one line (checked at start-up, before anything is read). eval_image_size
    and eval_resize are settled (not 0)."""
    for name in ("global_batch_size", "bn_group_size", "image_size"):
        if getattr(cfg, name) < 1:
            return f"{name}={getattr(cfg, name)} must be at least 1"
    if cfg.eval_image_size < 1 or cfg.eval_resize < cfg.eval_image_size:
        return (
            f"eval_image_size={cfg.eval_image_size}, eval_resize={cfg.eval_resize}: "
            "the crop must be at least 1 pixel and at most the resized short side"
        )
    if cfg.eval_batches < 0 or cfg.num_workers < 0:
        return "eval_batches and num_workers must be at least 0"
    # Ghost BatchNorm groups must not straddle ranks or microbatches.
    per_rank = cfg.global_batch_size // world_size
    for name, size in (
        ("the per-rank batch (global_batch_size / world size)", per_rank),
        ("device_microbatch_size", cfg.device_microbatch_size),
    ):
        if isinstance(size, int) and size % cfg.bn_group_size:
            return (
                f"{name}={size} is not a multiple of bn_group_size="
                f"{cfg.bn_group_size}; BatchNorm groups must not be split: change one"
            )
    return None


def load_splits(
    cfg: DataConfig, env: dist.DistEnv, augment: Sequence[Augment] = ()
) -> tuple[ImageData, Batches, Batches]:
    """The images `cfg.data` names, this rank's training batches of them (epoch 0's
    order; `Batches.at_epoch` for others, `augment` applied after the crop) and its
    validation batches, at the sizes `cfg` sets. OSError or ValueError (one line) for
    a missing path, a bad file, too few images."""
    images = load_images(cfg.data)
    train = Batches(
        images,
        "train",
        cfg.global_batch_size,
        cfg.seed,
        cfg.image_size,
        cfg.train_crop,
        rank=env.rank,
        world_size=env.world_size,
        augment=augment,
    )
    val = Batches(
        images,
        "val",
        cfg.global_batch_size,
        cfg.seed,
        cfg.eval_image_size,
        cfg.train_crop,
        rank=env.rank,
        world_size=env.world_size,
        resize=cfg.eval_resize,
    )
    return images, train, val


def load_images(data: str) -> ImageData:
    """The images named by `--data` ("" for scikit-learn's digits)."""
    if not data:
        return digits()
    if shards.is_shards(data):
        return shard_images(data)
    path = Path(data).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"--data={data}: no such folder; pass an ImageFolder tree (train/<class>/, "
            "val/<class>/) or cifar-10-batches-bin, or leave it empty for the default"
        )
    if (path / CIFAR_FILES[0]).exists():
        return cifar10(path)
    return image_folder(path)


def digits() -> ImageData:
    spec = importlib.util.find_spec("sklearn")
    csv = (
        Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if spec
        else None
    )
    if csv is None or not csv.is_file():
        raise FileNotFoundError(
            "the default data is scikit-learn's digits: pip install scikit-learn, or "
            "pass --data=PATH (an ImageFolder tree or cifar-10-batches-bin)"
        )
    with gzip.open(csv, "rt") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.float32)
    # 64 pixel values 0..16, then the label; scaled to 0..255 grey levels.
    pixels = np.round(table[:, :64] * (255 / 16)).astype(np.uint8).reshape(-1, 8, 8, 1)
    labels = table[:, 64].astype(np.int64)
    order = np.random.default_rng(0).permutation(len(labels))  # a fixed held-out set
    cut = int(len(labels) * (1 - DIGITS_VAL_FRACTION))
    train, val = order[:cut], order[cut:]
    mean = float(pixels[train].mean()) / 255
    std = float(pixels[train].std()) / 255
    return ImageData(
        Split(labels[train], pixels=pixels[train]),
        Split(labels[val], pixels=pixels[val]),
        classes=[str(d) for d in range(10)],
        channels=1,
        kind="digits",
        mean=(mean,),
        std=(std,),
        source=f"scikit-learn digits ({csv})",
    )


def cifar10(folder: Path) -> ImageData:
    def read(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
        records = []
        for name in names:
            path = folder / name
            size = path.stat().st_size if path.is_file() else -1
            if size != 10_000 * CIFAR_RECORD:
                raise ValueError(
                    f"{path} is missing or truncated ({max(size, 0):,} of "
                    f"{10_000 * CIFAR_RECORD:,} bytes); download "
                    "cifar-10-binary.tar.gz again and extract it"
                )
            records.append(np.fromfile(path, dtype=np.uint8).reshape(-1, CIFAR_RECORD))
        table = np.concatenate(records)
        pixels = table[:, 1:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(pixels), table[:, 0].astype(np.int64)

    train_pixels, train_labels = read(CIFAR_FILES)
    val_pixels, val_labels = read(["test_batch.bin"])
    return ImageData(
        Split(train_labels, pixels=train_pixels),
        Split(val_labels, pixels=val_pixels),
        classes=CIFAR_CLASSES,
        channels=3,
        kind="cifar",
        mean=CIFAR_STATS[0],
        std=CIFAR_STATS[1],
        source=f"CIFAR-10 binary ({folder})",
    )


def image_folder(root: Path) -> ImageData:
    """`root/train/<class>/<image>` and `root/val/<class>/<image>`; classes by name.

    Every file's header is checked here, before training starts, so an undecodable
    image is reported now rather than hours into a run.
    """
    fix = "lay it out as train/<class>/<image> and val/<class>/<image>"
    splits = {}
    for split in ("train", "val"):
        folder = root / split
        if not folder.is_dir():
            raise ValueError(f"--data={root}: no {split}/ folder; {fix}")
        classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        if not classes:
            raise ValueError(f"{folder} has no class folders; {fix}")
        splits[split] = classes
    if splits["train"] != splits["val"]:
        only = sorted(set(splits["train"]) ^ set(splits["val"]))
        raise ValueError(
            f"--data={root}: train/ and val/ have different class folders "
            f"({', '.join(only[:5])} in only one); give both splits the same classes"
        )
    classes = splits["train"]
    loaded = {}
    for split in ("train", "val"):
        files, labels = [], []
        for label, name in enumerate(classes):
            found = sorted(
                p
                for p in (root / split / name).rglob("*")
                if p.suffix.lower() in IMAGE_SUFFIXES
            )
            if not found:
                suffixes = ", ".join(sorted(IMAGE_SUFFIXES))
                raise ValueError(f"{root / split / name} holds no images ({suffixes})")
            files += found
            labels += [label] * len(found)
        for path in files:
            try:
                with Image.open(path) as image:
                    image.verify()
            except Exception as error:  # Pillow raises several kinds for a bad file
                raise ValueError(
                    f"cannot decode image {path} ({error}); remove or replace it"
                ) from error
        loaded[split] = Split(np.array(labels, dtype=np.int64), files=files)
    return ImageData(
        loaded["train"],
        loaded["val"],
        classes=classes,
        channels=3,
        kind="folder",
        mean=IMAGENET_STATS[0],
        std=IMAGENET_STATS[1],
        source=f"image folders under {root}",
    )


def shard_images(root: str) -> ImageData:
    """A streaming dataset of encoded images; classes, augmentation from meta.json (MDS
    shards without one: `mds_images`)."""
    meta = shards.read_meta(root, optional=shards.is_mds(root))
    if not meta:  # MDS shards without one
        return mds_images(root)
    try:
        kind, classes = meta["kind"], [str(name) for name in meta["classes"]]
        channels, mean, std = int(meta["channels"]), meta["mean"], meta["std"]
        if kind not in ("digits", "cifar", "folder") or len(mean) != channels:
            raise ValueError(kind)
    except (KeyError, TypeError, ValueError) as error:
        raise shards.ShardError(
            f"--data={root}: meta.json needs kind (digits|cifar|folder), classes, "
            f"channels, mean and std ({type(error).__name__}: {error})"
        ) from None
    # Digits and CIFAR decode to arrays (their augmentation works on arrays).
    in_memory = None if kind == "folder" else np.empty(0, dtype=np.uint8)
    splits = [
        Split(None, pixels=in_memory, shards=shards.open_split(root, split))
        for split in ("train", "val")
    ]
    writer = "MDS" if splits[0].shards.columns else "litdata"  # MDS: columns known
    return ImageData(
        *splits,
        classes=classes,
        channels=channels,
        kind=kind,
        mean=tuple(mean),
        std=tuple(std),
        source=f"streaming dataset {root} ({writer} shards)",
    )


def mds_images(root: str) -> ImageData:
    """MDS shards as mosaicml-streaming's vision datasets write them (columns `x`: an
    image, `y`: its class index), without meta.json: trained like ImageFolder data (RGB,
    ImageNet's statistics and augmentation); the classes are 0 .. the largest label in
    val/ (read once at start-up; a meta.json with `classes` names them instead)."""
    splits = [
        Split(None, shards=shards.open_split(root, split)) for split in ("train", "val")
    ]
    for split, name in zip(splits, ("train", "val")):
        if not {"x", "y"} <= set(split.shards.columns):
            columns = ", ".join(split.shards.columns)
            raise shards.ShardError(
                f"--data={root}: {name}/ has columns {columns}; image MDS shards need "
                "x (the image) and y (its class index)"
            )
    labels = [int(split.shards[i]["y"]) for i in range(len(splits[1]))]
    return ImageData(
        *splits,
        classes=[str(label) for label in range(max(labels, default=0) + 1)],
        channels=3,
        kind="folder",
        mean=IMAGENET_STATS[0],
        std=IMAGENET_STATS[1],
        source=f"MDS shards {root}",
    )


def convert(
    data: str, output: str, chunk_bytes: str = "64MB", format: str = "litdata"
) -> None:
    """Write the images `--data` names as a streaming dataset in folder `output`:
    litdata shards (its `optimize`) of train/ and val/ holding each image encoded (files
    as they are, arrays as PNG) with its label, and meta.json. Upload the folder as it
    is (`aws s3 sync OUT s3://bucket/data`) and train with --data=s3://bucket/data.
    `format` mds: MDS shards instead (mosaicml-streaming's MDSWriter, zstd), columns x
    (the encoded image's bytes) and y (its label), readable by Composer's users too.
    """
    images = load_images(data)
    if format == "mds":
        for split in ("train", "val"):
            part = getattr(images, split)
            items = (encoded(i, part) for i in range(len(part)))
            rows = ({"x": item["image"], "y": item["label"]} for item in items)
            shards.write_mds(
                output, split, {"x": "bytes", "y": "int"}, rows, chunk_bytes
            )
    else:
        write_litdata(images, output, chunk_bytes)
    meta = {
        "kind": images.kind,
        "classes": images.classes,
        "channels": images.channels,
        "mean": list(images.mean),
        "std": list(images.std),
        "source": images.source,
    }
    (Path(output) / shards.META).write_text(json.dumps(meta, indent=1) + "\n")


def write_litdata(images: ImageData, output: str, chunk_bytes: str) -> None:
    """train/ and val/ as litdata shards of `encoded` items."""
    import litdata

    for split in ("train", "val"):
        litdata.optimize(
            fn=functools.partial(encoded, split=getattr(images, split)),
            inputs=list(range(len(getattr(images, split)))),
            output_dir=str(Path(output) / split),
            chunk_bytes=chunk_bytes,
            num_workers=1,
            start_method="fork",  # the worker inherits the images (no pickling)
            mode="overwrite",
            verbose=False,
        )


def encoded(i: int, split: Split) -> dict[str, bytes | int]:
    """Sample i as one shard item: the image file's bytes, or the array as PNG."""
    if split.files is not None:
        image = split.files[i].read_bytes()
    else:
        buffer = io.BytesIO()
        Image.fromarray(
            split.pixels[i].squeeze(-1)
            if split.pixels.shape[-1] == 1
            else split.pixels[i]
        ).save(buffer, format="PNG")
        image = buffer.getvalue()
    return {"image": image, "label": int(split.labels[i])}


# ---------------------------------------------------------------- augmentations


def pad_crop_flip(
    image: np.ndarray, pad: int, flip: bool, rng: np.random.Generator
) -> np.ndarray:
    """A random crop of the zero-padded image, same size; mirrored half the time."""
    h, w = image.shape[:2]
    padded = np.pad(image, ((pad, pad), (pad, pad), (0, 0)))
    top, left = rng.integers(0, 2 * pad + 1, size=2)
    crop = padded[top : top + h, left : left + w]
    return crop[:, ::-1] if flip and rng.random() < 0.5 else crop


def random_resized_crop(
    image: Image.Image, size: int, rng: np.random.Generator
) -> np.ndarray:
    """Inception-style crop: 8%-100% of the area, aspect ratio 3/4-4/3, resized to
    size x size, mirrored half the time (the centre crop after 10 failed draws)."""
    width, height = image.size
    area = width * height
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < w <= width and 0 < h <= height:
            left, top = rng.integers(0, width - w + 1), rng.integers(0, height - h + 1)
            break
    else:
        w = h = min(width, height)
        left, top = (width - w) // 2, (height - h) // 2
    box = (int(left), int(top), int(left + w), int(top + h))
    crop = np.asarray(image.resize((size, size), Image.BILINEAR, box=box))
    return crop[:, ::-1] if rng.random() < 0.5 else crop


def center_crop(image: Image.Image, size: int, resize: int) -> np.ndarray:
    """Evaluation: the short side resized to `resize`, then the centre size x size."""
    width, height = image.size
    scale = resize / min(width, height)
    w, h = max(size, round(width * scale)), max(size, round(height * scale))
    left, top = (w - size) // 2, (h - size) // 2
    return np.asarray(
        image.resize((w, h), Image.BILINEAR).crop((left, top, left + size, top + size))
    )


# algorithm: label_smoothing
class LabelSmoothingConfig(Protocol):
    """The field of train.py's Config that label smoothing reads."""

    label_smoothing_smoothing: float


def smooth_labels(
    targets: torch.Tensor, num_classes: int, cfg: LabelSmoothingConfig
) -> torch.Tensor:
    """Label smoothing: (1 - s) * one-hot + s / num_classes (s: the smoothing), for
    targets given as class indices or as class probabilities (a row per sample)."""
    smoothing = cfg.label_smoothing_smoothing
    if targets.dim() == 1:  # class indices -> probabilities
        targets = torch.nn.functional.one_hot(targets, num_classes).float()
    return (1 - smoothing) * targets + smoothing / num_classes


# end algorithm: label_smoothing


# algorithm: mixup
class MixupConfig(Protocol):
    """The fields of train.py's Config that MixUp reads."""

    seed: int
    mixup_alpha: float
    mixup_prob: float


def mixup_batch(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    num_classes: int,
    lam: float,
    partner: torch.Tensor,
    rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MixUp (Zhang et al. 2018) of this rank's share of the global batch: sample g
    becomes lam * x[g] + (1 - lam) * x[partner[g]], its target (class probabilities)
    likewise. Partners may sit on other ranks: inputs and targets are all-gathered."""
    if targets.dim() == 1:  # class indices -> probabilities
        targets = torch.nn.functional.one_hot(targets, num_classes).float()
    share = inputs.shape[0]
    mine = dist.to_device(partner[rank * share : (rank + 1) * share], inputs.device)
    other_inputs = dist.gather_rows(inputs)[mine]
    other_targets = dist.gather_rows(targets)[mine]
    inputs = lam * inputs + (1 - lam) * other_inputs
    return inputs, lam * targets + (1 - lam) * other_targets


def mixup_step(
    inputs: torch.Tensor,
    targets: torch.Tensor,
    num_classes: int,
    cfg: MixupConfig,
    step: int,
    env: dist.DistEnv,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """This step's MixUp: on the steps the "batch mixer" draw gives it, lam drawn from
    Beta(mixup_alpha, mixup_alpha) and this rank's share mixed with partners from a
    permutation of the global batch (both from (seed, step)); otherwise the batch as it
    is and lam 1.0. Returns the inputs, the targets and lam."""
    mixup_lambda = 1.0
    if step_rng(cfg.seed, step, "batch mixer").random() < cfg.mixup_prob:
        rng = step_rng(cfg.seed, step, "mixup")
        mixup_lambda = float(rng.beta(cfg.mixup_alpha, cfg.mixup_alpha))
        # Partners among this step's global rows (every rank holds as many).
        partner = torch.from_numpy(rng.permutation(len(inputs) * env.world_size))
        inputs, targets = mixup_batch(
            inputs, targets, num_classes, mixup_lambda, partner, env.rank
        )
    return inputs, targets, mixup_lambda


# end algorithm: mixup


# algorithm: progressive_resizing
class ProgressiveResizingConfig(Protocol):
    """The fields of train.py's Config that progressive resizing reads."""

    seed: int
    progressive_resizing_initial_scale: float
    progressive_resizing_delay_fraction: float
    progressive_resizing_finetune_fraction: float
    progressive_resizing_size_increment: int
    progressive_resizing_mode: str


def progressive_resizing_size(
    fraction: float, height: int, width: int, cfg: ProgressiveResizingConfig
) -> tuple[int, int]:
    """Image size after `fraction` of training (Composer's ProgressiveResizing): the
    scale is initial_scale for delay_fraction of training, then grows linearly to 1
    where the last finetune_fraction begins. The width is rounded to a multiple of
    size_increment (at least one), the height scaled alike."""
    delay = cfg.progressive_resizing_delay_fraction
    ramp = 1 - delay - cfg.progressive_resizing_finetune_fraction
    if fraction < delay:
        grown = 0.0
    elif fraction >= delay + ramp:
        grown = 1.0
    else:
        grown = (fraction - delay) / ramp
    scale = cfg.progressive_resizing_initial_scale
    scale += (1 - scale) * grown
    step = cfg.progressive_resizing_size_increment
    rounded = min(width, max(step, round(width * scale / step) * step))
    if scale >= 1 or rounded >= width:  # full size (also when width % step != 0)
        return height, width
    return int(height * rounded / width), rounded


def check_progressive_resizing(cfg: ProgressiveResizingConfig) -> str | None:
    """None if the delay and the finetune fraction leave a share of training to grow
    the images in, else the problem in one line."""
    delay = cfg.progressive_resizing_delay_fraction
    finetune = cfg.progressive_resizing_finetune_fraction
    if delay + finetune > 1:
        return (
            f"progressive_resizing_delay_fraction={delay} and _finetune_fraction="
            f"{finetune} add up to more than 1 (of training)"
        )
    return None


def progressive_resizing_inputs(
    images: torch.Tensor, fraction: float, step: int, cfg: ProgressiveResizingConfig
) -> torch.Tensor:
    """The images of step `step` at the size for `fraction` of training: resized, or
    cropped (mode crop) at an offset drawn from (seed, step)."""
    size = progressive_resizing_size(fraction, *images.shape[-2:], cfg)
    mode, crop_seed = cfg.progressive_resizing_mode, [cfg.seed, step]
    return progressive_resize(images, size, mode, crop_seed)


def progressive_resize(
    images: torch.Tensor, size: tuple[int, int], mode: str, seed: list[int]
) -> torch.Tensor:
    """Images (..., C, H, W) at `size`: nearest-neighbour resized, or cropped at one
    offset for the batch drawn from `seed` (the same on every rank). channels_last
    memory stays channels_last."""
    if tuple(images.shape[-2:]) == size:
        return images
    channels_last = images.dim() == 4 and not images.is_contiguous()
    channels_last = channels_last and images.is_contiguous(
        memory_format=torch.channels_last
    )
    if mode == "crop":
        top, left = (
            np.random.default_rng(seed).integers(full - new + 1)
            for full, new in zip(images.shape[-2:], size)
        )
        images = images[..., top : top + size[0], left : left + size[1]]
    else:  # leading dimensions (AugMix's views) folded into the batch
        flat = torch.nn.functional.interpolate(
            images.flatten(0, -4), size=size, mode="nearest"
        )
        images = flat.reshape(*images.shape[:-2], *size)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return images.contiguous(memory_format=layout)


# end algorithm: progressive_resizing


# ---------------------------------------------------------------- batches


class Batches(torch.utils.data.Dataset):
    """Item i: this rank's share of global batch i of `epoch`: uint8 images (N, C, H,
    W; N, V, C, H, W when an augmentation returns V views of each sample), int64 labels
    and float weights. Training batches are shuffled and augmented;
    validation batches are in file order, not augmented, and the last one is padded
    with weight-0 samples so that every rank runs the same number of forward passes."""

    def __init__(
        self,
        data: ImageData,
        split: str,
        batch_size: int,
        seed: int,
        image_size: int,
        crop: str = "inception",
        epoch: int = 0,
        rank: int = 0,
        world_size: int = 1,
        resize: int = 0,
        augment: Sequence[Augment] = (),
    ) -> None:
        self.data, self.split, self.train = data, getattr(data, split), split == "train"
        self.augment = augment  # training only, after the crop
        self.batch_size, self.seed, self.image_size = batch_size, seed, image_size
        self.crop = crop  # ImageFolder: inception (ImageNet's) or pad (CIFAR's)
        self.resize = resize or round(image_size / 0.875)  # evaluation's short side
        self.epoch, self.rank, self.world_size = epoch, rank, world_size
        if self.train:
            self.batches_per_epoch = len(self.split) // batch_size  # no partial batch
            if self.batches_per_epoch == 0:
                raise ValueError(
                    f"the training split holds {len(self.split)} images, fewer than "
                    f"one global batch of {batch_size}; use more data or a smaller "
                    "global_batch_size"
                )
            if self.split.shards is not None:  # chunk by chunk (runtime/shards.py)
                self.order = self.split.shards.order(seed, epoch)
            else:
                self.order = np.random.default_rng([seed, epoch]).permutation(
                    len(self.split)
                )
        else:
            self.batches_per_epoch = -(-len(self.split) // batch_size)
            self.order = np.arange(len(self.split))

    def __len__(self) -> int:
        return self.batches_per_epoch

    def at_epoch(self, epoch: int) -> Batches:
        """These batches in `epoch`'s order, augmented with `epoch`'s draws."""
        split = "train" if self.train else "val"
        return Batches(
            self.data,
            split,
            self.batch_size,
            self.seed,
            self.image_size,
            self.crop,
            epoch,
            self.rank,
            self.world_size,
            self.resize,
            self.augment,
        )

    @property
    def image_side(self) -> int:
        """The side of the square images this yields: image_size for ImageFolder data,
        the images' own size for the digits and CIFAR (one sample transformed)."""
        return np.asarray(self.transform(self.split.sample(0)[0], 0)).shape[-2]

    def __getitem__(
        self, index: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        share = self.batch_size // self.world_size
        start = index * self.batch_size + self.rank * share
        ids = self.order[start : start + share]
        weight = torch.ones(share)
        weight[len(ids) :] = 0  # past the end of the validation split: padding
        ids = np.concatenate([ids, np.zeros(share - len(ids), dtype=ids.dtype)])
        # Read in index order (shards: chunk by chunk, cheaper), keep the batch's order.
        loaded = {i: self.split.sample(i) for i in sorted(set(map(int, ids)))}
        samples = [loaded[int(i)] for i in ids]
        images = np.stack(
            [self.transform(image, int(i)) for (image, _), i in zip(samples, ids)]
        )
        images = torch.from_numpy(images).movedim(-1, -3).contiguous()  # channels first
        labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
        return images, labels, weight

    def transform(self, image: np.ndarray | Image.Image, i: int) -> np.ndarray:
        """Sample i; training: augmented by a generator seeded with (seed, epoch, i)."""
        kind = self.data.kind
        if kind == "folder" and self.crop == "pad":  # CIFAR's, at image_size
            size = (self.image_size, self.image_size)
            image = np.asarray(image.resize(size, Image.BILINEAR))
        if not self.train:
            if kind == "folder" and self.crop == "inception":
                return center_crop(image, self.image_size, self.resize)
            return image
        rng = np.random.default_rng([self.seed, self.epoch, i])
        if kind == "folder" and self.crop == "inception":
            image = random_resized_crop(image, self.image_size, rng)
        elif kind == "folder":
            image = pad_crop_flip(image, pad=4, flip=True, rng=rng)
        else:
            image = pad_crop_flip(
                image, pad=1 if kind == "digits" else 4, flip=kind == "cifar", rng=rng
            )
        for augment in self.augment:  # drawing from the same generator, in order
            image = augment(np.array(image), rng)  # a writable, contiguous copy
        return image


def loader(
    batches: Batches, start: int, num_workers: int, device: torch.device
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Batches start, start + 1, ... of the epoch, each sent to `device` as it is taken
    (dist.to_device: the copy does not make the host wait); images on disk decoded in
    `num_workers` processes while the model trains (0, or images in memory: in this
    process), which die with this one."""
    batches = torch.utils.data.DataLoader(
        batches,
        batch_size=None,  # items are whole batches already
        sampler=range(start, len(batches)),
        num_workers=num_workers if batches.data.on_disk else 0,
        pin_memory=device.type == "cuda",
        worker_init_fn=dist.end_with_parent,  # killed with their rank, even mid-batch
    )
    for batch in batches:
        yield dist.to_device(batch, device)


def step_rng(seed: int, step: int, stream: str) -> np.random.Generator:
    """A generator for the random choices a training step makes over its whole global
    batch (a mixing partner per sample, a mask per sample): seeded by (seed, step,
    stream), so every rank draws the same, on any world size, after any resume.
    `stream` names who draws; different names give independent draws."""
    tag = int.from_bytes(stream.encode(), "little")  # the name as a number
    return np.random.default_rng([seed, step, tag])


def normalize(images: torch.Tensor, data: ImageData) -> torch.Tensor:
    """uint8 pixels to floats, standardized per channel (done on the device: 4x less
    to copy there)."""
    mean, std = channel_stats(data.mean, data.std, images.device)
    return (images.float() / 255 - mean) / std


@functools.lru_cache(maxsize=4)
def channel_stats(
    mean: tuple[float, ...], std: tuple[float, ...], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel mean and standard deviation, (1, channels, 1, 1) on `device`,
    made once: a copy of them per batch would end in a device sync each time."""
    return tuple(torch.tensor(s, device=device).view(1, -1, 1, 1) for s in (mean, std))


def main() -> None:
    """`python data.py convert OUT --data=...`: write a streaming dataset."""
    parser = argparse.ArgumentParser(description=convert.__doc__)
    parser.add_argument("command", choices=["convert"])
    parser.add_argument("output", help="the folder to write (train/, val/, meta.json)")
    parser.add_argument(
        "--data", default="", help="as train.py's --data; '': the default"
    )
    parser.add_argument(
        "--chunk_bytes", default="64MB", help="the size of one chunk file"
    )
    parser.add_argument(
        "--format",
        choices=["litdata", "mds"],
        default="litdata",
        help="litdata shards, or MDS shards (mosaicml-streaming's, as Composer's data)",
    )
    args = parser.parse_args()
    try:
        convert(args.data, args.output, args.chunk_bytes, args.format)
    except ImportError:
        need = "litdata: " + shards.INSTALL
        if args.format == "mds":
            need = "mosaicml-streaming: " + shards.MDS_INSTALL
        print(f"error: streaming datasets need {need}", file=sys.stderr)
        sys.exit(2)
    except (OSError, ValueError) as error:  # a missing path, an undecodable image
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote a streaming dataset to {args.output}")


if __name__ == "__main__":
    main()
