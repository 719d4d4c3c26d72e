"""Tests for runtime.checkpoint: single process, CPU, a two-layer model trained with AdamW."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from runtime import checkpoint
from runtime.checkpoint import MARKER, TRAIN_STATE, CheckpointError
from runtime.dist import DistEnv
from runtime.time import Progress

BATCHES_PER_EPOCH = 5


def build(
    hidden: int = 8, layers: int = 2, seed: int = 0
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A small model and AdamW with two parameter groups, like the generated train.py."""
    torch.manual_seed(seed)
    modules: list[nn.Module] = [nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 3)]
    if layers == 3:
        modules += [nn.ReLU(), nn.Linear(3, 3)]
    elif layers == 1:
        modules = [nn.Linear(4, hidden)]
    model = nn.Sequential(*modules)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
    )
    return model, optimizer


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, progress: Progress, steps: int
) -> None:
    for _ in range(steps):
        loss = model(torch.randn(6, 4)).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        progress.advance(samples=6, tokens=24)


def state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    progress: Progress | None = None,
    **more: object,
) -> dict:
    """What the generated loop checkpoints (the model alone: a weights-only load)."""
    entries = {"model": model, "optimizer": optimizer, "progress": progress, **more}
    return {name: value for name, value in entries.items() if value is not None}


class Note:
    """Small plain JSON state (as the microbatch search's): kept in train_state.json."""

    def __init__(self, **values: object) -> None:
        self.values = values

    def state_dict(self) -> dict:
        return dict(self.values)

    def load_state_dict(self, state_dict: dict) -> None:
        self.values = dict(state_dict)


def same_params(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture
def saved(tmp_path: Path) -> dict:
    """A model trained 7 steps and checkpointed; `next_rand` is what torch.rand gave right after."""
    model, optimizer = build()
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    train(model, optimizer, progress, 7)
    for group in optimizer.param_groups:
        group["lr"] = (
            3e-3  # as a schedule would: a fresh optimizer (lr=1e-2) must take this value
        )
    folder = tmp_path / "checkpoints"
    note = Note(microbatch=3, note="x")
    checkpointer = checkpoint.Checkpointer(folder)
    path = checkpointer.save(state(model, optimizer, progress, note=note))
    next_rand = torch.rand(8)
    return {
        "folder": folder,
        "checkpointer": checkpointer,
        "path": path,
        "model": model,
        "optimizer": optimizer,
        "progress": progress,
        "note": note,
        "next_rand": next_rand,
    }


# ---------------------------------------------------------------- round trip


def test_save_writes_complete_step_folder(saved: dict) -> None:
    path = saved["path"]
    assert path == saved["folder"] / "step-7"
    assert (path / MARKER).is_file() and (path / ".metadata").is_file()
    assert list(path.glob("*.distcp")) and (path / "rng-rank0.pt").is_file()
    state = json.loads((path / TRAIN_STATE).read_text())
    assert state["world_size"] == 1 and state["progress"]["batch"] == 7
    # Plain JSON state is kept here, readable, under its entry's name; not in DCP.
    assert state["note"] == {"microbatch": 3, "note": "x"} and "extra" not in state
    metadata = checkpoint.reading.read_metadata(path).state_dict_metadata
    assert sorted({key.split(".")[0] for key in metadata}) == ["model", "optimizer"]


def test_load_restores_model_optimizer_progress_rng_bitwise(saved: dict) -> None:
    model, optimizer = build(seed=1)
    assert not same_params(model, saved["model"])  # the load below has work to do
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    torch.manual_seed(12345)  # any RNG state; load must bring back the saved one

    note = Note()
    loaded = state(model, optimizer, progress, note=note)
    resumed = checkpoint.load(saved["path"], loaded, seed=0)

    assert resumed.step == 7 and resumed.saved_world_size == 1
    assert resumed.rng_restored is True
    assert note.values == {"microbatch": 3, "note": "x"}
    assert torch.equal(torch.rand(8), saved["next_rand"])
    assert progress.state_dict() == saved["progress"].state_dict()
    assert progress.batch == 7 and progress.epoch == 1 and progress.batch_in_epoch == 2
    assert same_params(model, saved["model"])
    original = saved["optimizer"]
    for p_saved, p_loaded in zip(
        saved["model"].parameters(), model.parameters(), strict=True
    ):
        s_saved, s_loaded = original.state[p_saved], optimizer.state[p_loaded]
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s_saved[key], s_loaded[key]), key
        assert float(s_loaded["step"]) == 7
    for g_saved, g_loaded in zip(
        original.param_groups, optimizer.param_groups, strict=True
    ):
        assert (
            g_loaded["weight_decay"] == g_saved["weight_decay"]
            and g_loaded["lr"] == g_saved["lr"] == 3e-3
        )
        assert len(g_loaded["params"]) == len(g_saved["params"])

    # One more identical step on both: still bitwise equal (the optimizer state is really live).
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(3))
    for m, opt in ((saved["model"], original), (model, optimizer)):
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert same_params(model, saved["model"])


def test_load_weights_only(saved: dict) -> None:
    model, optimizer = build(seed=1)
    resumed = checkpoint.load(saved["path"], state(model))
    assert same_params(model, saved["model"])
    assert resumed.step == 7 and resumed.rng_restored is True
    assert not optimizer.state  # untouched


# ---------------------------------------------------------------- folder handling


def make_dir(folder: Path, name: str, complete: bool) -> Path:
    path = folder / name
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shard")
    if complete:
        (path / MARKER).write_text("done\n")
    return path


