"""``scan`` and ``scan_layers``: XLA ``while`` loops over a traced step function.

``scan(fn, init, xs)`` has the semantics of ``jax.lax.scan``. ``fn`` is traced
once on placeholder tensors (no device memory, nothing executed), lowered to
HLO with :class:`~torch_xla_ext.LoweringContext`, and called from the body of a
single XLA ``while`` loop. Every tensor the body reads besides its carry and
slice -- tensors ``fn`` closes over, tensors it creates, the RNG seed -- is a
loop-invariant operand fetched as a device reference (sharding kept, nothing
copied to the host).

Tensors ``fn`` closes over are *lifted*: a ``TorchFunctionMode`` active while
``fn`` is traced substitutes each XLA tensor that was neither passed in nor
created by ``fn`` with a placeholder, so outside tensors become explicit loop
operands, receive gradients, and may not be written by ``fn``. This lazy trace
runs on every call (see :mod:`torch_xla_ext._lift`): the operands are the
tensors ``fn`` reads on *this* call, and a lowered loop is reused only for a
trace with the same fingerprint, so no value is ever served stale.

Autograd: ``fn`` is split by AOTAutograd into a forward graph (outputs plus
saved activations) and a backward graph, with ``partition_fn`` choosing what
is saved and what is recomputed. The forward graph runs as one while loop that
also stacks the saved activations; the backward graph runs as a second, reverse
while loop that carries the carry's gradient and accumulates the gradients of
lifted outside tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import re
import threading
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.utils._pytree as pytree

from ._annotate import behind_barrier, fresh_node, is_replicated_spec
from ._lift import Lifter, graph_hash
from ._format import parse_tiled_spec
from .lowering import LoweringContext, _require_xla_tensor

__all__ = ["scan", "scan_layers", "scan_cache_info", "clear_scan_cache", "ScanCacheInfo"]

PyTree = Any
Sig = tuple[tuple[int, ...], torch.dtype]

# --------------------------------------------------------------------------- #
# Pytree helpers.
# --------------------------------------------------------------------------- #


def _leaves_with_paths(tree: PyTree, root: str) -> tuple[list[tuple[str, Any]], pytree.TreeSpec]:
    flat, spec = pytree.tree_flatten_with_path(tree)
    return [(root + pytree.keystr(path), leaf) for path, leaf in flat], spec


def _check_tensor_leaves(named: list[tuple[str, Any]], allow_none: bool, who: str = "") -> None:
    for path, leaf in named:
        if leaf is not None or not allow_none:
            _require_xla_tensor(leaf, f"scan: {who}{path}")


def _signature(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype)


# --------------------------------------------------------------------------- #
# The while loop.
# --------------------------------------------------------------------------- #


# --------------------------------------------------------------------------- #
# Tracing and lowering one step into a while loop.
# --------------------------------------------------------------------------- #


def _xb():
    import torch_xla.core.xla_builder as xb

    return xb


def _placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A device tensor with a shape and a dtype but no buffer: for tracing only."""
    return _xb().create_placeholder_tensor(tuple(shape), dtype)


def _not_device_data(t: torch.Tensor) -> torch.Tensor:
    # A pending computation instead of device data, so that mark_sharding
    # inside fn annotates the value rather than replacing the tensor's data,
    # which would detach it from its HLO parameter.
    return fresh_node(t)


@contextlib.contextmanager
def _rng_state_kept():
    """Undo the advance of torch_xla's RNG state caused by random ops traced in fn.

    The loop draws its own seeds, so a traced call and a cached call leave the
    RNG state in the same place. Reading the state moves no data.
    """
    import torch_xla.core.xla_model as xm

    state = xm.get_rng_state()
    try:
        yield
    finally:
        xm.set_rng_state(state)


def _sharding_of(t: torch.Tensor) -> Any:
    """``t``'s sharding annotation (an ``OpSharding``), or None when it has none or is replicated.

    Holding this rather than ``t`` matters: a tensor kept alive until the next
    sync becomes an output of the synced graph and is materialized.
    """
    import torch_xla

    X = torch_xla._XLAC
    return None if is_replicated_spec(X._get_xla_sharding_spec(t)) else X._get_xla_op_sharding(t)


def _canonical_specs(tensors: list[torch.Tensor]) -> list[str]:
    """Sharding strings with both spellings of "not sharded" (``''`` and ``'{replicated}'``) as ``'{replicated}'``.

    The spelling changes under the caller: after an execution, or once torch_xla
    has propagated shardings through a user computation the tensor feeds.
    """
    import torch_xla

    specs = torch_xla._XLAC._get_xla_sharding_specs(tensors) if tensors else []
    return ["{replicated}" if is_replicated_spec(spec) else spec for spec in specs]


def _apply_shardings(values: Sequence[torch.Tensor | None], shardings: Sequence[Any]) -> None:
    """Annotate each lazy value with its ``OpSharding`` (from :func:`_sharding_of`), where it has one."""
    import torch_xla

    for value, sharding in zip(values, shardings):
        if value is not None and sharding is not None:
            torch_xla._XLAC._xla_mark_sharding(value, sharding)


def _shard_like(values: Sequence[torch.Tensor | None], refs: Sequence[torch.Tensor | None]) -> None:
    """Annotate each lazy value with its reference tensor's sharding, if it has one."""
    _apply_shardings(values, [None if r is None else _sharding_of(r) for r in refs])


class _Traced(NamedTuple):
    """One lazy trace of a flat step function on placeholders."""

    carry_ph: list[torch.Tensor]    # placeholders for the carry leaves
    x_ph: list[torch.Tensor]        # placeholders for one slice of each xs leaf
    outside_ph: list[torch.Tensor]  # placeholders for the outside tensors
    outside: list[torch.Tensor]     # outside tensors the step read, in order of first use (lifting traces)
    carry_out: list[torch.Tensor]
    ys: list[torch.Tensor]
    mutated: tuple[int, ...]        # carry + x leaves the step wrote into, by position
    fingerprint: tuple              # what a cached loop must match (lifting traces; see Lifter)
    held: list[Any]                 # objects the fingerprint names by identity


def _trace(step: Callable, carry: Sequence[Sig], x: Sequence[Sig], outside: Sequence[Sig] | None = None) -> _Traced:
    """Run ``step`` lazily on placeholders; nothing executes and no device memory is allocated.

    See :func:`_trace_on_placeholders`. If ``step`` raises, the locals of the
    frames the exception passed through are cleared (the traceback still names
    every file and line): they hold lazy tensors over placeholders, which the
    next ``torch_xla.sync()`` would try to execute if the exception were kept
    (a failed test's report, ``sys.last_traceback``).
    """
    try:
        return _trace_on_placeholders(step, carry, x, outside)
    except BaseException as error:
        seen: set[int] = set()
        chained: BaseException | None = error
        while chained is not None and id(chained) not in seen:
            seen.add(id(chained))
            traceback.clear_frames(chained.__traceback__)
            chained = chained.__cause__ or chained.__context__
        raise


