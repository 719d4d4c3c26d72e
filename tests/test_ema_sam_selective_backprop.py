"""EMA, SAM and selective backprop: each effect checked in the code the generator writes.

One image project holds all three (and gradient clipping, which SAM must run before); the
in-process tests import its functions, the distributed ones train it on 1 and 2 ranks.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from projects import (
    checkout_env,
    project_modules,
    read_metrics,
    run_train,
    run_train_apart,
)
from scaffold.render import new_project

TESTS = Path(__file__).resolve().parent
STOP_AFTER = TESTS / "stop_after.py"
RECIPE = """
[answers]
task = "image_classification"
model_family = "resnet"
model = "tiny"

[algorithms.ema]
[algorithms.sam]
[algorithms.selective_backprop]
[algorithms.gradient_clipping]
"""
# The tiny ResNet on the digits: 12 samples per step in BatchNorm groups of 2; selective
# backprop keeps a third of them (4: two per rank on 2 ranks), from the first step on.
SMALL = [
    "--model=tiny",
    "--precision=fp32",
    "--global_batch_size=12",
    "--device_microbatch_size=2",
    "--bn_group_size=2",
    "--lr=0.2",
    "--lr_warmup=0.25dur",
    "--eval_batches=3",
    "--dist_timeout=120",
    "--selective_backprop_start=0",
    f"--selective_backprop_keep={1 / 3!r}",
    "--ema_half_life=2ba",
]
TOLERANCE = 2e-5  # reduction order on 2 ranks (see test_image.py)


def small(*overrides: str) -> list[str]:
    """SMALL with some keys given other values."""
    keys = {arg.split("=")[0] for arg in overrides}
    return [arg for arg in SMALL if arg.split("=")[0] not in keys] + list(overrides)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("vision")
    (root / "recipe.toml").write_text(RECIPE)
    # With the out-of-memory search: the 2-rank test retries SAM's passes after an OOM.
    new_project(str(root / "recipe.toml"), root / "p", ["auto_microbatching=true"], "p")
    return root / "p"


@pytest.fixture(scope="module")
def modules(project: Path):
    with project_modules(project) as loaded:
        yield loaded


def ok(result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def torchrun(
    nproc: int, *args: str | Path, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *map(str, args),
        "--device=cpu",
    ]
    return subprocess.run(
        command,
        cwd=cwd,
        env={**checkout_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=400,
    )


def checkpoint_entries(path: Path) -> dict:
    """A DCP checkpoint as one plain dict (no process group)."""
    out = path.parent / f"{path.name}.pt"
    dcp_to_torch_save(path, out)
    return torch.load(out, weights_only=False)


# ---------------------------------------------------------------- ema


def test_ema_of_a_constant_model_follows_the_closed_form(modules) -> None:
    """After n updates towards constant weights w from e0: e_n = w + s^n (e0 - w), with
    s = 2^(-update_interval / half_life); running statistics too; the step counter copied.
    """
    train = modules["train"]
    cfg = train.Config(
        ema_half_life=train.Time.parse("4ba"),
        ema_update_interval=train.Time.parse("1ba"),
    )
    s = train.ema_smoothing(cfg)
    assert s == 2.0 ** (-1 / 4)
    dur = train.Config(
        max_duration=train.Time.parse("100ba"),
        ema_half_life=train.Time.parse("0.1dur"),
        ema_update_interval=train.Time.parse("5ba"),
    )
    assert train.ema_smoothing(dur) == 2.0 ** (-5 / 10)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    with torch.no_grad():
        for (
            value
        ) in model.state_dict().values():  # every float differs from the average's
            value.normal_() if value.is_floating_point() else value.fill_(7)
    ema = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    start = {k: v.clone() for k, v in ema.state_dict().items()}
    n = 5
    for _ in range(n):
        train.update_ema(ema, model, s)
    for key, value in ema.state_dict().items():
        if key.endswith("num_batches_tracked"):
            assert value.item() == 7
            continue
        expected = model.state_dict()[key] + s**n * (
            start[key] - model.state_dict()[key]
        )
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-6)
        assert not torch.equal(value, model.state_dict()[key])  # not simply copied


@pytest.fixture(scope="module")
def refused(
    project: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """The runs of the two refusal tests, in one interpreter (torch imported once).
    Each name: (workdir, result)."""
    runs = {
        "ema": small("--ema_half_life=2ep"),
        "selective_backprop": small("--selective_backprop_keep=0.25"),  # 3 samples
    }
    return run_train_apart(project, tmp_path_factory.mktemp("refused"), runs)


def test_ema_units_must_match_is_one_line_exit_2(refused: dict) -> None:
    workdir, result = refused["ema"]
    assert result.returncode == 2 and result.stderr.strip().startswith(
        "error: ema:"
    ), result.stderr
    assert not (workdir / "runs").exists()


def test_ema_resumes_2_to_1_ranks_bitwise_is_evaluated_and_exported(
    project: Path, modules, tmp_path: Path
) -> None:
    """2 FSDP ranks save the average at step 2; one process resumes it with no further
    updates: its step-4 average equals the step-2 one bitwise, evaluation of the average gives
    the same score at step 2 (2 ranks) and step 4 (1 process) while the live score moves, and
    that score is the one evaluate() gives on the exported weights."""
    common = [
        *SMALL,
        "--max_duration=4ba",
        "--eval_interval=2ba",
        "--save_interval=2ba",
        "--save_num_checkpoints_to_keep=0",
        "--run_name=ema",
    ]
    ok(
        torchrun(
            2,
            STOP_AFTER,
            2,
            project / "train.py",
            *common,
            "--parallelism=fsdp",
            cwd=tmp_path,
        )
    )
    resumed = ok(run_train(project, tmp_path, *common, "--ema_update_interval=1000ba"))
    assert "(saved on 2 rank(s), now 1)" in resumed.stdout
    folder = tmp_path / "runs" / "ema" / "checkpoints"
    two, one = checkpoint_entries(folder / "step-2"), checkpoint_entries(
        folder / "step-4"
    )
    assert two["ema"].keys() == two["model"].keys()
    for key in two["ema"]:
        assert torch.equal(two["ema"][key], one["ema"][key]), key
    assert any(
        not torch.equal(two["ema"][k], two["model"][k])
        for k in two["ema"]
        if "running" not in k
    )
    rows = {row["step"]: row for row in read_metrics(tmp_path, "ema")}
    assert abs(rows[2]["ema_val_loss"] - rows[4]["ema_val_loss"]) <= TOLERANCE
    assert abs(rows[2]["val_loss"] - rows[4]["val_loss"]) > 100 * TOLERANCE
    assert abs(rows[4]["ema_val_loss"] - rows[4]["val_loss"]) > 100 * TOLERANCE

    # scaffold export writes the average by default (the run named it), the live weights on request.
    from safetensors.torch import load_file

    from runtime.checkpoint import export_safetensors

    info = export_safetensors(tmp_path / "runs" / "ema", tmp_path / "ema.safetensors")
    assert info["entry"] == "ema" and info["step"] == 4
    exported = load_file(tmp_path / "ema.safetensors")
    assert all(torch.equal(exported[k], one["ema"][k]) for k in exported)
    export_safetensors(
        tmp_path / "runs" / "ema", tmp_path / "live.safetensors", entry="model"
    )
    live = load_file(tmp_path / "live.safetensors")
    assert all(torch.equal(live[k], one["model"][k]) for k in live)

    # The logged ema_val_loss is evaluate() on the exported average.
    train, model, data = modules["train"], modules["model"], modules["data"]
    cfg = train.config.parse(train.Config, ["--device=cpu", *common])
    images = data.load_images(cfg.data)
    net = model.ResNet(
        model.ResNetConfig(
            num_classes=10,
            in_channels=images.channels,
            bn_group_size=cfg.bn_group_size,
            **model.PRESETS["tiny"],
        )
    )
    net.load_state_dict(exported)
    env = train.dist.environment("cpu")
    val = data.Batches(
        images,
        "val",
        batch_size=cfg.global_batch_size,
        seed=cfg.seed,
        image_size=cfg.image_size,
    )
    search = train.microbatch.Search(
        net, net.blocks, env, 2, per_rank_batch=12, log=lambda _: None
    )
    scores = train.evaluate(net, val, cfg, env, search)
    assert scores["val_loss"] == pytest.approx(rows[4]["ema_val_loss"], abs=1e-6)


# ---------------------------------------------------------------- sam


class Bowl(torch.nn.Module):
    """loss(w) = 1/2 w^T A w: gradient A w."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64))
        self.a = torch.tensor(
            [[3.0, 0.5, 0.0], [0.5, 1.0, 0.2], [0.0, 0.2, 2.0]], dtype=torch.float64
        )
        self.step_stats = torch.tensor(
            [1.0]
        )  # as ghost BatchNorm's: the first pass's are kept

    def loss(self) -> torch.Tensor:
        self.step_stats = self.step_stats + 1
        return 0.5 * self.w @ self.a @ self.w


