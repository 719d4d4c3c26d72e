"""Checkpoints with torch.distributed.checkpoint (DCP): world-size independent, complete or absent.

    checkpointer = checkpoint.Checkpointer(folder, keep=2, async_save=False)
    # Everything a run resumes: modules, optimizers, and objects with state_dict() and
    # load_state_dict() (the progress, the microbatch search, the early stopper, ...).
    state = {"model": model, "optimizer": optimizer, "progress": progress}
    resumed = checkpointer.resume(state, load_path=..., seed=...)  # None: a fresh start
    checkpointer.save(state)  # step-<progress.batch>/, COMPLETE once every rank wrote
    checkpointer.close()  # an asynchronous save in flight: finished and marked complete
    checkpoint.export_safetensors(run_or_checkpoint, "model.safetensors")  # no process group
    weights, step, found, entry = checkpoint.read_weights(run_or_checkpoint)  # sampling

One concern per module: `layout` (step folders, the COMPLETE marker, rotation,
train_state.json), `reading` (loading without executing pickles), `contents` (what is saved:
the `state` dict's modules, optimizers and state-dict objects), `checkpointer` (save, resume,
the asynchronous save in flight), `export` (safetensors for inference), `storage` (fsspec
URLs: staged uploads, downloads, remote rotation), `failures` (a storage failure in one line),
`writing` (DCP's writer whose threads report their errors), `compat` (0.1.0's API).
"""

from runtime.checkpoint.checkpointer import (
    CheckpointSettings,
    Checkpointer,
    Resumed,
    check_access,
    load,
    will_resume,
)
from runtime.checkpoint.compat import (
    resume,
    save,
    wait,
)  # scaffold 0.1.0 projects, until upgraded
from runtime.checkpoint.export import export_safetensors, read_weights
from runtime.checkpoint.failures import StorageError
from runtime.checkpoint.layout import (
    MARKER,
    TRAIN_STATE,
    CheckpointError,
    is_complete,
    latest,
    remove_incomplete,
    resolve,
)

__all__ = (
    "MARKER",
    "TRAIN_STATE",
    "CheckpointError",
    "CheckpointSettings",
    "Checkpointer",
    "Resumed",
    "StorageError",
    "check_access",
    "export_safetensors",
    "read_weights",
    "is_complete",
    "latest",
    "load",
    "remove_incomplete",
    "resolve",
    "resume",
    "save",
    "wait",
    "will_resume",
)
