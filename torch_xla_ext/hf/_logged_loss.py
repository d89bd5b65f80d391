"""The loss a logged Trainer step reads: the global value already, under SPMD; no gather across processes.

At each logged step Trainer averages its running loss "over all processes"
with ``nested_gather``, which on XLA is ``xm.mesh_reduce``: a rendezvous
that pickles the loss to the host, uploads it, gathers sizes and payloads
across processes and reads them back (measured on a tiny Llama, 8 devices:
7 device-to-host transfers and 2 uploads per logged step, beside the
gradient norm's one read). Under SPMD one program computes the global loss,
replicated on every device of every process: the gather returns copies of
that value, and their mean is the value. :func:`spmd_loss_gather` makes
``transformers.trainer.nested_gather`` return a host copy of the tensors (one
read each, a replicated scalar: no gather runs) while an ``SPMDTrainer``
logs on this thread; every other caller, and every other thread, gets
transformers' function.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["spmd_loss_gather"]

_active: contextvars.ContextVar[bool] = contextvars.ContextVar("txe_spmd_loss_gather", default=False)
_installed: list[Callable[..., Any]] = []


def _install() -> None:
    """Wrap ``transformers.trainer.nested_gather`` once (the name ``_maybe_log_save_evaluate`` calls)."""
    if _installed:
        return
    import transformers.trainer as trainer_module

    original = trainer_module.nested_gather

    @functools.wraps(original)
    def nested_gather(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        if not _active.get():
            return original(tensors, *args, **kwargs)
        # One read of each tensor, and Trainer's mean of it on the host: no program to compile for the mean.
        return torch.utils._pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tensors)

    trainer_module.nested_gather = nested_gather
    _installed.append(original)


@contextlib.contextmanager
def spmd_loss_gather() -> Iterator[None]:
    """Inside the block, on this thread, Trainer's cross-process loss gather returns its input (see above)."""
    _install()
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)