def test_sam_gradient_is_the_gradient_at_the_ascended_weights(modules) -> None:
    train = modules["train"]
    bowl = Bowl()
    w = bowl.w.detach().clone()
    rho = 0.3
    bowl.loss().backward()  # the first pass: g at w
    saved = train.sam_ascend(bowl, rho)
    assert bowl.w.grad is None  # the second pass starts from an empty .grad
    bowl.loss().backward()
    train.sam_descend(bowl, saved)
    g = bowl.a @ w
    expected = bowl.a @ (w + rho * g / g.norm())
    torch.testing.assert_close(bowl.w.grad, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(bowl.w.detach(), w)  # restored bitwise
    assert bowl.step_stats.item() == 2.0  # the second pass's statistics dropped


def test_sam_steps_count_from_the_first(project: Path, tmp_path: Path) -> None:
    """A SAM step every `interval` steps from step 0 on (Composer's from step k - 1):
    with interval 2 the steps 0 and 2, with interval 1000 step 0 alone, so the two runs
    part at step 2 (the loss after it differs), not at step 1 (Composer's phase)."""
    losses = {}
    for interval in (2, 1000):
        args = [
            "--max_duration=4ba",
            "--eval_interval=1000ba",
            "--save_interval=1000ba",
            f"--sam_interval={interval}",
            f"--run_name=sam{interval}",
        ]
        ok(run_train(project, tmp_path, *small(*args)))
        rows = read_metrics(tmp_path, f"sam{interval}")
        losses[interval] = [row["loss"] for row in rows if "loss" in row]
    assert losses[2][:3] == losses[1000][:3]  # steps 1-3: after steps 0 and 1
    assert losses[2][3] != losses[1000][3]  # step 4: after SAM step 2 or a plain one


# ---------------------------------------------------------------- selective backprop


def test_selective_backprop_scores_antialiased_images_by_cross_entropy(
    modules,
) -> None:
    """The scoring forward at scale_factor 0.5 sees the images resized with
    antialiasing (Composer's F.interpolate does not antialias), and its score is the
    cross-entropy on the real labels: the kept samples are the highest such losses."""
    train = modules["train"]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 4 * 4, 3))
    inputs, labels = torch.randn(16, 3, 8, 8), torch.randint(0, 3, (16,))
    cfg = train.Config(
        selective_backprop_scale_factor=0.5,
        precision="fp32",
        selective_backprop_sampling="top",
    )
    env = train.dist.environment("cpu")

    def top(antialias: bool) -> list[int]:
        small_images = F.interpolate(
            inputs, scale_factor=0.5, mode="bilinear", antialias=antialias
        )
        with torch.no_grad():
            scores = F.cross_entropy(net(small_images), labels, reduction="none")
        return sorted(torch.argsort(scores, descending=True, stable=True)[:4].tolist())

    assert top(True) != top(False)  # the two resizings keep other samples here
    rng = np.random.default_rng(0)  # unused by "top"
    kept_x, _ = train.select_high_loss(net, inputs, labels, 4, cfg, env, 8, rng)
    assert torch.equal(kept_x, inputs[top(True)])