def test_latest_ignores_incomplete_and_foreign_names(tmp_path: Path) -> None:
    assert checkpoint.latest(tmp_path / "absent") is None
    folder = tmp_path / "checkpoints"
    for name in ("step-2", "step-9", "step-10"):
        make_dir(folder, name, complete=True)
    make_dir(folder, "step-11", complete=False)
    for name in ("step-12.tmp", "step-x", "other", "step-", "final-step-99"):
        make_dir(folder, name, complete=True)
    (folder / "step-50").write_text("a file, not a checkpoint")
    assert (
        checkpoint.latest(folder) == folder / "step-10"
    )  # numeric order, not "step-9" > "step-10"


def test_remove_incomplete_deletes_only_incomplete_step_folders(tmp_path: Path) -> None:
    assert checkpoint.remove_incomplete(tmp_path / "absent") == []
    folder = tmp_path / "checkpoints"
    make_dir(folder, "step-3", complete=True)
    make_dir(folder, "step-4", complete=False)
    make_dir(folder, "step-7", complete=False)
    make_dir(folder, "notes", complete=False)
    removed = checkpoint.remove_incomplete(folder)
    assert sorted(p.name for p in removed) == ["step-4", "step-7"]
    assert sorted(p.name for p in folder.iterdir()) == ["notes", "step-3"]
    assert (folder / "step-3" / "__0_0.distcp").is_file()
    assert checkpoint.latest(folder) == folder / "step-3"


def test_rotation_keeps_newest_complete(tmp_path: Path) -> None:
    folder = tmp_path / "checkpoints"
    model, optimizer = build()
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    checkpointer = checkpoint.Checkpointer(folder, keep=2)
    for _ in range(4):
        train(model, optimizer, progress, 1)
        checkpointer.save(state(model, optimizer, progress))
    assert sorted(p.name for p in folder.iterdir()) == ["step-3", "step-4"]

    # An interrupted save (no marker) must not count as one of the kept two.
    make_dir(folder, "step-5", complete=False)
    train(model, optimizer, progress, 2)
    assert progress.batch == 6
    checkpointer.save(state(model, optimizer, progress))
    complete = sorted(p.name for p in folder.iterdir() if checkpoint.is_complete(p))
    assert complete == ["step-4", "step-6"]

    # keep=0 keeps everything.
    train(model, optimizer, progress, 1)
    checkpoint.Checkpointer(folder, keep=0).save(state(model, optimizer, progress))
    assert sorted(p.name for p in folder.iterdir() if checkpoint.is_complete(p)) == [
        "step-4",
        "step-6",
        "step-7",
    ]


def test_saving_a_step_again_is_a_noop_and_another_starts_save_replaces_it(
    saved: dict,
) -> None:
    """The Checkpointer that saved step 7 saving it again (the final save landing on a
    save_interval step) changes nothing. Another start at step 7 (a run restarted from an
    earlier checkpoint with --load_path, say after its loss diverged) replaces it: step-7
    holds the state this run had at step 7, not the older start's."""
    before = snapshot(saved["path"])
    model, optimizer, progress = saved["model"], saved["optimizer"], saved["progress"]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    changed = state(model, optimizer, progress, note=Note(note="changed"))
    again = saved["checkpointer"].save(changed)
    assert again == saved["path"]
    assert snapshot(saved["path"]) == before

    replaced = checkpoint.Checkpointer(saved["folder"]).save(changed)
    assert replaced == saved["path"] and checkpoint.is_complete(replaced)
    fresh, _ = build(seed=1)
    note = Note()
    checkpoint.load(replaced, state(fresh, note=note))
    assert note.values["note"] == "changed" and same_params(fresh, model)


# ---------------------------------------------------------------- load errors


def test_load_without_marker_names_the_path(saved: dict) -> None:
    (saved["path"] / MARKER).unlink()
    model, optimizer = build(seed=1)
    with pytest.raises(CheckpointError, match="not a complete checkpoint") as info:
        checkpoint.load(saved["path"], state(model, optimizer))
    assert str(saved["path"]) in str(info.value)
    with pytest.raises(CheckpointError, match="step-999"):
        checkpoint.load(saved["folder"] / "step-999", state(model, optimizer))


@pytest.mark.parametrize("keep_bytes", [0.5, 0.0])
def test_truncated_shard_raises_and_deletes_nothing(
    saved: dict, keep_bytes: float
) -> None:
    path = saved["path"]
    shard = sorted(path.glob("*.distcp"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: int(len(data) * keep_bytes)])
    before = snapshot(path)
    model, optimizer = build(seed=1)
    with pytest.raises(CheckpointError) as info:
        checkpoint.load(path, state(model, optimizer, Progress(BATCHES_PER_EPOCH)))
    message = str(info.value)
    assert str(path) in message and "Traceback" not in message
    assert len(message) < 2500
    assert snapshot(path) == before
    assert checkpoint.remove_incomplete(saved["folder"]) == []
    assert checkpoint.latest(saved["folder"]) == path


