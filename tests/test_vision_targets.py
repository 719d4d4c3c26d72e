"""Vision catalog: label smoothing, MixUp, CutMix, CutOut and ColOut (image_classification, resnet).

The effects, not only that they run: the targets and losses equal closed forms and hand
computations (in the generated functions and in the logged loss of a real first step); the
mixed batch is the same on 1 and 2 ranks, with any microbatch size, and across a kill -9
resume; with both mixers selected a step is mixed by exactly one, as the shared draw says;
mixers whose shares add up to more than 1 (their defaults) split every step in proportion;
CutOut and ColOut remove exactly the stated pixels, rows and columns.

One project holds all five algorithms (mixup and cutmix at 0.5 each); flags switch pieces off
for the closed-form checks (--label_smoothing_smoothing=0, --mixup_prob=0, --cutmix_prob=0,
--colout_p_row=0 ...). Launches: four short single-process runs in this process, two
subprocesses (kill -9 and its resume) and one torchrun on 2 ranks.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import black
import pytest
import torch
import torch.nn.functional as F

from conftest import scaffold_cli
from projects import checkout_env, project_modules, read_metrics, run_train
from scaffold.catalog import CatalogError, catalog_order, load_algorithms
from scaffold.jinja_black import BLACK_MODE
from scaffold.paths import template_dir
from scaffold.render import new_project

TESTS = Path(__file__).resolve().parent
STOP_AFTER = TESTS / "stop_after.py"
SEED, BATCH, CLASSES = 42, 12, 10
RECIPE = """\
[answers]
task = "image_classification"
model_family = "resnet"
model = "tiny"
[algorithms.label_smoothing]
smoothing = 0.1
[algorithms.mixup]
alpha = 0.4
prob = 0.5
[algorithms.cutmix]
alpha = 1.0
prob = 0.5
[algorithms.cutout]
[algorithms.colout]
"""
# The tiny ResNet on the 8x8 digits: a global batch of 12, BatchNorm groups of 2.
SMALL = [
    "--precision=fp32",
    f"--global_batch_size={BATCH}",
    "--bn_group_size=2",
    "--lr=0.2",
    "--lr_warmup=0.25dur",
    "--eval_batches=1",
    "--dist_timeout=120",
    f"--seed={SEED}",
]
# Only the target rewrites: no pixels dropped (cutout cannot be switched off: it keeps a
# 1-pixel hole at a known place, reproduced below).
TARGETS_ONLY = [
    "--colout_p_row=0",
    "--colout_p_col=0",
    "--cutout_length=1",
    "--cutout_per_image=true",
]
STEPS = 8  # steps 0-7: the shared draw picks mixup 7 times and cutmix once (step 6)
TOLERANCE = 2e-5  # 2 ranks and another microbatch size sum in another order


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vision")
    (root / "recipe.toml").write_text(RECIPE)
    new_project(str(root / "recipe.toml"), root / "p", [], "p")
    return root / "p"


def test_all_five_together_render_black_clean_in_the_declared_order(
    project: Path,
) -> None:
    train = (project / "train.py").read_text()
    assert black.format_str(train, mode=BLACK_MODE) == train
    batch_start = train[
        train.index("# event: BATCH_START") : train.index("# event: AFTER_BACKWARD")
    ]
    fences = [
        line.strip().removeprefix("# algorithm: ")
        for line in batch_start.splitlines()
        if line.strip().startswith("# algorithm: ")
    ]
    # The catalog's order: label_smoothing declares before = [mixup, cutmix], and that holds.
    order = catalog_order(load_algorithms(template_dir()))
    assert fences == [name for name in order if name in fences]
    assert sorted(fences) == ["colout", "cutmix", "cutout", "label_smoothing", "mixup"]
    assert fences.index("label_smoothing") < min(
        fences.index("mixup"), fences.index("cutmix")
    )


@pytest.fixture(scope="module")
def modules(project: Path):
    with project_modules(project) as loaded:
        yield loaded


def train_once(
    project: Path,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    *args: str,
    steps: int = 1,
) -> list[dict]:
    """main() of the generated train.py in this process, `steps` steps: `args` on top
    of SMALL."""
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    with project_modules(project) as loaded:
        argv = [
            "train.py",
            "--run_name=r",
            "--device=cpu",
            *SMALL,
            f"--max_duration={steps}ba",
            "--save_interval=1000ba",
            "--eval_interval=1000ba",
            "--device_microbatch_size=4",
            *args,
        ]
        monkeypatch.setattr(sys, "argv", argv)
        try:
            loaded["train"].main()
        finally:
            from runtime import dist

            dist.shutdown()
    return read_metrics(workdir, "r")


def first_batch(
    modules, per_image: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Module]:
    """Step 0's normalized global batch (its 1-pixel CutOut holes per image, or one for
    the whole batch), its labels, and the initial model (train mode)."""
    data, model = modules["data"], modules["model"]
    images = data.load_images("")
    pixels, labels, _ = data.Batches(
        images, "train", batch_size=BATCH, seed=SEED, image_size=224
    )[0]
    torch.manual_seed(SEED)  # as train.py: the initial weights
    net = model.ResNet(
        model.ResNetConfig(
            num_classes=CLASSES, in_channels=1, bn_group_size=2, **model.PRESETS["tiny"]
        )
    )
    inputs = data.normalize(pixels, images)
    # The 1-pixel CutOut hole of TARGETS_ONLY: one per image, at its drawn centre.
    rng = data.step_rng(SEED, 0, "cutout")
    centers = rng.integers(0, (8, 8), size=(BATCH if per_image else 1, 1, 2))
    for i in range(BATCH):
        row, col = centers[i if per_image else 0, 0]
        inputs[i, :, row, col] = 0.0
    return inputs, labels, net


def smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, s: float) -> torch.Tensor:
    """Per-sample closed form: -(1 - s) log p[y] - (s / K) sum_c log p[c]."""
    log_p = logits.log_softmax(dim=1)
    return -(1 - s) * log_p.gather(1, labels[:, None])[:, 0] - s / log_p.shape[
        1
    ] * log_p.sum(dim=1)


def step_one_loss(rows: list[dict]) -> float:
    return next(row["loss"] for row in rows if row.get("step") == 1 and "loss" in row)


# ---------------------------------------------------------------- the generated functions


def test_mixup_batch_equals_a_hand_computation(modules) -> None:
    data = modules["data"]
    x = torch.randn(6, 1, 4, 4, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 3, 4, 5])
    perm = torch.tensor([3, 0, 5, 1, 2, 4])
    mixed, targets = data.mixup_batch(x, y, CLASSES, 0.3, perm, rank=0)
    for i in range(6):
        torch.testing.assert_close(mixed[i], 0.3 * x[i] + 0.7 * x[perm[i]])
    logits = torch.randn(6, CLASSES, generator=torch.Generator().manual_seed(1))
    loss = F.cross_entropy(logits, targets, reduction="none")
    expected = 0.3 * F.cross_entropy(
        logits, y, reduction="none"
    ) + 0.7 * F.cross_entropy(logits, y[perm], reduction="none")
    torch.testing.assert_close(loss, expected)
    # Soft (smoothed) targets are mixed as they are.
    soft = torch.full((6, CLASSES), 0.01) + 0.9 * F.one_hot(y, CLASSES)
    _, mixed_soft = data.mixup_batch(x, soft, CLASSES, 0.3, perm, rank=0)
    torch.testing.assert_close(mixed_soft, 0.3 * soft + 0.7 * soft[perm])


def test_cutmix_box_and_batch_equal_a_hand_computation(modules) -> None:
    train = modules["train"]
    # lam 0.75: sides sqrt(0.25) = half of 8, centred at (4, 3): rows 2..5, columns 1..4.
    assert train.cutmix_box(0.75, 8, 8, (4, 3)) == (2, 6, 1, 5)
    # Clipped at the corner: rows 0..1, columns 0..2 of the same 4x4 box.
    assert train.cutmix_box(0.75, 8, 8, (0, 1)) == (0, 2, 0, 3)
    x = torch.randn(4, 2, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([1, 2, 3, 4])
    perm = torch.tensor([2, 3, 0, 1])
    box = (0, 2, 0, 3)
    mixed, targets, lam = train.cutmix_batch(x, y, CLASSES, box, perm, rank=0)
    assert lam == 1 - 6 / 64  # corrected to the clipped box's area
    expected = x.clone()
    for i in range(4):
        expected[i, :, 0:2, 0:3] = x[perm[i], :, 0:2, 0:3]
    assert torch.equal(mixed, expected)
    onehot = F.one_hot(y, CLASSES).float()
    torch.testing.assert_close(targets, lam * onehot + (1 - lam) * onehot[perm])


def test_cutout_blanks_exactly_the_stated_squares(modules) -> None:
    train = modules["train"]
    # An interior hole of side 3 removes exactly 9 of 64 pixels; a hole centred on the corner
    # is clipped to 2x2 (side // 2 = 1 row and column before the centre fall outside); two
    # disjoint holes remove 2 * 9.
    centers = torch.tensor([[[4, 4]], [[0, 0]]])
    holes = train.cutout_holes(centers, 3, 8, 8)
    assert holes.shape == (2, 1, 8, 8)
    assert holes[0, 0].sum() == 9 and holes[0, 0, 3:6, 3:6].all()
    assert holes[1, 0].sum() == 4 and holes[1, 0, 0:2, 0:2].all()
    two = train.cutout_holes(torch.tensor([[[1, 1], [5, 5]]]), 3, 8, 8)
    assert two.sum() == 18 and two[0, 0, 0:3, 0:3].all() and two[0, 0, 4:7, 4:7].all()


@pytest.mark.parametrize(
    ("p_row", "p_col", "rows", "cols"), [(0.25, 0.5, 6, 4), (0.0, 0.125, 8, 7)]
)
def test_colout_drops_exactly_the_stated_rows_and_columns(
    modules, p_row, p_col, rows, cols
) -> None:
    data = modules["data"]  # the draw lives in data.py, the indexing in train.py
    # Pixel values encode their place: value = 8 * row + column.
    x = torch.arange(64.0).view(1, 1, 8, 8).expand(3, 2, 8, 8)

    def colout(p_row: float, p_col: float, step: int) -> torch.Tensor:
        kept_rows, kept_cols = data.colout_kept(8, 8, p_row, p_col, SEED, step)
        return x[..., kept_rows, :][..., kept_cols]  # as train.py's BATCH_START block

    out = colout(p_row, p_col, 5)
    assert out.shape == (3, 2, rows, cols)
    kept_rows, kept_cols = out[0, 0, :, 0] // 8, out[0, 0, 0, :] % 8
    assert kept_rows.tolist() == sorted(set(kept_rows.tolist()))  # distinct, in order
    assert kept_cols.tolist() == sorted(set(kept_cols.tolist()))
    assert torch.equal(
        out, x[..., kept_rows.long(), :][..., kept_cols.long()]
    )  # same for all
    assert torch.equal(out, colout(p_row, p_col, 5))  # a pure function of (seed, step)
    others = [colout(0.25, 0.5, s) for s in range(6, 10)]
    assert any(not torch.equal(o, colout(0.25, 0.5, 5)) for o in others)


# ---------------------------------------------------------------- a real first step


def test_label_smoothing_loss_equals_the_closed_form(
    project: Path, modules, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = train_once(
        project,
        tmp_path / "w",
        monkeypatch,
        *TARGETS_ONLY,
        "--mixup_prob=0",
        "--cutmix_prob=0",
        "--label_smoothing_smoothing=0.2",
    )
    inputs, labels, net = first_batch(modules)
    expected = smoothed_loss(net(inputs), labels, 0.2).mean().item()
    assert abs(step_one_loss(rows) - expected) < 1e-5 * expected
    plain = F.cross_entropy(net(inputs), labels).item()
    assert abs(plain - expected) > 1e-3  # smoothing changed the loss


def test_cutout_cuts_one_set_of_holes_for_the_batch_by_default(
    project: Path, modules, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Composer's cutout_batch: one hole position for every image of the batch (the
    per-image holes of --cutout_per_image=true give another loss)."""
    args = [a for a in TARGETS_ONLY if not a.startswith("--cutout_per_image")]
    rows = train_once(
        project,
        tmp_path / "w",
        monkeypatch,
        *args,
        "--mixup_prob=0",
        "--cutmix_prob=0",
        "--label_smoothing_smoothing=0.0",
    )
    inputs, labels, net = first_batch(modules, per_image=False)
    expected = F.cross_entropy(net(inputs), labels).item()
    assert abs(step_one_loss(rows) - expected) < 1e-5 * expected
    inputs, labels, net = first_batch(modules, per_image=True)
    assert abs(F.cross_entropy(net(inputs), labels).item() - expected) > 1e-4