def test_selective_backprop_scoring_leaves_the_batchnorm_statistics(modules) -> None:
    """The running statistics after a selection step are the training forward's alone
    (Composer's scoring forward updates them too): the scoring forward's group
    statistics are dropped when forward_backward starts."""
    train, model_module = modules["train"], modules["model"]
    inputs, labels = torch.randn(12, 1, 8, 8), torch.arange(12) % 10
    cfg = train.Config(precision="fp32", selective_backprop_sampling="top")
    env = train.dist.environment("cpu")

    def resnet() -> torch.nn.Module:
        torch.manual_seed(0)
        config = model_module.ResNetConfig(
            num_classes=10,
            in_channels=1,
            bn_group_size=2,
            **model_module.PRESETS["tiny"],
        )
        return model_module.ResNet(config)

    scored, plain = resnet(), resnet()
    rng = np.random.default_rng(0)  # unused by "top"
    kept = train.select_high_loss(scored, inputs, labels, 4, cfg, env, 4, rng)
    for net in (scored, plain):
        search = train.microbatch.Search(
            net, net.blocks, env, 4, per_rank_batch=4, log=lambda _: None
        )
        train.forward_backward(net, *kept, search, 1.0, cfg)
        train.update_running_stats(net, lambda total: total)
    norms = [
        [m for m in net.modules() if hasattr(m, "step_stats")]
        for net in (scored, plain)
    ]
    assert norms[0] and all(m.num_batches_tracked.item() == 1 for m in norms[0])
    for a, b in zip(*norms, strict=True):
        assert torch.equal(a.running_mean, b.running_mean)
        assert torch.equal(a.running_var, b.running_var)


