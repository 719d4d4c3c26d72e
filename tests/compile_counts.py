"""Run a generated train.py and report, as it exits, how many graphs torch.compile made.

    python compile_counts.py path/to/train.py --key=value ...
    torchrun --nproc_per_node=2 compile_counts.py path/to/train.py ...

Each process prints one line `compile-counts rank=R graphs=N breaks=B by_step=G1,G2,...`
(dynamo's `unique_graphs` and graph-break counters; G1, G2, ... the graphs made by the end of
each optimizer step, so a recompilation after warmup shows as a later increase). Hitting
dynamo's recompile limit raises instead of silently falling back to eager
(`fail_on_recompile_limit_hit`), so an unbounded recompilation cannot pass as a small count.
Nothing else in the run changes.
"""

import atexit
import os
import runpy
import sys

import torch._dynamo
from torch._dynamo.utils import counters
from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook

torch._dynamo.config.fail_on_recompile_limit_hit = True
graphs_by_step: list[int] = []


def record_step(optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
    graphs_by_step.append(counters["stats"]["unique_graphs"])


def report() -> None:
    breaks = sum(counters["graph_break"].values())
    rank = os.environ.get("RANK", "0")
    by_step = ",".join(map(str, graphs_by_step))
    print(
        f"compile-counts rank={rank} graphs={counters['stats']['unique_graphs']} "
        f"breaks={breaks} by_step={by_step}",
        flush=True,
    )


register_optimizer_step_post_hook(record_step)  # every optimizer's steps
atexit.register(report)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
