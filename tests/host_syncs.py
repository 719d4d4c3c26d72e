"""Host syncs counted on the CPU: what would make the host wait for a CUDA device.

`torch.cuda.set_sync_debug_mode` reports syncs only on a GPU. On the CPU every tensor is on
the host, so `HostSyncs` tracks which tensors *would* be on the device: what `.to(device)`
returns (a batch, the model's parameters and buffers), tensors made with a `device=`
argument other than the string "cpu", and everything computed from them, autograd's
gradients and optimizer states included. On such a tensor it counts:

- a read into Python: `.item()`, `bool()`, `int()`, `float()` (a branch on a device
  value), `.tolist()`, `.numpy()`, printing it;
- a copy to the host: `.cpu()`, `.to("cpu")`, `host.copy_(device_tensor)`;
- an op whose output size depends on the values (the device must report them): `nonzero`,
  `masked_select`, indexing or assigning through a boolean mask, `unique`, `bincount`,
  `repeat_interleave` without `output_size`, `one_hot` without `num_classes`, `equal`;

and a blocking copy to the device (`.to(device)` without `non_blocking=True`,
`torch.tensor(..., device=device)`), which CUDA performs as a copy then a stream sync.
What a CPU-only path keeps on the host stays a host tensor (AdamW's step counts without
`fused`, a gloo flag), so reading it counts nothing, as on CUDA; `one_hot`'s range checks,
which only the CPU runs, are not counted either. A `torch.device` object is taken for the
run's device and the string "cpu" for the host: code that means the host writes "cpu" or
`.cpu()`.

    with HostSyncs() as syncs:
        ...                   # build, move to the device, warm up
        syncs.counting = True
        ...                   # the steps that must not sync
        syncs.counting = False
    syncs.events              # ["model.py:88 in forward: aten.nonzero", ...]
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
TORCH_DIR = str(Path(torch.__file__).parent)
THIS_FILE = str(Path(__file__).resolve())
TAG = "_host_syncs_on_device"  # the attribute that marks a device tensor

# Reads of a tensor's values into Python.
READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.__complex__,
    torch.Tensor.__array__,
    torch.Tensor.__repr__,
    torch.Tensor.__format__,
}
MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
# Ops that copy Python data into a new tensor (a host-to-device copy when on the device).
FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray, torch.Tensor.new_tensor}
# Checks only the CPU's kernels make (CUDA's skip them): not counted.
CPU_ONLY_CHECKS = {F.one_hot}
# Ops that wait for the device whatever their arguments.
ALWAYS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.nonzero.out,
    aten.masked_select.default,
    aten.masked_select.out,
    aten._unique.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.equal.default,
}
MASK_INDEXED = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
COPIES = {aten.copy_.default, aten._foreach_copy_.default}


def on_device(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and TAG in value.__dict__


def mark(value: Any) -> None:
    if isinstance(value, torch.Tensor):
        value.__dict__[TAG] = True
    elif isinstance(value, (list, tuple)):
        for item in value:
            mark(item)


def tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    """The tensor arguments of an aten op (they come alone or in lists)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def where() -> str:
    """The innermost caller outside torch and this file: `file.py:LINE in FUNCTION`."""
    frame = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(TORCH_DIR) and filename != THIS_FILE:
            return f"{Path(filename).name}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "?"


def target(args: tuple, kwargs: dict) -> str | None:
    """Where a `.to(...)` or a factory puts its result: "host", "device" or None (not said)."""
    for value in (*args, kwargs.get("device")):
        if isinstance(value, str):
            return "host" if value.split(":")[0] == "cpu" else "device"
        if isinstance(value, torch.device) or (
            isinstance(value, int) and not isinstance(value, bool) and value >= 0
        ):
            return "device"
    return None


class HostSyncs:
    """Tracks device tensors from `__enter__` on; records syncs while `counting`."""

    def __init__(self) -> None:
        self.counting = False
        self.events: list[str] = []
        self._quiet = 0  # > 0: inside a counted read or a CPU-only check
        self._modes = (_Functions(self), _Dispatch(self))

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def record(self, what: str) -> None:
        if self.counting and not self._quiet:
            self.events.append(f"{where()}: {what}")

    @contextmanager
    def quiet(self) -> Iterator[None]:
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A copy of `tensor` that is not marked as on the device (on CUDA, `.cpu()` and
    `.to(device)` return another tensor; on the CPU, the same one)."""
    with torch.no_grad():
        copy = torch.empty_like(tensor).copy_(tensor)
    copy.__dict__.pop(TAG, None)
    return copy.requires_grad_(tensor.requires_grad)


class _Functions(TorchFunctionMode):
    """Python-level calls: reads, copies between host and device, factories."""

    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        syncs = self.syncs
        if func in READS:
            if on_device(args[0]):
                syncs.record(f".{func.__name__}() of a device tensor")
            with syncs.quiet():
                return func(*args, **kwargs)
        if func in MOVES:
            return self._move(func, args, kwargs)
        if func in CPU_ONLY_CHECKS:
            with syncs.quiet():
                return func(*args, **kwargs)
        result = func(*args, **kwargs)
        if kwargs.get("device") is not None and target((), kwargs) == "device":
            if func in FROM_DATA:
                data = args[1] if func is torch.Tensor.new_tensor else args[0]
                if not on_device(data):
                    syncs.record(f"{func.__name__}(data, device=...): a blocking copy")
            mark(result)
        return result

    def _move(self, func, args: tuple, kwargs: dict) -> Any:
        syncs, source = self.syncs, args[0]
        goes = {torch.Tensor.cpu: "host", torch.Tensor.cuda: "device"}.get(
            func, target(args[1:], kwargs)
        )
        result = func(*args, **kwargs)
        if goes == "host" and on_device(source):
            syncs.record("a copy to the host")
            if result is source:
                result = host_copy(source)
        elif goes == "device" and not on_device(source):
            if not kwargs.get("non_blocking", False):
                syncs.record(".to(device) without non_blocking=True: a blocking copy")
            if result is source and not isinstance(source, torch.nn.Parameter):
                result = host_copy(source)  # the host tensor stays a host tensor
            mark(result)
        return result


class _Dispatch(TorchDispatchMode):
    """Every op, autograd's backward included: device-ness flows from inputs to outputs."""

    def __init__(self, syncs: HostSyncs) -> None:
        super().__init__()
        self.syncs = syncs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in COPIES and on_device(args[1]) and not on_device(args[0]):
            self.syncs.record("a copy to the host (copy_)")
            return func(*args, **kwargs)
        if not any(on_device(t) for t in tensors(args, kwargs)):
            return func(*args, **kwargs)
        problem = self._sync(func, args, kwargs)
        if problem:
            self.syncs.record(problem)
        result = func(*args, **kwargs)
        mark(result)
        return result

    @staticmethod
    def _sync(func, args: tuple, kwargs: dict) -> str | None:
        name = func.overloadpacket.__name__
        if func in ALWAYS:
            return f"aten.{name}"
        if func in MASK_INDEXED:
            masks = [
                index
                for index in args[1]
                if index is not None and index.dtype in (torch.bool, torch.uint8)
            ]
            return f"aten.{name} with a boolean mask" if masks else None
        if func is aten.repeat_interleave.Tensor:
            size = kwargs.get("output_size", args[2] if len(args) > 2 else None)
            return None if size is not None else f"aten.{name} without output_size"
        if func is aten.one_hot.default:
            classes = kwargs.get("num_classes", args[1] if len(args) > 1 else -1)
            return f"aten.{name} without num_classes" if classes == -1 else None
        return None


class _StepsCounted(Exception):
    """Raised out of the training loop once the counted steps are done."""


def training_syncs(script: Path, *args: str, counted_steps: int = 1) -> list[str]:
    """Run `script` (a generated train.py, with `args`) in this process and return the
    syncs of its steps after the first, up to and including step 1 + counted_steps: the
    end of step 1 (after the progress bar moved) to the same point of the last step.
    Those steps must not log, evaluate or save: pass intervals longer than the run. The
    run is stopped there (no final evaluation, checkpoint or sample)."""
    import runpy
    import signal

    import runtime.monitor as monitor

    syncs = HostSyncs()
    update, steps = monitor.Monitor.update, [0]

    def counted(self, progress) -> None:
        update(self, progress)
        steps[0] += 1
        syncs.counting = steps[0] <= counted_steps
        if steps[0] > counted_steps:
            raise _StepsCounted

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    saved_argv, saved_path = sys.argv, list(sys.path)
    monitor.Monitor.update = counted
    sys.argv, sys.path[:0] = [str(script), *args], [str(script.parent)]
    try:
        with syncs:
            runpy.run_path(str(script), run_name="__main__")
    except _StepsCounted:
        pass
    finally:
        monitor.Monitor.update = update
        sys.argv, sys.path[:] = saved_argv, saved_path
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert steps[0] > counted_steps, f"the run stopped after {steps[0]} step(s)"
    return syncs.events
