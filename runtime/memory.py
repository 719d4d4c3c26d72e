"""CUDA memory snapshots: the allocator's history of every allocation and free, for
https://pytorch.org/memory_viz (the `memory_snapshot` and `oom_observer` catalog entries).

`torch.cuda.memory._record_memory_history` records each allocation's size, address and
stack; `torch.cuda.memory._snapshot()` returns the record, written here as a pickle (drop
it on pytorch.org/memory_viz) and an HTML timeline (`torch.cuda._memory_viz.trace_plot`).
CUDA only: `check` refuses any other device before a run starts.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import torch

# Allocation events kept (the newest ones), as Composer's default.
MAX_ENTRIES = 100_000


def check(name: str, device: torch.device) -> str | None:
    """The one-line refusal of a CUDA-only entry on another device, or None."""
    if device.type == "cuda":
        return None
    return (
        f"{name} records the CUDA allocator's memory history, but this run is on "
        f"{device.type}; run it on a GPU (--device=cuda) or remove it "
        f"(scaffold remove {name})"
    )


def snapshot_due(batch: int, start: int, steps: int) -> str:
    """What memory_snapshot does now, `batch` steps done: "record" (before step
    start+1), "write" (after step start+steps), else "". A run resumed inside the
    window records nothing (the history of its first steps is gone)."""
    return "record" if batch == start else "write" if batch == start + steps else ""


def record(max_entries: int = MAX_ENTRIES) -> None:
    """Start recording every allocation and free (with its stack) on this process's GPU."""
    torch.cuda.memory._record_memory_history("all", max_entries=max_entries)


def stop() -> None:
    torch.cuda.memory._record_memory_history(None)


def write(path: Path) -> list[Path]:
    """The recorded history as `path`.pickle and `path`.html; [] if nothing was
    recorded (trace_plot refuses an empty history)."""
    snapshot = torch.cuda.memory._snapshot()
    if all(len(trace) == 0 for trace in snapshot["device_traces"]):
        return []
    path.parent.mkdir(parents=True, exist_ok=True)
    pickled, html = path.with_name(path.name + ".pickle"), path.with_name(
        path.name + ".html"
    )
    with open(pickled, "wb") as file:
        pickle.dump(snapshot, file)
    html.write_text(torch.cuda._memory_viz.trace_plot(snapshot))
    return [pickled, html]


def observe_out_of_memory(path: Callable[[], Path], log: Callable[[str], None]) -> None:
    """Record the allocator's history from now on and, when an allocation is about to
    fail with out-of-memory (before anything is freed), write it to `path()` (called
    then: it can name the step). Auto-microbatching's retries count as out-of-memory
    too: each writes its snapshot (the step's last one stays)."""

    def observer(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        written = ", ".join(map(str, write(path()))) or "nothing recorded"
        log(
            f"out of memory on cuda:{device} ({alloc:,} bytes asked); snapshot: {written}"
        )

    record()
    torch._C._cuda_attach_out_of_memory_observer(observer)
