"""The XLA ``while`` loop: lowering one traced step into it, and adding it to the lazy graph."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..lowering import LoweringContext
from .._xla import torch_xla_device, xla_builder, xlac
from .backend import _guard, _scalar_guard, computation_name, cpu_codegen, runtime_bound
from .trace import _signature, _Traced


#: The most iterations one loop runs. Its counter is s32: the TPU compiler
#: splits a 64-bit integer into two 32-bit halves, and behind a split counter
#: it no longer sees that the loop writes every row of its stacked outputs
#: (it then fills them with zeros first, a pass and code that grow with L).
MAX_LENGTH = 2**31 - 1


class _Groups(NamedTuple):
    """A loop's operands (or results) by role."""

    i: Any
    carry: list
    xs: list
    ys: list
    outside: list
    constants: list
    seed: Any | None


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The loop's operand tuple: ``i, *carry, *xs, *ys, *outside, *constants[, seed]``.

    ``ys`` are the stacked outputs, written one row per iteration; everything
    after them is loop-invariant. ``seed`` is there when the step draws random
    numbers.
    """

    num_carry: int
    num_xs: int
    num_ys: int
    num_outside: int
    num_constants: int
    has_seed: bool

    def split(self, flat: Sequence[Any]) -> _Groups:
        flat = list(flat)
        edges = [1]
        for n in (self.num_carry, self.num_xs, self.num_ys, self.num_outside, self.num_constants):
            edges.append(edges[-1] + n)
        rest = flat[edges[-1]:]
        seed = rest.pop(0) if self.has_seed else None
        if rest:  # pragma: no cover - the layout and the tuple come from one lowering
            raise RuntimeError(f"scan: internal error: {len(rest)} loop operands beyond the layout {self}")
        groups = [flat[a:b] for a, b in zip(edges, edges[1:])]
        return _Groups(flat[0], *groups, seed)

    def join(self, groups: _Groups) -> list[Any]:
        flat = [groups.i, *groups.carry, *groups.xs, *groups.ys, *groups.outside, *groups.constants]
        return flat + ([groups.seed] if self.has_seed else [])


class _Loop(NamedTuple):
    """A lowered while loop, its operand layout and the device data it reads besides its inputs."""

    computation: Any
    layout: _Layout
    y_shapes: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    constants: tuple[torch.Tensor, ...]  # device data the step created while traced


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

    Operands as :class:`_Layout` says. ``idx`` is ``i`` or ``length - 1 - i``;
    the step's RNG seed becomes ``seed + idx``.
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
    layout = _Layout(len(traced.carry_ph), len(traced.x_ph), len(traced.ys), len(traced.outside_ph), len(constants),
                     has_seed=seed_id >= 0)
    guarded = cpu_codegen()

    builder = xb.create_builder(computation_name(name, guarded))
    shapes = [xb.mkshape(xb.Type.S32, ())]
    shapes += [xb.tensor_shape(t) for t in traced.carry_ph]
    shapes += [xb.mkshape(xb.Op.from_torch_type(t.dtype), (length, *t.shape)) for t in traced.x_ph]
    # One stacked buffer per y (packing them by dtype compiles faster on CPU
    # but makes the SPMD partitioner reshard the packed rows every iteration).
    shapes += [xb.mkshape(xb.Op.from_torch_type(y.dtype), (length, *y.shape)) for y in traced.ys]
    shapes += [xb.tensor_shape(t) for t in traced.outside_ph]
    shapes += [xb.tensor_shape(t) for t in constants]
    if layout.has_seed:
        shapes.append(xb.mkshape(xb.Type.S64, ()))
    operands = [xb.mkparam(builder, k, s) for k, s in enumerate(shapes)]
    body = xb.computation_from_module_proto(name + "_step", ctx.hlo())

    def cond_fn(i, *_rest):
        return i < xb.Op.scalar(i.builder(), length, dtype=xb.Type.S32)

    def body_fn(*flat):
        ops = layout.split(flat)
        b = ops.i.builder()
        zero = xb.Op.scalar(b, 0, dtype=xb.Type.S32)
        idx = xb.Op.scalar(b, length - 1, dtype=xb.Type.S32) - ops.i if reverse else ops.i
        bound = runtime_bound(ops.i) if guarded else None
        args: list[Any] = [None] * num_params
        slices = [_guard(bound, _sizes(x)[1:], x.shape().dtype)(_slice_op(x, idx, zero)) for x in ops.xs]
        for pid, op in zip(ids, ops.carry + slices + ops.outside):
            if pid >= 0:
                args[pid] = op
        for pid, op in zip(constant_ids, ops.constants):
            args[pid] = op
        if layout.has_seed:
            args[seed_id] = ops.seed + idx.cast(xb.Type.S64)
        result = xb.Op.call(body, args)
        new_carry = [result.get_tuple_element(k) for k in range(layout.num_carry)]
        new_ys = []
        for k, stacked in enumerate(ops.ys):
            y = result.get_tuple_element(layout.num_carry + k)
            y = _scalar_guard(bound, _sizes(y), y.shape().dtype)(y)
            new_ys.append(_update_op(stacked, y, idx, zero))
        one = xb.Op.scalar(b, 1, dtype=xb.Type.S32)
        return xb.Op.tuple(layout.join(ops._replace(i=ops.i + one, carry=new_carry, ys=new_ys)))

    # The counter starts from a constant, not from parameter 0 (which the call
    # still passes): the loop then has the counted form whose trip count the
    # HLO reader reads (HloModule.while_loops()), for tpu.compile's costs.
    operands[0] = xb.Op.scalar(builder, 0, dtype=xb.Type.S32)
    computation = xb.Op.mkwhile(operands, cond_fn, body_fn).build(computation_name(name, guarded))
    return _Loop(computation, layout, tuple((tuple(y.shape), y.dtype) for y in traced.ys), tuple(constants))


def _run(loop: _Loop, init: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], length: int,
         outside: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Add the loop to the lazy graph; returns (carry, ys) as lazy XLA tensors.

    ``outside`` are the tensors this call's step reads from outside, in the
    order the loop was lowered with (never the ones of an earlier call).
    """
    layout = loop.layout
    if len(outside) != layout.num_outside:  # pragma: no cover - the plan's key fixes the count
        raise RuntimeError(f"scan: internal error: {len(outside)} outside operands for a loop lowered with "
                           f"{layout.num_outside}")
    device = torch_xla_device()
    seed = None
    if layout.has_seed:
        # A fresh base seed per call drawn on the device, from torch_xla's
        # generator, as the eager loop's random ops on the device draw: the
        # host generators (torch's CPU one included) stay where the loop
        # leaves them. Step idx uses base + idx. Nothing moves to the host.
        seed = torch.randint(0, 2**62, (), dtype=torch.int64, device=device)
    operands = _Groups(
        i=torch.zeros((), dtype=torch.int32, device=device),
        carry=list(init),
        xs=list(xs),
        ys=[torch.zeros((length, *shape), dtype=dtype, device=device) for shape, dtype in loop.y_shapes],
        outside=list(outside),
        constants=list(loop.constants),
        seed=seed,
    )
    out = layout.split(xlac()._xla_user_computation("xla::txe_scan", layout.join(operands), loop.computation))
    return out.carry, out.ys
