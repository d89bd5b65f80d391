"""One scan call in four stages: ``capture`` (trace fn), ``cache_key``, ``plan`` (look up or lower), ``run``.

``scan`` (:mod:`.api`) and ``scan_layers`` (:mod:`.layers`) call them in
this order and run their own checks between them.
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from .._xla import device_rng_seed, restore_device_rng_seed, torch_xla_device
from ..lowering import _require_xla_tensor
from .autograd import _GradPlan, _ScanFunction
from .backend import cpu_codegen
from .cache import _cached_plan, _Plan, global_state
from .errors import ScanInputError, ScanUnsupportedError
from .guard import describe_callable
from .loop import _lower, _run
from .sharding import _canonical_specs, _shard_like
from .state import ReachableState, backward_state_key
from .trace import (Sig, _signature, _trace, _Traced, clear_frame_locals, neutralize_made, refuse_kept_intermediates,
                    same_trace)

PyTree = Any

def _leaves_with_paths(tree: PyTree, root: str) -> tuple[list[tuple[str, Any]], pytree.TreeSpec]:
    flat, spec = pytree.tree_flatten_with_path(tree)
    return [(root + pytree.keystr(path), leaf) for path, leaf in flat], spec


def _check_tensor_leaves(named: list[tuple[str, Any]], allow_none: bool, who: str = "") -> None:
    for path, leaf in named:
        if leaf is not None or not allow_none:
            _require_xla_tensor(leaf, f"scan: {who}{path}")


def _flat_step(fn: Callable, init_spec: pytree.TreeSpec, x_spec: pytree.TreeSpec | None,
               found: dict[str, Any]) -> Callable:
    """``fn`` on flat leaves, checking what it returns against ``init``."""

    def step(carry_leaves: list[torch.Tensor], x_leaves: list[torch.Tensor]):
        carry = pytree.tree_unflatten(carry_leaves, init_spec)
        x = None if x_spec is None else pytree.tree_unflatten(x_leaves, x_spec)
        out = fn(carry, x)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ScanInputError(f"scan: fn must return a pair (carry, y), got {type(out).__name__}"
                            + (f" of length {len(out)}" if isinstance(out, (tuple, list)) else ""))
        named, spec = _leaves_with_paths(out[0], "carry")
        if spec != init_spec:
            raise ScanInputError(f"scan: fn returned a carry with structure {spec}, but init has structure "
                             f"{init_spec}; the carry's structure must not change")
        _check_tensor_leaves(named, allow_none=False, who="fn's returned ")
        for (path, leaf), before in zip(named, carry_leaves):
            if _signature(leaf) != _signature(before):
                raise ScanInputError(
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
    if needs_grad and traced.reads_host:
        # AOTAutograd traces fn on fake tensors and cannot take a real host tensor in.
        raise ScanUnsupportedError(
            "scan: fn reads a tensor on the host (a CPU tensor it did not receive, e.g. a table it uploads with "
            ".to(device)) while gradients are needed; the autograd trace cannot take host tensors in. Move it "
            "to the XLA device once, outside fn (table = table.to(device)), and read that: it becomes a loop "
            "operand, read anew on every call. (Without gradients host tensors work: their contents are "
            "part of the cache key.)"
        )
    if needs_grad:
        carry_sig = [_signature(t) for t in init]
        x_sig = [(tuple(t.shape[1:]), t.dtype) for t in xs]
        plan.grad = _GradPlan(step, carry_sig, x_sig, [t.requires_grad for t in xs], outside,
                              traced.mutated, length, reverse, partition_fn)
    else:
        plan.loop = _lower(traced, length, reverse, "scan")
    return plan

@dataclasses.dataclass
class Captured:
    """Stage 1, capture: ``fn`` traced lazily on placeholders (nothing runs, no device memory)."""

    step: Callable               # fn on flat leaves, as traced (the written x leaves appended to its ys)
    traced: _Traced | None       # the lifting trace; dropped by :meth:`release`
    init_spec: pytree.TreeSpec
    x_spec: pytree.TreeSpec | None
    carry_sig: list[Sig]
    x_sig: list[Sig]
    outside: list[torch.Tensor]  # the outside tensors fn read on this call: loop operands
    written: list[int]           # xs leaves fn writes into, by position (with ``keep_written``)
    y_spec: pytree.TreeSpec
    y_none: tuple[bool, ...]     # per y leaf: fn returned None there
    made: list[weakref.ref]      # every XLA tensor the traces made (see refuse_kept_intermediates)
    per_iteration: bool = False  # fn changed Python state and was traced once per iteration, all alike
    rng_seed: int = 0            # the device generator's seed before the traces (which draw on it)

    def retrace(self, fn: Callable) -> _Traced:
        """Another ``fn`` traced on this capture's signatures (scan_layers' other layers)."""
        traced = _trace(_flat_step(fn, self.init_spec, self.x_spec, {}), self.carry_sig, self.x_sig)
        self.made += traced.made
        return traced

    def release(self, fn: Callable) -> None:
        """Drop the trace, then refuse tensors ``fn`` kept beyond its call (see refuse_kept_intermediates)."""
        self.traced = None
        self.step = None  # type: ignore[assignment]
        refuse_kept_intermediates(self.made, lambda: describe_callable(fn))


def capture(fn: Callable, init_spec: pytree.TreeSpec, x_spec: pytree.TreeSpec | None, init_l: list[torch.Tensor],
            xs_l: list[torch.Tensor], keep_written: bool = False, iterations: int | None = 1,
            watch_state: bool = True) -> Captured:
    """Trace ``fn`` on placeholders for this call's signatures.

    Every call traces: the outside tensors ``fn`` reads now are the loop's
    operands, and the trace's fingerprint picks the cached loop, so a value
    that changed is never served stale. With ``keep_written`` (scan_layers'
    buffers), xs leaves ``fn`` writes into are traced again as extra ys: the
    stacked values of their slices as each iteration left them.

    A trace that changed Python state ``fn`` reaches (:mod:`~torch_xla_ext._scan.state`)
    is followed by one trace per remaining iteration (``iterations``: how
    many times the Python loop runs ``fn`` itself), each of which must trace
    like the first; ``iterations=None`` (each iteration runs another layer's
    forward) refuses such a change outright. ``watch_state=False``: no
    snapshot (the second capture of :func:`_refuse_self_changing`).
    """
    found: dict[str, Any] = {}
    rng_seed = device_rng_seed()
    step = _flat_step(fn, init_spec, x_spec, found)
    carry_sig = [_signature(t) for t in init_l]
    x_sig = [(tuple(t.shape[1:]), t.dtype) for t in xs_l]
    state = ReachableState(fn) if watch_state else None
    traced = _trace(step, carry_sig, x_sig)
    made = list(traced.made)
    changed = state.changed() if state is not None else []
    del state
    try:
        if changed:
            _trace_each_iteration(fn, step, traced, changed, iterations, carry_sig, x_sig, made)
    except BaseException:
        traced = None
        neutralize_made(made)
        raise
    n_c = len(init_l)
    written = [k - n_c for k in traced.mutated if k >= n_c] if keep_written else []
    if written:
        step = _with_written_xs(step, written)
        try:
            traced = _trace(step, carry_sig, x_sig)
        except BaseException:
            traced = None
            neutralize_made(made)
            raise
        made += traced.made
    return Captured(step, traced, init_spec, x_spec, carry_sig, x_sig, traced.outside, written, found["y_spec"],
                    found["y_none"], made, per_iteration=bool(changed), rng_seed=rng_seed)


#: At most this many iterations are traced one by one for a fn that changes Python state.
MAX_TRACED_ITERATIONS = 64


def _trace_each_iteration(fn: Callable, step: Callable, first: _Traced, changed: list[str], iterations: int | None,
                          carry_sig: list[Sig], x_sig: list[Sig], made: list[weakref.ref]) -> None:
    """Trace ``step`` for iterations 1.. of the loop, each with the state the one before left; refuse a difference."""
    what = f"changes Python state it can reach ({', '.join(changed[:4])}{', ...' if len(changed) > 4 else ''})"
    if iterations is None:
        raise ScanUnsupportedError(
            f"scan_layers: {describe_callable(fn)} {what} while it runs. In the Python loop every layer's forward "
            f"changes its own state once; scan_layers runs layers[0]'s forward, traced, for all of them. Keep "
            f"such state outside the forward, or run these layers in a Python loop."
        )
    if iterations > MAX_TRACED_ITERATIONS:
        raise ScanUnsupportedError(
            f"scan: fn, {describe_callable(fn)}, {what}. The Python loop runs fn with the state the previous "
            f"iteration left; scan can keep that only by tracing fn once per iteration and checking that every "
            f"iteration computes the same thing, and this loop has {iterations} iterations (at most "
            f"{MAX_TRACED_ITERATIONS} are traced). Move the state change out of fn, or pass the state in as a "
            f"tensor (in xs, or in the carry)."
        )
    for iteration in range(1, iterations):
        again = _trace(step, carry_sig, x_sig)
        made += again.made
        same = same_trace(again, first)
        del again
        if not same:
            raise ScanUnsupportedError(
                f"scan: fn, {describe_callable(fn)}, {what}, and computes with it: iteration {iteration} traces "
                f"differently from iteration 0. The Python loop runs fn with the state the previous iteration "
                f"left; a traced loop runs one trace for all iterations. Keep such state outside fn and pass it "
                f"in as a tensor (in xs, or in the carry)."
            )


def cache_key(captured: Captured, init_l: list[torch.Tensor], xs_l: list[torch.Tensor], length: int, reverse: bool,
              partition_fn: Callable | None, extra: tuple = ()) -> tuple:
    """Stage 2, key: what a cached plan must match (``extra``: what the caller passes ``fn`` that no trace shows)."""
    operands = init_l + xs_l + captured.outside
    return (captured.init_spec, captured.x_spec, tuple(_signature(t) for t in operands), tuple(_canonical_specs(operands)),
            tuple(t.requires_grad for t in operands), global_state(), length, reverse, partition_fn,
            bool(captured.written), cpu_codegen(), captured.traced.fingerprint, extra)


def plan(owner: Callable, key: tuple, captured: Captured, recapture: Callable[[], Captured],
         init_l: list[torch.Tensor], xs_l: list[torch.Tensor], length: int, reverse: bool,
         partition_fn: Callable | None, pure: bool) -> _Plan:
    """Stage 3, plan: the cached plan of ``owner`` (held weakly) for ``key``, or the loops lowered now.

    Before lowering, ``fn`` is captured once more (``recapture``) and must
    trace the same: see :func:`_refuse_self_changing`.
    """
    def make() -> _Plan:
        if not captured.per_iteration:  # else every iteration was traced already
            _refuse_self_changing(captured, recapture, owner)
        made = _make_plan(captured.step, captured.traced, init_l, xs_l, length, reverse, partition_fn)
        if made.grad is not None and made.grad.backward_python:
            made.backward_state = backward_state_key(owner, made.grad.backward_functions)
        return made

    def valid(cached: _Plan) -> bool:  # state only the backward reads is in no trace: compared here
        return cached.backward_state is None or (
            backward_state_key(owner, cached.grad.backward_functions) == cached.backward_state)

    return _cached_plan(owner, key, make, pure, valid)


def _refuse_self_changing(captured: Captured, recapture: Callable[[], Captured], fn: Callable) -> None:
    """Refuse a ``fn`` whose second trace in the same call differs from its first.

    Such a ``fn`` computes with Python state it changes itself (a counter in
    a closure or attribute, the length of a list it appends to) or with a
    value that changes between runs (``time.time()``): the Python loop would
    run it with a new value in every iteration, a lowered loop runs one trace
    for all. Checked only when a loop is about to be lowered (a few
    milliseconds next to a compile), so ``fn``'s Python side effects run
    twice in such a call.
    """
    again = recapture()
    captured.made += again.made
    same = (again.traced.fingerprint == captured.traced.fingerprint and again.written == captured.written
            and [id(t) for t in again.outside] == [id(t) for t in captured.outside])
    again.traced = again.step = None  # type: ignore[assignment]
    del again
    if not same:
        raise ScanUnsupportedError(
            f"scan: fn, {describe_callable(fn)}, traced twice in one call, computed two different things: it "
            f"reads Python state that it changes itself (a counter in a closure or an attribute, the length of "
            f"a list it appends to) or a value that changes between runs (time.time()). The Python loop would "
            f"run fn with a new value in every iteration; a traced loop runs one trace for all of them. Keep "
            f"such state outside fn and pass it in as a tensor (in xs, or in the carry)."
        )


def run(plan: _Plan, captured: Captured, init_l: list[torch.Tensor], xs_l: list[torch.Tensor], length: int
        ) -> tuple[list[torch.Tensor], tuple[list, pytree.TreeSpec], dict[int, torch.Tensor]]:
    """Stage 4, run: ``(carry leaves, (y leaves, y spec), updated xs)`` (see :func:`capture`'s ``keep_written``).

    Tracing and lowering ran ``fn``'s random ops on the device's generator (one
    trace on a cache hit, more on a miss): it is put back first, so the loop's
    seed (:func:`~torch_xla_ext._scan.loop._run`) is one draw from where the
    call found it, whatever the cache held.
    """
    restore_device_rng_seed(captured.rng_seed)
    written = captured.written
    if length == 0:
        carry_l = init_l
        device = torch_xla_device()
        ys_l = [torch.empty((0, *shape), dtype=dtype, device=device) for shape, dtype in plan.y_sig]
    elif plan.grad is not None:
        outs = _ScanFunction.apply(plan.grad, *init_l, *xs_l, *captured.outside)
        carry_l, ys_l = list(outs[:len(init_l)]), list(outs[len(init_l):])
    else:
        carry_l, ys_l = _run(plan.loop, init_l, xs_l, length, captured.outside)
    if length:
        _shard_like(carry_l, init_l)
    updated = dict(zip(written, ys_l[len(ys_l) - len(written):]))
    stacked = iter(ys_l[:len(ys_l) - len(written)])
    ys_full = [None if none else next(stacked) for none in captured.y_none]
    return carry_l, (ys_full, captured.y_spec), updated


def forget(captured: Captured | None, error: BaseException) -> None:
    """After a refusal or a failure: keep no trace alive (lazy tensors over placeholders) and no kept tensor live.

    The caller must drop its own reference to ``captured`` too, before re-raising.
    """
    if captured is not None:
        captured.traced = captured.step = None  # type: ignore[assignment]
        neutralize_made(captured.made)
    clear_frame_locals(error)


def _with_written_xs(step: Callable, written: list[int]) -> Callable:
    """``step`` that also returns, after its ys, the x leaves at ``written`` as the step left them."""

    def step_and_written(carry_leaves: list[torch.Tensor], x_leaves: list[torch.Tensor]):
        carry_out, ys = step(carry_leaves, x_leaves)
        return carry_out, [*ys, *(x_leaves[j] for j in written)]

    return step_and_written
