"""RandAugment, AugMix and progressive resizing (issue 14): each image operation does what it
says on a hand-made image; an augmented sample is a pure function of (seed, epoch, index), the
same in a DataLoader worker as in the main process; AugMix's consistency loss equals its closed
form and does not depend on the microbatch size; progressive resizing follows Composer's
schedule, bounds the number of distinct sizes, keeps channels_last, and a run killed (-9) and
resumed continues the same schedule with bitwise-equal losses.

Two generated projects (tiny ResNet): RandAugment with progressive resizing, and AugMix with
the Jensen-Shannon consistency loss.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from projects import (
    checkout_env,
    project_modules,
    read_metrics,
    run_train,
    run_train_many,
)
from scaffold.render import new_project

TESTS = Path(__file__).resolve().parent
SMALL = [
    "--model=tiny",
    "--precision=fp32",
    "--global_batch_size=8",
    "--device_microbatch_size=4",
    "--bn_group_size=2",
    "--eval_batches=1",
    "--dist_timeout=60",
]


def render(root: Path, name: str, algorithms: str) -> Path:
    recipe = root / f"{name}.toml"
    recipe.write_text(
        '[answers]\ntask = "image_classification"\nmodel_family = "resnet"\n'
        f'model = "tiny"\n{algorithms}'
    )
    new_project(str(recipe), root / name, [], name)
    return root / name


@pytest.fixture(scope="module")
def projects(
    tmp_path_factory: pytest.TempPathFactory, isolated_home: Path
) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("augment")
    return {
        "randaugment": render(
            root,
            "ra",
            "[algorithms.randaugment]\n[algorithms.progressive_resizing]\n"
            "initial_scale = 0.5\ndelay_fraction = 0.2\nfinetune_fraction = 0.2\n",
        ),
        # The batch algorithms that take the consistency loss's views too.
        "augmix": render(
            root,
            "am",
            "[algorithms.augmix]\njsd = true\n[algorithms.mixup]\n[algorithms.cutmix]\n"
            "[algorithms.cutout]\nper_image = true\n",
        ),
        # ... and those that refuse them.
        "augmix_flat": render(
            root, "amf", "[algorithms.augmix]\n[algorithms.channels_last]\n"
        ),
    }


@pytest.fixture(scope="module")
def ra(projects: dict[str, Path]):
    with project_modules(projects["randaugment"]) as modules:
        yield modules


@pytest.fixture(scope="module")
def am(projects: dict[str, Path]):
    with project_modules(projects["augmix"]) as modules:
        yield modules


def image_folder(root: Path, size: int = 24, per_class: int = 8) -> Path:
    """Two classes of noisy RGB images (textured, so that every operation changes them)."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for label, name in enumerate(("a", "b")):
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                pixels = rng.integers(0, 120, size=(size, size, 3)) + 100 * label
                Image.fromarray(pixels.astype(np.uint8)).save(
                    root / split / name / f"{i}.png"
                )
    return root


# ---------------------------------------------------------------- each operation on a hand-made image


def chw(array: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.array(array)).permute(2, 0, 1)


