"""Autocast around scan's captured graphs: the forward as the caller has it, the backward without.

AOTAutograd captures the step's forward and backward in one trace. Under
``torch.autocast`` the forward must see the caller's autocast, and the graph
then holds autocast's casts as ops. The backward is captured as PyTorch
advises autocast to be used, with ``backward()`` called after the autocast
block: its ops run in the dtypes the forward chose (a matmul the step ran in
float32 with autocast switched off inside gets a float32 gradient, as in the
Python loop). PyTorch's own switch for this (``backward_pass_autocast``)
finds no ``torch.xla`` module and leaves XLA's autocast on; :func:`off`
switches every device's. A ``backward()`` run under autocast is refused by
the scan's backward (eager would autocast its ops; the captured ones do not).

``F.scaled_dot_product_attention`` has an XLA autocast rule of the
package's (:mod:`torch_xla_ext._sdpa_autocast`): the capture goes through it
as eager does, so the graphs hold its casts and its float32 softmax.

Captured graphs run with autocast off as well: their casts are in them, and a
second pass of autocast would cast an op on its float32 list (a softmax, say)
up again, to a dtype the graph did not record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

__all__ = ["DEVICES", "enabled", "off", "on"]

#: The devices whose autocast state scan reads, switches and keys its cache on.
DEVICES = ("cpu", "cuda", "xla")


def enabled() -> list[tuple[str, torch.dtype]]:
    """The devices whose autocast is on in this thread, with its dtype."""
    return [(device, torch.get_autocast_dtype(device)) for device in DEVICES if torch.is_autocast_enabled(device)]


@contextlib.contextmanager
def off() -> Iterator[None]:
    """Autocast off for every device, in this thread, for the block."""
    with contextlib.ExitStack() as stack:
        for device, _ in enabled():
            stack.enter_context(torch.autocast(device, enabled=False))
        yield


@contextlib.contextmanager
def on(state: Sequence[tuple[str, torch.dtype]]) -> Iterator[None]:
    """Autocast on as ``state`` (from :func:`enabled`) has it, in this thread, for the block."""
    with contextlib.ExitStack() as stack:
        for device, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield
