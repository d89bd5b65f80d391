"""Lowering choices that exist for one backend's code generation (XLA:CPU)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._xla import torch_xla_device, xla_builder
from .cache import on_clear


# XLA:CPU emits each fusion as loops over its output's per-device shape (a
# dynamic-update-slice fusion over the whole buffer), and LLVM unrolls a plain
# copy loop over a small block completely: a [16, 512] block becomes ~350 KB
# of IR that compiles slower than the rest of its fusion together. A select
# whose predicate varies by row and is unknown until run time,
# ``iota(rows) < bound`` with ``bound`` an operand that always exceeds the row
# count, keeps such loops loops; unlike arithmetic it keeps every bit. Every
# slice a loop reads and every value it stores goes through it, and so does
# every gradient scan_layers hands back to a layer.
_BOUND = 2**31 - 1

def _guard(bound, sizes: list[int], etype) -> Callable:
    """``value -> select(iota(rows) < bound, value, 0)`` for values of ``sizes`` (identity for scalars).

    ``bound`` is the S32 scalar :data:`_BOUND`, passed in at run time (see :func:`_bound`).
    """
    if not sizes or sizes[0] > _BOUND:  # an S32 iota could not count the rows
        return lambda value: value
    xb = xla_builder()
    b = bound.builder()
    rows = xb.Op.iota(b, xb.mkshape(xb.Type.S32, tuple(sizes)), 0)
    keep = rows < bound.broadcast(sizes)
    zeros = xb.Op.zero(b, dtype=etype).broadcast(sizes)
    return lambda value: keep.select(value, zeros)

_bound_tensors: dict[str, torch.Tensor] = {}

def _bound() -> torch.Tensor:
    """An int32 ``[_BOUND]`` on the XLA device (cached): the runtime bound of :func:`_guard`."""
    device = str(torch_xla_device())
    if device not in _bound_tensors:
        _bound_tensors[device] = torch.tensor([_BOUND], dtype=torch.int32).to(device)
    return _bound_tensors[device]


@on_clear
def _clear_bound() -> None:
    _bound_tensors.clear()