def _trace_on_placeholders(step: Callable, carry: Sequence[Sig], x: Sequence[Sig],
                           outside: Sequence[Sig] | None) -> _Traced:
    """Run ``step`` lazily on placeholders.

    With ``outside=None`` this is the lifting trace of a user step,
    ``step(carry, x)``: outside tensors it reads are lifted (see
    :class:`~torch_xla_ext._lift.Lifter`) and the trace is fingerprinted. With
    ``outside`` signatures, ``step(carry, x, outside)`` receives placeholders for
    them and may read no other outside tensor (the autograd graphs).
    """
    carry_ph = [_placeholder(*s) for s in carry]
    x_ph = [_placeholder(*s) for s in x]
    outside_ph: list[torch.Tensor] = []

    def standin(t: torch.Tensor) -> torch.Tensor:
        ph = _placeholder(t.shape, t.dtype)
        outside_ph.append(ph)
        return _not_device_data(ph)

    carry_in = [_not_device_data(t) for t in carry_ph]
    x_in = [_not_device_data(t) for t in x_ph]
    lifting = outside is None
    if lifting:
        lifter = Lifter(carry_in + x_in + carry_ph + x_ph, standin, record=True)
        # Written inputs: in-place ops (also through views) bump the version
        # counter; ops that update an argument from C++ (batch_norm's running
        # stats) change only its graph. A sharding annotation changes the graph
        # too, and then the input counts as written (a copy is harmless).
        before = [(t._version, graph_hash([t])) for t in carry_in + x_in]
        with lifter, _rng_state_kept():
            carry_out, ys = step(carry_in, x_in)
        lifter.check_outside_unchanged()
        bumped = tuple(k for k, (t, (v, _)) in enumerate(zip(carry_in + x_in, before)) if t._version != v)
        mutated = tuple(k for k, (t, (v, h)) in enumerate(zip(carry_in + x_in, before))
                        if k in bumped or graph_hash([t]) != h)
        _check_no_y_aliases_written_carry(ys, carry_in, bumped)
    else:
        outside_ph = [_placeholder(*s) for s in outside]
        outside_in = [_not_device_data(t) for t in outside_ph]
        lifter = Lifter(carry_in + x_in + outside_in + carry_ph + x_ph + outside_ph, None)
        with lifter, _rng_state_kept():
            carry_out, ys = step(carry_in, x_in, outside_in)
        mutated = ()
    carry_out, ys = list(carry_out), list(ys)
    fingerprint = lifter.fingerprint(carry_out + ys) if lifting else ()
    return _Traced(carry_ph, x_ph, outside_ph, list(lifter.outside), carry_out, ys, mutated, fingerprint,
                   lifter.held)


def _check_no_y_aliases_written_carry(ys: Sequence[torch.Tensor], carry_in: Sequence[torch.Tensor],
                                       mutated: tuple[int, ...]) -> None:
    """Refuse a y that is (a view of) a carry leaf fn updates in place.

    In the Python loop that y is the next iteration's carry, updated in place
    again: every such y ends up equal to the final carry. A loop that stacks
    each iteration's value would return something else.
    """
    for i in (k for k in mutated if k < len(carry_in)):
        c = carry_in[i]
        for j, y in enumerate(ys):
            if y is c or (y._is_view() and y._base is c):
                raise ValueError(
                    f"scan: fn updates carry leaf {i} in place and also returns it as y leaf {j}; in the Python "
                    f"loop every such y aliases the final carry. Return a copy (y = c.clone()) or update the "
                    f"carry out of place (c = c + ...)."
                )


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
    xb = _xb()
    b = bound.builder()
    rows = xb.Op.iota(b, xb.mkshape(xb.Type.S32, tuple(sizes)), 0)
    keep = rows < bound.broadcast(sizes)
    zeros = xb.Op.zero(b, dtype=etype).broadcast(sizes)
    return lambda value: keep.select(value, zeros)


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
    xb = _xb()
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
    import torch_xla

    if len(outside) != loop.num_outside:  # pragma: no cover - the plan's key fixes the count
        raise RuntimeError(f"scan: internal error: {len(outside)} outside operands for a loop lowered with "
                           f"{loop.num_outside}")
    device = torch_xla.device()
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
    out = torch_xla._XLAC._xla_user_computation("xla::txe_scan", operands, loop.computation)
    n_c, n_x = loop.num_carry, loop.num_xs
    return list(out[1:1 + n_c]), list(out[1 + n_c + n_x:1 + n_c + n_x + len(loop.y_shapes)])


# --------------------------------------------------------------------------- #
# Autograd: forward and backward graphs from AOTAutograd, each run as a loop.
# --------------------------------------------------------------------------- #


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


@contextlib.contextmanager
def _traceable_mark_sharding(lifter: Lifter):
    """Make ``xs.mark_sharding`` inside fn work while AOTAutograd traces it.

    The plain annotation cannot apply to the fake tensors of a trace. While
    tracing, ``torch_xla.distributed.spmd.mark_sharding`` on a fake tensor
    records torch_xla's traceable sharding op (which also shards the
    gradient) and later uses of the tensor read the annotated value.
    """
    import torch_xla.distributed.spmd as xs
    import torch_xla.distributed.spmd.xla_sharding as xla_sharding
    from torch._subclasses.fake_tensor import is_fake

    original = xla_sharding.mark_sharding

    def mark_sharding(t, mesh, partition_spec):
        if not isinstance(t, torch.Tensor) or not is_fake(t):
            return original(t, mesh, partition_spec)
        annotated = xla_sharding.MarkShardingFunction.apply(lifter.resolve(t), mesh, partition_spec)
        lifter.alias(t, annotated)
        return annotated

    xs.mark_sharding = xla_sharding.mark_sharding = mark_sharding
    try:
        yield
    finally:
        xs.mark_sharding = xla_sharding.mark_sharding = original


def _input_source(node, placeholders: list, n_c: int, n_x: int) -> tuple[str, int] | None:
    """("x", j) or ("outside", k) when ``node`` is that input of the forward graph."""
    if node not in placeholders:
        return None
    pos = placeholders.index(node)
    if n_c <= pos < n_c + n_x:
        return ("x", pos - n_c)
    if pos >= n_c + n_x:
        return ("outside", pos - n_c - n_x)
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
    from ._annotate import ANNOTATE_OP

    ops = []
    marked = False
    base = node
    while base not in placeholders:
        target = getattr(base, "target", None)
        if target is ANNOTATE_OP:
            if not base.args[3]:
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


