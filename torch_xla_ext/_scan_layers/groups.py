"""Interleaved layer stacks: ``scan_layers`` over a repeating group of layers.

Models whose layers alternate kinds (sliding / global attention every other
layer) are not homogeneous layer by layer, but they are group by group: with
``group_size=2`` the scanned step is "layer 2i, then layer 2i+1", and every
group must match the first (each group's members may differ from each other).
A :class:`LayerGroup` is that step as a module, so the homogeneity checks,
stacking, buffers and gradients of ``scan_layers`` apply to groups unchanged.

Each position in a group may receive its own arguments (a sliding-window mask
for one, a full mask for the other): pass them as the keyword
``POSITIONS`` (a list of ``(args, kwargs)``, one per position); tensors among
them become loop operands like any layer argument.

The groups of a ``nn.ModuleList`` are built once and kept in the list's
``__dict__`` (the loop's cache is keyed by the first group: new group
objects every call would compile a new loop every call).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._scan.errors import ScanInputError

__all__ = ["LayerGroup", "POSITIONS", "layer_groups"]

#: Keyword carrying per-position ``(args, kwargs)`` to a :class:`LayerGroup`.
POSITIONS = "_txe_group_positions"

_CACHE = "_txe_layer_groups"


class LayerGroup(torch.nn.Module):
    """``len(members)`` consecutive layers applied in order: one scanned step of an interleaved stack."""

    def __init__(self, members: Sequence[torch.nn.Module], num_carried: int) -> None:
        super().__init__()
        self.members = torch.nn.ModuleList(members)
        self.num_carried = num_carried

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        carry, args = inputs[:self.num_carried], inputs[self.num_carried:]
        positions = kwargs.pop(POSITIONS, None)
        out = None
        for k, layer in enumerate(self.members):
            layer_args, layer_kwargs = (args, kwargs) if positions is None else positions[k]
            out = layer(*carry, *layer_args, **layer_kwargs)
            carry = (out,) if isinstance(out, torch.Tensor) else tuple(out)
            if k + 1 < len(self.members) and len(carry) != self.num_carried:
                # Decided on what the layer returns (an annotation may say a tuple where it returns a tensor).
                raise ScanInputError(
                    f"scan_layers: {type(layer).__name__}.forward, position {k} of a group of "
                    f"{len(self.members)}, returned {len(carry)} value(s) where the group hands "
                    f"{self.num_carried} on to the next position; the layers of an interleaved stack must "
                    f"return what they take (the hidden states as a tensor)"
                )
        return out


def layer_groups(layers: Sequence[torch.nn.Module], group_size: int, num_carried: int) -> list[LayerGroup]:
    """``layers`` as consecutive groups of ``group_size`` (built once per list and kept, see the module doc)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ScanInputError(f"scan_layers: group_size must be a positive int, got {group_size!r}")
    if not isinstance(layers, torch.nn.ModuleList):
        raise ScanInputError(f"scan_layers: group_size={group_size} needs the layers as an nn.ModuleList (its "
                             f"groups are built once and kept with it), got {type(layers).__name__}")
    members = list(layers._modules.values())  # not iter(layers): a scanned Hugging Face stack iterates otherwise
    if len(members) % group_size:
        raise ScanInputError(
            f"scan_layers: {len(members)} layers do not split into groups of {group_size}; scan the first "
            f"{len(members) - len(members) % group_size} and run the rest in a Python loop"
        )
    key = (group_size, num_carried)
    cache: dict = layers.__dict__.setdefault(_CACHE, {})
    groups = cache.get(key)
    flat = [m for g in groups for m in g.members] if groups is not None else None
    if flat is None or len(flat) != len(members) or any(a is not b for a, b in zip(flat, members)):
        groups = [LayerGroup(members[i:i + group_size], num_carried) for i in range(0, len(members), group_size)]
        cache[key] = groups
    return groups