def test_smoothing_then_mixup_loss_equals_the_hand_computation(
    project: Path, modules, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Label smoothing runs before MixUp (declared order); the loss of the first step is
    lam * smoothed loss(own label) + (1 - lam) * smoothed loss(partner's label), with lam
    and the partners drawn from (seed, step 0)."""
    rows = train_once(
        project,
        tmp_path / "w",
        monkeypatch,
        *TARGETS_ONLY,
        "--mixup_prob=1",
        "--cutmix_prob=0",
    )
    inputs, labels, net = first_batch(modules)
    rng = modules["data"].step_rng(SEED, 0, "mixup")
    lam = float(rng.beta(0.4, 0.4))
    perm = torch.from_numpy(rng.permutation(BATCH))
    assert rows[0]["mixup_lambda"] == lam and rows[0]["cutmix_lambda"] == 1.0
    logits = net(lam * inputs + (1 - lam) * inputs[perm])
    expected = (
        (
            lam * smoothed_loss(logits, labels, 0.1)
            + (1 - lam) * smoothed_loss(logits, labels[perm], 0.1)
        )
        .mean()
        .item()
    )
    assert abs(step_one_loss(rows) - expected) < 1e-5 * expected


def test_cutmix_loss_equals_the_hand_computation(
    project: Path, modules, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = train_once(
        project,
        tmp_path / "w",
        monkeypatch,
        *TARGETS_ONLY,
        "--mixup_prob=0",
        "--cutmix_prob=1",
        "--label_smoothing_smoothing=0",
    )
    inputs, labels, net = first_batch(modules)
    rng = modules["data"].step_rng(SEED, 0, "cutmix")
    lam = float(rng.beta(1.0, 1.0))
    row, col = rng.integers(8), rng.integers(8)
    perm = torch.from_numpy(rng.permutation(BATCH))
    half = int(8 * math.sqrt(1 - lam)) // 2
    top, bottom, left, right = (
        max(row - half, 0),
        min(row + half, 8),
        max(col - half, 0),
        min(col + half, 8),
    )
    mixed = inputs.clone()
    mixed[..., top:bottom, left:right] = inputs[perm][..., top:bottom, left:right]
    lam = 1 - (bottom - top) * (right - left) / 64
    assert rows[0]["cutmix_lambda"] == pytest.approx(lam, abs=1e-12) and lam < 1
    logits = net(mixed)
    expected = (
        (
            lam * F.cross_entropy(logits, labels, reduction="none")
            + (1 - lam) * F.cross_entropy(logits, labels[perm], reduction="none")
        )
        .mean()
        .item()
    )
    assert abs(step_one_loss(rows) - expected) < 1e-5 * expected


@pytest.mark.parametrize(("mixup_prob", "cutmix_prob"), [(1.0, 1.0), (1.0, 0.5)])
def test_mixers_whose_shares_exceed_1_take_turns_in_proportion(
    mixup_prob: float,
    cutmix_prob: float,
    project: Path,
    modules,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At their defaults (1.0 each, what `scaffold add mixup` then `scaffold add cutmix`
    gives) both train: every step is mixed by exactly one, mixup where the shared draw
    falls below its proportional share (1/2; with cutmix_prob=0.5, 2/3), as timm's
    Mixup switches. 10 steps: the draws give cutmix step 9, and step 6 at 1/2 only."""
    rows = train_once(
        project,
        tmp_path / "w",
        monkeypatch,
        *TARGETS_ONLY,
        f"--mixup_prob={mixup_prob}",
        f"--cutmix_prob={cutmix_prob}",
        steps=10,
    )
    share = mixup_prob / (mixup_prob + cutmix_prob)
    steps = [row for row in rows if "mixup_lambda" in row]
    assert [row["step"] for row in steps] == list(range(1, 11))
    step_rng = modules["data"].step_rng
    for row in steps:
        draw = step_rng(SEED, row["step"] - 1, "batch mixer").random()
        mixed = (row["mixup_lambda"] < 1.0, row["cutmix_lambda"] < 1.0)
        assert mixed == (draw < share, draw >= share), (row["step"], draw, mixed)
    cutmix_steps = [row["step"] for row in steps if row["cutmix_lambda"] < 1.0]
    assert cutmix_steps == ([7, 10] if share == 0.5 else [10])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--label_smoothing_smoothing=1.0"],
            "label_smoothing_smoothing=1.0 is outside its range [0, 1)",
        ),
        (["--mixup_alpha=0"], "mixup_alpha=0.0 is outside its range (0, inf)"),
        (["--cutmix_alpha=-1"], "cutmix_alpha=-1.0 is outside its range (0, inf)"),
        (
            ["--cutout_length=1.5"],
            "cutout_length=1.5 must be a fraction in (0, 1) of the image or a whole number",
        ),
        (["--cutout_num_holes=0"], "cutout_num_holes=0 is outside its range [1, inf)"),
        (["--colout_p_col=1.0"], "colout_p_col=1.0 is outside its range [0, 1)"),
    ],
)
def test_bad_hyperparameters_are_one_line_exit_2(
    args: list[str],
    message: str,
    project: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        train_once(project, tmp_path / "w", monkeypatch, *args)
    assert exited.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert (
        len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    ), lines
    assert not (tmp_path / "w" / "runs").exists()


# ---------------------------------------------------------------- ranks, microbatches, kill -9


def trajectory(workdir: Path) -> list[tuple]:
    return [
        (r["step"], r["loss"], r["mixup_lambda"], r["cutmix_lambda"], r.get("val_loss"))
        for r in read_metrics(workdir, "r")
    ]


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def test_mixing_is_the_same_on_2_ranks_any_microbatch_and_after_kill_9(
    project: Path, modules, tmp_path: Path
) -> None:
    """All five algorithms, 8 steps: one process with whole-batch microbatches; the same
    killed (-9, inside the save of step 3) and resumed: bitwise equal; FSDP on 2 ranks with
    microbatches of 2 (partners on the other rank: all-gathered): equal within reduction
    order. The shared draw gives every step to exactly one mixer."""
    common = [
        *SMALL,
        f"--max_duration={STEPS}ba",
        "--eval_interval=4ba",
        "--save_interval=1ba",
        "--run_name=r",
    ]
    one, killed, two = (tmp_path / name for name in ("one", "killed", "two"))
    for folder in (one, killed, two):
        folder.mkdir()
    ok(run_train(project, one, *common, "--device_microbatch_size=12"))
    reference = trajectory(one)

    # Exactly one mixer per step, the one the shared draw names.
    step_rng = modules["data"].step_rng
    for step, _, mixup_lambda, cutmix_lambda, _ in reference:
        draw = step_rng(SEED, step - 1, "batch mixer").random()
        assert (mixup_lambda < 1.0) == (draw < 0.5) and (cutmix_lambda < 1.0) == (
            draw >= 0.5
        ), step
    assert {row[2] < 1.0 for row in reference} == {
        True,
        False,
    }  # both mixers took steps

    died = subprocess.run(
        [
            sys.executable,
            str(STOP_AFTER),
            "kill:3",
            str(project / "train.py"),
            *common,
            "--device_microbatch_size=12",
            "--device=cpu",
        ],
        cwd=killed,
        env=checkout_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert died.returncode == -9, died.stderr[-3000:]
    resumed = ok(run_train(project, killed, *common, "--device_microbatch_size=12"))
    assert "resumed from" in resumed.stdout
    assert trajectory(killed) == reference

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(project / "train.py"),
        *common,
        "--device_microbatch_size=2",
        "--parallelism=fsdp",
        "--device=cpu",
    ]
    ok(
        subprocess.run(
            command,
            cwd=two,
            env=checkout_env(),
            capture_output=True,
            text=True,
            timeout=400,
        )
    )
    for ours, theirs in zip(trajectory(two), reference, strict=True):
        assert ours[0] == theirs[0] and ours[2:4] == theirs[2:4]
        assert abs(ours[1] - theirs[1]) <= TOLERANCE, (ours, theirs)
        assert (ours[4] is None) == (theirs[4] is None)
        if ours[4] is not None:
            assert abs(ours[4] - theirs[4]) <= TOLERANCE
    losses = [row[1] for row in reference]
    assert min(abs(a - b) for a, b in zip(losses, losses[1:])) > 10 * TOLERANCE


# ---------------------------------------------------------------- hyperparameter ranges at generation


@pytest.mark.parametrize(
    ("refused", "accepted", "message"),
    [
        (
            "label_smoothing.smoothing=1",
            "label_smoothing.smoothing=0",
            "label_smoothing.smoothing = 1.0 is outside its range [0, 1)",
        ),
        (
            "mixup.alpha=0",
            "mixup.alpha=1e-3",
            "mixup.alpha = 0.0 is outside its range (0, inf)",
        ),
        (
            "cutmix.prob=1.5",
            "cutmix.prob=0",
            "cutmix.prob = 1.5 is outside its range [0, 1]",
        ),
        (
            "colout.p_row=-0.1",
            "colout.p_row=0",
            "colout.p_row = -0.1 is outside its range [0, 1)",
        ),
        (
            "cutout.num_holes=0",
            "cutout.num_holes=1",
            "cutout.num_holes = 0 is outside its range [1, inf)",
        ),
    ],
)
def test_scaffold_new_refuses_a_hyperparameter_out_of_range(
    refused: str, accepted: str, message: str, tmp_path: Path
) -> None:
    """The declared `range` of algorithm.toml, checked when the project is generated: one
    line, exit 2, nothing written; the range's closed end is accepted."""
    recipe = tmp_path / "recipe.toml"
    recipe.write_text(RECIPE)
    dest = tmp_path / "p"
    result = scaffold_cli("new", "--recipe", str(recipe), str(dest), "--set", refused)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: {message}; fix the recipe or the --set value"
    ]
    assert not dest.exists()
    assert (
        scaffold_cli(
            "new", "--recipe", str(recipe), str(dest), "--set", accepted
        ).returncode
        == 0
    )


@pytest.mark.parametrize("bad", ['range = "0..1"', 'range = "[0.5, 1)"'])
def test_a_malformed_range_or_a_default_outside_it_is_a_catalog_error(
    bad: str, tmp_path: Path
) -> None:
    template = tmp_path / "templates"
    shutil.copytree(template_dir(), template)
    toml = template / "algorithms" / "label_smoothing" / "algorithm.toml"
    toml.write_text(toml.read_text().replace('range = "[0, 1)"', bad))
    with pytest.raises(CatalogError, match="hyperparameter 'smoothing' has range"):
        load_algorithms(template)
