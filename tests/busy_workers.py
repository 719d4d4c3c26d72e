"""Run a generated train.py whose DataLoader workers are busy when the rank is killed.

    python busy_workers.py N PIDS_FILE path/to/train.py --key=value ...

Each worker asked for a batch past the first N + 1 of the epoch appends its pid to PIDS_FILE
and works on it for ten minutes (as a worker decoding a large batch, or waiting on a slow
store, does); the rank kills itself (-9) once checkpoint step-N is saved. (Batch N, the next
step's, the loop fetches before it saves step N: it is served.) Nothing else changes.
"""

import os
import runpy
import signal
import sys
import time

import torch.utils.data._utils.fetch as fetch

import runtime.checkpoint as checkpoint

STOP, PIDS = int(sys.argv[1]), sys.argv[2]
_fetch = fetch._MapDatasetFetcher.fetch
_save = checkpoint.Checkpointer.save


def slow_fetch(self, index):
    if index > STOP:
        with open(PIDS, "a") as out:
            out.write(f"{os.getpid()}\n")
        time.sleep(600)
    return _fetch(self, index)


def save_then_die(self, *args, **kwargs):
    path = _save(self, *args, **kwargs)
    if str(path).rstrip("/").endswith(f"step-{STOP}"):
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    return path


fetch._MapDatasetFetcher.fetch = slow_fetch
checkpoint.Checkpointer.save = save_then_die
sys.argv = sys.argv[3:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
