"""Host random draws made by a traced step function, caught on the tracing thread only.

A trace runs ``fn`` once; the Python loop would draw new host random numbers
each iteration, so a draw in ``fn`` is refused. Other threads of the process
(a data loader shuffling, augmenting) draw from the same global generators at
the same time: their draws must be neither blamed on ``fn`` nor undone. So a
draw is caught on the tracing thread, and no generator is ever put back
over another thread's draws:

* **torch**: the :class:`~torch_xla_ext._scan.lift.Lifter` (a torch function
  mode: per thread) sees every torch call of ``fn``; :func:`torch_host_draw`
  tells one that would draw host random numbers (the ops PyTorch tags
  ``nondeterministic_seeded``, on host tensors), refused before it draws.
* **Python's ``random``** (the module's global generator and any
  ``random.Random`` instance: the loop would draw from one anew each
  iteration too): its draws are no torch calls. :func:`watching` installs,
  for this thread only, a profile function (``csrc/draw_watch.cc``) that fails
  any call into such a generator with :class:`HostDraw` before it runs. A
  profile function puts CPython's evaluation loop in its slower tracing mode
  (measured: a ``scan_layers`` trace of 4 decoder blocks 20 -> 31 ms), so a
  trace is watched only when it must be: the global generator's state
  (:func:`python_random_state`, a few microseconds) is compared around each
  trace, and only a trace during which it moved (``fn`` drew once, or another
  thread drew) is followed by a watched one, which refuses ``fn``'s draw
  before it happens or, seeing none, stands. (A draw only from a
  ``random.Random`` of ``fn``'s own moves no global state and is seen only
  when a watched trace runs.)
* **numpy's global state**: numpy's methods are compiled without profile
  events, so no per-thread watch sees them. Instead the trace holds the
  global generator's own lock (:class:`NumpyGlobalHeld`, a re-entrant lock
  every draw from it takes): another thread's draw waits for the trace
  (milliseconds) instead of interleaving, so a state that moved meanwhile
  moved by ``fn`` alone, and putting it back undoes only ``fn``'s draws.
  (numpy ``Generator`` and ``RandomState`` objects of the user's are not
  watched here: :class:`~torch_xla_ext._scan.state.ReachableState` keys the
  ones ``fn`` reaches by their state, so a trace that drew from one changed
  that state, and every iteration is then traced, drawing as the loop draws.)
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import numpy as np
import torch

from .. import _watch

__all__ = ["HostDraw", "watching", "python_random_state", "NumpyGlobalHeld", "generator_name", "torch_host_draw",
           "TORCH_CPU", "NUMPY_GLOBAL"]

TORCH_CPU = "torch's CPU generator (torch.rand/randn/randint/... on the host)"
NUMPY_GLOBAL = "numpy's global random state"


class HostDraw(Exception):
    """Raised in place of a host generator's method call while a trace watches: ``(generator, method name)``."""


@contextmanager
def watching() -> Iterator[_watch.DrawWatch]:
    """Refuse, on this thread, calls into Python random generators (:class:`HostDraw`); yields the watch.

    ``watch.hit()`` is the first refused call, ``(generator, method)``: set even
    when ``fn`` caught the exception and went on.
    """
    watch = _watch.DrawWatch((random.Random,), HostDraw)
    with watch:
        yield watch


def python_random_state() -> object:
    """Python's global generator's state, comparable (``random.getstate()``: about 5 us)."""
    return random.getstate()


def generator_name(generator: Any) -> str:
    """How a refusal names a Python generator."""
    return "Python's random module" if generator is random._inst else "a random.Random instance"


class NumpyGlobalHeld:
    """Holds numpy's global generator's lock for a trace; tells whether the trace drew from it, and undoes that.

    While held, only this thread can draw from numpy's global state, so
    :attr:`moved` is this thread's doing alone; on exit a moved state is put
    back (the trace's own draws only).
    """

    def __init__(self) -> None:
        self._lock = np.random.mtrand._rand._bit_generator.lock
        self._before: dict | None = None
        self.moved = False

    def __enter__(self) -> NumpyGlobalHeld:
        self._lock.acquire()
        self._before = np.random.get_state(legacy=False)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            after = np.random.get_state(legacy=False)
            b, a = self._before["state"], after["state"]
            self.moved = (b["pos"] != a["pos"] or not np.array_equal(b["key"], a["key"])
                          or self._before["has_gauss"] != after["has_gauss"])
            if self.moved:
                np.random.set_state(self._before)
        finally:
            self._lock.release()


@cache
def _seeded_names() -> frozenset[str]:
    """Names of the torch functions and methods that draw random numbers (PyTorch's own tag, and a few more)."""
    names = {"random_", "rrelu", "rrelu_", "dropout1d", "dropout2d", "dropout3d", "feature_dropout",
             "feature_alpha_dropout", "alpha_dropout", "gumbel_softmax"}
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name, None)
        overloads = getattr(packet, "overloads", None)
        if overloads is None:
            continue
        if any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in overloads()):
            names.add(name)
    return frozenset(names)


def torch_host_draw(func: Any, args: tuple, kwargs: dict, leaves) -> bool:
    """Whether the torch call ``func(*args, **kwargs)`` would draw host random numbers (decided before it runs).

    A call of a random function (:func:`_seeded_names`) counts when none of
    its tensor arguments lives on the XLA device and it makes no tensor there
    (no ``device=`` of XLA, no XLA default device): an XLA draw is lowered
    into the loop with a seed of its own per iteration. ``leaves`` gives the
    tensor leaves of a value.
    """
    if getattr(func, "__name__", "") not in _seeded_names():
        return False
    if any(t.device.type == "xla" for t in (*leaves(args), *leaves(kwargs))):
        return False
    device = kwargs.get("device")
    device = torch.get_default_device() if device is None else torch.device(device)
    return device.type != "xla"
