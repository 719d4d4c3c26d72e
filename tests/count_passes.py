"""Run a generated train.py and report, as it exits, the forward/backward passes of each step.

    python count_passes.py path/to/train.py --key=value ...

A pass is a call of the outermost module (the model, or its DDP/FSDP wrapper) with
gradients enabled; evaluation, sampling and selective backprop's scoring forwards run without
them and are counted apart. An optimizer step closes a step. At exit the process prints one
line per step, `passes step=K shapes=[[rows, length, ...], ...] scoring=N` (the shape of each
pass's first tensor argument, and the number of gradient-free forwards). Nothing else in the
run changes.
"""

import atexit
import os
import runpy
import sys

import torch
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)
from torch.optim.optimizer import register_optimizer_step_post_hook

depth = 0
passes: list[list[int]] = []  # this step's: the shape of each pass's first tensor
scoring = 0  # this step's gradient-free outermost forwards
steps: list[tuple[list[list[int]], int]] = []


def enter(module, args):
    global depth, scoring
    if depth == 0:
        shape = next(list(a.shape) for a in args if isinstance(a, torch.Tensor))
        if torch.is_grad_enabled():
            passes.append(shape)
        else:
            scoring += 1
    depth += 1


def leave(module, args, output):
    global depth
    depth -= 1


def close_step(optimizer, args, kwargs):
    global passes, scoring
    if passes:  # a second optimizer (Muon's AdamW) steps after the first: one step
        steps.append((passes, scoring))
        passes, scoring = [], 0


def report():
    for number, (shapes, scored) in enumerate(steps, start=1):
        print(f"passes step={number} shapes={shapes} scoring={scored}", flush=True)


register_module_forward_pre_hook(enter)
register_module_forward_hook(leave, always_call=True)
register_optimizer_step_post_hook(close_step)
atexit.register(report)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
