"""Rematerialization policies for ``scan`` and ``scan_layers``: what the forward loop saves for the backward.

JAX's ``jax.checkpoint`` policies as AOTAutograd partition functions, passed
as ``partition_fn``::

    txe.scan_layers(layers, h, partition_fn=remat.nothing_saveable)
    txe.scan(fn, init, xs, partition_fn=remat.dots_saveable)
    txe.scan(fn, init, xs, partition_fn=remat.save_only_these_names("attn_out"))
    # inside fn: a = remat.checkpoint_name(a, "attn_out")

``nothing_saveable``
    the forward loop stacks only what each iteration received (its carry; x
    slices and outside tensors are read again); the backward loop recomputes
    every other activation. Least memory, most recomputation.
``dots_saveable``
    also keeps the outputs of matrix products (``mm``, ``bmm``, ``addmm``,
    ``baddbmm``, convolutions): the backward recomputes only the cheap
    elementwise work between them.
``save_only_these_names(*names)``
    keeps only tensors marked with :func:`checkpoint_name` under one of
    ``names``.

Every policy keeps random ops' outputs (a recomputed dropout would draw
another mask) and leaves values and gradients unchanged: only where the
backward gets each activation from changes. The default partition
(``partition_fn=None``) saves every activation the backward reads.

Each policy tags the forward nodes of AOTAutograd's joint graph with
PyTorch's ``CheckpointPolicy`` (``MUST_SAVE`` / ``MUST_RECOMPUTE``, what
``torch.utils.checkpoint``'s selective checkpointing uses) and lets PyTorch's
min-cut partitioner split the graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

__all__ = ["checkpoint_name", "dots_saveable", "nothing_saveable", "save_only_these_names"]


@torch.library.custom_op("txe::checkpoint_name", mutates_args=())
def _checkpoint_name(t: torch.Tensor, name: str) -> torch.Tensor:
    return t.clone()


@_checkpoint_name.register_fake
def _(t: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(t)


def _backward(ctx, grad: torch.Tensor):
    return grad, None


_checkpoint_name.register_autograd(_backward)


def checkpoint_name(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t``, marked ``name`` for :func:`save_only_these_names` (the value and its gradient are unchanged)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"checkpoint_name: expected a tensor, got {type(t).__name__}")
    if not isinstance(name, str) or not name:
        raise ValueError(f"checkpoint_name: name must be a non-empty string, got {name!r}")
    return torch.ops.txe.checkpoint_name(t, name)


_DOTS = {
    torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten.convolution.default,
}


def _forward_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The joint graph's forward computation: call nodes that do not depend on a tangent."""
    backward: set[fx.Node] = set()
    forward = []
    for node in graph.nodes:
        if node.op == "placeholder":
            if "tangents" in str(node.target):
                backward.add(node)
            continue
        if node.op != "call_function":
            continue
        if any(arg in backward for arg in node.all_input_nodes):
            backward.add(node)
        else:
            forward.append(node)
    return forward


def _is_random(node: fx.Node) -> bool:
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in target.tags


def _policy(saveable: Callable[[fx.Node], bool], name: str) -> Callable:
    from functorch.compile import min_cut_rematerialization_partition
    from torch.utils.checkpoint import CheckpointPolicy

    def partition(joint_module: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
        for node in _forward_nodes(joint_module.graph):
            keep = saveable(node) or _is_random(node)
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.MUST_RECOMPUTE
            node.meta["ac_graph_id"] = 0
        return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)

    partition.__name__ = partition.__qualname__ = name
    return partition


#: Save nothing but each iteration's inputs; recompute every activation in the backward.
nothing_saveable = _policy(lambda node: False, "nothing_saveable")

#: Save the outputs of matrix products; recompute the elementwise work between them.
dots_saveable = _policy(lambda node: node.target in _DOTS, "dots_saveable")

_named_policies: dict[tuple[str, ...], Callable] = {}


def save_only_these_names(*names: str) -> Callable:
    """A partition function saving only tensors marked by :func:`checkpoint_name` with one of ``names``.

    The same names give the same function object, so scan's cache of lowered
    loops (keyed by ``partition_fn``) is reused across calls.
    """
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"save_only_these_names: give one or more non-empty names, got {names!r}")
    key = tuple(sorted(set(names)))
    if key not in _named_policies:
        wanted = set(key)
        _named_policies[key] = _policy(
            lambda node: node.target is torch.ops.txe.checkpoint_name.default and node.args[1] in wanted,
            f"save_only_these_names{key!r}")
    return _named_policies[key]
