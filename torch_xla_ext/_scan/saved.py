"""Where a scan's saved activations come from, and the layout of its primal inputs.

The forward graph of AOTAutograd's split takes ``carry + x + outside``
(:class:`_Primals`) and saves activations for the backward. Each saved
activation is a named record: stacked by the forward loop (:class:`_Stacked`),
re-read from an input by the backward loop (:class:`_Input`), or recomputed
from one (:class:`_Recompute`: casts and views, FSDP's gather). The backward
loop's operands hold them as :class:`_SavedLayout` says.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .._annotate import behind_barrier, regather_mark

@dataclasses.dataclass(frozen=True)
class _Primals:
    """Positions in the autograd graphs' primal inputs ``*carry, *x, *outside``.

    The same order indexes ``grad_mask``, ``reach``, the backward graph's
    gradients and the shardings :class:`_ScanFunction` keeps. The graphs'
    outputs are ``*carry, *y`` (:meth:`y` gives a y's position there).
    """

    n_c: int
    n_x: int
    n_o: int

    def x(self, j: int) -> int:
        return self.n_c + j

    def outside(self, k: int) -> int:
        return self.n_c + self.n_x + k

    def y(self, j: int) -> int:
        """Position of y ``j`` among the outputs ``*carry, *y``."""
        return self.n_c + j

    def split(self, flat: Sequence[Any]) -> tuple[list, list, list]:
        """``(carry, x, outside)`` of a sequence laid out as the primals."""
        flat = list(flat)
        return flat[:self.n_c], flat[self.n_c:self.outside(0)], flat[self.outside(0):]


@dataclasses.dataclass(frozen=True)
class _SavedLayout:
    """What the backward reads besides its carry: ``*stacked, *aliased x slices, *rest``.

    ``rest`` is the stacked ys' gradients in the backward loop's xs, and the
    outside tensors in what the autograd function saves.
    """

    num_stacked: int
    num_aliased: int

    def split(self, flat: Sequence[Any]) -> tuple[list, list, list]:
        flat = list(flat)
        a, b = self.num_stacked, self.num_stacked + self.num_aliased
        return flat[:a], flat[a:b], flat[b:]


class _Stacked(NamedTuple):
    """A saved activation the forward loop stacks: its ``index``-th stacked output."""

    index: int


class _Input(NamedTuple):
    """A saved activation that is an input of the forward graph, read again by the backward loop."""

    kind: str   # "x" (a slice of xs leaf ``index``) or "outside" (outside tensor ``index``)
    index: int


class _Recompute(NamedTuple):
    """A saved activation the backward loop recomputes from an input: casts and views, see :func:`_recompute_chain`."""

    base: _Input
    ops: list
    barrier: bool  # behind an optimization barrier (a gather fully_shard marked)


_Saved = _Stacked | _Input | _Recompute


def _input_source(node, placeholders: list, primals: _Primals) -> _Input | None:
    """The :class:`_Input` ``node`` is, when it is an x or outside input of the forward graph."""
    if node not in placeholders:
        return None
    pos = placeholders.index(node)
    if primals.x(0) <= pos < primals.outside(0):
        return _Input("x", pos - primals.x(0))
    if pos >= primals.outside(0):
        return _Input("outside", pos - primals.outside(0))
    return None


# Single-input ops that are free to recompute in the backward: casts and views.
_PASSTHROUGH = {
    torch.ops.aten._to_copy.default,
    torch.ops.prims.convert_element_type.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.t.default,
    torch.ops.aten.permute.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.view.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim,
    torch.ops.aten.expand.default,
}


def _recompute_chain(node, placeholders: list) -> tuple[Any, list, bool] | None:
    """``(input node, [ops], marked)`` when ``node`` is cheap to recompute in the backward.

    That is: casts and views applied to a graph input, possibly around a
    sharding annotation; ``marked`` when one is marked ``recompute_in_backward``
    (FSDP's gather). A transposed weight that a matmul saved is such a chain:
    reading the weight slice again is free, stacking it would copy every layer.
    """
    ops = []
    marked = False
    base = node
    while base not in placeholders:
        target = getattr(base, "target", None)
        mark = regather_mark(base)
        if mark is not None:
            if not mark:
                return None
            marked = True
        elif target not in _PASSTHROUGH:
            return None
        ops.append(base)
        base = base.args[0]
    return base, [(op.target, tuple(op.args[1:]), dict(op.kwargs)) for op in reversed(ops)], marked


def _replay(value: torch.Tensor, ops: list, barrier: bool) -> torch.Tensor:
    """Recompute a saved value from its input; behind an optimization barrier if ``barrier``."""
    if barrier:
        value = behind_barrier(value)
    for target, args, kwargs in ops:
        value = target(value, *args, **kwargs)
    return value
