"""The door to torch_xla's private API: ``torch_xla._XLAC`` and ``torch_xla.core.xla_builder``.

Everything here is imported lazily, on first use: ``torch_xla`` must not be
imported before the user has chosen the PJRT device and SPMD mode.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch

__all__ = ["xlac", "xla_builder", "torch_xla_device", "redirected_mark_sharding", "device_rng_seed",
           "restore_device_rng_seed", "wait_for_executions_in_flight"]


def xlac() -> Any:
    """``torch_xla._XLAC``, the C++ binding (lowering contexts, shardings, device data, graph hashes)."""
    import torch_xla

    return torch_xla._XLAC


def wait_for_executions_in_flight() -> None:
    """Wait for the device's executions in flight before anything reads a graph's device data.

    ``torch_xla.sync()`` returns before its execution finishes; until then each
    result is a placeholder (under SPMD a sharded one, replicated results
    included) with no shards yet, and torch_xla 2.9 reads its first shard's
    handle without checking, both when walking a graph's device data (its
    text, its lowering) and when lowering it: a segmentation fault. Waiting
    moves no data: about 2 us when nothing is in flight, else the rest of
    that execution.
    """
    xlac()._xla_wait_device_ops(devices=[])


def xla_builder() -> ModuleType:
    """``torch_xla.core.xla_builder``: XLA ops from Python, computations, placeholder tensors."""
    import torch_xla.core.xla_builder as xb

    return xb


def torch_xla_device() -> torch.device:
    """The XLA device of this process (``torch_xla.device()``)."""
    import torch_xla

    return torch_xla.device()


def device_rng_seed() -> int:
    """torch_xla's running random seed of the default device: a host integer, read without running anything."""
    return xlac()._xla_get_rng_seed("")


def restore_device_rng_seed(seed: int) -> None:
    """Put the device's generator back at ``seed`` (from :func:`device_rng_seed`) if it moved.

    The next random op then draws what it would have drawn had nothing moved
    it (torch_xla keeps the running seed and the graph's seed value in step).
    """
    if device_rng_seed() != seed:
        xlac()._xla_set_rng_seed(seed, "")


_redirects = threading.local()
_redirect_lock = threading.Lock()
_redirect_installed = False


def _install_mark_sharding_redirect() -> None:
    """Replace ``xs.mark_sharding`` once per process by a function that honours this thread's redirects.

    With no redirect open on the calling thread it calls torch_xla's own
    function with the same arguments, so other threads and calls outside a
    redirect see no difference. (Code that imported the function by name
    before this ran keeps torch_xla's own.)
    """
    global _redirect_installed
    with _redirect_lock:
        if _redirect_installed:
            return
        import torch_xla.distributed.spmd as xs
        import torch_xla.distributed.spmd.xla_sharding as xla_sharding

        original = xla_sharding.mark_sharding

        @functools.wraps(original)
        def mark_sharding(*args: Any, **kwargs: Any) -> Any:
            handlers = getattr(_redirects, "handlers", None)
            if handlers:
                return handlers[-1](original, *args, **kwargs)
            return original(*args, **kwargs)

        xs.mark_sharding = xla_sharding.mark_sharding = mark_sharding
        _redirect_installed = True


@contextlib.contextmanager
def redirected_mark_sharding(handler: Callable[..., Any]) -> Iterator[None]:
    """While open, this thread's ``xs.mark_sharding(...)`` calls ``handler(torch_xla_function, ...)``.

    Scoped to the thread: the process-wide function is replaced once, and
    dispatches per thread, so a trace in one thread never changes what
    ``mark_sharding`` does in another.
    """
    _install_mark_sharding_redirect()
    handlers = _redirects.__dict__.setdefault("handlers", [])
    handlers.append(handler)
    try:
        yield
    finally:
        handlers.pop()