def test_selective_backprop_keeps_the_top_loss_samples_and_the_gradient_is_theirs(
    modules,
) -> None:
    """With sampling="top" the kept samples are the highest-loss ones (ties to the lower
    index), in global order; a step on them has the gradient of the mean loss over exactly that subset.
    """
    train = modules["train"]
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    inputs, labels = torch.randn(8, 3, 2, 2), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    inputs[5] = inputs[2]
    labels[5] = labels[2]  # a tie: sample 2 goes first
    cfg = train.Config(
        selective_backprop_scale_factor=1.0,
        precision="fp32",
        selective_backprop_sampling="top",
    )
    env = train.dist.environment("cpu")
    with torch.no_grad():
        losses = F.cross_entropy(net(inputs), labels, reduction="none")
    rng = np.random.default_rng(0)  # unused by "top"
    kept_x, kept_y = train.select_high_loss(net, inputs, labels, 3, cfg, env, 4, rng)
    ranked = sorted(range(8), key=lambda i: (-losses[i].item(), i))[:3]
    assert 2 in ranked or 5 not in ranked
    expected = sorted(ranked)
    assert torch.equal(kept_x, inputs[expected]) and torch.equal(
        kept_y, labels[expected]
    )
    # The loop's gradient (summed loss / kept count) against the subset's mean loss by hand.
    net.zero_grad()
    (F.cross_entropy(net(kept_x), kept_y, reduction="sum") / 3).backward()
    ours = [p.grad.clone() for p in net.parameters()]
    net.zero_grad()
    hand = (
        sum(
            F.cross_entropy(net(inputs[i : i + 1]), labels[i : i + 1]) for i in expected
        )
        / 3
    )
    hand.backward()
    for a, b in zip(ours, (p.grad for p in net.parameters())):
        torch.testing.assert_close(a, b)


