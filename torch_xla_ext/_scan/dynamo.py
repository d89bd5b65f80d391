"""``scan`` under ``torch.compile``: refused at trace time with a clear error.

A scan lowers its own XLA ``while`` loop from a lazy trace on placeholders,
which dynamo's fake tensors cannot run. Running it between compiled graphs
(``torch.compiler.disable``, a graph break) gives the eager values on the
first call, but with torch_xla 2.9's ``openxla`` backend the gradients of the
following calls are wrong once parameters are updated in place; the same
happens to plain eager code behind a graph break, so it is not the scan's
doing, and it is not a risk worth a silently wrong gradient. Scanned models
run without ``torch.compile``: the lazy tensor graph already compiles each
step (and the scan's loop) into one XLA computation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


class ScanUnderCompileError(RuntimeError):
    """``scan`` or ``scan_layers`` was called inside a ``torch.compile`` region."""


def _inside_compiled_call() -> bool:
    """Whether this call is part of a ``torch.compile``-d function's call.

    True while dynamo traces it, and when it runs eagerly after a graph break
    (dynamo's frame callback is then still installed).
    """
    if torch.compiler.is_compiling():
        return True
    callback = torch._C._dynamo.eval_frame.get_eval_frame_callback()
    return callback is not None and callback is not False


def refused_under_compile(fn: F) -> F:
    """``fn``, raising :class:`ScanUnderCompileError` when called inside a ``torch.compile``-d call.

    With ``fullgraph=True`` dynamo reports the error while tracing (its
    message quotes this one); otherwise dynamo breaks the graph at the call,
    compiles and runs what came before, and this raises when the call runs.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _inside_compiled_call():
            raise ScanUnderCompileError(
                f"torch_xla_ext.{fn.__name__.lstrip('_')} cannot run inside torch.compile: it lowers its own XLA "
                f"while loop from a lazy trace, and torch_xla 2.9's openxla backend computes wrong gradients after "
                f"a graph break around it once parameters are updated in place. Run the scanned model without "
                f"torch.compile (each lazy step is compiled into one XLA computation, the loop included), or "
                f"compile only the parts that do not scan."
            )
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
