"""Tensors with a shape and no data: a program lowered from shapes, for models bigger than this machine.

torch_xla's ``create_placeholder_tensor(shape, dtype)`` gives an XLA tensor
over a device-data handle with no buffer: 0 bytes, on any device count. A
graph over it lowers like one over data (the placeholder is an HLO
parameter), so a training step of a 70B model lowers here with no weights.
Two things torch_xla cannot do with it:

- **Execute it.** A program reading a placeholder that gets executed is a
  segmentation fault in torch_xla 2.9 (measured). Only lower it, and let every
  tensor whose pending graph reads one go before anything syncs
  (:func:`torch_xla_ext.tpu._fit_step.compile_step` collects its model before it
  returns; nothing recorded here holds a parameter).
- **Mark its sharding.** ``mark_sharding`` shards the data, and there is none
  ("Data does not present on any device"). :func:`mark_placeholder` instead
  annotates the placeholder's value in the graph (a ``Sharding`` custom call
  over the parameter: the tensor reports the sharding, as a marked one does)
  and records the sharding here. :func:`parameter_shardings` gives each such
  parameter that sharding in the lowered program: the parameter then carries
  what the sharded device data of the real program carries, and the custom
  call is a no-op. ``_annotate.mark_sharding`` takes this path for every
  placeholder, so ``fully_shard`` and ``hf.prepare`` place placeholder
  parameters as they place real ones.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ._xla import xla_builder, xlac
from ._weak import WeakIdMap

__all__ = ["placeholder", "is_placeholder", "mark_placeholder", "before_step", "parameter_shardings",
           "placeholder_parameters", "replace_parameters"]

# The tensor a placeholder became once annotated -> (a tensor still over the placeholder's
# data handle, the sharding text). Held weakly by the annotated tensor: its entry goes with it.
_marked: WeakIdMap = WeakIdMap()


def placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An XLA tensor of ``shape`` and ``dtype`` that holds no data (lower it; never execute it)."""
    return xla_builder().create_placeholder_tensor(tuple(int(n) for n in shape), dtype)


def is_placeholder(t: torch.Tensor) -> bool:
    """Whether ``t`` is an XLA tensor over a placeholder's data handle (one not yet annotated)."""
    return t.device.type == "xla" and bool(xlac()._is_placecholder(t))  # (torch_xla's spelling)


def mark_placeholder(t: torch.Tensor, sharding: Any) -> None:
    """Give the placeholder ``t`` the ``OpSharding`` ``sharding``: annotated in the graph, recorded here.

    ``t`` keeps its identity (a parameter stays the same ``Parameter``); a
    second tensor over the placeholder's data handle is kept, so the lowered
    program's parameter can be found by its handle.
    """
    if not is_placeholder(t):
        raise ValueError("mark_placeholder: the tensor is not a placeholder (or was annotated already)")
    # The same device-data node, under a tensor of its own: detached, or its autograd node would hold
    # ``t`` (a parameter's gradient accumulator) and the map's entry would never let its key go.
    data = t.detach().clone()
    xlac()._xla_annotate_custom_sharding(t, sharding)
    _marked[t] = (data, xlac()._get_xla_sharding_spec(t))


def before_step(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s device data as it is now, for ``tpu.compile(donated=...)``.

    A marked placeholder's recorded data (``t`` itself is a graph node over
    it), else ``t.clone()`` (a new tensor over the same data).
    """
    entry = _marked.get(t)
    return t.clone() if entry is None else entry[0]


def placeholder_parameters(ctx: Any) -> dict[int, torch.Tensor]:
    """``{parameter number: annotated tensor}`` of the placeholders ``mark_placeholder`` recorded that
    the lowered program ``ctx`` (a built ``LoweringContext``) reads."""
    entries = [(key, data) for key, (data, _) in _marked.items()]
    numbers = ctx.tensor_parameter_ids([data for _, data in entries]) if entries else []
    return {n: key for (key, _), n in zip(entries, numbers) if n >= 0}


def parameter_shardings(ctx: Any) -> dict[int, str]:
    """``{parameter number: sharding text}`` for every recorded placeholder the lowered program reads."""
    return {n: _marked.get(key)[1] for n, key in placeholder_parameters(ctx).items()}


def replace_parameters(modules: Iterable[torch.nn.Module]) -> int:
    """Replace every parameter of ``modules`` by a placeholder of its shape and dtype; returns how many.

    A parameter shared by several modules (tied weights) becomes one
    placeholder shared the same way; ``requires_grad`` is kept. Buffers are
    left as they are (small, and a model computes some of them at
    construction: rotary frequencies).
    """
    made: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(placeholder(p.shape, p.dtype), requires_grad=p.requires_grad)
            module._parameters[name] = made[id(p)]
    return len(made)
