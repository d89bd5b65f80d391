"""Explicit transfers: which torch calls move an XLA tensor's data, and intercepting them.

A call such as ``.cpu()``, ``.item()``, ``bool()`` or ``torch.tensor(...,
device=xla)`` moves data between host and device the moment it runs.
:func:`classify` names such a call from its function and arguments without
running it (and without moving anything); :class:`InterceptMode` hands every
such call made in its thread to a callback *before* the call runs, so the
callback can refuse it while the data is still where it was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._xla import xlac
from .metrics import D2H, H2D
from .tracebacks import hide_from_pytest

# pytest leaves this module's frames out of a HostTransferError's traceback.
__tracebackhide__ = hide_from_pytest

_T = torch.Tensor
# Methods/functions that always read an XLA tensor's data to the host.
_ALWAYS_D2H = {
    _T.cpu: "Tensor.cpu()",
    _T.numpy: "Tensor.numpy()",
    _T.item: "Tensor.item()",
    _T.tolist: "Tensor.tolist()",
    _T.__bool__: "bool(Tensor)",
    _T.__int__: "int(Tensor)",
    _T.__float__: "float(Tensor)",
    _T.__complex__: "complex(Tensor)",
    _T.__index__: "operator.index(Tensor)",
    _T.__repr__: "repr(Tensor)",
    _T.__format__: "format(Tensor)",
    _T.__array__: "numpy.asarray(Tensor)",
    _T.is_nonzero: "Tensor.is_nonzero()",
    _T.equal: "Tensor.equal()",
    _T.allclose: "Tensor.allclose()",
    torch.equal: "torch.equal()",
    torch.allclose: "torch.allclose()",
    torch.is_nonzero: "torch.is_nonzero()",
}
# Captured at import, before any stand-in replaces them on torch.Tensor (see
# register_stand_in), so that the identity checks below match torch's own callables.
TO = _T.to
COPY_ = _T.copy_
_TWO_TENSOR_READS = (_T.equal, _T.allclose, torch.equal, torch.allclose)
_FACTORIES_WITH_DATA = {
    torch.tensor: "torch.tensor(..., device=xla)",
    torch.as_tensor: "torch.as_tensor(..., device=xla)",
    torch.asarray: "torch.asarray(..., device=xla)",
}

# Stand-in (a wrapper installed in torch's place) -> the torch callable it stands for.
_original_of: dict[Any, Any] = {}

# Called with (direction, op description, tensor or None) before an explicit transfer runs.
TransferCallback = Callable[[str, str, torch.Tensor | None], None]


def is_xla(value: Any) -> bool:
    """True for a tensor that lives on an XLA device."""
    return isinstance(value, torch.Tensor) and value.is_xla


def _is_device(device: Any, kind: str) -> bool:
    if device is None:
        return False
    try:
        return torch.device(device).type == kind
    except (RuntimeError, TypeError):
        return False


def describe(t: torch.Tensor) -> str:
    """Shape, dtype and (for an XLA tensor) sharding; reads metadata only, moves no data."""
    desc = f"shape {tuple(t.shape)} dtype {t.dtype}"
    if is_xla(t):
        try:
            spec = xlac()._get_xla_sharding_spec(t)
        except Exception:  # pragma: no cover - describing must never fail
            spec = ""
        desc += f" sharding {spec or '{replicated}'}"
    return desc


def register_stand_in(stand_in: Any, original: Any) -> None:
    """Make :func:`unwrapped` (and so the interception) see ``stand_in`` as ``original``."""
    _original_of[stand_in] = original


def unwrapped(func: Any) -> Any:
    """The torch callable ``func`` stands in for, or ``func`` itself."""
    try:
        return _original_of.get(func, func)
    except TypeError:  # unhashable callable
        return func


def classify(func: Any, args: tuple, kwargs: dict) -> tuple[str, str, torch.Tensor | None] | None:
    """(direction, op description, tensor) if ``func(*args, **kwargs)`` would transfer.

    ``func`` is a torch callable itself (see :func:`unwrapped`); nothing is run
    and nothing moves.
    """
    if func in _ALWAYS_D2H:
        t = args[0] if args else None
        if is_xla(t):
            return D2H, _ALWAYS_D2H[func], t
        if len(args) > 1 and is_xla(args[1]) and func in _TWO_TENSOR_READS:
            return D2H, _ALWAYS_D2H[func], args[1]
        return None
    if func is TO:
        src = args[0] if args else None
        if not isinstance(src, torch.Tensor):
            return None
        try:
            target, _, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        except (RuntimeError, TypeError):
            return None
        if target is None:
            return None
        if is_xla(src) and not _is_device(target, "xla"):
            return D2H, f"Tensor.to({target})", src
        if not is_xla(src) and _is_device(target, "xla"):
            return H2D, f"Tensor.to({target})", src
        return None
    if func is COPY_:
        dst = args[0] if args else None
        src = args[1] if len(args) > 1 else kwargs.get("src")
        if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
            if is_xla(src) and not is_xla(dst):
                return D2H, "Tensor.copy_(xla -> host)", src
            if is_xla(dst) and not is_xla(src):
                return H2D, "Tensor.copy_(host -> xla)", src
        return None
    if func in _FACTORIES_WITH_DATA and _is_device(kwargs.get("device"), "xla"):
        data = args[0] if args else kwargs.get("data")
        if isinstance(data, torch.Tensor) and is_xla(data):
            return None
        what = (f"data of shape {tuple(data.shape)}" if hasattr(data, "shape")
                else f"Python {type(data).__name__}")
        return H2D, f"{_FACTORIES_WITH_DATA[func]} from {what}", data if isinstance(data, torch.Tensor) else None
    return None


class InterceptMode(TorchFunctionMode):
    """Hands each explicit transfer made in this thread to ``on_transfer`` before it runs.

    torch keeps the mode stack per thread, so other threads' calls are never
    seen. ``on_transfer`` may raise to stop the call before any data moves;
    it is called directly from ``__torch_function__`` (one frame deeper than
    the mode itself, for ``warnings.warn``'s ``stacklevel``).
    """

    def __init__(self, on_transfer: TransferCallback) -> None:
        super().__init__()
        self._on_transfer = on_transfer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = classify(unwrapped(func), args, kwargs)
        if hit is not None:
            self._on_transfer(*hit)
        return func(*args, **kwargs)
