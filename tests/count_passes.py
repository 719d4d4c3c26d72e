"""Run a generated train.py and report, as it exits, the forward/backward passes of each step.

    python count_passes.py path/to/train.py --key=value ...

A pass is a call of the outermost module (the model, or its DDP/FSDP wrapper) with
gradients enabled; evaluation, sampling and selective backprop's scoring forwards run without
them and are counted apart. An optimizer step closes a step. At exit the process prints one
line per step, `passes step=K shapes=[[rows, length, ...], ...] scoring=N` (the shape of each
pass's first tensor argument, positional or named, and the number of gradient-free forwards). Nothing else in the
run changes.
"""

import atexit
import os
import runpy
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

depth = 0
passes: list[list[int]] = []  # this step's: the shape of each pass's first tensor
scoring = 0  # this step's gradient-free outermost forwards
steps: list[tuple[list[list[int]], int]] = []


def counted_call(module, *args, **kwargs):
    """Module._call_impl, counting the outermost calls (their hooks see no keyword
    arguments, and a model may take its tensors by name: `model(**micro_inputs)`)."""
    global depth, scoring
    if depth == 0:
        tensors = (a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        shape = list(next(tensors).shape)
        if torch.is_grad_enabled():
            passes.append(shape)
        else:
            scoring += 1
    depth += 1
    try:
        return call_impl(module, *args, **kwargs)
    finally:
        depth -= 1


def close_step(optimizer, args, kwargs):
    global passes, scoring
    if passes:  # a second optimizer (Muon's AdamW) steps after the first: one step
        steps.append((passes, scoring))
        passes, scoring = [], 0


def report():
    for number, (shapes, scored) in enumerate(steps, start=1):
        print(f"passes step={number} shapes={shapes} scoring={scored}", flush=True)


call_impl = torch.nn.Module._call_impl
torch.nn.Module._call_impl = counted_call
register_optimizer_step_post_hook(close_step)
atexit.register(report)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
