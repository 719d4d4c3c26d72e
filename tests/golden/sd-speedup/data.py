"""Training data: captioned images, in memory as uint8 pixels, and a resumable order.

The default data is real and offline: scikit-learn's handwritten digits (1,797 8x8
grey-scale images; `pip install scikit-learn`), read from the CSV file the package
ships, scaled up to `resolution` pixels and captioned from their labels ("a
handwritten digit seven"). A fixed 20% is held out for validation. Because the captions
name a class, the samples can be judged: a classifier trained on the same labelled
images says which digit each generated image shows (train.py).
`--data=PATH` takes
- a JSON Lines file of `{"file": ..., "caption": ...}` rows, file paths relative to the
  .jsonl file (`--val_data`: its own file; without it a seeded 10% is held out);
- a folder written by `datasets`' `save_to_disk` with an `image` column and a `text` or
  `caption` column (its `train` and `validation`/`test` splits);
- MDS shards (a folder or URL holding train/ and val/ as mosaicml-streaming's MDSWriter
  writes them; Composer's and mosaicml/diffusion's data) with mosaicml/diffusion's
  columns: `image` (encoded bytes, or a jpeg/png/pil image) and `caption`. Every row is
  read into memory at start-up, as a file's: a captioned set at this task's scale fits.
  `python data.py convert OUT --data=...` writes any of these as such shards.
Every image is decoded once, converted to RGB, resized on its short side and centre
cropped to `resolution`. Epoch e visits the samples in a permutation seeded by
(seed, e): any batch is a pure function of (seed, epoch, batch index), on any number of
ranks, after any resume.
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from runtime import shards

DIGIT_WORDS = "zero one two three four five six seven eight nine".split()
DIGITS_VAL_FRACTION = 0.2
# MDS columns: mosaicml/diffusion's StreamingImageCaptionDataset image_key, caption_key.
IMAGE_COLUMN, CAPTION_COLUMN = "image", "caption"


@dataclass
class Captioned:
    """Images (uint8, N x resolution x resolution x 3) and their captions; `labels` the
    class of each image where the captions name one (the digits), else None."""

    images: np.ndarray
    captions: list[str]
    labels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.captions)


@dataclass
class CaptionData:
    train: Captioned
    val: Captioned
    classes: list[str]  # the caption of each label (the digits), else []
    source: str  # what was read, for the log


def load_captioned(data: str, val_data: str, resolution: int, seed: int) -> CaptionData:
    """The captioned images named by `--data` ("" for scikit-learn's digits)."""
    if not data:
        return digits(resolution)
    path = Path(data).expanduser()
    if shards.is_shards(data):  # MDS shards: a folder or URL holding train/ and val/
        if val_data:
            raise ValueError(
                f"--val_data={val_data}: --data={data} holds its own val/ split; "
                "remove --val_data"
            )
        return mds_captioned(data, resolution)
    if path.suffix == ".jsonl" and path.is_file():
        rows = read_jsonl(path, resolution)
        if val_data:
            return CaptionData(
                rows, read_jsonl(Path(val_data).expanduser(), resolution), [], str(path)
            )
        order = np.random.default_rng(seed).permutation(len(rows))
        cut = len(rows) - max(1, len(rows) // 10)
        return CaptionData(
            subset(rows, order[:cut]), subset(rows, order[cut:]), [], str(path)
        )
    if path.is_dir() and (path / "dataset_dict.json").is_file():
        return saved_dataset(path, resolution)
    raise FileNotFoundError(
        f"--data={data}: not a .jsonl file, a datasets folder or MDS shards; pass JSON "
        'Lines of {"file", "caption"} rows, a save_to_disk folder, MDS shards, or '
        "leave it empty for the default"
    )


def digits(resolution: int) -> CaptionData:
    spec = importlib.util.find_spec("sklearn")
    csv = (
        Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if spec
        else None
    )
    if csv is None or not csv.is_file():
        raise FileNotFoundError(
            "the default data is scikit-learn's digits: pip install scikit-learn, or "
            "pass --data=PATH (JSON Lines of file and caption, or a datasets folder)"
        )
    with gzip.open(csv, "rt") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.float32)
    # 64 pixel values 0..16, then the label; scaled up (bilinear), grey RGB.
    pixels = torch.from_numpy(table[:, :64] / 16).view(-1, 1, 8, 8)
    pixels = torch.nn.functional.interpolate(pixels, size=resolution, mode="bilinear")
    images = (pixels.clamp(0, 1) * 255).round().byte().expand(-1, 3, -1, -1)
    images = images.permute(0, 2, 3, 1).contiguous().numpy()
    labels = table[:, 64].astype(np.int64)
    classes = [f"a handwritten digit {word}" for word in DIGIT_WORDS]
    whole = Captioned(images, [classes[label] for label in labels], labels)
    order = np.random.default_rng(0).permutation(len(labels))  # a fixed held-out set
    cut = int(len(labels) * (1 - DIGITS_VAL_FRACTION))
    return CaptionData(
        subset(whole, order[:cut]),
        subset(whole, order[cut:]),
        classes,
        f"scikit-learn digits ({csv})",
    )


def subset(data: Captioned, ids: np.ndarray) -> Captioned:
    labels = None if data.labels is None else data.labels[ids]
    return Captioned(data.images[ids], [data.captions[i] for i in ids], labels)


def read_jsonl(path: Path, resolution: int) -> Captioned:
    """Rows of {"file", "caption"}; a bad row is a ValueError naming its line."""
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: no such file; pass a .jsonl file of file and caption rows"
        )
    images, captions = [], []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            row = json.loads(line)
            file, caption = path.parent / row["file"], str(row["caption"])
        except (ValueError, KeyError, TypeError):
            raise ValueError(
                f'{where}: not a JSON object with "file" and "caption"; fix the line'
            ) from None
        if not file.is_file():
            raise FileNotFoundError(
                f"{where}: the image {file} does not exist; fix or drop the line"
            )
        images.append(decode(file.read_bytes(), resolution, where))
        captions.append(caption)
    if not captions:
        raise ValueError(f"{path}: no rows; add lines of file and caption")
    return Captioned(np.stack(images), captions)