class _GradPlan:
    """``fn`` split into forward/backward graphs, and the loops that run them.

    Primal inputs of the graphs are ``carry + x + outside``. The forward graph
    returns ``carry_out + y + saved``; saved activations that are just an x
    slice or an outside tensor are not stacked by the forward loop but read
    again by the backward loop.
    """

    def __init__(self, step: Callable, carry: list[Sig], x: list[Sig], x_grad: list[bool],
                 outside: list[torch.Tensor], mutated: tuple[int, ...], length: int, reverse: bool,
                 partition_fn: Callable | None) -> None:
        """``outside`` are the current call's outside tensors: traced through, never held.

        ``mutated`` lists the carry and x leaves ``step`` writes into (by
        position in ``carry + x``): ``step`` gets its own copies of them, as
        the Python loop's ``fn`` would write into values it alone holds.
        """
        from functorch.compile import aot_function, default_partition, make_boxed_func

        self.n_c, self.n_x, self.n_o = len(carry), len(x), len(outside)
        self.length, self.reverse = length, reverse
        self.outside_sig: list[Sig] = [_signature(t) for t in outside]
        captured: dict[str, torch.fx.GraphModule] = {}

        def capture(kind: str):
            def compiler(gm: torch.fx.GraphModule, _inputs):
                captured[kind] = gm
                return make_boxed_func(gm)

            return compiler

        n_c, n_x = self.n_c, self.n_x

        def primal_fn(*args):
            # AOTAutograd would turn a write into an input into an extra leading
            # output; the step writes into copies instead.
            own = [a.clone() if k in mutated else a for k, a in enumerate(args[:n_c + n_x])]
            lifter = Lifter([*args, *own], None, fixed=list(zip(outside, args[n_c + n_x:])))
            with lifter, _traceable_mark_sharding(lifter):
                carry_out, ys = step(own[:n_c], own[n_c:])
            carry_out = [lifter.resolve(o) for o in carry_out]
            ys = [lifter.resolve(o) for o in ys]
            ins = {id(a) for a in args}
            # Outputs aliasing inputs would be rebuilt outside the captured graph.
            return tuple(o.clone() if id(o) in ins or o._is_view() else o for o in carry_out + ys)

        import torch_xla

        device = torch_xla.device()

        def example(shape, dtype, grad: bool) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device).requires_grad_(grad)

        args = [example(s, d, _is_float_dtype(d)) for s, d in carry]
        args += [example(s, d, g and _is_float_dtype(d)) for (s, d), g in zip(x, x_grad)]
        args += [example(t.shape, t.dtype, t.requires_grad) for t in outside]
        with torch.enable_grad():
            compiled = aot_function(primal_fn, fw_compiler=capture("fw"), bw_compiler=capture("bw"),
                                    partition_fn=partition_fn or default_partition, enable_log=False)
            outs = compiled(*args)
            self.tangent_mask = [o.requires_grad for o in outs]
            diff = [o for o in outs if o.requires_grad]
            if diff:
                torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
        self.num_y = len(outs) - n_c
        self.fw = captured["fw"]
        self.bw = captured.get("bw")
        self.grad_mask = [a.requires_grad for a in args]
        out_nodes = list(next(n for n in self.fw.graph.nodes if n.op == "output").args[0])
        placeholders = [n for n in self.fw.graph.nodes if n.op == "placeholder"]
        saved_nodes = out_nodes[len(outs):]
        # Where each saved activation comes from: ("stacked", k) -- stacked by the
        # forward loop; ("x", j) / ("outside", k) -- an input, read again by the
        # backward loop; ("recompute", (kind, index), ops, marked) -- casts and
        # views of an x or outside input, replayed by the backward loop (behind
        # an optimization barrier when they gather: see _recompute_chain).
        self.saved_src: list[tuple] = []
        stacked = 0
        for node in saved_nodes:
            source = _input_source(node, placeholders, n_c, n_x)
            chain = _recompute_chain(node, placeholders) if source is None else None
            base = _input_source(chain[0], placeholders, n_c, n_x) if chain is not None else None
            if source is not None:
                self.saved_src.append(source)
            elif base is not None:
                self.saved_src.append(("recompute", base, *chain[1:]))
            else:
                self.saved_src.append(("stacked", stacked))
                stacked += 1
        self.num_stacked = stacked
        self.x_aliased = sorted({src[1] for src in self._input_reads() if src[0] == "x"})
        self.carry_sig, self.x_sig = carry, x
        self.fwd_loop = _lower(_trace(self._forward_step, carry, x, self.outside_sig), length, reverse,
                               "scan_forward")
        self.saved_sig = [s for s in self.fwd_loop.y_shapes[self.num_y:]]
        self.y_sig = list(self.fwd_loop.y_shapes[:self.num_y])
        self._bwd_loop: _Loop | None = None

    def _input_reads(self) -> list[tuple[str, int]]:
        """The inputs the backward loop reads: aliased ones and the bases of recomputations."""
        reads = []
        for src in self.saved_src:
            if src[0] in ("x", "outside"):
                reads.append(src)
            elif src[0] == "recompute":
                reads.append(src[1])
        return reads

    def _forward_step(self, carry, x, outside):
        result = list(self.fw(*carry, *x, *outside))
        n_out = self.n_c + self.num_y
        saved = result[n_out:]
        stacked = [saved[i] for i, src in enumerate(self.saved_src) if src[0] == "stacked"]
        return result[:self.n_c], result[self.n_c:n_out] + stacked

    def _backward_step(self, carry, x, outside):
        n_c, n_x = self.n_c, self.n_x
        float_carry = [i for i in range(n_c) if _is_float_dtype(self.carry_sig[i][1])]
        grad_outside = [k for k in range(self.n_o) if self.grad_mask[n_c + n_x + k]]
        g = dict(zip(float_carry, carry[:len(float_carry)]))
        acc = carry[len(float_carry):]
        stacked = x[:self.num_stacked]
        x_slices = dict(zip(self.x_aliased, x[self.num_stacked:self.num_stacked + len(self.x_aliased)]))
        gy = x[self.num_stacked + len(self.x_aliased):]
        def read(kind: str, k: int) -> torch.Tensor:
            return stacked[k] if kind == "stacked" else x_slices[k] if kind == "x" else outside[k]

        saved = []
        for src in self.saved_src:
            if src[0] == "recompute":
                saved.append(_replay(read(*src[1]), src[2], barrier=src[3]))
            else:
                saved.append(read(src[0], src[1]))
        tangents = [g[i] for i in range(n_c) if self.tangent_mask[i]]
        tangents += [gy[j] for j in range(self.num_y) if self.tangent_mask[n_c + j]]
        grads = list(self.bw(*saved, *tangents))

        def grad_or_zeros(pos: int, sig: Sig) -> torch.Tensor:
            value = grads[pos] if pos < len(grads) else None
            return value if value is not None else torch.zeros(sig[0], dtype=sig[1], device=carry[0].device
                                                               if carry else x[0].device)

        new_g = [grad_or_zeros(i, self.carry_sig[i]) for i in float_carry]
        new_acc = [a + grad_or_zeros(n_c + n_x + k, self.outside_sig[k]) for a, k in zip(acc, grad_outside)]
        gx = [grad_or_zeros(n_c + j, self.x_sig[j]) for j in range(n_x) if self.grad_mask[n_c + j]]
        return new_g + new_acc, gx

    def backward_loop(self) -> _Loop:
        if self._bwd_loop is None:
            n_c, n_x = self.n_c, self.n_x
            carry = [self.carry_sig[i] for i in range(n_c) if _is_float_dtype(self.carry_sig[i][1])]
            carry += [self.outside_sig[k] for k in range(self.n_o) if self.grad_mask[n_c + n_x + k]]
            xs = list(self.saved_sig) + [self.x_sig[j] for j in self.x_aliased] + list(self.y_sig)
            self._bwd_loop = _lower(_trace(self._backward_step, carry, xs, self.outside_sig), self.length,
                                    not self.reverse, "scan_backward")
        return self._bwd_loop


