"""The one registry of lowered loops: keyed by fn and the trace's fingerprint, emptied by clear_scan_cache."""

from __future__ import annotations

import dataclasses
import inspect
import threading
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from . import autocast

if TYPE_CHECKING:  # the plan's parts; imported for annotations only (they import this module)
    from .autograd import _GradPlan
    from .loop import _Loop
    from .trace import Sig

#: Other caches of the package (stacking computations, index tensors, layer
#: steps) register a function here that empties them; clear_scan_cache calls all.
_clear_hooks: list[Callable[[], None]] = []


def on_clear(hook: Callable[[], None]) -> Callable[[], None]:
    """Register ``hook`` to run in :func:`clear_scan_cache` (usable as a decorator)."""
    _clear_hooks.append(hook)
    return hook


@dataclasses.dataclass
class _Plan:
    """The lowered loops for one fingerprint of ``fn``; they read outside tensors passed per call."""

    y_sig: list[Sig]              # per stacked y leaf
    held: list[Any]               # objects the fingerprint names by identity (kept alive with it)
    loop: _Loop | None = None      # forward-only
    grad: _GradPlan | None = None  # with autograd
    #: With a backward that runs the user's Python: the state it may read, keyed when the plan was made
    #: (:func:`~torch_xla_ext._scan.state.backward_state_key`); the plan serves only calls that key the same.
    backward_state: Any = None


class ScanCacheInfo(NamedTuple):
    """Counters of :func:`scan`'s trace cache (process-wide)."""

    traces: int  # calls that lowered fn into new loops (a miss)
    hits: int    # calls whose trace matched a cached plan's fingerprint
    size: int    # plans held


def global_state() -> object:
    """PyTorch's process state that changes what a trace computes, comparable: part of every cache key.

    Dynamo's ``GlobalStateGuard`` (grad mode, autocast enabled and dtype per
    device, the default dtype, deterministic algorithms, reduced-precision
    matmul flags, torch-function state) as its JSON text: about 3 us. A loop
    lowered under autocast is then never served to a call without it, nor
    the other way round.
    """
    guard = torch._C._dynamo.guards.GlobalStateGuard()
    getstate = getattr(guard, "__getstate__", None)
    if getstate is not None:
        state = getstate()
        if isinstance(state, str):
            return state
    return (torch.is_grad_enabled(), torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
            tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in autocast.DEVICES))


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
        for hook in _clear_hooks:
            hook()


def _cached_plan(fn: Callable, key: tuple, make: Callable[[], _Plan], pure: bool,
                 valid: Callable[[_Plan], bool] = lambda plan: True) -> _Plan:
    """The plan cached for ``key`` when ``valid`` accepts it (called outside the lock), else ``make()``'s, cached."""
    owner, key = _cache_slot(fn, key)
    if pure and owner is not None:
        with _cache_lock:
            entry = _cache.get(owner)
            plan = entry.get(key) if entry else None
        if plan is not None and valid(plan):
            with _cache_lock:
                if entry.get(key) is plan:
                    entry[key] = entry.pop(key)  # most recently used last
                _counters["hits"] += 1
            return plan
    plan = make()
    with _cache_lock:
        _counters["traces"] += 1
        if pure and owner is not None:
            entry = _cache.setdefault(owner, {})
            entry.pop(key, None)  # (a plan the call found stale is replaced)
            entry[key] = plan
            while len(entry) > _PLANS_PER_FN:
                del entry[next(iter(entry))]
    return plan


def _cache_slot(fn: Callable, key: tuple) -> tuple[Any, tuple]:
    """The object the cache holds weakly for ``fn`` (None: not cacheable) and the full key.

    A bound method is a new object on every attribute access, so it is cached
    under its instance, keyed also by its function. A plain function is
    cached under its code: a lambda written inside a training step is a new
    function object on every step, and keyed by itself it would lower its
    loop again every step (tens of milliseconds of host time each). Sharing
    is safe because a plan is a function of the trace alone: every call
    traces ``fn`` and the key holds that trace's fingerprint, so two functions
    with one code (and other closures) reuse a plan only where they trace
    the same; their outside tensors are read from each call's own trace.
    """
    if isinstance(fn, types.FunctionType):
        return fn.__code__, key
    owner, func = (fn.__self__, fn.__func__) if inspect.ismethod(fn) else (fn, None)
    try:
        weakref.ref(owner)
    except TypeError:
        return None, key
    return owner, (func, *key)
