"""AOTAutograd as scan uses it: one step split into forward and backward FX graphs, on this thread only.

:func:`split` runs AOTAutograd over the step's primal function and returns the
two graphs it captured. AOTAutograd snapshots torch's CPU generator before it
traces and puts it back after (``preserve_rng_state``): process-wide, so a
data loader thread's draws made meanwhile (hundreds of milliseconds on a
first call) would be rewound and repeated. Scan's capture draws nothing from
host generators (the lifting trace refused any such draw before it), so for
it, and on its thread only, that snapshot is skipped
(:func:`_host_rng_left_alone`); every other user of AOTAutograd
(``torch.compile`` on any thread) keeps PyTorch's behaviour.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import torch

from .._annotate import scan_step_trace
from . import autocast

__all__ = ["Split", "split", "note_backward_python"]

_local = threading.local()


class Split(NamedTuple):
    """What :func:`split` captured."""

    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule | None  # None when no output needs a gradient
    outs: tuple                       # the compiled function's outputs on the example inputs
    backward_python: tuple[str, ...]  # the user's Python code the backward ran (see :func:`split`)
    backward_functions: tuple[type, ...]  # the custom Functions among it (their classes)


#: Custom Functions whose backward reads no Python state a call can change: PyTorch's, torch_xla's, this
#: package's. Module backward hooks run the user's hooks through one of PyTorch's, so it does not count.
_TRUSTED = ("torch.", "torch_xla.", "torch_xla_ext.")
_MODULE_HOOKS = "BackwardHookFunction"


def _describe_function(cls: type) -> str:
    if cls.__name__ == _MODULE_HOOKS:
        return "a module backward hook (register_full_backward_hook)"
    backward = getattr(cls, "backward", None)
    code = getattr(backward, "__code__", None)
    where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{cls.__qualname__}.backward{where}"


def _install_backward_recording() -> None:
    """Let the engine's call of a custom Function's backward note, on a recording thread, whose it is.

    Installed once on PyTorch's ``BackwardCFunction.apply`` (which the engine
    looks up at every call); elsewhere it only calls PyTorch's own.
    """
    from torch.autograd.function import BackwardCFunction

    original = BackwardCFunction.apply
    if getattr(original, "txe_recording", False):
        return

    def apply(self, *args):
        seen = getattr(_local, "backward_python", None)
        if seen is not None:
            cls = self._forward_cls
            if cls.__name__ == _MODULE_HOOKS or not cls.__module__.startswith(_TRUSTED):
                seen.append((_describe_function(cls), cls))
        return original(self, *args)

    apply.txe_recording = True  # type: ignore[attr-defined]
    BackwardCFunction.apply = apply  # type: ignore[method-assign]


def note_backward_python(what: str) -> None:
    """Record, while :func:`split` runs on this thread, that the backward runs the user's Python ``what``."""
    seen = getattr(_local, "backward_python", None)
    if seen is not None:
        seen.append((what, None))


@contextlib.contextmanager
def _recording_backward_python() -> Iterator[list[tuple[str, type | None]]]:
    _install_backward_recording()
    outer = getattr(_local, "backward_python", None)
    _local.backward_python = seen = []
    try:
        yield seen
    finally:
        _local.backward_python = outer


def _decompositions() -> dict:
    """Ops the autograd graphs decompose before torch_xla lowers them.

    ``F.dropout`` reaches AOTAutograd's graphs as ``aten.native_dropout``,
    and torch_xla 2.9 lowers ``native_dropout(x, p, train=True)`` keeping each
    element with probability ``p`` and scaling by ``1/p`` (eager ``F.dropout``
    on XLA uses another, correct kernel). PyTorch's decomposition (uniform
    draws compared with ``p``, scaled by ``1/(1-p)``) gives dropout's
    semantics and a boolean mask.
    """
    from torch._decomp import get_decompositions

    return get_decompositions([torch.ops.aten.native_dropout])


def _install_per_thread_rng_preservation() -> None:
    """Make AOTAutograd's ``preserve_rng_state`` a no-op on threads inside :func:`_host_rng_left_alone`.

    Installed once; elsewhere it calls PyTorch's own, unchanged.
    """
    import torch._functorch.aot_autograd as aot_autograd

    original = aot_autograd.preserve_rng_state
    if getattr(original, "txe_per_thread", False):
        return

    @contextlib.contextmanager
    def preserve_rng_state() -> Iterator[None]:
        if getattr(_local, "left_alone", False):
            yield
        else:
            with original():
                yield

    preserve_rng_state.txe_per_thread = True  # type: ignore[attr-defined]
    aot_autograd.preserve_rng_state = preserve_rng_state


@contextlib.contextmanager
def _host_rng_left_alone() -> Iterator[None]:
    _install_per_thread_rng_preservation()
    outer = getattr(_local, "left_alone", False)
    _local.left_alone = True
    try:
        yield
    finally:
        _local.left_alone = outer


def split(primal_fn: Callable, args: Sequence[torch.Tensor], partition_fn: Callable | None) -> Split:
    """Run AOTAutograd on ``primal_fn(*args)`` and its backward; return the forward and backward graphs.

    The backward graph is captured by running the backward of the compiled
    function once, seeded with ones, on the example inputs ``args`` (which
    hold no data anyone reads: nothing is executed). The forward runs under
    the caller's autocast, the backward without (see :mod:`.autocast`).

    ``backward_python`` names the user's Python code that tracing the
    backward ran: a custom ``autograd.Function``'s backward not from PyTorch,
    torch_xla or this package, a module backward hook, a tensor hook the step
    registered (noted by the lifter, :func:`note_backward_python`). What such
    code reads (a coefficient on a schedule, a hook's closure, a value kept
    on ``ctx``) is in no forward trace: a plan with it is reused only while
    that state is unchanged
    (:func:`~torch_xla_ext._scan.state.backward_state_key`).
    """
    from functorch.compile import aot_function, default_partition, make_boxed_func

    captured: dict[str, torch.fx.GraphModule] = {}

    def capture(kind: str):
        def compiler(gm: torch.fx.GraphModule, _inputs):
            captured[kind] = gm
            return make_boxed_func(gm)

        return compiler

    callers = autocast.enabled()

    def forward_as_called(*primals):  # the backward AOTAutograd traces after it runs without autocast
        with autocast.on(callers):
            return primal_fn(*primals)

    with (torch.enable_grad(), scan_step_trace(), _host_rng_left_alone(), autocast.off(),
          _recording_backward_python() as backward_python):
        compiled = aot_function(forward_as_called, fw_compiler=capture("fw"), bw_compiler=capture("bw"),
                                partition_fn=partition_fn or default_partition,
                                decompositions=_decompositions(), enable_log=False)
        outs = compiled(*args)
        diff = [o for o in outs if o.requires_grad]
        if diff:
            torch.autograd.backward(diff, [torch.ones_like(o) for o in diff])
    return Split(captured["fw"], captured.get("bw"), tuple(outs),
                 tuple(dict.fromkeys(what for what, _ in backward_python)),
                 tuple(dict.fromkeys(cls for _, cls in backward_python if cls is not None)))
