"""Recording explicit device->host calls in every thread.

torch_xla's transfer metrics do not say which thread moved data. The first
guard of a process therefore wraps torch's explicit device->host entry points
(:data:`OBSERVED_METHODS` on ``torch.Tensor``, :data:`OBSERVED_FUNCTIONS` in
``torch``) for every thread and for the rest of the process. A wrapped call
that reads an XLA tensor to the host is recorded with its thread and its
start and end times (the latest :data:`MAX_CALLS` calls are kept); a call
still running is known as such. The wrappers move and copy nothing and add
about 1 us per call.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from .explicit import COPY_, TO, classify, is_xla, register_stand_in
from .metrics import D2H
from .tracebacks import hide_from_pytest

# pytest leaves this module's frames out of a HostTransferError's traceback.
__tracebackhide__ = hide_from_pytest

OBSERVED_METHODS: tuple[str, ...] = (
    "cpu", "to", "copy_", "numpy", "item", "tolist", "is_nonzero", "equal", "allclose",
    "__bool__", "__int__", "__float__", "__complex__", "__index__", "__repr__", "__format__",
    "__array__",
)
OBSERVED_FUNCTIONS: tuple[str, ...] = ("equal", "allclose", "is_nonzero")
# Completed calls kept for matching (torch_xla keeps 1024 samples per metric by default).
MAX_CALLS = 4096


class Call(NamedTuple):
    """An explicit device->host call on an XLA tensor that returned normally."""

    thread: int  # threading.get_ident() of the thread that made it
    thread_name: str
    op: str
    start_ns: int
    end_ns: int


_registry_lock = threading.Lock()
# The latest calls, guard or no guard: a call that ends between two guards may
# still own a sample that an overlapping call of another thread could be taken for.
_calls: collections.deque[Call] = collections.deque(maxlen=MAX_CALLS)  # guarded by _registry_lock
# Thread ident -> start of the outermost wrapped call it is running. Single dict
# operations are atomic, so the wrappers touch it without the lock.
_running: dict[int, int] = {}
_installed_ns: int | None = None  # when the wrappers went in
_threads_at_install: frozenset[int] = frozenset()  # idents alive then: their running call was not seen


def installed_ns() -> int | None:
    """When the wrappers went in (``time.time_ns()``), None before the first guard."""
    return _installed_ns


def threads_at_install() -> frozenset[int]:
    """Idents of the threads alive when the wrappers went in: a call they were running then was not seen."""
    return _threads_at_install


def recorded_and_running(started_by: int) -> tuple[list[Call], dict[int, int]]:
    """The recorded calls, and the calls still running (ident -> start) that started by ``started_by``."""
    with _registry_lock:
        recorded = list(_calls)
        running = {i: s for i, s in _running.copy().items() if s <= started_by}  # copy: atomic
    return recorded, running


def _attributable_thread() -> bool:
    """False in threads Python did not start (autograd's device threads, C++ pools).

    Such a thread works for whoever queued the work (``backward()`` on an XLA
    tensor runs its hooks there), so its calls explain nobody's transfers.
    """
    return not isinstance(threading.current_thread(), threading._DummyThread)


def _may_read_xla(original: Any, args: tuple, kwargs: dict) -> bool:
    """Cheap filter before :func:`classify`: False for calls that cannot read an XLA tensor."""
    if original is TO:
        return bool(args) and is_xla(args[0]) and (
            "device" in kwargs or any(isinstance(a, (str, torch.device, int, torch.Tensor)) for a in args[1:])
        )
    if original is COPY_:
        return is_xla(args[1] if len(args) > 1 else kwargs.get("src"))
    return bool(args) and (is_xla(args[0]) or (len(args) > 1 and is_xla(args[1])))


def _record(original: Any, args: tuple, kwargs: dict, ident: int) -> bool:
    """Register a finished call if it read an XLA tensor to the host; never raises."""
    end = time.time_ns()
    try:
        if not _may_read_xla(original, args, kwargs):
            return False
        hit = classify(original, args, kwargs)
        if hit is None or hit[0] != D2H or not _attributable_thread():
            return False
        name = threading.current_thread().name
        with _registry_lock:
            start = _running.pop(ident)
            _calls.append(Call(ident, name, hit[1], start, end))
        return True
    except Exception:  # pragma: no cover - observing must never break the caller
        return False


def _observed(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` with its running time noted, and recorded when it read an XLA tensor."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ident = threading.get_ident()
        if ident in _running:  # nested inside an observed call of this thread
            return original(*args, **kwargs)
        recorded = False
        try:
            _running[ident] = time.time_ns()
            result = original(*args, **kwargs)
            recorded = _record(original, args, kwargs, ident)
            return result
        finally:
            if not recorded:
                _running.pop(ident, None)

    return wrapper


def install() -> None:
    """Wrap the explicit device->host entry points once per process (moves nothing)."""
    global _installed_ns, _threads_at_install
    if _installed_ns is not None:
        return
    with _registry_lock:
        if _installed_ns is not None:
            return
        for owner, names in ((torch.Tensor, OBSERVED_METHODS), (torch, OBSERVED_FUNCTIONS)):
            for name in names:
                original = getattr(owner, name)
                wrapper = _observed(original)
                register_stand_in(wrapper, original)
                setattr(owner, name, wrapper)
        _installed_ns = time.time_ns()
        _threads_at_install = frozenset(t.ident for t in threading.enumerate() if t.ident is not None)
