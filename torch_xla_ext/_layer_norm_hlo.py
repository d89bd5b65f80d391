"""LayerNorm's forward and closed-form backward as one prebuilt XLA computation each, for lazy tensors.

Written op by op (:mod:`._partitionable`), a LayerNorm records ~10 lazy ops
forward and ~13 backward; at ~3-8 us of host time each that was the largest
cost fully_shard added to a step's trace (measured at 16 decoder layers: 33
LayerNorm backwards took 3.7 ms of a 20 ms backward). Here each direction is
one ``_xla_user_computation`` node (~2 us), built once per shape and dtype.
The computation holds the same math with XLA's own ops (reductions, elementwise
ops, broadcasts); XLA inlines the call, and the SPMD partitioner shards it
like the op-by-op version (a test checks that a batch-sharded activation is
never gathered).

Only real lazy XLA tensors take this path. A tracer (scan's AOTAutograd trace
on fake tensors, ``torch.compile``) records the op-by-op version, which it can
differentiate; so does a backward under ``create_graph``.
"""

from __future__ import annotations

import functools
import math

import torch

from ._annotate import traced
from ._xla import xla_builder, xlac

__all__ = ["applies", "forward", "backward"]

_DTYPES = (torch.float32, torch.float64)


def applies(x: torch.Tensor) -> bool:
    """Whether ``x`` is a real lazy XLA tensor of a dtype the computations are built for."""
    return x.device.type == "xla" and x.dtype in _DTYPES and not traced(x)


def _add(a, b):
    return a + b


def _sum(value, dims: list[int], zero):
    return value.reduce(zero, _add, dims)


def _split(shape: tuple[int, ...], n: int) -> tuple[list[int], list[int]]:
    """The row dims and the normalized (last ``n``) dims of ``shape``."""
    rank = len(shape)
    return list(range(rank - n)), list(range(rank - n, rank))


@functools.lru_cache(maxsize=256)
def _forward_computation(dtype: torch.dtype, shape: tuple[int, ...], n: int, eps: float, has_weight: bool,
                         has_bias: bool):
    """``(x[, weight][, bias]) -> (y, mean, rstd)``; mean and rstd keep the normalized dims as size 1."""
    xb = xla_builder()
    etype = xb.Op.from_torch_type(dtype)
    b = xb.create_builder("txe_layer_norm")
    rows, normalized = _split(shape, n)
    dims = [shape[d] for d in normalized]
    x = xb.mkparam(b, 0, xb.mkshape(etype, shape))
    k = 1
    weight = bias = None
    if has_weight:
        weight, k = xb.mkparam(b, k, xb.mkshape(etype, tuple(dims))), k + 1
    if has_bias:
        bias = xb.mkparam(b, k, xb.mkshape(etype, tuple(dims)))
    zero = xb.Op.zero(b, dtype=etype)
    row_shape = [shape[d] for d in rows]
    count = xb.Op.scalar(b, float(math.prod(dims)), dtype=etype).broadcast(row_shape)
    mean = _sum(x, normalized, zero) / count
    centered = x - mean.broadcast_in_dim(list(shape), rows)
    var = _sum(centered * centered, normalized, zero) / count
    rstd = (var + xb.Op.scalar(b, eps, dtype=etype).broadcast(row_shape)).rsqrt()
    y = centered * rstd.broadcast_in_dim(list(shape), rows)
    if weight is not None:
        y = y * weight.broadcast_in_dim(list(shape), normalized)
    if bias is not None:
        y = y + bias.broadcast_in_dim(list(shape), normalized)
    kept = row_shape + [1] * n
    return xb.Op.tuple([y, mean.reshape(kept), rstd.reshape(kept)]).build("txe_layer_norm")


@functools.lru_cache(maxsize=256)
def _backward_computation(dtype: torch.dtype, shape: tuple[int, ...], n: int, has_weight: bool,
                          outputs: tuple[bool, bool, bool]):
    """``(dy, x[, weight], mean, rstd) -> (dx?, dweight?, dbias?)``, the ones ``outputs`` asks for."""
    xb = xla_builder()
    etype = xb.Op.from_torch_type(dtype)
    b = xb.create_builder("txe_layer_norm_backward")
    rows, normalized = _split(shape, n)
    dims = [shape[d] for d in normalized]
    kept = tuple(shape[d] for d in rows) + (1,) * n
    dy = xb.mkparam(b, 0, xb.mkshape(etype, shape))
    x = xb.mkparam(b, 1, xb.mkshape(etype, shape))
    k = 2
    weight = None
    if has_weight:
        weight, k = xb.mkparam(b, k, xb.mkshape(etype, tuple(dims))), k + 1
    everywhere = list(range(len(shape)))
    mean = xb.mkparam(b, k, xb.mkshape(etype, kept)).broadcast_in_dim(list(shape), everywhere)
    rstd = xb.mkparam(b, k + 1, xb.mkshape(etype, kept)).broadcast_in_dim(list(shape), everywhere)
    zero = xb.Op.zero(b, dtype=etype)
    count = xb.Op.scalar(b, float(math.prod(dims)), dtype=etype).broadcast([shape[d] for d in rows])
    xhat = (x - mean) * rstd
    g = dy * weight.broadcast_in_dim(list(shape), normalized) if weight is not None else dy

    def row_mean(value):
        return (_sum(value, normalized, zero) / count).broadcast_in_dim(list(shape), rows)

    want_dx, want_dw, want_db = outputs
    results = []
    if want_dx:
        results.append(rstd * (g - row_mean(g) - xhat * row_mean(g * xhat)))
    if want_dw:
        results.append(_sum(dy * xhat, rows, zero))
    if want_db:
        results.append(_sum(dy, rows, zero))
    return xb.Op.tuple(results).build("txe_layer_norm_backward")


def forward(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, n: int,
            eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(y, mean, rstd)`` of LayerNorm over the last ``n`` dims of ``x`` (all one dtype, see :func:`applies`)."""
    computation = _forward_computation(x.dtype, tuple(x.shape), n, eps, weight is not None, bias is not None)
    operands = [t for t in (x, weight, bias) if t is not None]
    y, mean, rstd = xlac()._xla_user_computation("xla::txe_layer_norm", operands, computation)
    return y, mean, rstd


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor,
             rstd: torch.Tensor, n: int, outputs: tuple[bool, bool, bool]) -> list[torch.Tensor | None]:
    """``[dx, dweight, dbias]``, None where ``outputs`` does not ask for one (dweight needs ``weight``)."""
    outputs = (outputs[0], outputs[1] and weight is not None, outputs[2])
    results = iter(())
    if any(outputs):
        computation = _backward_computation(x.dtype, tuple(x.shape), n, weight is not None, outputs)
        operands = [t for t in (dy, x, weight, mean, rstd) if t is not None]
        results = iter(xlac()._xla_user_computation("xla::txe_layer_norm_backward", operands, computation))
    return [next(results) if wanted else None for wanted in outputs]