def _is_float_dtype(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


class _ScanFunction(torch.autograd.Function):
    """Forward loop saving activations; backward loop in reverse."""

    @staticmethod
    def forward(ctx, plan: _GradPlan, *flat: torch.Tensor):
        n_c, n_x = plan.n_c, plan.n_x
        init, xs, outside = list(flat[:n_c]), list(flat[n_c:n_c + n_x]), list(flat[n_c + n_x:])
        with torch.no_grad():
            carry, ys_all = _run(plan.fwd_loop, init, xs, plan.length, outside)
        ys, stacked = ys_all[:plan.num_y], ys_all[plan.num_y:]
        ctx.plan = plan
        ctx.shardings = [_sharding_of(t) for t in init + xs + outside]
        # The backward reads the outside tensors of this call; saving them lets
        # autograd refuse a backward after they were modified in place, as eager does.
        ctx.save_for_backward(*stacked, *[xs[j] for j in plan.x_aliased], *outside)
        outs = carry + ys
        ctx.mark_non_differentiable(*[t for t in outs if not _is_float(t)])
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        plan: _GradPlan = ctx.plan
        n_c, n_x = plan.n_c, plan.n_x
        saved = list(ctx.saved_tensors)
        n_s, n_a = plan.num_stacked, len(plan.x_aliased)
        stacked, aliased_xs, outside = saved[:n_s], saved[n_s:n_s + n_a], saved[n_s + n_a:]
        import torch_xla

        device = torch_xla.device()

        def or_zeros(g, sig):
            return g if g is not None else torch.zeros(sig[0], dtype=sig[1], device=device)

        float_carry = [i for i in range(n_c) if _is_float_dtype(plan.carry_sig[i][1])]
        grad_outside = [k for k in range(plan.n_o) if plan.grad_mask[n_c + n_x + k]]
        init = [or_zeros(grads[i], plan.carry_sig[i]) for i in float_carry]
        init += [or_zeros(None, plan.outside_sig[k]) for k in grad_outside]
        gys = [or_zeros(grads[n_c + j], ((plan.length, *plan.y_sig[j][0]), plan.y_sig[j][1]))
               for j in range(plan.num_y)]
        with torch.no_grad():
            carry, gxs = _run(plan.backward_loop(), init, stacked + aliased_xs + gys, plan.length, outside)
        grad_init: list[torch.Tensor | None] = [None] * n_c
        for i, g in zip(float_carry, carry[:len(float_carry)]):
            grad_init[i] = g
        grad_outside_vals: list[torch.Tensor | None] = [None] * plan.n_o
        for k, g in zip(grad_outside, carry[len(float_carry):]):
            grad_outside_vals[k] = g
        grad_xs: list[torch.Tensor | None] = [None] * n_x
        for j, g in zip([j for j in range(n_x) if plan.grad_mask[n_c + j]], gxs):
            grad_xs[j] = g
        # Gradients are sharded like the tensors they belong to.
        _apply_shardings(grad_init, ctx.shardings[:n_c])
        _apply_shardings(grad_xs, ctx.shardings[n_c:n_c + n_x])
        _apply_shardings(grad_outside_vals, ctx.shardings[n_c + n_x:])
        return (None, *grad_init, *grad_xs, *grad_outside_vals)


# --------------------------------------------------------------------------- #
# Plans and their cache.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class _Plan:
    """The lowered loops for one fingerprint of ``fn``; they read outside tensors passed per call."""

    y_sig: list[Sig]              # per stacked y leaf
    held: list[Any]               # objects the fingerprint names by identity (kept alive with it)
    loop: _Loop | None = None      # forward-only
    grad: _GradPlan | None = None  # with autograd


class ScanCacheInfo(NamedTuple):
    """Counters of :func:`scan`'s trace cache (process-wide)."""

    traces: int  # calls that lowered fn into new loops (a miss)
    hits: int    # calls whose trace matched a cached plan's fingerprint
    size: int    # plans held


_cache_lock = threading.Lock()
_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Plans kept per fn, least recently used dropped first: a fn whose fingerprint
#: changes on every call (a Python number that keeps changing) must not grow
#: the cache without bound.
_PLANS_PER_FN = 16
_counters = {"traces": 0, "hits": 0}


def scan_cache_info() -> ScanCacheInfo:
    """How often :func:`scan` traced ``fn`` versus reused a cached plan."""
    with _cache_lock:
        return ScanCacheInfo(_counters["traces"], _counters["hits"], sum(len(v) for v in _cache.values()))


def clear_scan_cache() -> None:
    """Forget every cached plan (and the host tensors their fingerprints hold) and scan_layers' stacking helpers."""
    with _cache_lock:
        _cache.clear()
        _counters["traces"] = _counters["hits"] = 0
        _stack_computation.cache_clear()
        _unstack_computation.cache_clear()
        _index_tensors.clear()
        _bound_tensors.clear()


def _flat_step(fn: Callable, init_spec: pytree.TreeSpec, x_spec: pytree.TreeSpec | None,
               found: dict[str, Any]) -> Callable:
    """``fn`` on flat leaves, checking what it returns against ``init``."""

    def step(carry_leaves: list[torch.Tensor], x_leaves: list[torch.Tensor]):
        carry = pytree.tree_unflatten(carry_leaves, init_spec)
        x = None if x_spec is None else pytree.tree_unflatten(x_leaves, x_spec)
        out = fn(carry, x)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise TypeError(f"scan: fn must return a pair (carry, y), got {type(out).__name__}"
                            + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
        named, spec = _leaves_with_paths(out[0], "carry")
        if spec != init_spec:
            raise ValueError(f"scan: fn returned a carry with structure {spec}, but init has structure "
                             f"{init_spec}; the carry's structure must not change")
        _check_tensor_leaves(named, allow_none=False, who="fn's returned ")
        for (path, leaf), before in zip(named, carry_leaves):
            if _signature(leaf) != _signature(before):
                raise ValueError(
                    f"scan: fn changed {path} from shape {tuple(before.shape)} {before.dtype} to "
                    f"{tuple(leaf.shape)} {leaf.dtype}; the carry's shapes and dtypes must not change"
                )
        y_named, y_spec = _leaves_with_paths(out[1], "y")
        _check_tensor_leaves(y_named, allow_none=True, who="fn's returned ")
        found["y_spec"] = y_spec
        found["y_none"] = tuple(leaf is None for _, leaf in y_named)
        return [leaf for _, leaf in named], [leaf for _, leaf in y_named if leaf is not None]

    return step


def _make_plan(step: Callable, traced: _Traced, init: list[torch.Tensor], xs: list[torch.Tensor],
               length: int, reverse: bool, partition_fn: Callable | None) -> _Plan:
    """Lower the loops for ``traced`` (this call's lifting trace of ``step``)."""
    outside = traced.outside
    plan = _Plan([_signature(y) for y in traced.ys], traced.held)
    if length == 0:
        return plan
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in itertools.chain(init, xs, outside))
    if needs_grad:
        carry_sig = [_signature(t) for t in init]
        x_sig = [(tuple(t.shape[1:]), t.dtype) for t in xs]
        plan.grad = _GradPlan(step, carry_sig, x_sig, [t.requires_grad for t in xs], outside,
                              traced.mutated, length, reverse, partition_fn)
    else:
        plan.loop = _lower(traced, length, reverse, "scan")
    return plan


def _cached_plan(fn: Callable, key: tuple, make: Callable[[], _Plan], pure: bool) -> _Plan:
    owner, key = _cache_slot(fn, key)
    if pure and owner is not None:
        with _cache_lock:
            entry = _cache.get(owner)
            plan = entry.get(key) if entry else None
            if plan is not None:
                entry[key] = entry.pop(key)  # most recently used last
                _counters["hits"] += 1
                return plan
    plan = make()
    with _cache_lock:
        _counters["traces"] += 1
        if pure and owner is not None:
            entry = _cache.setdefault(owner, {})
            entry[key] = plan
            while len(entry) > _PLANS_PER_FN:
                del entry[next(iter(entry))]
    return plan


def _cache_slot(fn: Callable, key: tuple) -> tuple[Any, tuple]:
    """The object the cache holds weakly for ``fn`` (None: not cacheable) and the full key.

    A bound method is a new object on every attribute access, so it is cached
    under its instance, keyed also by its function.
    """
    owner, func = (fn.__self__, fn.__func__) if inspect.ismethod(fn) else (fn, None)
    try:
        weakref.ref(owner)
    except TypeError:
        return None, key
    return owner, (func, *key)


# --------------------------------------------------------------------------- #
# Public API.
# --------------------------------------------------------------------------- #


def scan(
    fn: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
    init: PyTree,
    xs: PyTree,
    *,
    length: int | None = None,
    reverse: bool = False,
    partition_fn: Callable | None = None,
    is_fn_pure: bool = True,
) -> tuple[PyTree, PyTree]:
    """Loop ``fn`` over the leading dimension of ``xs`` in one XLA ``while`` loop.

    Semantics of ``jax.lax.scan``::

        carry = init
        for i in (reversed(range(N)) if reverse else range(N)):
            carry, ys[i] = fn(carry, xs[i])
        return carry, stack(ys)

    Args:
      fn: ``fn(carry, x) -> (carry, y)`` on pytrees of XLA tensors. The carry it
        returns must have ``init``'s structure, shapes and dtypes; ``y`` leaves
        may be None. ``fn`` may read tensors defined outside it (weights,
        buffers, any XLA tensor): they become loop operands, keep their
        sharding and receive gradients. It may update its carry, its x slice
        and tensors it creates in place: each iteration works on its own
        copies, so ``init`` and ``xs`` are never written. It may not write into
        tensors defined outside it (in place, ``out=``, ``.data``, a view,
        ``copy_``, setitem): that raises before anything runs. A y that is a
        carry leaf ``fn`` updated in place is refused (in the Python loop every
        such y aliases the final carry).
      init: pytree of XLA tensors, the initial carry.
      xs: pytree of XLA tensors sharing a leading dimension N, or None (then
        ``length`` is required and ``fn`` receives ``x=None``).
      length: N; required when ``xs`` is None, checked against ``xs`` otherwise.
      reverse: walk ``xs`` from the end; ``ys[i]`` still belongs to ``xs[i]``.
      partition_fn: AOTAutograd partitioner deciding what the forward loop
        saves for the backward loop: ``functorch.compile.default_partition``
        (default; saves activations) or
        ``functorch.compile.min_cut_rematerialization_partition`` (recomputes
        cheap ones).
      is_fn_pure: reuse lowered loops across calls (default True). Every call
        still runs ``fn`` once, lazily on placeholders (host-side; nothing
        executes), so it computes with what ``fn`` reads *on this call*: the
        outside tensors (a dict entry or attribute now holding another
        tensor, new values alike), Python numbers and other non-tensor
        arguments of its torch calls, host tensors (by identity and version
        counter). A loop lowered on an earlier call is reused only when this
        trace matches it exactly (same torch calls with the same non-tensor
        arguments, the same role for every tensor argument, the same graph)
        and the inputs have the same structure, shapes, dtypes, shardings and
        ``requires_grad`` flags; otherwise ``fn`` is lowered and compiled again
        (at most 16 loops are kept per ``fn``; see :func:`scan_cache_info`).
        For reuse to pay off, keep the Python numbers ``fn`` passes to torch
        and its control flow the same between calls (pass a number that
        changes every step, a learning rate say, as a tensor). Side effects
        outside torch run once per call, at trace time, not once per
        iteration. False: lower and compile on every call.

    Returns:
      ``(carry, ys)``: ``ys`` stacks every ``y`` along a new leading dimension.
      Everything stays on the device; nothing is copied to the host. Random
      ops in ``fn`` draw different numbers in each iteration, reproducibly
      under ``torch.manual_seed``.
    """
    if not callable(fn):
        raise TypeError(f"scan: fn must be callable, got {type(fn).__name__}")
    if not isinstance(reverse, bool):
        raise TypeError(f"scan: reverse must be a bool, got {type(reverse).__name__}")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
        raise ValueError(f"scan: length must be a non-negative int or None, got {length!r}")
    init_named, init_spec = _leaves_with_paths(init, "init")
    _check_tensor_leaves(init_named, allow_none=False)
    init_l = [leaf for _, leaf in init_named]
    if xs is None:
        if length is None:
            raise ValueError("scan: xs is None, so length is required (the number of iterations)")
        x_spec, xs_l = None, []
    else:
        x_named, x_spec = _leaves_with_paths(xs, "xs")
        _check_tensor_leaves(x_named, allow_none=False)
        if not x_named:
            raise ValueError("scan: xs has no tensor leaves; pass xs=None and length=N to scan without inputs")
        for path, leaf in x_named:
            if leaf.dim() == 0:
                raise ValueError(f"scan: {path} is a scalar; every xs leaf needs a leading dimension to scan over")
        first_path, first = x_named[0]
        for path, leaf in x_named[1:]:
            if leaf.shape[0] != first.shape[0]:
                raise ValueError(
                    f"scan: xs leaves must share their leading dimension: {first_path} has "
                    f"{first.shape[0]} but {path} has {leaf.shape[0]}"
                )
        if length is not None and length != first.shape[0]:
            raise ValueError(f"scan: length={length} but the leading dimension of {first_path} is {first.shape[0]}")
        length = int(first.shape[0])
        xs_l = [leaf for _, leaf in x_named]

    carry_l, ys_full, _ = _scan_flat(fn, init_spec, x_spec, init_l, xs_l, length, reverse, partition_fn,
                                     is_fn_pure)
    return pytree.tree_unflatten(carry_l, init_spec), pytree.tree_unflatten(ys_full[0], ys_full[1])


def _scan_flat(fn: Callable, init_spec: pytree.TreeSpec, x_spec: pytree.TreeSpec | None, init_l: list[torch.Tensor],
               xs_l: list[torch.Tensor], length: int, reverse: bool, partition_fn: Callable | None, pure: bool,
               check_written: Callable[[list[int]], None] | None = None,
               ) -> tuple[list[torch.Tensor], tuple[list, pytree.TreeSpec], dict[int, torch.Tensor]]:
    """:func:`scan` on checked, flat arguments: ``(carry leaves, (y leaves, y spec), updated xs)``.

    With ``check_written`` (scan_layers' buffers), ``updated`` maps the
    position of each xs leaf that ``fn`` writes into to the stacked values of
    its slices as each iteration left them; ``check_written`` sees those
    positions first, before anything is lowered, and may refuse them.
    """
    # Every call traces fn lazily on placeholders (nothing runs): the outside
    # tensors it reads now are the loop's operands, and the trace's fingerprint
    # picks the cached loop, so a value that changed is never served stale.
    found: dict[str, Any] = {}
    step = _flat_step(fn, init_spec, x_spec, found)
    carry_sig = [_signature(t) for t in init_l]
    x_sig = [(tuple(t.shape[1:]), t.dtype) for t in xs_l]
    traced = _trace(step, carry_sig, x_sig)
    n_c = len(init_l)
    written = [k - n_c for k in traced.mutated if k >= n_c] if check_written is not None else []
    if written:
        check_written(written)
        step = _with_written_xs(step, written)
        traced = _trace(step, carry_sig, x_sig)
    outside = traced.outside
    specs = tuple(_canonical_specs(init_l + xs_l + outside))
    key = (init_spec, x_spec, tuple(_signature(t) for t in init_l + xs_l + outside), specs,
           tuple(t.requires_grad for t in init_l + xs_l + outside), torch.is_grad_enabled(), length, reverse,
           partition_fn, check_written is not None, traced.fingerprint)
    plan = _cached_plan(fn, key, lambda: _make_plan(step, traced, init_l, xs_l, length, reverse, partition_fn),
                        pure)
    if length == 0:
        carry_l = init_l
        import torch_xla

        device = torch_xla.device()
        ys_l = [torch.empty((0, *shape), dtype=dtype, device=device) for shape, dtype in plan.y_sig]
    elif plan.grad is not None:
        outs = _ScanFunction.apply(plan.grad, *init_l, *xs_l, *outside)
        carry_l, ys_l = list(outs[:n_c]), list(outs[n_c:])
    else:
        carry_l, ys_l = _run(plan.loop, init_l, xs_l, length, outside)
    if length:
        _shard_like(carry_l, init_l)
    updated = dict(zip(written, ys_l[len(ys_l) - len(written):]))
    stacked = iter(ys_l[:len(ys_l) - len(written)])
    ys_full = [None if none else next(stacked) for none in found["y_none"]]
    return carry_l, (ys_full, found["y_spec"]), updated


def _with_written_xs(step: Callable, written: list[int]) -> Callable:
    """``step`` that also returns, after its ys, the x leaves at ``written`` as the step left them."""

    def step_and_written(carry_leaves: list[torch.Tensor], x_leaves: list[torch.Tensor]):
        carry_out, ys = step(carry_leaves, x_leaves)
        return carry_out, [*ys, *(x_leaves[j] for j in written)]

    return step_and_written


# --------------------------------------------------------------------------- #
# scan_layers.
# --------------------------------------------------------------------------- #



def _tiling(member: torch.Tensor) -> tuple[tuple[int, ...], str, bool] | None:
    """``member``'s tiled sharding (see :func:`parse_tiled_spec`); ``((1,) * dim, "", False)`` if unsharded.

    None for a sharding that is neither tiled nor replicated (e.g. manual).
    """
    import torch_xla

    spec = torch_xla._XLAC._get_xla_sharding_spec(member)
    if is_replicated_spec(spec):
        return (1,) * member.dim(), "", False
    return parse_tiled_spec(spec)


def _merged(shape: tuple[int, ...], tiles: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``shape`` with each unsharded dim merged into the dim before it, and the tiles of the result.

    ``(128, 512)`` tiled ``(8, 1)`` gives ``(65536,)`` tiled ``(8,)``: each
    device's block is still one contiguous piece, so the reshape moves no data
    between devices. ``(128, 512)`` tiled ``(1, 8)`` stays as it is, and so
    does ``(10, 512)`` tiled ``(8, 1)`` (uneven, padded blocks).
    """
    dims: list[int] = []
    kept: list[int] = []
    for size, tile in zip(shape, tiles):
        # A dim sharded unevenly is padded per device: its blocks would not
        # line up with the merged dim's, so nothing merges into it.
        if dims and tile == 1 and dims[-1] % kept[-1] == 0:
            dims[-1] *= size
        else:
            dims.append(size)
            kept.append(tile)
    return tuple(dims), tuple(kept)


def _stacked_layout(member: torch.Tensor) -> tuple[tuple[int, ...], Callable[[torch.Tensor], None]]:
    """The shape each member has inside the stacked tensor, and how to shard the stacked tensor.

    Members are stacked with unsharded dims merged (:func:`_merged`). XLA:CPU
    emits a copy of a small multi-dim block as a nest of constant-trip loops
    that LLVM unrolls completely (a ``[16, 512]`` block is ~2000 vector
    instructions per kernel); a 1-D block stays a loop. The stacking, the
    scan's reads of each layer and its writes of each layer's gradient copy
    the merged blocks; only handing the gradients back writes blocks of the
    member's own shape.
    """
    shape = tuple(member.shape)
    tiling = _tiling(member)
    if tiling is None:
        return shape, lambda stacked: None
    tiles, devices_text, _ = tiling
    flat, flat_tiles = _merged(shape, tiles[:len(shape)])

    def shard(stacked: torch.Tensor) -> None:
        # An unsharded member or a device list in a form (iota) only
        # propagation should decide leaves the stacked tensor unannotated.
        if not devices_text or not re.fullmatch(r"[\d,]+", devices_text):
            return
        import torch_xla.distributed.spmd as xs

        mesh = _tile_mesh(flat_tiles + tiles[len(shape):], devices_text)
        xs.mark_sharding(stacked, mesh, (None, *mesh.axis_names[:len(flat)]))

    return flat, shard


@functools.lru_cache(maxsize=256)
def _tile_mesh(dims: tuple[int, ...], devices_text: str):
    """A mesh whose axes are the tile dimensions of a sharding string (one per distinct sharding)."""
    import torch_xla.distributed.spmd as xs

    ids = np.array([int(v) for v in devices_text.split(",")])
    return xs.Mesh(ids, dims, tuple(f"axis{i}" for i in range(len(dims))))


# Handing the stacked gradient back with L constant-offset ``slice``s costs one
# generated kernel per layer. With the offsets as runtime operands the L
# dynamic slices are one kernel, compiled once, so the compile time stays flat
# in L; the index scalars are device data, made once. Stacking needs no
# offsets: one ``concatenate`` per member is one kernel whatever L is, and
# unlike L dynamic-update-slices (each a pass over the whole buffer on XLA:CPU)
# it writes every element once.
_index_tensors: dict[str, list[torch.Tensor]] = {}
_bound_tensors: dict[str, torch.Tensor] = {}


def _indices(n: int) -> list[torch.Tensor]:
    """``[0] .. [n-1]`` as int64 ``[1]`` tensors on the XLA device (cached; the host sends each once).

    Shape ``[1]``, not a scalar: torch_xla turns a 0-d 0 or 1 sent to the
    device into a graph constant, which would fold the offset back in.
    """
    import torch_xla

    device = torch_xla.device()
    have = _index_tensors.setdefault(str(device), [])
    have.extend(torch.tensor([i], dtype=torch.int64).to(device) for i in range(len(have), n))
    return have[:n]


def _bound() -> torch.Tensor:
    """An int32 ``[_BOUND]`` on the XLA device (cached): the runtime bound of :func:`_guard`."""
    import torch_xla

    device = str(torch_xla.device())
    if device not in _bound_tensors:
        _bound_tensors[device] = torch.tensor([_BOUND], dtype=torch.int32).to(device)
    return _bound_tensors[device]


def _index_params(b, n: int) -> list:
    """Parameters ``0 .. n-1`` of builder ``b``: the ``[1]`` tensors of :func:`_indices`, as scalars."""
    xb = _xb()
    return [xb.mkparam(b, k, xb.mkshape(xb.Type.S64, (1,))).reshape([]) for k in range(n)]


@functools.lru_cache(maxsize=256)
def _stack_computation(n: int, shape: tuple[int, ...], flat: tuple[int, ...], dtype: torch.dtype):
    """``(members...) -> concatenate([m.reshape([1, *flat]) for m in members])``.

    ``flat`` is the member's stacked layout (see :func:`_stacked_layout`).
    """
    xb = _xb()
    b = xb.create_builder("txe_stack")
    etype = xb.Op.from_torch_type(dtype)
    members = [xb.mkparam(b, k, xb.mkshape(etype, shape)) for k in range(n)]
    stacked = xb.Op.concat_in_dim([m.reshape([1, *flat]) for m in members], 0, builder=b)
    return xb.Op.tuple([stacked]).build("txe_stack")


@functools.lru_cache(maxsize=256)
def _unstack_computation(n: int, shape: tuple[int, ...], flat: tuple[int, ...], dtype: torch.dtype):
    """``(indices..., stacked, bound) -> (stacked[indices[0]], ..., stacked[indices[n-1]])``, each in ``shape``."""
    xb = _xb()
    b = xb.create_builder("txe_unstack")
    etype = xb.Op.from_torch_type(dtype)
    indices = _index_params(b, n)
    stacked = xb.mkparam(b, n, xb.mkshape(etype, (n, *flat)))
    bound = xb.mkparam(b, n + 1, xb.mkshape(xb.Type.S32, (1,))).reshape([])
    zero = xb.Op.scalar(b, 0, dtype=xb.Type.S64)
    guard = _guard(bound, list(shape), etype)
    members = [guard(_slice_op(stacked, idx, zero).reshape(list(shape))) for idx in indices]
    return xb.Op.tuple(members).build("txe_unstack")


def _stack(members: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(members)`` with each member reshaped as :func:`_stacked_layout` says, and sharded like it."""
    import torch_xla

    first = members[0]
    n = len(members)
    flat, shard = _stacked_layout(first)
    computation = _stack_computation(n, tuple(first.shape), flat, first.dtype)
    (stacked,) = torch_xla._XLAC._xla_user_computation("xla::txe_stack", list(members), computation)
    shard(stacked)
    return stacked


def _unstack(stacked: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """The members of ``stacked`` (see :func:`_stack`) in ``shape``, as new tensors rather than views."""
    import torch_xla

    n = stacked.shape[0]
    computation = _unstack_computation(n, shape, tuple(stacked.shape[1:]), stacked.dtype)
    operands = [*_indices(n), stacked, _bound()]
    return list(torch_xla._XLAC._xla_user_computation("xla::txe_unstack", operands, computation))


class _Stack(torch.autograd.Function):
    """Stack along a new leading dim; forward and backward keep each member's sharding."""

    @staticmethod
    def forward(ctx, *members: torch.Tensor) -> torch.Tensor:
        ctx.shardings = [_sharding_of(t) for t in members]
        ctx.shape = tuple(members[0].shape)
        return _stack(members)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grads = _unstack(grad, ctx.shape)
        _apply_shardings(grads, ctx.shardings)
        return tuple(grads)


def _is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor of an AOTAutograd trace (fake or functional) rather than a lazy XLA tensor."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _layer_state(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(layer.named_parameters())
    state.update(dict(layer.named_buffers()))
    return state


def _check_homogeneous(layers: Sequence[torch.nn.Module]) -> list[str]:
    first = layers[0]
    ref = _layer_state(first)
    names = list(ref)
    for i, layer in enumerate(layers):
        for name, t in _layer_state(layer).items():
            if t.device.type != "xla":
                raise TypeError(f"scan_layers: layers[{i}].{name} is on {t.device}; move the layers to the XLA "
                                f"device first (layers.to(torch_xla.device()))")
    ref_specs = _canonical_specs(list(ref.values()))
    for i, layer in enumerate(layers[1:], start=1):
        if type(layer) is not type(first):
            raise TypeError(f"scan_layers: layers[{i}] is a {type(layer).__name__} but layers[0] is a "
                            f"{type(first).__name__}; all layers must be of one class")
        state = _layer_state(layer)
        if list(state) != names:
            missing = sorted(set(names) ^ set(state))
            raise ValueError(f"scan_layers: layers[{i}] has parameters/buffers {list(state)} but layers[0] has "
                             f"{names} (first difference: {missing[0] if missing else 'order'})")
        specs = _canonical_specs(list(state.values()))
        for (name, t), spec, ref_spec in zip(state.items(), specs, ref_specs):
            r = ref[name]
            for what, a, b in (("shape", tuple(t.shape), tuple(r.shape)), ("dtype", t.dtype, r.dtype),
                               ("device", t.device.type, r.device.type), ("sharding", spec, ref_spec),
                               ("requires_grad", t.requires_grad, r.requires_grad)):
                if a != b:
                    raise ValueError(f"scan_layers: layers[{i}].{name} has {what} {a} but layers[0].{name} "
                                     f"has {b}; scanned layers must be homogeneous")
    return names


_layer_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layer_step(template: torch.nn.Module, names: list[str], shapes: list[tuple[int, ...]]) -> Callable:
    """One step function per template layer, so repeated calls hit scan's cache.

    The stacked members may be reshaped (:func:`_stacked_layout`); the step
    gives each slice its parameter's shape back. It holds the template
    weakly: the cache is keyed by the template and must not keep it alive.
    """
    key = (tuple(names), tuple(shapes))
    steps = _layer_steps.setdefault(template, {})
    if key not in steps:
        from torch.func import functional_call

        template_ref = weakref.ref(template)

        def step(h, state):
            params = {name: t if tuple(t.shape) == shape else t.reshape(shape)
                      for name, shape, t in zip(names, shapes, state)}
            views = [(t, params[name]) for name, t in zip(names, state) if params[name] is not t]
            before = [(v._version, graph_hash([v])) for _, v in views if not _is_fake(v)]
            out = functional_call(template_ref(), params, (h,))
            # A write into a reshaped member reaches its slice through the view,
            # except from ops that update an argument from C++ in lazy mode
            # (batch_norm's running stats): copy those back so scan sees them.
            for (t, v), (version, digest) in zip([tv for tv in views if not _is_fake(tv[1])], before):
                if v._version != version or graph_hash([v]) != digest:
                    t.copy_(v.reshape(t.shape))
            return out, None

        steps[key] = step
    return steps[key]


def scan_layers(
    layers: Sequence[torch.nn.Module],
    x: torch.Tensor,
    *,
    partition_fn: Callable | None = None,
    is_layer_pure: bool = True,
) -> torch.Tensor:
    """Apply homogeneous layers in sequence as one :func:`scan`: ``x = layer(x)`` for each.

    The layers must be of one class with the same parameter and buffer names,
    shapes, dtypes, shardings and ``requires_grad`` flags; the first
    difference is reported. Their parameters are stacked along a new leading
    dimension (sharded like each layer's own parameter on the other
    dimensions, which may be merged where that moves no data between
    devices) and ``layers[0]`` is called with each slice through
    ``torch.func.functional_call``. Gradients land on each layer's own
    parameters, sharded like them. Nothing moves to the host.

    Buffers a layer updates in place (BatchNorm's running statistics, a step
    counter) are written back to each layer's own buffers, as the loop
    writes them. A forward that writes into a parameter is refused before
    anything runs. Layers may read tensors and Python values from outside
    (a shared dict holding the attention mask, a config): every call reads
    them as they are then (see ``is_fn_pure`` of :func:`scan`).

    Args:
      layers: a sequence (e.g. ``nn.ModuleList``) of modules mapping a tensor
        to a tensor of the same shape and dtype.
      x: the input, an XLA tensor.
      partition_fn: see :func:`scan`.
      is_layer_pure: reuse the lowered loop on later calls with the same
        layers and input signature when the forward's trace matches; the
        contract of ``is_fn_pure`` in :func:`scan`.
    """
    layers = list(layers)
    if not all(isinstance(layer, torch.nn.Module) for layer in layers):
        raise TypeError("scan_layers: layers must be a sequence of torch.nn.Module")
    if not isinstance(x, torch.Tensor) or x.device.type != "xla":
        raise TypeError("scan_layers: x must be a torch.Tensor on the XLA device")
    if not layers:
        return x
    names = _check_homogeneous(layers)
    states = [_layer_state(layer) for layer in layers]
    stacked = []
    for name in names:
        members = [state[name] for state in states]
        if any(m.requires_grad for m in members) and torch.is_grad_enabled():
            stacked.append(_Stack.apply(*members))
        else:
            with torch.no_grad():
                stacked.append(_Stack.apply(*members))
    shapes = [tuple(states[0][name].shape) for name in names]
    step = _layer_step(layers[0], names, shapes)
    _, x_spec = pytree.tree_flatten(stacked)
    params = {name for name, _ in layers[0].named_parameters()}

    def only_buffers(written: list[int]) -> None:
        # A write into a parameter would bypass autograd and the optimizer.
        for j in written:
            if names[j] in params:
                raise RuntimeError(
                    f"scan_layers: {type(layers[0]).__name__}.forward writes into its parameter '{names[j]}' "
                    f"in place; scan_layers cannot keep that write. Update parameters outside the forward (an "
                    f"optimizer step), or keep the value in a buffer."
                )

    (out,), _, updated = _scan_flat(step, pytree.tree_flatten(x)[1], x_spec, [x], stacked, len(layers), False,
                                    partition_fn, is_layer_pure, check_written=only_buffers)
    if updated:
        _write_back_buffers(states, names, shapes, updated)
    return out


def _write_back_buffers(states: list[dict[str, torch.Tensor]], names: list[str], shapes: list[tuple[int, ...]],
                        updated: dict[int, torch.Tensor]) -> None:
    """Copy the buffer values each layer's iteration left behind into that layer's buffers, as the loop would."""
    with torch.no_grad():
        for j, stacked_value in updated.items():
            for state, value in zip(states, _unstack(stacked_value, shapes[j])):
                state[names[j]].copy_(value)
