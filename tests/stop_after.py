"""Run a generated train.py, but stop it (exit 0) right after it saved checkpoint `step-N`.

    python stop_after.py N path/to/train.py --key=value ...
    torchrun --nproc_per_node=2 stop_after.py N path/to/train.py ...
    python stop_after.py kill:N path/to/train.py ...   # SIGKILL inside save N: data, no marker

Like a job whose allocation ends: the run is cut off after a save, and the next launch
(any number of ranks) resumes it. `Checkpointer.save` is wrapped; nothing else changes.
With `kill:N` the process kills itself (-9) after every rank's shards of step N are on disk
and before the COMPLETE marker is written: the worst moment for a checkpoint to look whole.
"""

import os
import runpy
import signal
import sys

import runtime.checkpoint as checkpoint

KILL = sys.argv[1].startswith("kill:")
STOP = f"step-{int(sys.argv[1].removeprefix('kill:'))}"
_save = checkpoint.Checkpointer.save
_finish = checkpoint.Checkpointer._finish


def name_of(path):  # a local Path, or the URL of a remote checkpoint
    return str(path).rstrip("/").rsplit("/", 1)[-1]


def finish_or_die(self, name, *args, **kwargs):
    if name_of(name) == STOP:
        os.kill(os.getpid(), signal.SIGKILL)
    return _finish(self, name, *args, **kwargs)


def save_then_stop(self, *args, **kwargs):
    path = _save(self, *args, **kwargs)
    if name_of(path) == STOP:
        self.wait()
        sys.stdout.flush()
        os._exit(0)
    return path


if KILL:
    checkpoint.Checkpointer._finish = finish_or_die
else:
    checkpoint.Checkpointer.save = save_then_stop
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