def saved_dataset(path: Path, resolution: int) -> CaptionData:
    """A `datasets` DatasetDict from save_to_disk: `image` and `text` or `caption`."""
    import datasets

    splits = datasets.load_from_disk(str(path))
    val_name = next((name for name in ("validation", "test") if name in splits), None)
    if "train" not in splits or val_name is None:
        raise ValueError(
            f"--data={path}: needs a train split and a validation or test split"
        )

    def read(split: str) -> Captioned:
        table = splits[split]
        column = "text" if "text" in table.column_names else "caption"
        if "image" not in table.column_names or column not in table.column_names:
            raise ValueError(
                f"--data={path}: split {split} needs columns image and text"
            )
        images = [
            decode(png(image), resolution, f"{path} {split}[{i}]")
            for i, image in enumerate(table["image"])
        ]
        return Captioned(np.stack(images), [str(text) for text in table[column]])

    return CaptionData(read("train"), read(val_name), [], str(path))


def mds_captioned(data: str, resolution: int) -> CaptionData:
    """The train/ and val/ splits of MDS shards, every row read into memory (a captioned
    set at this task's scale fits): columns `image` (bytes of a jpeg or png file, or a
    jpeg/png/pil image) and `caption`, as mosaicml/diffusion reads them."""
    if not shards.is_mds(data):
        raise shards.ShardError(
            f"--data={data}: no MDS index in train/ (index.json with `shards`); the "
            "diffusion task reads MDS shards written by MDSWriter, JSON Lines or a "
            "datasets folder"
        )

    def read(split: str) -> Captioned:
        found = shards.open_split(data, split)
        if IMAGE_COLUMN not in found.columns or CAPTION_COLUMN not in found.columns:
            raise shards.ShardError(
                f"--data={data}: {split}/ has columns {', '.join(found.columns)}; "
                f"image-caption MDS shards need {IMAGE_COLUMN} and {CAPTION_COLUMN} "
                "(mosaicml/diffusion's); write them with those columns"
            )
        images, captions = [], []
        for i in range(len(found)):
            sample, where = found[i], f"--data={data} {split}/ sample {i}"
            image = sample[IMAGE_COLUMN]
            content = png(image) if isinstance(image, Image.Image) else image
            if not isinstance(content, bytes):
                raise ValueError(
                    f"{where}: {IMAGE_COLUMN} is not image bytes or an image; write "
                    "bytes or a pil image"
                )
            images.append(decode(content, resolution, where))
            captions.append(str(sample[CAPTION_COLUMN]))
        return Captioned(np.stack(images), captions)

    return CaptionData(read("train"), read("val"), [], data)


