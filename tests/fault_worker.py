"""Run a generated train.py, and SIGKILL one rank at a chosen moment of its first start.

    torchrun --max-restarts=1 --nproc_per_node=2 fault_worker.py WHERE:N:RANK train.py ...

WHERE is where rank RANK kills itself (-9), in the first round of workers only
(TORCHELASTIC_RESTART_COUNT 0, or no torchrun): the restarted ranks train normally.

    step:N   in the first forward of step N+1 (N optimizer steps done, its gradients not
             yet reduced): mid-step
    eval:N   in the first forward of the evaluation after step N: mid-evaluation
    save:N   inside the save of checkpoint step-N, once this rank's shards are written and
             before the COMPLETE marker: mid-save

In the later rounds the victim starts 6 s late, as a rank on a busy node does: the other
ranks then reach the store first (before runtime.dist's round store, they read the dead
process's address there, and the restarted group never formed). Nothing else changes:
global hooks count optimizer steps and see forwards; `dcp.save` is wrapped for `save`.
"""

import os
import runpy
import signal
import sys
import time

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook

import runtime.checkpoint.checkpointer as checkpointer

WHERE, STEP, RANK = sys.argv[1].split(":")
STEP, RANK = int(STEP), int(RANK)
ARMED = (
    os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    and int(os.environ.get("RANK", "0")) == RANK
)
steps = 0


def die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def count_step(optimizer, args, kwargs) -> None:
    global steps
    steps += 1


def in_forward(module, args) -> None:
    if steps == STEP and torch.is_grad_enabled() == (WHERE == "step"):
        die()


_save = checkpointer.dcp.save


def save_then_die(*args, **kwargs):
    result = _save(*args, **kwargs)
    if steps == STEP:
        die()
    return result


RESTARTED = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
if RESTARTED and int(os.environ.get("RANK", "0")) == RANK:
    time.sleep(6)
if ARMED:
    register_optimizer_step_post_hook(count_step)
    if WHERE == "save":
        checkpointer.dcp.save = save_then_die
    else:
        register_module_forward_pre_hook(in_forward)
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
