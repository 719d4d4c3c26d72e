"""What a checkpoint holds: the loop's `state = {"model": model, "optimizer": optimizer,
"progress": progress, ...}`.

Each entry is saved under its name. Modules and optimizers go through DCP's
`get_*_state_dict` / `set_*_state_dict`, so their state does not depend on the world size or
the sharding (FSDP2, DDP or none); an optimizer is paired with the module in `state` that
holds its parameters. Anything else with `state_dict()` / `load_state_dict()` (the
progress, the microbatch search, the early stopper, an LR schedule) is saved as its
state dict:

- plain JSON data (dicts with string keys, lists, strings, numbers, booleans, None)
  goes into train_state.json, under the entry's name, beside the progress. Such state
  is small and worth reading by eye (the microbatch size found, the best validation
  loss), and it comes back as it was saved: DCP would load it into the shape of the
  object's state dict now, which changes with the configuration (early stopping
  switched on, a fixed microbatch size made `auto`), where a resume should hand the
  object what it saved.
- anything else (tensors) goes through DCP, like a module (no pickles either way).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from runtime.checkpoint.layout import CheckpointError

# train_state.json's own keys, which no entry's name may take.
RESERVED = ("world_size", "origin", "export")
# 0.1.0 and 0.2.0 saved the objects that were not entries (the microbatch search, the
# early stopper) merged in one dict under this key of train_state.json.
LEGACY_EXTRA = "extra"


def _module_of(state: dict[str, Any], name: str) -> nn.Module:
    params = {id(p) for group in state[name].param_groups for p in group["params"]}
    for value in state.values():
        if isinstance(value, nn.Module) and params <= {
            id(p) for p in value.parameters()
        }:
            return value
    raise TypeError(
        f"state[{name!r}] optimizes parameters of no module in the state; add its model"
    )


def _optimizers(value: Any) -> Any:
    """An optimizer, or the optimizers a chain steps together (e.g. `runtime.muon.Chain`: Muon
    for hidden matrices, AdamW for the rest; DCP keys each one's state by parameter name, so
    several share one entry); None for anything else."""
    if isinstance(value, torch.optim.Optimizer):
        return value
    chained = getattr(value, "optimizers", None)
    if (
        isinstance(chained, list)
        and chained
        and all(isinstance(o, torch.optim.Optimizer) for o in chained)
    ):
        return chained
    return None


def _check_entry(name: str, value: Any) -> None:
    if name in RESERVED:
        raise TypeError(
            f"state[{name!r}]: train_state.json keeps its own {name!r} "
            "there; give the entry another name"
        )
    saveable = (
        isinstance(value, nn.Module)
        or _optimizers(value) is not None
        or (
            callable(getattr(value, "state_dict", None))
            and callable(getattr(value, "load_state_dict", None))
        )
    )
    if not saveable:
        raise TypeError(
            f"state[{name!r}] is a {type(value).__name__}: checkpoints "
            "hold modules, optimizers and objects with state_dict() and "
            "load_state_dict()"
        )


def _through_dcp(value: Any) -> bool:
    return isinstance(value, nn.Module) or _optimizers(value) is not None


def _has_state(value: Any) -> bool:
    """Whether loading into `value` would change it (an optimizer has param groups)."""
    return _optimizers(value) is not None or bool(value.state_dict())


def is_plain(value: Any) -> bool:
    """JSON gives it back equal: dicts with string keys, lists, strings, numbers,
    booleans and None (not tuples, which come back as lists, nor int keys: strings)."""
    if value is None or isinstance(value, (str, int, float)):
        return True
    if isinstance(value, list):
        return all(is_plain(item) for item in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and is_plain(item) for k, item in value.items())
    return False


def module_options(trainable_only: bool = False) -> StateDictOptions:
    """How modules are saved and loaded: every parameter, or (`trainable_only`, e.g. LoRA
    adapters on a frozen model) only those with requires_grad: a frozen parameter never
    changes, and is rebuilt where the model is built (from_pretrained), so checkpoints stay
    small; loading then leaves the frozen ones as they are."""
    return StateDictOptions(
        ignore_frozen_params=trainable_only, strict=not trainable_only
    )


def _frozen_names(module: nn.Module) -> set[str]:
    """Every name of a frozen parameter, tied aliases included (DCP's
    ignore_frozen_params keeps a tied weight's second name, e.g. a tied lm_head)."""
    inner = module.module if isinstance(module, DistributedDataParallel) else module
    named = inner.named_parameters(remove_duplicate=False)
    return {name for name, param in named if not param.requires_grad}


def plain_tensor(value: Any) -> Any:
    """A weight that a tensor subclass wraps around one tensor of its shape (torchao's
    float8 all-gather weight under FSDP2) as that tensor, sharing its memory; anything
    else unchanged. A checkpoint then holds plain tensors, which any process reads (the
    subclass's pickled class is refused), and loads back into the weight in place."""
    local = value._local_tensor if isinstance(value, DTensor) else value
    if type(local) is torch.Tensor or not hasattr(local, "__tensor_flatten__"):
        return value
    inner = getattr(local, local.__tensor_flatten__()[0][0])
    if type(inner) is not torch.Tensor or inner.shape != local.shape:
        return value
    if not isinstance(value, DTensor):
        return inner
    return DTensor.from_local(
        inner,
        value.device_mesh,
        value.placements,
        shape=value.shape,
        stride=value.stride(),
    )


def state_dicts(state: dict[str, Any], trainable_only: bool = False) -> dict[str, Any]:
    """The state dict of every entry, as DCP saves (or loads into) it; TypeError for an entry
    that cannot be saved."""
    result = {}
    for name, value in state.items():
        _check_entry(name, value)
        if isinstance(value, nn.Module):
            options = module_options(trainable_only)
            result[name] = {
                key: plain_tensor(tensor)
                for key, tensor in get_model_state_dict(value, options=options).items()
            }
            if trainable_only:  # a tied alias of a frozen weight (lm_head) too
                frozen = _frozen_names(value)
                result[name] = {
                    k: v for k, v in result[name].items() if k not in frozen
                }
        elif _optimizers(value) is not None:
            result[name] = get_optimizer_state_dict(
                _module_of(state, name), _optimizers(value)
            )
        else:
            result[name] = value.state_dict()
    return result


def split(
    state: dict[str, Any], trainable_only: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The state dicts to save: (through DCP, into train_state.json); see the module
    docstring. TypeError for an entry that cannot be saved."""
    saved = state_dicts(state, trainable_only)
    plain = {
        name: saved.pop(name)
        for name, value in state.items()
        if not _through_dcp(value) and is_plain(saved[name])
    }
    return saved, plain


def sources(
    path: Path, state: dict[str, Any], train_state: dict[str, Any], metadata: Metadata
) -> dict[str, str]:
    """Where each entry of `state` comes back from: "dcp", "json" (its key in
    train_state.json) or LEGACY_EXTRA (a checkpoint of 0.2.0 or before: the dict the
    microbatch search and the early stopper were saved in, merged; each object picks its
    own keys). An entry the checkpoint lacks is left out when its state dict is empty
    (nothing to restore); otherwise every such entry is named in one CheckpointError."""
    in_dcp = {key.split(".", 1)[0] for key in metadata.state_dict_metadata}
    in_json = {name for name in train_state if name not in RESERVED}
    legacy = isinstance(train_state.get(LEGACY_EXTRA), dict)
    found: dict[str, str] = {}
    absent = []
    for name, value in state.items():
        _check_entry(name, value)
        if name in in_dcp:
            found[name] = "dcp"
        elif name in in_json and not _through_dcp(value):
            found[name] = "json"
        elif legacy and not _through_dcp(value):
            found[name] = LEGACY_EXTRA
        elif _has_state(value):
            absent.append(name)
    if absent:
        raise CheckpointError(
            f"{path} holds no {', '.join(absent)} (it holds "
            f"{', '.join(sorted(in_dcp | in_json))}); start from a "
            "checkpoint saved with the same state entries"
        )
    return found


def restore(
    path: Path,
    state: dict[str, Any],
    found: dict[str, str],
    loaded: dict[str, Any],
    train_state: dict[str, Any],
    trainable_only: bool = False,
) -> None:
    """Load into the objects of `state`: DCP's `loaded` (`state_dicts` of the "dcp"
    entries, filled by DCP), the others' state dicts from train_state.json."""
    # Optimizers first, then modules: the order of DCP's set_state_dict.
    for name, value in state.items():
        if found.get(name) == "dcp" and _optimizers(value) is not None:
            set_optimizer_state_dict(
                _module_of(state, name), _optimizers(value), loaded[name]
            )
    for name, value in state.items():
        source = found.get(name)
        if source == "dcp" and isinstance(value, nn.Module):
            options = module_options(trainable_only)
            set_model_state_dict(value, loaded[name], options=options)
        elif source == "dcp" and _optimizers(value) is None:
            value.load_state_dict(loaded[name])
        elif source == "json":
            value.load_state_dict(train_state[name])
        elif source == LEGACY_EXTRA:
            try:
                value.load_state_dict(train_state[LEGACY_EXTRA])
            except (KeyError, TypeError, ValueError) as error:
                # An object 0.2.0 did not save in `extra` (a newer entry) gets it too.
                why = f"{type(error).__name__}: {error}"
                raise CheckpointError(
                    f"{path} (saved by scaffold 0.2.0 or before) holds no {name}, and "
                    f"its extra state does not restore it ({why}); start from a "
                    "checkpoint saved with the same state entries"
                ) from error


def check_saved(
    path: Path, metadata: Metadata, state: dict[str, Any], loaded: dict[str, Any]
) -> None:
    """Each module's keys and shapes are the checkpoint's: all differences named (DCP
    reports only the first, and not unexpected keys)."""
    problems = []
    for name, value in state.items():
        if isinstance(value, nn.Module):
            problems += _module_problems(name, metadata, loaded[name])
    if problems:
        raise CheckpointError(
            f"{path} was saved from a different model ({'; '.join(problems)}); "
            "build the model with the configuration it was trained with"
        )


def _module_problems(
    name: str, metadata: Metadata, module_state: dict[str, Any]
) -> list[str]:
    saved = {
        key.removeprefix(f"{name}."): meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(f"{name}.")
    }
    problems = []
    for label, keys in (
        (
            "missing from the checkpoint",
            [key for key in module_state if key not in saved],
        ),
        (
            "in the checkpoint but not in this model",
            [key for key in saved if key not in module_state],
        ),
        (
            "different shapes",
            [
                f"{key} (saved {list(saved[key].size)}, model {list(value.shape)})"
                for key, value in module_state.items()
                if key in saved
                and isinstance(value, torch.Tensor)
                and hasattr(saved[key], "size")
                and tuple(saved[key].size) != tuple(value.shape)
            ],
        ),
    ):
        if keys:
            more = f" and {len(keys) - 10} more" if len(keys) > 10 else ""
            entry = "" if name == "model" else f"{name} "
            problems.append(f"{entry}{label}: {', '.join(keys[:10])}{more}")
    return problems
