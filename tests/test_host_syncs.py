"""No host sync in a training step that does not log, in every recipe (DESIGN.md §4.8).

A step that does not log queues its work on the device and goes on: nothing in it reads a
device value (a loss, a norm, a count), copies one to the host, asks the device for an output
size (`nonzero`, a boolean mask) or copies to the device in a way that waits. Each recipe
trains here in this process, on the CPU, under `host_syncs.HostSyncs`, which knows which
tensors would be on a GPU and counts what would wait for it there. Logging steps may sync
(that is what `log_interval` is for): the counted steps log, evaluate and save nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import RECIPES
from host_syncs import HostSyncs, training_syncs

PROJECT_MODULES = ("train", "model", "data", "sample")
QUIET = [  # nothing logged, evaluated or saved in the steps run
    "--max_duration=100ba",
    "--log_interval=100ba",
    "--eval_interval=100ba",
    "--save_interval=100ba",
    "--autoresume=false",
    "--run_name=syncs",
]


def smoke_settings(project: Path, workdir: Path) -> list[str]:
    """The project's own small CPU settings (tests/test_smoke.py's SMALL and data)."""
    spec = importlib.util.spec_from_file_location(
        f"smoke_{project.parent.name}", project / "tests" / "test_smoke.py"
    )
    smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(smoke)
    settings = list(smoke.SMALL)
    if hasattr(smoke, "toy_data"):
        settings.append(f"--data={smoke.toy_data(workdir)}")
    return settings


def small_data(recipe: str, workdir: Path) -> list[str]:
    """Data that loads in a moment where the default takes seconds (the standard
    library's source, the digits and a classifier trained on them)."""
    if recipe.startswith("gpt2"):
        text = workdir / "corpus.txt"
        text.write_text(Path(json.__file__).read_text() * 4)
        return [f"--data={text}"]
    if recipe.startswith("sd"):
        (workdir / "img").mkdir()
        rows = []
        for i in range(12):
            pixels = np.full((16, 16, 3), 40 + 16 * i, np.uint8)
            Image.fromarray(pixels).save(workdir / "img" / f"{i}.png")
            rows.append({"file": f"img/{i}.png", "caption": f"a square, shade {i}"})
        data = workdir / "captions.jsonl"
        data.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return [f"--data={data}", "--tiny_vae_steps=1", "--global_batch_size=4"]
    return []


@contextmanager
def fresh_modules() -> Iterator[None]:
    """The project's modules imported anew, and forgotten afterwards."""
    saved = {n: sys.modules.pop(n) for n in PROJECT_MODULES if n in sys.modules}
    try:
        yield
    finally:
        for name in PROJECT_MODULES:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def overridden(settings: list[str], overrides: list[str]) -> list[str]:
    keys = {arg.split("=")[0] for arg in overrides}
    return [arg for arg in settings if arg.split("=")[0] not in keys] + overrides


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_step_that_does_not_log_never_waits_for_the_device(
    recipe: str, generated: dict[str, Path], tmp_path: Path
) -> None:
    project = generated[recipe]
    settings = smoke_settings(project, tmp_path)
    args = overridden(settings, [*small_data(recipe, tmp_path), *QUIET])
    cwd = Path.cwd()
    os.chdir(tmp_path)  # runs/ lands here
    try:
        with fresh_modules():
            events = training_syncs(project / "train.py", *args)
    finally:
        os.chdir(cwd)
    assert events == [], "\n".join(events)


# ------------------------------------------------------------------ the counter itself


def test_the_counter_counts_what_waits_for_a_gpu_and_nothing_else() -> None:
    device = torch.device("cpu")  # the run's device, as train.py names it
    with HostSyncs() as syncs:
        x = torch.randn(4, 3).to(device, non_blocking=True)  # a batch on the device
        host = torch.arange(4)
        syncs.counting = True
        y = (x * 2).sum(1)  # device work: queued
        host.tolist(), int(host.sum()), host[host > 1]  # host values: free
        assert syncs.events == []
        y.sum().item()
        bool(y[0] > 0)
        y.tolist()
        y.cpu()
        x[x > 0]
        x[y > 0] = 0.0
        y.nonzero()
        torch.tensor([1.0], device=device)
        host.to(device)
        torch.repeat_interleave(torch.ones(2, dtype=torch.long, device=device))
        kept = torch.repeat_interleave(
            torch.ones(2, dtype=torch.long, device=device), output_size=2
        )
        torch.nn.functional.one_hot(kept, 3)  # only the CPU's kernel checks the range
        torch.zeros(3, device=device).nonzero_static(size=2)  # a size from the host
    kinds = [event.split(": ", 1)[1] for event in syncs.events]
    assert kinds == [
        ".item() of a device tensor",
        ".__bool__() of a device tensor",
        ".tolist() of a device tensor",
        "a copy to the host",
        "aten.index with a boolean mask",
        "aten.index_put_ with a boolean mask",
        "aten.nonzero",
        "tensor(data, device=...): a blocking copy",
        ".to(device) without non_blocking=True: a blocking copy",
        "aten.repeat_interleave without output_size",
    ]
    assert all(event.startswith("test_host_syncs.py:") for event in syncs.events)


def test_to_device_moves_a_batch_class_and_leaves_host_data() -> None:
    """dist.to_device copies tensors without waiting, lets an object with a `to` of its
    own (masked_lm's Batch, which keeps its marks on the host) move itself, and leaves
    host data (numbers, numpy arrays) where it is."""
    from runtime import dist

    class Marked:
        def __init__(self, where: str) -> None:
            self.where = where

        def to(self, device: torch.device) -> Marked:
            return Marked(str(device))

    device = torch.device("cpu")
    rows, marked, count, array = np.arange(3), Marked("host"), 7, np.zeros(2)
    with HostSyncs() as syncs:
        syncs.counting = True
        moved = dist.to_device(
            {"ids": torch.arange(3), "batch": [marked, count, array]}, device
        )
    assert syncs.events == []  # the copies queue, nothing waits
    assert moved["batch"][0].where == "cpu" and marked.where == "host"
    assert moved["batch"][1] == count and moved["batch"][2] is array
    assert torch.equal(moved["ids"], torch.from_numpy(rows))


def test_gradients_and_optimizer_state_are_device_tensors() -> None:
    device = torch.device("cpu")
    with HostSyncs() as syncs:
        model = torch.nn.Linear(3, 1).to(device)
        optimizer = torch.optim.AdamW(model.parameters())
        for _ in range(2):
            model(torch.randn(2, 3).to(device, non_blocking=True)).sum().backward()
            syncs.counting = True  # from the second step on
            optimizer.step()  # the CPU's AdamW reads its step counts: host tensors
        syncs.counting = True
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        exp_avg = optimizer.state[model.weight]["exp_avg"]
        assert syncs.events == []
        float(norm), float(exp_avg.sum())
    assert len(syncs.events) == 2