def test_missing_metadata_raises(saved: dict) -> None:
    (saved["path"] / ".metadata").unlink()
    model, optimizer = build(seed=1)
    with pytest.raises(CheckpointError, match=r"\.metadata"):
        checkpoint.load(saved["path"], state(model, optimizer))
    assert not same_params(model, saved["model"])


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        (
            {"hidden": 16},
            [
                "different shapes",
                "0.weight (saved [8, 4], model [16, 4])",
                "2.weight",
                "0.bias",
            ],
        ),
        ({"layers": 3}, ["missing from the checkpoint", "4.weight", "4.bias"]),
        (
            {"layers": 1},
            ["in the checkpoint but not in this model", "2.weight", "2.bias"],
        ),
    ],
    ids=["other-shapes", "checkpoint-lacks-keys", "model-lacks-keys"],
)
def test_other_model_names_the_mismatch(
    saved: dict, kwargs: dict, expected: list[str]
) -> None:
    for optimizer_too in (True, False):
        model, optimizer = build(seed=1, **kwargs)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        with pytest.raises(CheckpointError, match="different model") as info:
            checkpoint.load(
                saved["path"], state(model, optimizer if optimizer_too else None)
            )
        for text in expected:
            assert text in str(info.value)
        assert str(saved["path"]) in str(info.value)
        assert all(
            torch.equal(before[k], v) for k, v in model.state_dict().items()
        )  # nothing half-loaded


@pytest.mark.parametrize(
    "damage",
    [
        lambda text: text[: len(text) // 2],
        lambda text: "[]",
        lambda text: json.dumps(
            {k: v for k, v in json.loads(text).items() if k != "progress"}
        ),
        lambda text: json.dumps({**json.loads(text), "world_size": "one"}),
        lambda text: json.dumps(
            {
                **json.loads(text),
                "progress": {**json.loads(text)["progress"], "batch": -1},
            }
        ),
        lambda text: json.dumps({**json.loads(text), "progress": {"batch": 7}}),
    ],
    ids=[
        "truncated",
        "not-an-object",
        "no-progress",
        "bad-world-size",
        "negative-counter",
        "partial-progress",
    ],
)
def test_damaged_train_state_raises(saved: dict, damage) -> None:
    file = saved["path"] / TRAIN_STATE
    file.write_text(damage(file.read_text()))
    for progress in (Progress(batches_per_epoch=BATCHES_PER_EPOCH), None):
        model, optimizer = build(seed=1)
        with pytest.raises(CheckpointError, match=TRAIN_STATE):
            checkpoint.load(saved["path"], state(model, optimizer, progress))
        assert not same_params(
            model, saved["model"]
        )  # rejected before anything was restored
        if progress is not None:
            assert progress.batch == 0


def test_other_batches_per_epoch_raises_before_restoring(saved: dict) -> None:
    model, optimizer = build(seed=1)
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH + 1)
    with pytest.raises(CheckpointError, match="batches_per_epoch"):
        checkpoint.load(saved["path"], state(model, optimizer, progress))
    assert not same_params(model, saved["model"]) and progress.batch == 0


# ---------------------------------------------------------------- RNG across world sizes


def next_rand_after_load(
    path: Path, seed: int, noise: int
) -> tuple[torch.Tensor, bool]:
    model, optimizer = build(seed=1)
    torch.manual_seed(noise)  # a different RNG state before each load
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    resumed = checkpoint.load(path, state(model, optimizer, progress), seed=seed)
    return torch.rand(8), resumed.rng_restored


def test_other_world_size_reseeds_deterministically(saved: dict) -> None:
    file = saved["path"] / TRAIN_STATE
    file.write_text(json.dumps({**json.loads(file.read_text()), "world_size": 2}))
    first, restored_first = next_rand_after_load(saved["path"], seed=0, noise=1)
    second, restored_second = next_rand_after_load(saved["path"], seed=0, noise=2)
    other_seed, _ = next_rand_after_load(saved["path"], seed=1, noise=1)
    assert restored_first is False and restored_second is False
    assert torch.equal(first, second)
    assert not torch.equal(
        first, saved["next_rand"]
    )  # not the saved (other world size) state
    assert not torch.equal(first, other_seed)


def test_missing_rng_file_reseeds(saved: dict) -> None:
    (saved["path"] / "rng-rank0.pt").unlink()
    first, restored = next_rand_after_load(saved["path"], seed=0, noise=1)
    second, _ = next_rand_after_load(saved["path"], seed=0, noise=2)
    assert restored is False and torch.equal(first, second)


# ---------------------------------------------------------------- no pickle execution


class Boom:
    """Unpickling this runs code: a checkpoint must never do that."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def __reduce__(self):
        return (Path.touch, (Path(self.flag),))


def test_metadata_naming_other_classes_is_refused(saved: dict, tmp_path: Path) -> None:
    import pickle

    flag = tmp_path / "executed"
    metadata = saved["path"] / ".metadata"
    metadata.write_bytes(pickle.dumps(Boom(str(flag))))
    model, optimizer = build(seed=1)
    with pytest.raises(
        CheckpointError, match=r"\.metadata.*not allowed in checkpoint metadata"
    ):
        checkpoint.load(saved["path"], state(model, optimizer))
    with pytest.raises(CheckpointError, match="not allowed"):
        checkpoint.export_safetensors(saved["path"], tmp_path / "out.safetensors")
    assert not flag.exists()


def test_non_tensor_entries_load_with_weights_only(saved: dict, tmp_path: Path) -> None:
    """A pickled object among the optimizer's hyperparameters is refused, not executed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    flag = tmp_path / "executed"
    model, optimizer = saved["model"], saved["optimizer"]
    model_state, optimizer_state = get_state_dict(model, optimizer)
    optimizer_state["param_groups"][0]["lr"] = Boom(str(flag))
    evil = saved["folder"] / "step-8"
    dcp.save(
        {"model": model_state, "optimizer": optimizer_state},
        checkpoint_id=evil,
        no_dist=True,
    )
    for name in ("train_state.json", "COMPLETE"):
        (evil / name).write_bytes((saved["path"] / name).read_bytes())
    fresh, fresh_optimizer = build(seed=1)
    with pytest.raises(
        CheckpointError, match="__0_0.distcp is unreadable .*not plain data; refused"
    ):
        checkpoint.load(evil, state(fresh, fresh_optimizer))
    assert not flag.exists()


