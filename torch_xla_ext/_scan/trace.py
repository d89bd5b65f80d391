"""Tracing a step function lazily on placeholders: nothing executes and no device memory is allocated.

:func:`_trace` runs a flat step ``(carry, x) -> (carry, ys)`` on placeholder
tensors under :class:`~torch_xla_ext._scan.lift.Lifter` and returns the lazy
outputs, the outside tensors it read, which inputs it wrote, and the trace's
fingerprint (what a cached loop must match).
"""

from __future__ import annotations

import contextlib
import gc
import traceback
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .._annotate import fresh_node
from .._partitionable import partitionable_ops
from .._xla import xla_builder
from .errors import ScanUnsupportedError
from .guard import TraceAgain, tracing
from .lift import Lifter, ValueIdentity

Sig = tuple[tuple[int, ...], torch.dtype]


def _signature(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), t.dtype)


def _placeholder(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A device tensor with a shape and a dtype but no buffer: for tracing only."""
    return xla_builder().create_placeholder_tensor(tuple(shape), dtype)


def _not_device_data(t: torch.Tensor) -> torch.Tensor:
    # A pending computation instead of device data, so that mark_sharding
    # inside fn annotates the value rather than replacing the tensor's data,
    # which would detach it from its HLO parameter.
    return fresh_node(t)


@contextlib.contextmanager
def _ordinary_tensors():
    """Under ``torch.inference_mode``, trace with ordinary tensors, grad mode still off.

    Inference tensors have no version counter, and the trace reads version
    counters to see which inputs ``fn`` writes. The trace's tensors never
    leave it; the loop it lowers runs in the caller's mode.
    """
    if not torch.is_inference_mode_enabled():
        yield
        return
    with torch.inference_mode(False), torch.no_grad():
        yield


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
    made: list[weakref.ref]         # XLA tensors fn made (lifting traces): see refuse_kept_intermediates
    reads_host: bool                # fn passed a host tensor from outside to a torch call (lifting traces)


#: Traces of one call at most: the first; one watching who drew; one more if that one also imported.
_TRACES = 3


def _trace(step: Callable, carry: Sequence[Sig], x: Sequence[Sig], outside: Sequence[Sig] | None = None) -> _Traced:
    """Run ``step`` lazily on placeholders; nothing executes and no device memory is allocated.

    See :func:`_trace_on_placeholders`. If ``step`` raises, the locals of the
    frames the exception passed through are cleared (the traceback still names
    every file and line): they hold lazy tensors over placeholders, which the
    next ``torch_xla.sync()`` would try to execute if the exception were kept
    (a failed test's report, ``sys.last_traceback``).
    """
    made: list[weakref.ref] = []
    try:
        with _ordinary_tensors():
            for attempt in range(_TRACES):
                try:
                    return _trace_on_placeholders(step, carry, x, outside, made, watch=attempt > 0,
                                                  last=attempt == _TRACES - 1)
                except TraceAgain:  # see guard.tracing: tell who drew (watching), imports done
                    neutralize_made(made)
                    made.clear()
            raise AssertionError("unreachable: the last trace asks for no other")
    except BaseException as error:
        clear_frame_locals(error)
        # fn may have kept tensors before it failed (or was refused): no later sync may run them.
        neutralize_made(made)
        raise


def clear_frame_locals(error: BaseException) -> None:
    """Clear the locals of the frames ``error`` (and the exceptions chained to it) passed through.

    Frames of a trace hold lazy tensors over placeholders; an exception kept
    alive (a test's ``pytest.raises``, ``sys.last_traceback``, or only a
    reference cycle not yet collected) would keep them alive, and the next
    ``torch_xla.sync()`` would try to run them. The traceback still names
    every file and line. The frame that handles ``error`` is still running
    and keeps its locals: it must drop its own references before re-raising.
    """
    seen: set[int] = set()
    chained: BaseException | None = error
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__


def _trace_on_placeholders(step: Callable, carry: Sequence[Sig], x: Sequence[Sig],
                           outside: Sequence[Sig] | None, made: list[weakref.ref], watch: bool = False,
                           last: bool = True) -> _Traced:
    """Run ``step`` lazily on placeholders.

    With ``outside=None`` this is the lifting trace of a user step,
    ``step(carry, x)``: outside tensors it reads are lifted (see
    :class:`~torch_xla_ext._scan.lift.Lifter`) and the trace is fingerprinted. With
    ``outside`` signatures, ``step(carry, x, outside)`` receives placeholders for
    them and may read no other outside tensor (the autograd graphs).
    ``watch``, ``last``: see :func:`~torch_xla_ext._scan.guard.tracing`.

    Device random ops in ``step`` advance torch_xla's device RNG state, once
    per op as one eager call would (the loop itself draws its own seeds). The
    state is not put back afterwards: it is process-wide, and putting it back
    would rewind the device draws another thread made meanwhile.
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
        lifter.made = made
        # Written inputs: in-place ops (also through views) bump the version
        # counter; ops that update an argument from C++ (batch_norm's running
        # stats) replace only its value. A sharding annotation replaces the value
        # too, and then the input counts as written (a copy is harmless).
        identity = ValueIdentity(carry_in + x_in)
        with tracing(watch=watch, last=last), partitionable_ops(), lifter:
            carry_out, ys = step(carry_in, x_in)
        _raise_caught_refusal(lifter)
        lifter.check_outside_unchanged()
        mutated = tuple(k for k, c in enumerate(identity.changed(carry_in + x_in)) if c)
        bumped = tuple(k for k, w in enumerate(identity.written(carry_in + x_in)) if w)
        del identity
        _check_no_y_aliases_written_carry(ys, carry_in, bumped)
    else:
        outside_ph = [_placeholder(*s) for s in outside]
        outside_in = [_not_device_data(t) for t in outside_ph]
        lifter = Lifter(carry_in + x_in + outside_in + carry_ph + x_ph + outside_ph, None)
        with tracing(watch=watch, last=last), partitionable_ops(), lifter:
            carry_out, ys = step(carry_in, x_in, outside_in)
        _raise_caught_refusal(lifter)
        mutated = ()
    carry_out, ys = list(carry_out), list(ys)
    fingerprint = lifter.fingerprint() if lifting else ()
    return _Traced(carry_ph, x_ph, outside_ph, list(lifter.outside), carry_out, ys, mutated, fingerprint,
                   lifter.held, lifter.made, lifter.reads_host)


def same_trace(a: _Traced, b: _Traced) -> bool:
    """Whether two lifting traces of one signature lower to the same loop over the same outside tensors."""
    return (a.fingerprint == b.fingerprint and a.mutated == b.mutated
            and [id(t) for t in a.outside] == [id(t) for t in b.outside])


def _raise_caught_refusal(lifter: Lifter) -> None:
    """Raise the refusal ``fn`` caught (``except Exception:``) and went on from without the refused value."""
    if lifter.refusal is not None:
        refusal = lifter.refusal
        lifter.refusal = None
        raise refusal


def refuse_kept_intermediates(made: Sequence[weakref.ref], fn: Callable[[], str]) -> None:
    """Refuse XLA tensors a lifting trace made that are still alive once the trace is dropped.

    Call it after the last reference to the :class:`_Traced` is gone: what is
    still alive was kept by fn (appended to a list, stored in an attribute).
    Those are lazy values over placeholders: the next ``torch_xla.sync()``
    would execute them and crash, and in the Python loop they would hold one
    iteration's values, which a scan cannot give. Before raising, each kept
    tensor is neutralized (:func:`_neutralize`). ``fn()`` names the traced
    function in the message; it is called only when refusing.
    """
    kept = _alive(made)
    if not kept:
        return
    shown = ", ".join(f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in kept[:4])
    count = len(kept)
    _neutralize(kept)
    del kept
    raise ScanUnsupportedError(
        f"scan: fn, {fn()}, keeps {count} tensor(s) it computed beyond its call ({shown}"
        f"{', ...' if count > 4 else ''}): appended to a list, stored in an attribute, a dict or a global. scan "
        f"traces fn once on placeholders, so what it keeps holds no iteration's values (the Python loop would "
        f"keep each iteration's). Return such values as ys (stacked over iterations) or in the carry. The kept "
        f"tensors now hold NaN (integers: 0) so that no later torch_xla.sync() runs them."
    )


def neutralize_made(made: Sequence[weakref.ref]) -> None:
    """Neutralize (see :func:`_neutralize`) the tensors of ``made`` still alive: after a trace failed or was refused."""
    _neutralize(_alive(made))


def _alive(made: Sequence[weakref.ref]) -> list[torch.Tensor]:
    """The tensors of ``made`` still alive (after one collection if any were: a cycle may hold them)."""
    if not any(r() is not None for r in made):
        return []
    gc.collect()
    return [t for t in (r() for r in made) if t is not None]


def _neutralize(kept: list[torch.Tensor]) -> None:
    """Give each kept lazy tensor a value of its shape (NaN, integers 0) instead of its graph over placeholders."""
    with torch.no_grad():
        for t in kept:
            fill = float("nan") if t.is_floating_point() or t.is_complex() else 0
            t.data = torch.full(t.shape, fill, dtype=t.dtype, device=t.device)


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
