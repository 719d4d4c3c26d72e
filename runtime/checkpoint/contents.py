"""What a checkpoint holds: the loop's `state = {"model": model, "optimizer": optimizer, ...}`.

Each entry is saved under its name. Modules and optimizers go through DCP's
`get_*_state_dict` / `set_*_state_dict`, so their state does not depend on the world size or
the sharding (FSDP2, DDP or none); an optimizer is paired with the module in `state` that
holds its parameters. Anything else with `state_dict()` / `load_state_dict()` is saved as its
state dict (tensors, numbers, strings; no pickled objects).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from runtime.checkpoint.layout import CheckpointError


def _module_of(state: dict[str, Any], name: str) -> nn.Module:
    params = {id(p) for group in state[name].param_groups for p in group["params"]}
    for value in state.values():
        if isinstance(value, nn.Module) and params <= {id(p) for p in value.parameters()}:
            return value
    raise TypeError(f"state[{name!r}] optimizes parameters of no module in the state; add its model")


def _optimizers(value: Any) -> Any:
    """An optimizer, or the optimizers a chain steps together (e.g. `runtime.muon.Chain`: Muon
    for hidden matrices, AdamW for the rest; DCP keys each one's state by parameter name, so
    several share one entry); None for anything else."""
    if isinstance(value, torch.optim.Optimizer):
        return value
    chained = getattr(value, "optimizers", None)
    if isinstance(chained, list) and chained and all(isinstance(o, torch.optim.Optimizer) for o in chained):
        return chained
    return None


def state_dicts(state: dict[str, Any]) -> dict[str, Any]:
    """The state dict of every entry, as DCP saves (or loads into) it; TypeError for an entry
    that cannot be saved."""
    result = {}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            result[name] = get_model_state_dict(value)
        elif _optimizers(value) is not None:
            result[name] = get_optimizer_state_dict(_module_of(state, name), _optimizers(value))
        elif callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None)):
            result[name] = value.state_dict()
        else:
            raise TypeError(f"state[{name!r}] is a {type(value).__name__}: checkpoints hold modules, "
                            "optimizers and objects with state_dict() and load_state_dict()")
    return result


def restore(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Load `loaded` (from `state_dicts(state)`, filled by DCP) into the objects of `state`."""
    # Optimizers first, then modules: the order of DCP's set_state_dict.
    for name, value in state.items():
        if _optimizers(value) is not None:
            set_optimizer_state_dict(_module_of(state, name), _optimizers(value), loaded[name])
    for name, value in state.items():
        if isinstance(value, nn.Module):
            set_model_state_dict(value, loaded[name])
        elif _optimizers(value) is None:
            value.load_state_dict(loaded[name])


def check_saved(path: Path, metadata: Metadata, state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """The checkpoint holds every entry, and each module's keys and shapes: all differences named
    (DCP reports only the first, and not unexpected keys)."""
    saved_names = sorted({key.split(".", 1)[0] for key in metadata.state_dict_metadata})
    absent = [name for name in state if loaded[name] and name not in saved_names]
    if absent:
        raise CheckpointError(f"{path} holds no {', '.join(absent)} (it holds {', '.join(saved_names)}); "
                              "start from a checkpoint saved with the same state entries")
    problems = []
    for name, value in state.items():
        if isinstance(value, nn.Module):
            problems += _module_problems(name, metadata, loaded[name])
    if problems:
        raise CheckpointError(f"{path} was saved from a different model ({'; '.join(problems)}); "
                              "build the model with the configuration it was trained with")


def _module_problems(name: str, metadata: Metadata, module_state: dict[str, Any]) -> list[str]:
    saved = {key.removeprefix(f"{name}."): meta for key, meta in metadata.state_dict_metadata.items()
             if key.startswith(f"{name}.")}
    problems = []
    for label, keys in (
        ("missing from the checkpoint", [key for key in module_state if key not in saved]),
        ("in the checkpoint but not in this model", [key for key in saved if key not in module_state]),
        ("different shapes", [
            f"{key} (saved {list(saved[key].size)}, model {list(value.shape)})"
            for key, value in module_state.items()
            if key in saved and isinstance(value, torch.Tensor) and hasattr(saved[key], "size")
            and tuple(saved[key].size) != tuple(value.shape)
        ]),
    ):
        if keys:
            more = f" and {len(keys) - 10} more" if len(keys) > 10 else ""
            entry = "" if name == "model" else f"{name} "
            problems.append(f"{entry}{label}: {', '.join(keys[:10])}{more}")
    return problems
