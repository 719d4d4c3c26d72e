"""torchrun worker for test_preempt: rank 1 signals itself during step 3; every rank writes where it stopped to rank<R>.txt.

torchrun --standalone --nproc_per_node=2 preempt_worker.py SIGNAL
"""

import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from runtime.preempt import Preemption

dist.init_process_group("gloo")
rank = dist.get_rank()
preemption = Preemption()
stopped_at = None
for step in range(1, 50):
    if rank == 1 and step == 3:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    time.sleep(0.01 * (1 - rank))  # rank 0 lags: the signal is never simultaneous
    payload = torch.ones(4)
    dist.all_reduce(payload)  # the "training" collectives go on alongside
    if preemption.agreed():
        stopped_at = step
        break
# A file per rank: two ranks printing to torchrun's shared stdout can interleave their lines.
with open(f"rank{rank}.txt", "w") as out:
    out.write(
        f"rank {rank} stopped at {stopped_at} by {preemption.stopped_by} received {preemption.received}"
    )
preemption.close()
dist.barrier()
dist.destroy_process_group()