def png(image: Image.Image) -> bytes:
    """A decoded image as PNG bytes (lossless), for `decode`."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def decode(content: bytes, resolution: int, where: str) -> np.ndarray:
    """RGB pixels, the short side resized to `resolution`, centre cropped square."""
    try:
        image = Image.open(io.BytesIO(content))
        image = image.convert("RGB")
    except (OSError, ValueError) as error:
        raise ValueError(
            f"{where}: the image does not decode ({error}); replace or drop it"
        ) from None
    scale = resolution / min(image.size)
    size = (
        max(resolution, round(image.width * scale)),
        max(resolution, round(image.height * scale)),
    )
    image = image.resize(size, Image.Resampling.BICUBIC)
    left, top = (size[0] - resolution) // 2, (size[1] - resolution) // 2
    return np.asarray(image.crop((left, top, left + resolution, top + resolution)))


def token_ids(tokenizer, captions: list[str]) -> torch.Tensor:
    """Token ids of every caption, padded to the text encoder's length; a caption
    longer than that is a ValueError naming it (nothing is cut off silently)."""
    limit = tokenizer.model_max_length
    for caption in captions:
        if len(tokenizer(caption).input_ids) > limit:
            raise ValueError(
                f"the caption {caption!r} is longer than the text encoder's {limit} "
                "tokens; shorten it"
            )
    return tokenizer(
        captions, padding="max_length", max_length=limit, return_tensors="pt"
    ).input_ids


class Batches:
    """Global batch i of an epoch: images in [-1, 1] (N, 3, H, W) and token ids.
    `get` returns one rank's share; the order is seeded by (seed, epoch)."""

    def __init__(
        self, data: Captioned, token_ids: torch.Tensor, batch_size: int, seed: int
    ) -> None:
        self.data, self.token_ids = data, token_ids
        self.batch_size, self.seed = batch_size, seed
        self.batches_per_epoch = len(data) // batch_size  # no partial batch
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the training split holds {len(data)} images, fewer than one global "
                f"batch of {batch_size}; use more data or a smaller global_batch_size"
            )

    def get(
        self, epoch: int, index: int, rank: int, world_size: int
    ) -> dict[str, torch.Tensor | np.ndarray]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.data))
        share = self.batch_size // world_size
        start = index * self.batch_size + rank * share
        return rows(self.data, self.token_ids, order[start : start + share])


def rows(
    data: Captioned, token_ids: torch.Tensor, ids: np.ndarray | None = None
) -> dict[str, torch.Tensor | np.ndarray]:
    """Images in [-1, 1] (N, 3, H, W), token ids and row numbers (`index`: which
    images of the split; an array, host data that stays on the host) of the rows `ids`
    (None: all)."""
    ids = np.arange(len(data)) if ids is None else ids
    images = torch.from_numpy(data.images[ids]).permute(0, 3, 1, 2).float() / 127.5 - 1
    return {
        "pixels": images,
        "input_ids": token_ids[torch.from_numpy(ids)],
        "index": ids,
    }


def convert(
    data: str,
    output: str,
    chunk_bytes: str = "64MB",
    val_data: str = "",
    resolution: int = 16,
    seed: int = 42,
) -> None:
    """Write the captioned images `--data` names (with --val_data and --seed as
    train.py takes them), decoded, resized and cropped to `resolution`, as MDS shards in
    folder `output` (mosaicml-streaming's MDSWriter, zstd): train/ and val/, the split
    train.py would make, in mosaicml/diffusion's columns `image` (png) and `caption`
    (str). The digits' class labels are not written: a run on the shards has no judge.
    """
    captioned = load_captioned(data, val_data, resolution, seed)
    for split in ("train", "val"):
        part = getattr(captioned, split)
        rows = (
            {IMAGE_COLUMN: Image.fromarray(image), CAPTION_COLUMN: caption}
            for image, caption in zip(part.images, part.captions, strict=True)
        )
        columns = {IMAGE_COLUMN: "png", CAPTION_COLUMN: "str"}
        shards.write_mds(output, split, columns, rows, chunk_bytes)


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
    parser.add_argument("--val_data", default="", help="as train.py's --val_data")
    parser.add_argument(
        "--resolution",
        type=int,
        default=16,
        help="pixels a side of the written images (train.py's --resolution)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=42,
        help="as train.py's --seed: the held-out share without --val_data",
    )
    args = parser.parse_args()
    try:
        convert(
            args.data,
            args.output,
            args.chunk_bytes,
            val_data=args.val_data,
            resolution=args.resolution,
            seed=args.seed,
        )
    except ImportError:
        need = shards.MDS_INSTALL
        print(f"error: MDS shards need mosaicml-streaming: {need}", file=sys.stderr)
        sys.exit(2)
    except (
        OSError,
        ValueError,
    ) as error:  # a missing file, an image that does not decode
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote a streaming dataset to {args.output}")


if __name__ == "__main__":
    main()
