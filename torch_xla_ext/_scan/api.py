"""``scan``: argument checks and flattening; the call itself runs in :mod:`.stages`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from .dynamo import refused_under_compile
from .errors import ScanInputError
from .guard import one_call_at_a_time, refuse_nested
from .loop import MAX_LENGTH
from .stages import _check_tensor_leaves, _leaves_with_paths, cache_key, capture, forget, plan, run

PyTree = Any


@refused_under_compile
def scan(
    fn: Callable[[PyTree, PyTree], tuple[PyTree, PyTree]],
    init: PyTree,
    xs: PyTree,
    partition_fn: Callable | None = None,
    is_fn_pure: bool = True,
    *,
    length: int | None = None,
    reverse: bool = False,
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
      length: N; required when ``xs`` is None, checked against ``xs`` otherwise;
        at most ``2**31 - 1`` (the loop's counter is 32-bit).
      reverse: walk ``xs`` from the end; ``ys[i]`` still belongs to ``xs[i]``.
      partition_fn: (may be given by position, as in torch_xla's ``scan``)
        AOTAutograd partitioner deciding what the forward loop
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
        arguments, the same role for every tensor argument)
        and the inputs have the same structure, shapes, dtypes, shardings and
        ``requires_grad`` flags; otherwise ``fn`` is lowered and compiled again
        (at most 16 loops are kept per ``fn``, per code object for plain
        functions and lambdas; see :func:`scan_cache_info`).
        For reuse to pay off, keep the Python numbers ``fn`` passes to torch
        and its control flow the same between calls (pass a number that
        changes every step, a learning rate say, as a tensor). Side effects
        outside torch run once per call, at trace time, not once per
        iteration (twice in a call that lowers a new loop: ``fn`` is traced
        again and must trace the same, or ``ScanUnsupportedError``). Calls
        into torch_xla's own ops (``xm.*``, ``xs.mark_sharding``) are not
        torch calls and are not compared: keep their non-tensor arguments
        fixed between calls. False: lower and compile on every call.

    Returns:
      ``(carry, ys)``: ``ys`` stacks every ``y`` along a new leading dimension.
      Everything stays on the device; nothing is copied to the host. Random
      ops in ``fn`` draw different numbers in each iteration from torch_xla's
      device generator, reproducibly under ``xm.set_rng_state`` (as eager
      random ops on the device are), and no host generator moves. Inside ``torch.compile`` it raises
      (see ``_scan/dynamo.py``).
    """
    refuse_nested("scan")
    if not callable(fn):
        raise ScanInputError(f"scan: fn must be callable, got {type(fn).__name__}")
    if partition_fn is not None and not callable(partition_fn):
        raise ScanInputError(f"scan: partition_fn must be callable or None, got {type(partition_fn).__name__}"
                             + (" (the number of iterations is the keyword argument length=)"
                                if isinstance(partition_fn, int) else ""))
    if not isinstance(reverse, bool):
        raise ScanInputError(f"scan: reverse must be a bool, got {type(reverse).__name__}")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
        raise ScanInputError(f"scan: length must be a non-negative int or None, got {length!r}")
    init_named, init_spec = _leaves_with_paths(init, "init")
    _check_tensor_leaves(init_named, allow_none=False)
    init_l = [leaf for _, leaf in init_named]
    if xs is None:
        if length is None:
            raise ScanInputError("scan: xs is None, so length is required (the number of iterations)")
        x_spec, xs_l = None, []
    else:
        x_named, x_spec = _leaves_with_paths(xs, "xs")
        _check_tensor_leaves(x_named, allow_none=False)
        if not x_named:
            raise ScanInputError("scan: xs has no tensor leaves; pass xs=None and length=N to scan without inputs")
        for path, leaf in x_named:
            if leaf.dim() == 0:
                raise ScanInputError(f"scan: {path} is a scalar; every xs leaf needs a leading dimension to scan over")
        first_path, first = x_named[0]
        for path, leaf in x_named[1:]:
            if leaf.shape[0] != first.shape[0]:
                raise ScanInputError(
                    f"scan: xs leaves must share their leading dimension: {first_path} has "
                    f"{first.shape[0]} but {path} has {leaf.shape[0]}"
                )
        if length is not None and length != first.shape[0]:
            raise ScanInputError(f"scan: length={length} but the leading dimension of {first_path} is {first.shape[0]}")
        length = int(first.shape[0])
        xs_l = [leaf for _, leaf in x_named]

    if length > MAX_LENGTH:
        raise ScanInputError(f"scan: {length} iterations are more than the loop's 32-bit counter counts (at most "
                             f"{MAX_LENGTH}); split the scan into consecutive scans")
    carry_l, ys_full = _scan_flat(fn, init_spec, x_spec, init_l, xs_l, length, reverse, partition_fn, is_fn_pure)
    return pytree.tree_unflatten(carry_l, init_spec), pytree.tree_unflatten(ys_full[0], ys_full[1])


# --------------------------------------------------------------------------- #
# One call, in stages: capture -> key -> plan (looked up, or lowered) -> run.
# scan runs them in _scan_flat; scan_layers runs its own checks between them.
# --------------------------------------------------------------------------- #

@one_call_at_a_time()
def _scan_flat(fn: Callable, init_spec: pytree.TreeSpec, x_spec: pytree.TreeSpec | None, init_l: list[torch.Tensor],
               xs_l: list[torch.Tensor], length: int, reverse: bool, partition_fn: Callable | None, pure: bool,
               ) -> tuple[list[torch.Tensor], tuple[list, pytree.TreeSpec]]:
    """:func:`scan` on checked, flat arguments: ``(carry leaves, (y leaves, y spec))``."""
    captured = capture(fn, init_spec, x_spec, init_l, xs_l, iterations=length)
    try:
        key = cache_key(captured, init_l, xs_l, length, reverse, partition_fn)
        chosen = plan(fn, key, captured, lambda: capture(fn, init_spec, x_spec, init_l, xs_l, watch_state=False),
                      init_l, xs_l, length, reverse, partition_fn, pure)
        captured.release(fn)
        carry_l, ys, _ = run(chosen, captured, init_l, xs_l, length)
        return carry_l, ys
    except BaseException as error:
        forget(captured, error)
        captured = None
        raise
