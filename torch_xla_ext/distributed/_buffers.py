"""The buffers a ``fully_shard`` call manages, and their move to the XLA device.

As in PyTorch's FSDP2, ``fully_shard(module)`` moves the buffers of the
modules it manages (``module``'s tree, without the subtrees of nested fully
sharded modules and of ``replicate``-d modules) to the device. Buffers are not
sharded: a host buffer is uploaded once and is replicated over the mesh (what
an unannotated XLA tensor is under SPMD), so the forward never uploads it
again. A buffer already on the XLA device is left as it is, sharding included.

Identity: the move swaps the tensor objects (``torch.utils.swap_tensors``), so
the module attribute, ``named_buffers()`` and any other Python reference to
the buffer see the XLA tensor, and a buffer registered under several names
stays one tensor. Where a swap is impossible (the tensor has weak references,
or autograd holds it), each registration is pointed at one moved copy instead.
Registrations are kept, so non-persistent buffers stay non-persistent and the
state dict keys do not change.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn

from . import _traversal
from ._registry import is_fully_sharded

__all__ = ["ManagedBuffer", "check_buffers", "managed_buffers", "move_buffers"]


@dataclasses.dataclass
class ManagedBuffer:
    """One distinct buffer tensor and every (holder module, local name) registering it."""

    tensor: torch.Tensor
    fqn: str  # of its first registration, relative to the fully sharded module
    registrations: list[tuple[nn.Module, str]]


def managed_buffers(tree: _traversal.ModuleTree, module: nn.Module) -> list[ManagedBuffer]:
    """The distinct buffers ``module`` manages in ``tree`` (``module``'s own tree, replicated subtrees pruned).

    A module belongs to ``module`` when no other fully sharded module lies on
    its tree path from ``module`` (itself included).
    """
    managed: list[bool] = []
    found: dict[int, ManagedBuffer] = {}
    for i, m in enumerate(tree.modules):  # parents precede children
        parent = tree.parents[i]
        mine = m is module or (parent >= 0 and managed[parent] and not is_fully_sharded(m))
        managed.append(mine)
        if not mine:
            continue
        for name, buf in m._buffers.items():
            if buf is None:
                continue
            entry = found.get(id(buf))
            if entry is None:
                base = tree.fqn(i)
                entry = found[id(buf)] = ManagedBuffer(buf, f"{base}.{name}" if base else name, [])
            entry.registrations.append((m, name))
    return list(found.values())


def check_buffers(buffers: list[ManagedBuffer]) -> None:
    """Raise, before anything moves, for a buffer fully_shard cannot put on the XLA device."""
    for b in buffers:
        if b.tensor.device.type not in ("cpu", "xla"):
            raise ValueError(f"buffer {b.fqn} is on {b.tensor.device}; fully_shard moves buffers from the CPU to "
                             f"the XLA device, but not from {b.tensor.device.type}")


def move_buffers(buffers: list[ManagedBuffer], device: torch.device) -> None:
    """Upload every host buffer of ``buffers`` to ``device`` (replicated), keeping identities where it can."""
    for b in buffers:
        old = b.tensor
        if old.device.type == "xla":
            continue  # keeps whatever sharding it has
        with torch.no_grad():
            new = old.detach().to(device)
        new.requires_grad_(old.requires_grad)
        try:
            torch.utils.swap_tensors(old, new)
        except RuntimeError:
            # Not swappable: point every registration at the moved tensor instead.
            for holder, name in b.registrations:
                holder._buffers[name] = new
            b.tensor = new
