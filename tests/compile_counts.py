"""Run a generated train.py and report, as it exits, how many graphs torch.compile made.

    python compile_counts.py path/to/train.py --key=value ...
    torchrun --nproc_per_node=2 compile_counts.py path/to/train.py ...

Each process prints one line `compile-counts rank=R graphs=N breaks=B` (dynamo's
`unique_graphs` and graph-break counters). Hitting dynamo's recompile limit raises instead of
silently falling back to eager (`fail_on_recompile_limit_hit`), so an unbounded recompilation
cannot pass as a small count. Nothing else in the run changes.
"""

import atexit
import os
import runpy
import sys

import torch._dynamo
from torch._dynamo.utils import counters

torch._dynamo.config.fail_on_recompile_limit_hit = True


def report() -> None:
    breaks = sum(counters["graph_break"].values())
    rank = os.environ.get("RANK", "0")
    print(
        f"compile-counts rank={rank} graphs={counters['stats']['unique_graphs']} breaks={breaks}",
        flush=True,
    )


atexit.register(report)
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