def test_truncated_shard_is_named(saved: dict) -> None:
    shard = sorted(saved["path"].glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    model, optimizer = build(seed=1)
    with pytest.raises(CheckpointError, match=f"{shard} is truncated"):
        checkpoint.load(saved["path"], state(model, optimizer))


# ---------------------------------------------------------------- async save


def test_async_save_copies_the_state_and_marks_after_writing(saved: dict) -> None:
    model, optimizer, progress = saved["model"], saved["optimizer"], saved["progress"]
    train(model, optimizer, progress, 1)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    checkpointer = checkpoint.Checkpointer(saved["folder"], keep=1, async_save=True)
    path = checkpointer.save(state(model, optimizer, progress))
    with torch.no_grad():  # training goes on at once: the checkpoint must not see this
        for p in model.parameters():
            p.add_(1.0)
    checkpointer.wait()
    assert checkpoint.is_complete(path) and path.name == "step-8"
    assert sorted(p.name for p in saved["folder"].iterdir()) == [
        "step-8"
    ]  # rotated after the marker
    fresh, _ = build(seed=1)
    checkpoint.load(path, state(fresh))
    assert all(torch.equal(expected[k], v) for k, v in fresh.state_dict().items())
    checkpointer.wait()  # nothing in flight: a no-op


def test_next_save_waits_for_async_save(saved: dict) -> None:
    model, optimizer, progress = saved["model"], saved["optimizer"], saved["progress"]
    checkpointer = checkpoint.Checkpointer(saved["folder"], async_save=True)
    for _ in range(2):
        train(model, optimizer, progress, 1)
        checkpointer.save(state(model, optimizer, progress))
    assert checkpoint.is_complete(
        saved["folder"] / "step-8"
    )  # waited for by the second save
    checkpointer.wait()
    assert checkpoint.latest(saved["folder"]) == saved["folder"] / "step-9"


# ---------------------------------------------------------------- resume and load_path


def fresh_resume(folder: Path, **kwargs):
    model, optimizer = build(seed=1)
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    checkpointer = checkpoint.Checkpointer(folder)
    resumed = checkpointer.resume(state(model, optimizer, progress), **kwargs)
    return resumed, model, optimizer, progress, checkpointer


def test_resume_autoresumes_and_cleans_up(saved: dict) -> None:
    make_dir(saved["folder"], "step-9", complete=False)
    resumed, model, _, progress, _ = fresh_resume(saved["folder"])
    assert resumed.path == saved["path"] and resumed.step == 7 and progress.batch == 7
    assert resumed.rng_restored and resumed.describe() == [
        f"resumed from {saved['path']} at step 7"
    ]
    assert not (saved["folder"] / "step-9").exists()
    assert same_params(model, saved["model"])
    assert fresh_resume(saved["folder"], autoresume=False)[0] is None
    assert fresh_resume(saved["folder"].parent / "empty")[0] is None


def test_resume_load_path_errors(saved: dict, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nowhere does not exist"):
        fresh_resume(tmp_path / "run", load_path=str(tmp_path / "nowhere"))
    make_dir(tmp_path / "half", "step-3", complete=False)
    with pytest.raises(CheckpointError, match="holds no complete checkpoint"):
        fresh_resume(tmp_path / "run", load_path=str(tmp_path / "half"))
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        fresh_resume(tmp_path / "run", load_path=str(tmp_path / "half" / "step-3"))
    assert (
        tmp_path / "half" / "step-3"
    ).is_dir()  # never deleted: not this run's folder


def garbage_header(step: Path) -> str:
    shard = sorted(step.glob("*.distcp"))[0]
    shard.write_bytes(b"\0" * 64 + shard.read_bytes()[64:])
    return f"{shard} is unreadable"


def truncated_shard(step: Path) -> str:
    shard = sorted(step.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    return f"{shard} is truncated"


def unreadable_train_state(step: Path) -> str:
    (step / TRAIN_STATE).write_text("{")
    return f"{step / TRAIN_STATE} is unreadable"


@pytest.mark.parametrize(
    "damage", [garbage_header, truncated_shard, unreadable_train_state]
)
def test_a_damaged_newest_checkpoint_falls_back_when_resuming_on_its_own(
    saved: dict, damage
) -> None:
    """Autoresume: one note names the damaged newest checkpoint and why, the previous one
    is loaded (the model exactly as saved), the damaged one is kept until this run saves
    its step again, which replaces it. Named as load_path, it is refused."""
    folder, model, optimizer, progress = (
        saved[k] for k in ("folder", "model", "optimizer", "progress")
    )
    at_7 = {k: v.clone() for k, v in model.state_dict().items()}
    train(model, optimizer, progress, 2)
    newest = checkpoint.Checkpointer(folder).save(state(model, optimizer, progress))
    why = damage(newest)
    damaged = snapshot(newest)

    resumed, again, again_optimizer, again_progress, checkpointer = fresh_resume(folder)
    assert resumed.step == 7 and again_progress.batch == 7
    assert all(torch.equal(again.state_dict()[k], v) for k, v in at_7.items())
    first, last = resumed.describe()
    assert first.startswith(f"skipped the damaged checkpoint {newest} ({why}")
    assert "the damaged one is kept" in first
    assert last == f"resumed from {saved['path']} at step 7"
    assert layout_complete(newest) and snapshot(newest) == damaged

    with pytest.raises(CheckpointError, match="load_path") as refused:
        fresh_resume(folder.parent / "other", load_path=str(newest))
    assert why in str(refused.value)

    train(again, again_optimizer, again_progress, 2)
    assert checkpointer.save(state(again, again_optimizer, again_progress)) == newest
    assert snapshot(newest) != damaged
    resumed, *_ = fresh_resume(folder)
    assert resumed.describe() == [f"resumed from {newest} at step 9"]


def test_every_checkpoint_damaged_is_an_error(saved: dict) -> None:
    why = garbage_header(saved["path"])
    with pytest.raises(CheckpointError, match="damaged") as raised:
        fresh_resume(saved["folder"])
    assert why in str(raised.value)
    assert layout_complete(saved["path"])


def layout_complete(step: Path) -> bool:
    return (step / MARKER).is_file()


def test_load_path_weights_only_then_restart_continues(
    saved: dict, tmp_path: Path
) -> None:
    """A fine-tune starts from load_path; restarted after a preemption it continues itself."""
    run_dir = tmp_path / "finetune"
    for source in (
        saved["path"],
        saved["folder"],
        saved["folder"].parent,
    ):  # step, checkpoints, run
        resumed, model, optimizer, progress, checkpointer = fresh_resume(
            run_dir, load_path=str(source), weights_only=True
        )
        assert resumed.path == saved["path"] and resumed.weights_only
        assert (
            same_params(model, saved["model"])
            and progress.batch == 0
            and not optimizer.state
        )
        assert resumed.describe()[-1].startswith("loaded model weights from")
    train(model, optimizer, progress, 2)
    checkpointer.save(state(model, optimizer, progress))  # records where it started
    # The same command again: this run's own checkpoint, not the weights it started from.
    resumed, again, _, progress, _ = fresh_resume(
        run_dir, load_path=str(saved["folder"].parent), weights_only=True
    )
    assert (
        resumed.path == run_dir / "step-2"
        and progress.batch == 2
        and not resumed.weights_only
    )
    assert "continuing this run" in resumed.describe()[0]
    assert same_params(again, model)
    # Another load_path is a new start: it takes precedence over the run's own checkpoint.
    other = tmp_path / "other"
    shutil.copytree(saved["path"], other / "step-7")
    resumed, *_ = fresh_resume(run_dir, load_path=str(other))
    assert (
        resumed.path == other / "step-7" and "takes precedence" in resumed.describe()[0]
    )


# ---------------------------------------------------------------- export


def test_export_safetensors_with_tied_weights(tmp_path: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    def tied() -> nn.Module:
        model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 10, bias=False))
        model[1].weight = model[0].weight
        return model

    torch.manual_seed(0)
    model = tied()
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    progress.advance(samples=1, tokens=2)
    checkpointer = checkpoint.Checkpointer(tmp_path / "run" / "checkpoints")
    checkpointer.save(state(model, optimizer, progress))
    info = checkpoint.export_safetensors(
        tmp_path / "run", tmp_path / "model.safetensors"
    )
    assert info["step"] == 1 and info["tensors"] == 2
    weights = load_file(tmp_path / "model.safetensors")
    assert sorted(weights) == [
        "0.weight",
        "1.weight",
    ]  # the tied weight under both names
    torch.manual_seed(1)
    other = tied()
    other.load_state_dict(weights)  # strict: every key present
    assert other[1].weight is other[0].weight and torch.equal(
        other[0].weight, model[0].weight
    )
    with safe_open(tmp_path / "model.safetensors", "pt") as handle:
        assert handle.metadata()["step"] == "1"
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.export_safetensors(tmp_path / "nowhere", tmp_path / "x.safetensors")


# ---------------------------------------------------------------- the Checkpointer object


def test_checkpointers_share_no_save_in_flight_and_no_origin(
    saved: dict, tmp_path: Path
) -> None:
    """Two runs in one process: run A started from a load_path and saves asynchronously (its
    write fails), run B is fresh and saves synchronously. B neither waits for nor inherits
    A's failed save, and B's checkpoint does not claim A's origin."""
    a = checkpoint.Checkpointer(tmp_path / "a", async_save=True)
    model, optimizer = build(seed=1)
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    assert a.resume(state(model, optimizer, progress), load_path=str(saved["path"]))
    b = checkpoint.Checkpointer(tmp_path / "b")
    (tmp_path / "a" / "step-7" / ".metadata.tmp").mkdir(
        parents=True
    )  # A's write fails here
    a.save(state(model, optimizer, progress))
    b_path = b.save(state(model, optimizer, progress))
    assert checkpoint.is_complete(b_path)
    assert json.loads((b_path / TRAIN_STATE).read_text())["origin"] is None
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint step-7 was not saved to .*a/step-7: "
        r"Is a directory \[errno 21\] .*\.metadata\.tmp.*a rerun resumes from .*checkpoints/step-7$",
    ):
        a.wait()
    assert not checkpoint.is_complete(tmp_path / "a" / "step-7")
    a.close()  # nothing left in flight


def test_checkpoint_modules_hold_no_mutable_state() -> None:
    """No `global` rebinding and no module-level value that can change (constants only)."""
    import ast
    import inspect
    import pkgutil
    import re
    import types

    from runtime import dist

    immutable = (
        int,
        float,
        str,
        bytes,
        type(None),
        re.Pattern,
        type,
        types.ModuleType,
        types.FunctionType,
        types.BuiltinFunctionType,
    )

    def frozen(value: object) -> bool:
        if isinstance(value, (tuple, frozenset)):
            return all(frozen(item) for item in value)
        return isinstance(value, immutable) or type(value).__module__ in (
            "typing",
            "__future__",
        )

    names = [
        f"{checkpoint.__name__}.{info.name}"
        for info in pkgutil.iter_modules(getattr(checkpoint, "__path__", []))
    ]
    modules = [checkpoint, dist, *(__import__(name, fromlist=["_"]) for name in names)]
    assert len(modules) >= 6, names  # the package's modules were found
    for module in modules:
        tree = ast.parse(inspect.getsource(module))
        assert not [
            node for node in ast.walk(tree) if isinstance(node, ast.Global)
        ], module.__name__
        mutable = [
            name
            for name, value in vars(module).items()
            if not name.startswith("__") and not frozen(value)
        ]
        assert not mutable, f"{module.__name__}: {mutable}"


class Counter:
    """Not a module or an optimizer: anything with state_dict() and load_state_dict()."""

    def __init__(self) -> None:
        self.count, self.label = torch.zeros(2), ""

    def state_dict(self) -> dict:
        return {"count": self.count, "label": self.label}

    def load_state_dict(self, state_dict: dict) -> None:
        self.count, self.label = state_dict["count"], state_dict["label"]


def full_state(seed: int) -> dict:
    model, optimizer = build(seed=seed)
    ema, _ = build(seed=seed + 10)  # as an EMA of the model would be: a second module
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return {
        "model": model,
        "optimizer": optimizer,
        "ema": ema,
        "scheduler": scheduler,
        "counter": Counter(),
        "progress": Progress(BATCHES_PER_EPOCH),
    }


def test_extra_state_entries_are_saved_and_resumed(tmp_path: Path) -> None:
    saved = full_state(seed=0)
    for _ in range(3):
        train(saved["model"], saved["optimizer"], saved["progress"], 1)
        saved["scheduler"].step()
    saved["counter"].count += torch.tensor([1.0, 2.0])
    saved["counter"].label = "three steps"
    path = checkpoint.Checkpointer(tmp_path).save(saved)
    # The schedule's plain state is in train_state.json; the counter's tensor in DCP.
    train_state = json.loads((path / TRAIN_STATE).read_text())
    assert train_state["scheduler"] == saved["scheduler"].state_dict()
    assert "counter" not in train_state

    loaded = full_state(seed=1)
    resumed = checkpoint.Checkpointer(tmp_path).resume(loaded)
    assert resumed.path == path and resumed.step == 3 and loaded["progress"].batch == 3
    assert same_params(loaded["ema"], saved["ema"]) and same_params(
        loaded["model"], saved["model"]
    )
    assert loaded["scheduler"].state_dict() == saved["scheduler"].state_dict()
    assert (
        loaded["optimizer"].param_groups[0]["lr"]
        == saved["optimizer"].param_groups[0]["lr"]
        == 5e-3
    )
    assert torch.equal(loaded["counter"].count, torch.tensor([1.0, 2.0]))
    assert loaded["counter"].label == "three steps"

    # Weights only (a fine-tune): every module's weights, nothing else.
    fine_tune = full_state(seed=1)
    checkpoint.Checkpointer(tmp_path / "ft").resume(
        fine_tune, load_path=str(path), weights_only=True
    )
    assert (
        same_params(fine_tune["ema"], saved["ema"]) and not fine_tune["optimizer"].state
    )
    assert fine_tune["scheduler"].last_epoch == 0 and fine_tune["counter"].label == ""
    assert fine_tune["progress"].batch == 0

    # A checkpoint saved without the EMA entry cannot fill it: named, nothing restored.
    plain = state(saved["model"], saved["optimizer"], saved["progress"])
    checkpoint.Checkpointer(tmp_path / "plain").save(plain)
    later = full_state(seed=1)
    with pytest.raises(
        CheckpointError,
        match=r"step-3 holds no ema, scheduler, "
        r"counter \(it holds model, optimizer, progress\)",
    ):
        checkpoint.load(tmp_path / "plain" / "step-3", later)
    assert not same_params(later["model"], saved["model"])
    assert later["progress"].batch == 0
    # An entry with nothing to restore (an empty state dict) is not required.
    checkpoint.load(tmp_path / "plain" / "step-3", {**plain, "note": Note()})


def test_state_entries_that_cannot_be_saved_are_named(tmp_path: Path) -> None:
    model, optimizer = build()
    checkpointer = checkpoint.Checkpointer(tmp_path)
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    with pytest.raises(TypeError, match=r"state\['step'\] is a int"):
        checkpointer.save({"model": model, "step": 3, "progress": progress})
    with pytest.raises(
        TypeError, match=r"state\['optimizer'\] optimizes parameters of no module"
    ):
        checkpointer.save({"optimizer": optimizer, "progress": progress})
    with pytest.raises(TypeError, match=r"state\['origin'\]: train_state.json keeps"):
        checkpointer.save({"model": model, "progress": progress, "origin": Note()})
    # The progress names the checkpoint (step-N) and is recorded in train_state.json.
    with pytest.raises(ValueError, match=r"no 'progress' entry \(it has model\)"):
        checkpointer.save({"model": model})
    with pytest.raises(TypeError, match=r"'progress'\] is a dict, not a runtime.time"):
        checkpointer.save({"model": model, "progress": progress.state_dict()})
    assert not tmp_path.joinpath("step-0").exists()


@pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_writer_thread_that_fails_fails_the_save(
    saved: dict,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture,
    async_save: bool,
) -> None:
    """torch's extra DCP writer threads die with a printed traceback and their files are left
    out of the save (torch 2.13). Ours report the error: the save fails with one line naming
    the cause, prints no traceback, and is never marked complete (nor rotates a good one out).
    """
    import threading

    from torch.distributed.checkpoint import filesystem

    write = filesystem._write_files_from_queue
    took = threading.Event()

    def disk_full_in_extra_thread(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if threading.current_thread().name == "checkpoint-writer-1":  # the 2nd writer
            kwargs[
                "file_queue"
            ].get()  # takes a file's items off the queue, writes nothing
            took.set()
            raise OSError(28, "No space left on device")
        took.wait(10)
        return write(*args, **kwargs)

    monkeypatch.setattr(
        filesystem, "_write_files_from_queue", disk_full_in_extra_thread
    )
    model, optimizer, progress = saved["model"], saved["optimizer"], saved["progress"]
    train(model, optimizer, progress, 1)
    checkpointer = checkpoint.Checkpointer(
        saved["folder"], keep=1, async_save=async_save
    )
    with pytest.raises(checkpoint.StorageError) as raised:
        checkpointer.save(state(model, optimizer, progress))
        checkpointer.wait()
    assert took.is_set()
    assert str(raised.value) == (
        f"checkpoint step-8 was not saved to {saved['folder'] / 'step-8'}: No space "
        f"left on device [errno 28]; the checkpoints before it are intact: a rerun "
        f"resumes from {saved['path']}"
    )
    assert "Traceback" not in capfd.readouterr().err
    assert not checkpoint.is_complete(saved["folder"] / "step-8")
    assert checkpoint.latest(saved["folder"]) == saved["path"]  # step-7 kept


# ---------------------------------------------------------------- older checkpoints

REPO = Path(__file__).resolve().parent.parent
RELEASE_0_2_0 = "e505f85f8df8c7d945cd7d7096dac869c9ada644"  # main before this format
ONE_PROCESS = DistEnv(
    rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu")
)
# Trains 4 steps with 0.2.0's runtime and saves as its train.py did: the microbatch
# search's and the early stopper's state merged into `extra`. OOMs above 2 samples.
SAVE_0_2_0 = """
import sys
from pathlib import Path

import torch
from torch import nn

from runtime import checkpoint, early_stop, microbatch
from runtime.dist import DistEnv
from runtime.time import Progress, Time

out = Path(sys.argv[1])
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
progress = Progress(batches_per_epoch=3)
env = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
              device=torch.device("cpu"))
search = microbatch.Search(model, [model[0]], env, "auto", per_rank_batch=8)
stopper = early_stop.EarlyStopper("val_loss", Time.parse("2ba"))
for val_loss in (2.0, 1.0, 1.5, 1.5):  # best at step 2; 2 steps later (step 4) it stops
    for attempt in search.attempts(seq_len=16):
        with attempt:
            for micro in torch.randn(8, 4).split(attempt.size):
                if attempt.size > 2:
                    raise torch.OutOfMemoryError("injected")
                model(micro).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    progress.advance(samples=8, tokens=128)
    stopper.update(progress, {"val_loss": val_loss}, Time.parse("100ba"))
assert search.size == 2 and stopper.stopped
checkpointer = checkpoint.Checkpointer(out / "checkpoints")
checkpointer.save({"model": model, "optimizer": optimizer}, progress,
                  extra=search.state_dict() | stopper.state_dict())
saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
torch.save(saved, out / "saved.pt")
"""


def runtime_of(commit: str, dest: Path) -> Path:
    """The runtime package of a past commit of this repository, in `dest`."""
    found = subprocess.run(
        ["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True
    )
    if found.returncode != 0:
        pytest.skip(f"this checkout's git history lacks commit {commit[:7]} (shallow?)")
    dest.mkdir()
    archive = subprocess.run(
        ["git", "archive", "--format=tar", commit, "runtime"],
        cwd=REPO,
        capture_output=True,
        check=True,
    )
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return dest


def test_a_0_2_0_checkpoint_resumes_with_every_entry(tmp_path: Path) -> None:
    """Written by 0.2.0's own runtime (from this repository's history): the model,
    optimizer, progress, microbatch size found and early stopper's state come back."""
    from runtime import early_stop, microbatch
    from runtime.time import Time

    old = runtime_of(RELEASE_0_2_0, tmp_path / "runtime-0.2.0")
    run = subprocess.run(
        [sys.executable, "-c", SAVE_0_2_0, str(tmp_path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(old)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    step = tmp_path / "checkpoints" / "step-4"
    assert json.loads((step / TRAIN_STATE).read_text())["extra"] == {
        "microbatch_size": 2,
        "microbatch_seq_len": 16,
        "microbatch_world_size": 1,
        "early_stop": {"best": 1.0, "best_step": 2, "best_at": 2, "stopped": True},
    }

    def fresh() -> tuple[dict, list[str]]:
        torch.manual_seed(1)  # other initial weights
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
        lines: list[str] = []
        search = microbatch.Search(
            model, [model[0]], ONE_PROCESS, "auto", per_rank_batch=8, log=lines.append
        )
        patience = Time.parse("2ba")
        stopper = early_stop.EarlyStopper("val_loss", patience, log=lines.append)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return {
            "model": model,
            "optimizer": optimizer,
            "progress": Progress(3),
            "microbatch": search,
            "stopper": stopper,
        }, lines

    state, lines = fresh()
    resumed = checkpoint.Checkpointer(tmp_path / "checkpoints").resume(state)
    assert resumed is not None and resumed.step == 4 and resumed.rng_restored
    saved = torch.load(tmp_path / "saved.pt", weights_only=True)
    model_state = state["model"].state_dict()
    assert all(torch.equal(saved["model"][k], model_state[k]) for k in model_state)
    optimizer_state = state["optimizer"].state_dict()["state"]
    for index, expected in saved["optimizer"]["state"].items():
        assert all(
            torch.equal(value, optimizer_state[index][k])
            for k, value in expected.items()
        )
    assert state["progress"].state_dict() == {
        "batches_per_epoch": 3,
        "epoch": 1,
        "batch": 4,
        "sample": 32,
        "token": 512,
        "batch_in_epoch": 1,
        "previous_epoch": 1,
        "previous_batch": 3,
        "previous_sample": 24,
        "previous_token": 384,
    }
    search, stopper = state["microbatch"], state["stopper"]
    assert (search.size, search.settled_len) == (2, 16)
    assert [a.searching for a in search.attempts(seq_len=16)] == [False]  # no search
    assert stopper.stopped
    assert (stopper.best, stopper.best_step, stopper.best_at) == (1.0, 2, 2)
    assert "microbatch size: 2 (found before, from the checkpoint)" in lines
    assert "nothing to train" in lines[-1]

    # Saved again, in this release's format (no `extra`); that resumes the same way.
    state["progress"].advance(samples=8, tokens=128)
    path = checkpoint.Checkpointer(tmp_path / "checkpoints").save(state)
    train_state = json.loads((path / TRAIN_STATE).read_text())
    assert "extra" not in train_state
    assert train_state["microbatch"]["microbatch_size"] == 2 and train_state["stopper"]
    again, lines = fresh()
    assert checkpoint.Checkpointer(tmp_path / "checkpoints").resume(again).step == 5
    assert again["microbatch"].size == 2 and again["stopper"].stopped


def test_an_entry_a_0_2_0_checkpoint_lacks_and_its_extra_cannot_restore_is_named(
    saved: dict, tmp_path: Path
) -> None:
    """A newer entry (here: strict about its keys) is handed 0.2.0's `extra` too."""
    file = saved["path"] / TRAIN_STATE
    legacy = {**json.loads(file.read_text()), "extra": {"microbatch_size": 2}}
    file.write_text(json.dumps(legacy))
    model, optimizer = build(seed=1)
    with pytest.raises(
        CheckpointError,
        match=r"step-7 \(saved by scaffold 0.2.0 or "
        r"before\) holds no counter, and its extra state does not "
        r"restore it \(KeyError",
    ):
        checkpoint.load(saved["path"], state(model, optimizer, counter=Counter()))


def test_0_1_0_module_functions_save_and_resume(tmp_path: Path) -> None:
    """A 0.1.0 project's calls (until `scaffold upgrade`): its `extra` (the microbatch
    search's state) is kept where 0.2.0 kept it; after the upgrade, the search's."""
    from runtime import microbatch

    found = {"microbatch_size": 2, "microbatch_seq_len": 16, "microbatch_world_size": 1}
    model, optimizer = build()
    progress = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    train(model, optimizer, progress, 3)
    path = checkpoint.save(tmp_path, model, optimizer, progress, extra=found, keep=1)
    assert path == tmp_path / "step-3"
    assert json.loads((path / TRAIN_STATE).read_text())["extra"] == found
    checkpoint.wait()

    fresh, fresh_optimizer = build(seed=1)
    again = Progress(batches_per_epoch=BATCHES_PER_EPOCH)
    with pytest.warns(FutureWarning, match="scaffold upgrade"):
        resumed = checkpoint.resume(tmp_path, fresh, fresh_optimizer, again)
    assert resumed.step == 3 and again.batch == 3 and resumed.extra == found
    assert same_params(fresh, model)
    assert resumed.describe() == [f"resumed from {path} at step 3"]
    # 0.1.0's train.py hands the extra to the search's constructor.
    search = microbatch.Search(
        fresh,
        [fresh[0]],
        ONE_PROCESS,
        "auto",
        per_rank_batch=8,
        resumed=resumed.extra,
        log=lambda line: None,
    )
    assert (search.size, search.settled_len) == (2, 16)

    upgraded, upgraded_optimizer = build(seed=1)
    search = microbatch.Search(
        upgraded,
        [upgraded[0]],
        ONE_PROCESS,
        "auto",
        per_rank_batch=8,
        log=lambda line: None,
    )
    state = {
        "model": upgraded,
        "optimizer": upgraded_optimizer,
        "search": search,
        "progress": Progress(batches_per_epoch=BATCHES_PER_EPOCH),
    }
    assert checkpoint.Checkpointer(tmp_path).resume(state).step == 3
    assert (search.size, search.settled_len) == (2, 16)
