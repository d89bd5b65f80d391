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

``F.scaled_dot_product_attention`` is refused in that capture: torch_xla has
no autocast rule for it, so eager runs its decomposition op by op under
autocast (the softmax cast up to float32), while AOTAutograd decomposes it
below autocast (the softmax left in bfloat16). Without gradients scan traces
``fn`` op by op as eager does, and the attention is computed as eager does.

Captured graphs run with autocast off as well: their casts are in them, and a
second pass of autocast would cast an op on its float32 list (a softmax, say)
up again, to a dtype the graph did not record.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._frames import user_frame
from .errors import ScanUnsupportedError

__all__ = ["DEVICES", "enabled", "off", "on", "refusing_what_it_would_change"]

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


_ATTENTIONS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


class _RefuseAttention(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _ATTENTIONS:
            raise ScanUnsupportedError(
                f"scan: scaled_dot_product_attention under torch.autocast, with gradients (at {user_frame()}). "
                "torch_xla has no autocast rule for it: eager casts its softmax up to float32, and the trace "
                "that captures the scan's backward would leave it in bfloat16. Use the explicit attention "
                "(transformers' attn_implementation='eager'), compute in bfloat16 without autocast "
                "(fully_shard's or prepare's mp_policy), or call this outside autocast.")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def refusing_what_it_would_change(state: Sequence[tuple[str, torch.dtype]]) -> Iterator[None]:
    """Under autocast (``state`` not empty), refuse the calls the backward's capture would compute otherwise."""
    if not state:
        yield
        return
    with _RefuseAttention():
        yield