def test_selective_backprop_samples_by_loss_percentile_as_composer(modules) -> None:
    """The default sampling draws each sample with probability ~ its loss percentile **
    (1 / keep - 1) (Composer's select_using_loss), without replacement, from the step's
    generator: the same draw for the same (seed, step)."""
    train = modules["train"]
    assert train.Config().selective_backprop_sampling == "loss_percentile"
    scores = torch.tensor([0.3, 2.0, 0.1, 1.0, 0.7, 5.0, 0.2, 0.5])
    ranks = torch.argsort(torch.argsort(scores))  # 0: the lowest loss
    keep = 0.25
    weights = ((ranks.double() + 0.5) / 8) ** (1 / keep - 1)
    expected = weights / weights.sum()
    rng = np.random.default_rng(0)
    draws = torch.stack(
        [train.sample_by_loss(scores, 1, keep, rng) for _ in range(20000)]
    ).flatten()
    observed = torch.bincount(draws, minlength=8).double() / len(draws)
    torch.testing.assert_close(observed, expected, atol=0.01, rtol=0)
    # Two of eight: distinct samples, and a pure function of the step's generator.
    pairs = [
        train.sample_by_loss(scores, 2, 0.5, train.data.step_rng(7, 3, "sb"))
        for _ in range(2)
    ]
    assert len(set(pairs[0].tolist())) == 2 and torch.equal(pairs[0], pairs[1])


def test_selective_backprop_kept_count_must_fill_batchnorm_groups(
    refused: dict,
) -> None:
    workdir, result = refused["selective_backprop"]  # 3 samples, groups of 2
    assert result.returncode == 2 and "= 3 samples" in result.stderr, result.stderr
    assert "bn_group_size = 2" in result.stderr
    assert not (workdir / "runs").exists()


# ---------------------------------------------------------------- 1 process == 2 ranks


@pytest.fixture(scope="module")
def reference(project: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    workdir = tmp_path_factory.mktemp("one")
    ok(
        run_train(
            project,
            workdir,
            *SMALL,
            "--max_duration=4ba",
            "--eval_interval=2ba",
            "--run_name=one",
        )
    )
    return read_metrics(workdir, "one")


@pytest.mark.parametrize(
    ("args", "inject"),
    [
        (["--parallelism=fsdp"], ""),
        (
            ["--parallelism=ddp", "--device_microbatch_size=auto"],
            "ranks=1;above=2;phase=backward",
        ),
    ],
    ids=["fsdp-2", "ddp-2-auto-oom"],
)
def test_two_ranks_equal_one_process(
    args: list[str], inject: str, project: Path, reference: list[dict], tmp_path: Path
) -> None:
    """SAM's two passes, selective backprop's global choice and the average: per-step losses
    (the kept samples' mean: a different choice would change it), validation scores of the
    live and averaged weights equal one process's; with an injected OOM the step retries.
    """
    env = {"SCAFFOLD_INJECT_OOM": inject} if inject else None
    launch = [
        *small(*args),
        "--max_duration=4ba",
        "--eval_interval=2ba",
        "--run_name=two",
    ]
    result = ok(torchrun(2, project / "train.py", *launch, cwd=tmp_path, env=env))
    rows = read_metrics(tmp_path, "two")
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for ours, theirs in zip(rows, reference, strict=True):
        assert ours["selected"] == theirs["selected"]
        for key in ("loss", "val_loss", "ema_val_loss", "grad_norm"):
            assert (key in ours) == (key in theirs), key
            if key in ours:
                assert abs(ours[key] - theirs[key]) <= TOLERANCE, (ours["step"], key)
    assert [r["selected"] for r in rows] == [4, 12, 4, 12]
    assert rows[-1]["sam_steps"] == 4
    if inject:
        assert "retrying the batch at 2" in result.stdout
        assert {r["microbatch_size"] for r in rows[1:]} == {
            2
        }  # step 1 ran 2 rows: unproven
        assert math.isfinite(rows[-1]["loss"])
