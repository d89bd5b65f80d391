"""Save and restore a fully sharded model and its optimizer shard by shard, gathering nothing.

``save_sharded(path, model, optimizer)`` writes every device's shard of every
parameter and optimizer state tensor as it is, through
``torch.distributed.checkpoint`` (DCP) with torch_xla's SPMD planners;
``load_sharded(path, model, optimizer)`` reads them back into a model (and
optimizer) fully sharded the same way or on another mesh, where DCP reads
each target shard's slice. Neither gathers a sharded tensor
(``ReplicateShardedData``): a save moves each value's bytes to the host once,
a load reads the target's shards, fills them and uploads them.

The optimizer state is keyed by parameter name (``get_state_dict``), so a
checkpoint does not depend on the order parameters were given to the
optimizer. An optimizer with no state yet (a new AdamW) is given its state by
a step with learning rate 0 (PyTorch's ``get_state_dict`` does it) before the
load fills it. DCP needs no process group in one process (it plans alone); on
a pod every process calls these with ``path`` on storage all hosts see.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from .._contract import as_whole

__all__ = ["load_sharded", "save_sharded"]

# DCP's own notes when it plans in one process; they say nothing about this save.
_DCP_CHATTER = ("torch.distributed is disabled, unavailable or uninitialized",
                "The function definition for SavePlanner.set_up_planner", "TypedStorage is deprecated",
                "Using a non-tuple sequence for multidimensional indexing")


def _settle() -> None:
    """Run what is pending and wait for the devices: DCP reads device buffers directly."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` itself (accelerate wraps it in ``AcceleratedOptimizer``)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def _check(path: Any, model: Any, optimizer: Any) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(_torch_optimizer(optimizer), torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    devices = {p.device.type for p in model.parameters()}
    if devices != {"xla"}:
        raise ValueError(f"save_sharded/load_sharded read and write XLA shards; the model's parameters are on "
                         f"{sorted(devices)}")
    return os.fspath(path)


def _state(model: torch.nn.Module, optimizer: Any, with_model: bool = True) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    with as_whole():  # DCP walks every module's own parameters (a stacked layer's refuses a user's walk)
        if optimizer is None:
            return {"model": get_model_state_dict(model)}
        model_sd, optim_sd = get_state_dict(model, _torch_optimizer(optimizer))
    return {"model": model_sd, "optim": optim_sd} if with_model else {"optim": optim_sd}


def _refuse_other_layout(path: str, optim_state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Refuse an optimizer checkpoint whose parameters are stacked where the model's are not, or the other way.

    ``stack_layers`` keys a stack's optimizer state by its stacked parameters
    (``layers.mlp/up_proj/weight``), the unstacked model by each layer's
    (``layers.3.mlp.up_proj.weight``); DCP would report the keys missing
    without saying why.
    """
    def stacked(fqn: str) -> bool:  # a stacked parameter's last name holds '/' (stack_layers' key)
        return "/" in fqn.rpartition(".")[2]

    # Each saved optimizer-state key is "optim.state.<fqn>.<state name>": every dotted prefix of what follows
    # "optim.state." may be a parameter's name. One pass over the keys, not one per parameter.
    saved_state = [key.removeprefix("optim.state.") for key in saved if key.startswith("optim.state.")]
    prefixes = {rest[:i] for rest in saved_state for i, char in enumerate(rest) if char == "."}
    wanted = list(optim_state.get("state", {}))
    missing = [fqn for fqn in wanted if fqn not in prefixes]
    if not missing:
        return
    model_stacked = any(stacked(fqn) for fqn in wanted)
    saved_stacked = any(stacked(rest.rpartition(".")[0]) for rest in saved_state)
    if model_stacked != saved_stacked:
        raise ValueError(
            f"load_sharded: {path} holds the optimizer state of a model whose layers were "
            f"{'stored stacked' if saved_stacked else 'not stored stacked'} (stack_layers), and this model's "
            f"{'are' if model_stacked else 'are not'} (its state for {missing[0]} is not in the checkpoint). "
            f"Load it into a model stacked as the saved one was; the model's own state (load_sharded(path, model)) "
            f"loads either way")


def save_sharded(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any = None) -> None:
    """Write ``model``'s (and ``optimizer``'s) state to the directory ``path``, each device's shard as it is."""
    import torch.distributed.checkpoint as dcp
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    path = _check(path, model, optimizer)
    _settle()
    state = _state(model, optimizer)
    with warnings.catch_warnings():
        for message in _DCP_CHATTER:
            warnings.filterwarnings("ignore", message=message)
        dcp.save(state, checkpoint_id=path, planner=SPMDSavePlanner())


def load_sharded(path: str | os.PathLike, model: torch.nn.Module, optimizer: Any = None, *,
                 load_model: bool = True) -> None:
    """Fill ``model`` (and ``optimizer``) in place from a :func:`save_sharded` directory, keeping their sharding.

    The checkpoint must hold an optimizer state when ``optimizer`` is given.
    ``load_model=False`` fills only the optimizer (``model`` names its
    parameters); it needs an optimizer.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict, set_state_dict
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    path = _check(path, model, optimizer)
    if not isinstance(load_model, bool):
        raise TypeError(f"load_model must be a bool, got {type(load_model).__name__}")
    if not load_model and optimizer is None:
        raise ValueError("load_sharded: load_model=False loads only an optimizer, and none was given")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_sharded: no checkpoint directory at {path}")
    if optimizer is not None:
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        if not any(key.startswith("optim.") for key in saved):
            raise ValueError(f"load_sharded: {path} holds no optimizer state (it was saved without an optimizer)")
    state = _state(model, optimizer, load_model)  # creates a new optimizer's state (a zero-lr step), sharded
    if optimizer is not None:
        _refuse_other_layout(path, state["optim"], saved)
    _settle()
    with warnings.catch_warnings():
        for message in _DCP_CHATTER:
            warnings.filterwarnings("ignore", message=message)
        dcp.load(state, checkpoint_id=path, planner=SPMDLoadPlanner())
    with as_whole():
        if optimizer is None:
            set_model_state_dict(model, state["model"])
        elif not load_model:
            set_optimizer_state_dict(model, _torch_optimizer(optimizer), state["optim"])
        else:
            set_state_dict(model, _torch_optimizer(optimizer), model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