def test_each_operation_does_what_it_says(ra) -> None:
    data = ra["data"]
    ramp = torch.arange(256, dtype=torch.uint8).view(1, 16, 16)
    # solarize: exactly the pixels at or above the threshold are inverted
    solarized = data.solarize(ramp, 100)
    assert torch.equal(solarized[ramp < 100], ramp[ramp < 100])
    assert torch.equal(solarized[ramp >= 100], 255 - ramp[ramp >= 100])
    assert torch.equal(data.solarize(ramp, 256), ramp)
    # posterize: keeps the top bits: 3 bits -> multiples of 32, each pixel rounded down
    posterized = data.posterize(ramp, 3)
    assert set(posterized.unique().tolist()) == set(range(0, 256, 32))
    assert torch.equal(posterized, ramp // 32 * 32) and torch.equal(
        data.posterize(ramp, 8), ramp
    )
    # rotate: by 90 and 180 degrees (counter-clockwise) a known asymmetric pattern
    pattern = torch.arange(3 * 6 * 6, dtype=torch.uint8).view(3, 6, 6)
    assert torch.equal(data.rotate(pattern, 90), torch.rot90(pattern, 1, dims=(1, 2)))
    assert torch.equal(data.rotate(pattern, 180), torch.rot90(pattern, 2, dims=(1, 2)))
    # translate: content moves by whole pixels, black comes in
    moved = data.translate_x(pattern, 2)
    assert torch.equal(moved[:, :, :4], pattern[:, :, 2:]) and not moved[:, :, 4:].any()
    moved = data.translate_y(pattern, -1)
    assert torch.equal(moved[:, 1:], pattern[:, :-1]) and not moved[:, 0].any()
    # shear_x: row y moves left by factor * (y + 0.5) pixels (origin at the top-left corner)
    sheared = data.shear_x(pattern, 2.0)
    assert torch.equal(sheared[:, 0, :5], pattern[:, 0, 1:])  # row 0: by 1 pixel
    assert torch.equal(sheared[:, 1, :3], pattern[:, 1, 3:])  # row 1: by 3 pixels
    # autocontrast: every channel stretched to 0..255; a flat channel untouched
    dull = torch.stack([ramp[0] // 4 + 50, torch.full((16, 16), 7, dtype=torch.uint8)])
    stretched = data.autocontrast(dull)
    assert (stretched[0].min(), stretched[0].max()) == (0, 255) and torch.equal(
        stretched[1], dull[1]
    )
    # equalize: PIL's ImageOps.equalize, exactly, on a skewed image
    skewed = (np.random.default_rng(1).beta(2, 8, size=(20, 20, 3)) * 255).astype(
        np.uint8
    )
    expected = np.asarray(ImageOps.equalize(Image.fromarray(skewed)))
    assert torch.equal(data.equalize(chw(skewed)), chw(expected))
    # brightness 0: black; color 0: grey (all channels equal); contrast 0: one grey level
    rgb = chw(skewed)
    assert not data.brightness(rgb, 0.0).any()
    grey = data.color(rgb, 0.0)
    assert torch.equal(grey[0], grey[1]) and torch.equal(grey[1], grey[2])
    assert data.contrast(rgb, 0.0).unique().numel() == 1
    # sharpness 0: PIL's SMOOTH filter inside, the border kept
    smooth = np.asarray(
        Image.fromarray(skewed).filter(__import__("PIL.ImageFilter").ImageFilter.SMOOTH)
    )
    blurred = data.sharpness(rgb, 0.0)
    assert (
        blurred[:, 1:-1, 1:-1].int() - chw(smooth)[:, 1:-1, 1:-1].int()
    ).abs().max() <= 1
    assert torch.equal(blurred[:, 0], rgb[:, 0])
    # every operation of the set runs on grey and colour images and keeps shape and dtype
    rng = np.random.default_rng(0)
    for image in (rgb, rgb[:1]):
        for name in data.AUGMENTATION_SETS["all"]:
            out = data.random_operation(image, name, 9, rng)
            assert out.shape == image.shape and out.dtype == torch.uint8, name


@pytest.mark.parametrize(
    ("name", "severity", "low", "high", "brighter"),
    [
        # Composer's default ("all"), at hot's severity: half the draws strengthen, in
        # 1..10, and brightness() multiplies those by 0.75 (augmentation_primitives.py,
        # `brightness`): 0.75..7.5, above 1 for (10 - 4/3) / 9 of them.
        ("brightness", 10, 0.1, 7.5, 0.5 * (10 - 4 / 3) / 9),
        ("brightness", 3, 0.73, 2.25, 0.5 * (3 - 4 / 3) / 2),  # AugMix's severity
        ("contrast", 10, 0.1, 10.0, 0.5),  # the other colour factors: not reduced
        ("brightness_original", 10, 0.1, 1.9, 0.5),  # "original": AugMix's code
    ],
)
def test_colour_factors_follow_composers_augmentation_sets(
    ra, name: str, severity: int, low: float, high: float, brighter: float
) -> None:
    """Brightness on a grey level of 20, contrast on a checkerboard of 108 and 128
    about their mean 118 (no clipping up to 10x): the factors drawn span Composer's
    range for the set and exceed 1 as often."""
    data = ra["data"]
    if name == "contrast":
        image = torch.full((3, 4, 4), 108, dtype=torch.uint8)
        image[:, ::2, ::2] = image[:, 1::2, 1::2] = 128
        base, level = 118, 128
    else:
        image = torch.full((3, 4, 4), 20, dtype=torch.uint8)
        base, level = 0, 20
    rng = np.random.default_rng(0)
    factors = np.array(
        [
            (data.random_operation(image, name, severity, rng)[0, 0, 0].item() - base)
            / (level - base)
            for _ in range(800)
        ]
    )
    step = 0.5 / (level - base)  # the rounding to whole levels
    assert factors.min() >= low - step and factors.max() <= high + step
    assert factors.min() < low + 0.1 * (high - low)
    assert factors.max() > high - 0.1 * (high - low)
    assert abs((factors > 1 + step).mean() - brighter) < 0.06


@pytest.mark.parametrize(("height", "width"), [(6, 30), (30, 6)])
def test_translations_reach_a_third_of_their_own_side(
    ra, height: int, width: int
) -> None:
    """translate_x moves by up to a third of the width, translate_y of the height
    (Composer's translate_x and translate_y: PIL's size[0] and size[1])."""
    data = ra["data"]
    # Every pixel holds its column + 1 (translate_x) or row + 1 (translate_y).
    columns = torch.arange(1, width + 1, dtype=torch.uint8).expand(1, height, width)
    rows = torch.arange(1, height + 1, dtype=torch.uint8)[:, None].expand(
        1, height, width
    )
    rng = np.random.default_rng(0)
    for name, image, side, along in (
        ("translate_x", columns, width, 2),
        ("translate_y", rows, height, 1),
    ):
        shifts = set()
        for _ in range(200):
            moved = data.random_operation(image, name, 10, rng)
            kept = moved[0][moved[0] > 0].float()  # black came in where it moved from
            source = image[0][moved[0] > 0].float()
            shifts.add(int((kept - source).abs().max().item()))
        assert max(shifts) == int(side / 3 * 0.999), (name, sorted(shifts))


# ---------------------------------------------------------------- pure functions of (seed, epoch, index)


def samples_in_worker(batches, indices: list[int]) -> list[torch.Tensor]:
    loader = torch.utils.data.DataLoader(
        batches, batch_size=None, sampler=indices, num_workers=2
    )
    return [pixels for pixels, _, _ in loader]


@pytest.mark.parametrize("which", ["randaugment", "augmix"])
def test_same_seed_epoch_index_same_image_in_a_worker_and_here(
    which: str, projects: dict[str, Path], tmp_path: Path
) -> None:
    folder = image_folder(tmp_path / "images")
    with project_modules(projects[which]) as modules:
        data, train = modules["data"], modules["train"]
        cfg = train.Config()
        augment = train.augmentations(cfg)
        assert len(augment) == 1
        images = data.load_images(str(folder))
        batches = data.Batches(
            images, "train", 4, seed=5, image_size=16, epoch=2, augment=augment
        )
        plain = data.Batches(images, "train", 4, seed=5, image_size=16, epoch=2)
        here = [batches[i][0] for i in range(len(batches))]
        assert all(
            torch.equal(a, b)
            for a, b in zip(here, samples_in_worker(batches, list(range(len(batches)))))
        )
        # different samples give different images; another epoch another one
        flat = torch.cat(here)
        assert len({tuple(x.flatten().tolist()) for x in flat}) == len(flat)
        other_epoch = data.Batches(
            images, "train", 4, seed=5, image_size=16, epoch=3, augment=augment
        )
        same_sample = other_epoch.order.tolist().index(batches.order[0])
        share = 4
        assert not torch.equal(
            other_epoch[same_sample // share][0][same_sample % share], here[0][0]
        )
        if (
            which == "augmix"
        ):  # (clean, view 1, view 2): the clean one is the plain crop
            assert flat.shape[1:] == (3, 3, 16, 16)
            assert all(torch.equal(a[:, 0], plain[i][0]) for i, a in enumerate(here))
            assert not torch.equal(flat[:, 1], flat[:, 0]) and not torch.equal(
                flat[:, 1], flat[:, 2]
            )
        else:
            assert all(not torch.equal(a, plain[i][0]) for i, a in enumerate(here))


# ---------------------------------------------------------------- AugMix's consistency loss


def test_augmix_jsd_equals_its_closed_form(am) -> None:
    """JS(p1, p2, p3) = H(M) - mean H(p_i), M the mean prediction; summed over samples."""
    torch.manual_seed(0)
    logits = [torch.randn(5, 7) for _ in range(3)]
    probs = [torch.softmax(x.double(), dim=1) for x in logits]
    mixture = torch.stack(probs).mean(0)

    def entropy(p: torch.Tensor) -> torch.Tensor:
        return -(p * p.log()).sum(dim=1)

    expected = (
        entropy(mixture) - torch.stack([entropy(p) for p in probs]).mean(0)
    ).sum()
    assert math.isclose(
        am["train"].augmix_jsd(*logits).item(), expected.item(), rel_tol=1e-5
    )
    same = am["train"].augmix_jsd(logits[0], logits[0], logits[0])
    assert abs(same.item()) < 1e-6


def test_mixers_treat_the_views_of_an_image_alike(am) -> None:
    """On the consistency loss's (N, 3, C, H, W) batches MixUp and CutMix mix each view
    of an image with the same view of its partner."""
    train = am["train"]
    x = torch.randn(4, 3, 1, 6, 6, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 3])
    perm = torch.tensor([2, 0, 3, 1])
    mixed, targets = am["data"].mixup_batch(x, y, 10, 0.3, perm, rank=0)
    torch.testing.assert_close(mixed, 0.3 * x + 0.7 * x[perm])
    assert targets.shape == (4, 10)
    box = (1, 4, 2, 5)
    cut, _, lam = train.cutmix_batch(x, y, 10, box, perm, rank=0)
    expected = x.clone()
    expected[..., 1:4, 2:5] = x[perm][..., 1:4, 2:5]
    assert torch.equal(cut, expected) and lam == 1 - 9 / 36


def test_augmix_jsd_refuses_the_batch_algorithms_that_take_one_view(
    projects: dict[str, Path], tmp_path: Path
) -> None:
    project = projects["augmix_flat"]
    plain = run_train(project, tmp_path, *SMALL, "--max_duration=1ba", "--run_name=ok")
    assert plain.returncode == 0, plain.stderr[-3000:]
    result = run_train(project, tmp_path, *SMALL, "--augmix_jsd=true", "--run_name=bad")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: augmix_jsd=true batches three views of each image, which channels_last "
        "cannot take; set --augmix_jsd=false or remove it (scaffold remove NAME)"
    ]
    assert not (tmp_path / "runs" / "bad").exists()


def test_augmix_jsd_step_does_not_depend_on_the_microbatch_size(
    projects: dict[str, Path], tmp_path: Path
) -> None:
    """The views through MixUp (step 1), CutMix (step 2: seed 1's shared draws) and
    per-image CutOut, then the consistency loss: the same steps for any microbatch."""
    args = [a for a in SMALL if "microbatch" not in a] + [
        "--max_duration=2ba",
        "--eval_interval=2ba",
        "--lr=0.5",
        "--seed=1",
    ]
    runs = {}
    for micro in (2, 8):
        result = run_train(
            projects["augmix"],
            tmp_path,
            *args,
            f"--device_microbatch_size={micro}",
            f"--run_name=m{micro}",
        )
        assert result.returncode == 0, result.stderr[-3000:]
        runs[micro] = [row["loss"] for row in read_metrics(tmp_path, f"m{micro}")]
    assert runs[2] == pytest.approx(runs[8], abs=2e-6)
    rows = read_metrics(tmp_path, "m8")
    assert rows[0]["mixup_lambda"] < 1.0 and rows[1]["cutmix_lambda"] < 1.0
    unweighted = run_train(
        projects["augmix"], tmp_path, *args, "--augmix_jsd_weight=0", "--run_name=w0"
    )
    assert unweighted.returncode == 0, unweighted.stderr[-3000:]
    # the same clean images and weights at step 1: the difference is 12 x a divergence > 0
    assert read_metrics(tmp_path, "w0")[0]["loss"] < runs[8][0]


# ---------------------------------------------------------------- progressive resizing


def test_size_schedule_matches_composers_formula(ra) -> None:
    train = ra["train"]
    cfg = train.Config(
        progressive_resizing_initial_scale=0.5,
        progressive_resizing_delay_fraction=0.4,
        progressive_resizing_finetune_fraction=0.2,
        progressive_resizing_size_increment=4,
    )
    # scale = 0.5 until 0.4, then linear to 1.0 at 0.8 (= 1 - finetune); width rounded to 4
    for fraction, scale in (
        (0.0, 0.5),
        (0.4, 0.5),
        (0.5, 0.625),
        (0.7, 0.875),
        (0.8, 1.0),
        (0.99, 1.0),
    ):
        width = round(224 * scale / 4) * 4
        assert ra["data"].progressive_resizing_size(fraction, 224, 224, cfg) == (
            width,
            width,
        ), fraction
    # the height follows the width's factor (Composer rounds the width only)
    assert ra["data"].progressive_resizing_size(0.5, 150, 224, cfg) == (
        int(150 * 140 / 224),
        140,
    )
    # a full side that is no multiple of the increment is kept whole at full scale
    assert ra["data"].progressive_resizing_size(0.9, 30, 30, cfg) == (30, 30)


def test_distinct_sizes_are_bounded_by_the_increment(ra) -> None:
    train = ra["train"]
    for side, initial, step in (
        (224, 0.5, 4),
        (176, 0.6, 8),
        (32, 0.25, 4),
        (30, 0.5, 4),
    ):
        cfg = train.Config(
            progressive_resizing_initial_scale=initial,
            progressive_resizing_size_increment=step,
            progressive_resizing_delay_fraction=0.2,
            progressive_resizing_finetune_fraction=0.2,
        )
        sizes = {
            ra["data"].progressive_resizing_size(step_i / 5000, side, side, cfg)
            for step_i in range(5000)
        }
        assert len(sizes) <= (1 - initial) * side / step + 2
        assert all(w % step == 0 or w == side for _, w in sizes)
        assert (
            len(sizes) >= (1 - initial) * side / step - 1
        )  # it does grow through the sizes


def test_resize_and_crop_keep_channels_last_and_views(ra) -> None:
    data = ra["data"]  # progressive_resize is an image op: it lives in data.py
    images = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    last = images.contiguous(memory_format=torch.channels_last)
    resized = data.progressive_resize(last, (4, 4), "resize", [0, 1])
    assert (
        resized.is_contiguous(memory_format=torch.channels_last)
        and not resized.is_contiguous()
    )
    assert torch.equal(resized, images[:, :, ::2, ::2])  # nearest neighbour, factor 2
    cropped = data.progressive_resize(images, (4, 4), "crop", [0, 1])
    offsets = [
        (t, l)
        for t in range(5)
        for l in range(5)
        if torch.equal(cropped, images[:, :, t : t + 4, l : l + 4])
    ]
    assert len(offsets) == 1 and cropped.is_contiguous()
    assert torch.equal(
        data.progressive_resize(images, (4, 4), "crop", [0, 1]), cropped
    )  # (seed, step)
    assert data.progressive_resize(last, (4, 4), "crop", [0, 1]).is_contiguous(
        memory_format=torch.channels_last
    )
    views = images.view(2, 1, 3, 8, 8).expand(
        2, 3, 3, 8, 8
    )  # AugMix's (N, views, C, H, W)
    assert torch.equal(
        data.progressive_resize(views, (4, 4), "resize", [0, 1])[:, 2], resized
    )
    assert data.progressive_resize(images, (8, 8), "resize", [0, 1]) is images


def test_kill_9_resume_continues_the_schedule_bitwise(
    projects: dict[str, Path], tmp_path: Path
) -> None:
    """RandAugment in DataLoader workers + progressive resizing on 24-pixel images: a run killed
    (-9) inside its 5th save and rerun equals an uninterrupted one bitwise, sizes included.
    """
    project = projects["randaugment"]
    folder = image_folder(tmp_path / "images", size=24, per_class=40)
    args = [
        *SMALL,
        f"--data={folder}",
        "--image_size=24",
        "--num_workers=2",
        "--max_duration=10ba",
        "--eval_interval=10ba",
        "--save_interval=1ba",
    ]
    result = run_train(project, tmp_path, *args, "--run_name=ref")
    assert result.returncode == 0, result.stderr[-3000:]
    expected = read_metrics(tmp_path, "ref")
    killed = subprocess.run(
        [
            sys.executable,
            str(TESTS / "stop_after.py"),
            "kill:5",
            str(project / "train.py"),
            *args,
            "--run_name=cut",
            "--device=cpu",
        ],
        cwd=tmp_path,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = run_train(project, tmp_path, *args, "--run_name=cut")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[
        -3000:
    ]
    rows = read_metrics(tmp_path, "cut")
    keys = ("step", "loss", "image_width", "val_loss")
    assert [[r.get(k) for k in keys] for r in rows if r["step"] > 4] == [
        [r.get(k) for k in keys] for r in expected if r["step"] > 4
    ]
    # the logged sizes are the schedule's: 0.5 until 0.2 of training, full from 0.8 on
    for row in expected:
        fraction = (row["step"] - 1) / 10  # before the step: the size it trained at
        grown = min(
            max(fraction - 0.2, 0) / (1 - 0.2 - 0.2), 1
        )  # float ties as in train.py
        width = min(24, round(24 * (0.5 + 0.5 * grown) / 4) * 4)
        assert row["image_width"] == width, row
    assert len({row["image_width"] for row in expected}) >= 3


OUT_OF_RANGE = {
    "--randaugment_severity=11": (
        "randaugment",
        "error: randaugment_severity=11 is outside its range [0, 10]",
    ),
    "--augmix_alpha=0": (
        "augmix",
        "error: augmix_alpha=0.0 is outside its range (0, inf)",
    ),
    "--augmix_depth=0": (
        "augmix",
        "error: augmix_depth=0: use -1 (1 to 3 operations, drawn per chain) or at "
        "least 1",
    ),
    "--progressive_resizing_finetune_fraction=0.9": (
        "randaugment",
        "error: progressive_resizing_delay_fraction=0.2 and _finetune_fraction=0.9 add up to more than 1 (of "
        "training)",
    ),
}


@pytest.fixture(scope="module")
def out_of_range(
    projects: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """Each OUT_OF_RANGE run, in its own folder, all in one interpreter (runs that stop
    in setup import torch once). Each argument: (workdir, result)."""
    root = tmp_path_factory.mktemp("out-of-range")
    workdirs = {arg: root / str(i) for i, arg in enumerate(OUT_OF_RANGE)}
    for workdir in workdirs.values():
        workdir.mkdir()
    results = run_train_many(
        {
            arg: (projects[which], workdirs[arg], [*SMALL, arg, "--run_name=bad"])
            for arg, (which, _) in OUT_OF_RANGE.items()
        }
    )
    return {arg: (workdirs[arg], results[arg]) for arg in OUT_OF_RANGE}


@pytest.mark.parametrize("arg", OUT_OF_RANGE)
def test_a_hyperparameter_out_of_range_is_one_line_exit_2(
    arg: str, out_of_range: dict[str, tuple[Path, subprocess.CompletedProcess[str]]]
) -> None:
    workdir, result = out_of_range[arg]
    message = OUT_OF_RANGE[arg][1]
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [message]
    assert not (workdir / "runs").exists()


@pytest.mark.slow
def test_compiled_progressive_resizing_finishes_with_bounded_graphs(
    projects: dict[str, Path], tmp_path: Path
) -> None:
    """compile=true through sizes 12, 16, 20, 24: static graphs per size (the automatic
    dynamic graph crashed Inductor here), each recompile within the raised limit, no fallback
    to eager, the run finishes. Minutes on a CPU."""
    folder = image_folder(tmp_path / "images", size=24, per_class=40)
    args = [
        *SMALL,
        f"--data={folder}",
        "--image_size=24",
        "--num_workers=0",
        "--max_duration=10ba",
        "--eval_interval=10ba",
        "--compile=true",
        "--run_name=compiled",
    ]
    result = subprocess.run(
        [
            sys.executable,
            str(projects["randaugment"] / "train.py"),
            *args,
            "--device=cpu",
        ],
        cwd=tmp_path,
        env={**checkout_env(), "TORCH_LOGS": "recompiles"},
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    widths = [row["image_width"] for row in read_metrics(tmp_path, "compiled")]
    assert sorted(set(widths)) == [12, 16, 20, 24]
    recompiles = result.stderr.count("Recompiling function")
    blocks, sizes = (
        3,
        24 // 4 + 1,
    )  # the tiny ResNet's blocks; sizes within the increment's bound
    assert 0 < recompiles < 4 * sizes * blocks
    assert "recompile_limit" not in result.stderr
