"""The XLA ``while`` loop: lowering one traced step into it, and adding it to the lazy graph."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..lowering import LoweringContext
from .._xla import torch_xla_device, xla_builder, xlac
from .backend import _bound, _guard
from .trace import _signature, _Traced


class _Loop(NamedTuple):
    """A lowered while loop and how to assemble its operands."""

    computation: Any
    num_carry: int
    num_xs: int
    y_shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    num_outside: int                     # outside operands, passed to each run (never held)
    constants: tuple[torch.Tensor, ...]  # device data the step created while traced
    uses_seed: bool

def _sizes(op) -> list[int]:
    return list(op.shape().sizes)

def _slice_op(op, idx, zero):
    sizes = _sizes(op)
    start = [idx] + [zero] * (len(sizes) - 1)
    return op.dynamic_slice(start, [1] + sizes[1:]).reshape(sizes[1:])

def _update_op(op, value, idx, zero):
    """``op[idx] = value`` along dim 0."""
    sizes = _sizes(op)
    start = [idx] + [zero] * (len(sizes) - 1)
    return op.dynamic_update_slice(value.reshape([1] + sizes[1:]), start)

def _lower(traced: _Traced, length: int, reverse: bool, name: str) -> _Loop:
    """``while i < length: carry, ys[idx] = step(carry, xs[idx])`` as one XLA computation.

    Operands: ``i, *carry, *xs, *ys, *outside, *constants[, seed], bound``. ``idx`` is
    ``i`` or ``length - 1 - i``; the step's RNG seed becomes ``seed + idx``.
    """
    xb = xla_builder()
    for i, (before, after) in enumerate(zip(traced.carry_ph, traced.carry_out)):
        if _signature(before) != _signature(after):
            raise ValueError(
                f"scan: fn changed carry leaf {i} from {tuple(before.shape)} {before.dtype} to "
                f"{tuple(after.shape)} {after.dtype}; fn must return a carry like init"
            )
    ctx = LoweringContext(name)
    ctx.build(traced.carry_out + traced.ys)
    inputs = traced.carry_ph + traced.x_ph + traced.outside_ph
    ids = ctx.tensor_parameter_ids(inputs)
    taken = {i for i in ids if i >= 0}
    constants, constant_ids, seed_id = [], [], -1
    for p in ctx.parameters():
        if p.number in taken:
            continue
        if p.kind == "seed":
            seed_id = p.number
        elif p.tensor is not None:
            constants.append(p.tensor)
            constant_ids.append(p.number)
        else:  # pragma: no cover - the parameters of a lowered graph are device data
            raise RuntimeError(f"scan: HLO parameter {p.number} ({p.name}) is not backed by device data")
    num_params = len(ctx.module.entry_parameters)
    n_c, n_x, n_y = len(traced.carry_ph), len(traced.x_ph), len(traced.ys)
    n_o, n_k = len(traced.outside_ph), len(constants)

    builder = xb.create_builder(name)
    shapes = [xb.mkshape(xb.Type.S64, ())]
    shapes += [xb.tensor_shape(t) for t in traced.carry_ph]
    shapes += [xb.mkshape(xb.Op.from_torch_type(t.dtype), (length, *t.shape)) for t in traced.x_ph]
    # One stacked buffer per y (packing them by dtype compiles faster on CPU
    # but makes the SPMD partitioner reshard the packed rows every iteration).
    shapes += [xb.mkshape(xb.Op.from_torch_type(y.dtype), (length, *y.shape)) for y in traced.ys]
    shapes += [xb.tensor_shape(t) for t in traced.outside_ph]
    shapes += [xb.tensor_shape(t) for t in constants]
    if seed_id >= 0:
        shapes.append(xb.mkshape(xb.Type.S64, ()))
    shapes.append(xb.mkshape(xb.Type.S32, (1,)))
    operands = [xb.mkparam(builder, k, s) for k, s in enumerate(shapes)]
    body = xb.computation_from_module_proto(name + "_step", ctx.hlo())

    def cond_fn(i, *_rest):
        return i < xb.Op.scalar(i.builder(), length, dtype=xb.Type.S64)

    def body_fn(i, *rest):
        rest = list(rest)
        carry, rest = rest[:n_c], rest[n_c:]
        xs, rest = rest[:n_x], rest[n_x:]
        ys, rest = rest[:n_y], rest[n_y:]
        invariant = rest  # outside, constants, seed: passed through unchanged
        b = i.builder()
        zero = xb.Op.scalar(b, 0, dtype=xb.Type.S64)
        idx = xb.Op.scalar(b, length - 1, dtype=xb.Type.S64) - i if reverse else i
        args: list[Any] = [None] * num_params
        bound = invariant[-1].reshape([])
        slices = [_guard(bound, _sizes(x)[1:], x.shape().dtype)(_slice_op(x, idx, zero)) for x in xs]
        for pid, op in zip(ids, carry + slices + invariant[:n_o]):
            if pid >= 0:
                args[pid] = op
        for pid, op in zip(constant_ids, invariant[n_o:n_o + n_k]):
            args[pid] = op
        if seed_id >= 0:
            args[seed_id] = invariant[-2] + idx
        result = xb.Op.call(body, args)
        new_carry = [result.get_tuple_element(k) for k in range(n_c)]
        new_ys = []
        for k in range(n_y):
            y = result.get_tuple_element(n_c + k)
            y = _guard(bound, _sizes(y), y.shape().dtype)(y)
            new_ys.append(_update_op(ys[k], y, idx, zero))
        one = xb.Op.scalar(b, 1, dtype=xb.Type.S64)
        return xb.Op.tuple([i + one] + new_carry + xs + new_ys + invariant)

    computation = xb.Op.mkwhile(operands, cond_fn, body_fn).build(name)
    return _Loop(
        computation=computation,
        num_carry=n_c,
        num_xs=n_x,
        y_shapes=tuple((tuple(y.shape), y.dtype) for y in traced.ys),
        num_outside=len(traced.outside_ph),
        constants=tuple(constants),
        uses_seed=seed_id >= 0,
    )

def _run(loop: _Loop, init: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], length: int,
         outside: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Add the loop to the lazy graph; returns (carry, ys) as lazy XLA tensors.

    ``outside`` are the tensors this call's step reads from outside, in the
    order the loop was lowered with (never the ones of an earlier call).
    """
    if len(outside) != loop.num_outside:  # pragma: no cover - the plan's key fixes the count
        raise RuntimeError(f"scan: internal error: {len(outside)} outside operands for a loop lowered with "
                           f"{loop.num_outside}")
    device = torch_xla_device()
    operands = [torch.zeros((), dtype=torch.int64, device=device), *init, *xs]
    operands += [torch.zeros((length, *shape), dtype=dtype, device=device) for shape, dtype in loop.y_shapes]
    operands += list(outside)
    operands += list(loop.constants)
    if loop.uses_seed:
        # A fresh base seed per call from torch's default generator, so results
        # are reproducible under torch.manual_seed; step idx uses base + idx.
        # (8 bytes host->device; nothing moves device->host.)
        base = torch.randint(0, 2**62, (), dtype=torch.int64)
        operands.append(base.to(device))
    operands.append(_bound())
    out = xlac()._xla_user_computation("xla::txe_scan", operands, loop.computation)
    n_c, n_x = loop.num_carry, loop.num_xs
    return list(out[1:1 + n_c]), list(out[1 + n_c + n_x:1 + n_c + n_x + len(loop.y_shapes)])
