"""Guards against host<->device transfers of XLA tensors.

Two layers, mirroring ``jax.transfer_guard``:

(a) *Explicit* transfers of XLA tensors made from Python inside the guarded
    block (``.cpu()``, ``.to("cpu")``, ``.item()``, ``.tolist()``, ``.numpy()``,
    ``bool()/int()/float()``, printing, ``torch.equal``...) are intercepted by a
    ``TorchFunctionMode`` and, in ``"disallow"`` mode, raise
    :class:`HostTransferError` *before* any data moves.

(b) On exit, the deltas of torch_xla's transfer metrics over exactly the
    guarded block catch transfers made inside C++ (for example
    ``LoweringContext.parameter_id_tensor_mapping()``, which gathers sharded
    data with ``ReplicateShardedData`` and copies it to the host). In
    ``"disallow"`` mode they raise :class:`HostTransferError` with a report of
    what moved and how many bytes; ``"log"`` warns instead.

Guards nest: an inner ``"allow"`` inside an outer ``"disallow"`` is honoured,
and what moved inside the inner block is accounted to the inner block only.
Exceptions raised by the body propagate unchanged.

The metrics are process-wide: transfers made concurrently by *other* threads
while a guard is open are attributed to that guard. The Python-level
interception (layer a) is per thread.

Host-to-device: torch_xla uploads Python scalars used in arithmetic
(``x * 2.0``) as small device-data tensors the first time it sees each value,
so a ``"disallow"`` host-to-device guard can fire on code that looks
transfer-free. That is real data movement and is reported as such.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import torch
from torch.overrides import TorchFunctionMode

from ._format import format_bytes

__all__ = [
    "HostTransferError",
    "TransferStats",
    "measure_transfers",
    "no_host_transfers",
    "transfer_guard",
    "transfer_guard_device_to_host",
    "transfer_guard_host_to_device",
]

Mode = Literal["allow", "log", "disallow"]
_MODES: tuple[str, ...] = ("allow", "log", "disallow")
_D2H = "device_to_host"
_H2D = "host_to_device"


class HostTransferError(RuntimeError):
    """A transfer between host and XLA device happened where a guard disallows it."""


# --------------------------------------------------------------------------- #
# Layer (b): metric deltas.
# --------------------------------------------------------------------------- #

@dataclasses.dataclass(frozen=True)
class TransferStats:
    """Deltas of torch_xla's transfer metrics over a block of code.

    Attributes:
      d2h_transfers: number of device->host transfers (``TransferFromDeviceTime`` count).
      d2h_bytes: bytes received by the host (``InboundData`` total).
      d2h_time_ns: time spent in device->host transfers.
      replicate_sharded_data: sharded tensors gathered to one device (``ReplicateShardedData``).
      to_cpu: ``xla::_to_cpu`` calls.
      local_scalar_dense: ``aten::_local_scalar_dense`` calls (``.item()``, ``bool()``...).
      h2d_transfers: number of host->device transfers (``TransferToDeviceTime`` count).
      h2d_bytes: bytes sent to the device (``OutboundData`` total).
      h2d_time_ns: time spent in host->device transfers.
    """

    d2h_transfers: int = 0
    d2h_bytes: int = 0
    d2h_time_ns: int = 0
    replicate_sharded_data: int = 0
    to_cpu: int = 0
    local_scalar_dense: int = 0
    h2d_transfers: int = 0
    h2d_bytes: int = 0
    h2d_time_ns: int = 0

    @property
    def device_to_host(self) -> bool:
        """True when any device->host evidence is non-zero."""
        return any(
            (self.d2h_transfers, self.d2h_bytes, self.replicate_sharded_data,
             self.to_cpu, self.local_scalar_dense)
        )

    @property
    def host_to_device(self) -> bool:
        """True when any host->device evidence is non-zero."""
        return bool(self.h2d_transfers or self.h2d_bytes)

    def __sub__(self, other: TransferStats) -> TransferStats:
        return TransferStats(**{
            f.name: getattr(self, f.name) - getattr(other, f.name)
            for f in dataclasses.fields(self)
        })

    def __add__(self, other: TransferStats) -> TransferStats:
        return TransferStats(**{
            f.name: getattr(self, f.name) + getattr(other, f.name)
            for f in dataclasses.fields(self)
        })

    def report(self, direction: str | None = None) -> str:
        """A one-line human-readable account of what moved."""
        parts = []
        if direction in (None, _D2H) and self.device_to_host:
            parts.append(
                f"device->host: {self.d2h_transfers} transfer(s), {format_bytes(self.d2h_bytes)} "
                f"in {self.d2h_time_ns / 1e6:.2f} ms (TransferFromDeviceTime/InboundData), "
                f"ReplicateShardedData={self.replicate_sharded_data}, "
                f"xla::_to_cpu={self.to_cpu}, "
                f"aten::_local_scalar_dense={self.local_scalar_dense}"
            )
        if direction in (None, _H2D) and self.host_to_device:
            parts.append(
                f"host->device: {self.h2d_transfers} transfer(s), {format_bytes(self.h2d_bytes)} "
                f"in {self.h2d_time_ns / 1e6:.2f} ms (TransferToDeviceTime/OutboundData)"
            )
        return "; ".join(parts) if parts else "nothing moved"


def _read_stats() -> TransferStats:
    """Current absolute values of the transfer metrics (no data moves)."""
    import torch_xla.debug.metrics as met

    def metric(name: str) -> tuple[int, int]:
        data = met.metric_data(name)
        if data is None:
            return 0, 0
        return int(data[0]), int(data[1])

    def counter(name: str) -> int:
        value = met.counter_value(name)
        return 0 if value is None else int(value)

    d2h_n, d2h_ns = metric("TransferFromDeviceTime")
    _, d2h_bytes = metric("InboundData")
    h2d_n, h2d_ns = metric("TransferToDeviceTime")
    _, h2d_bytes = metric("OutboundData")
    return TransferStats(
        d2h_transfers=d2h_n,
        d2h_bytes=d2h_bytes,
        d2h_time_ns=d2h_ns,
        replicate_sharded_data=counter("ReplicateShardedData"),
        to_cpu=counter("xla::_to_cpu"),
        local_scalar_dense=counter("aten::_local_scalar_dense"),
        h2d_transfers=h2d_n,
        h2d_bytes=h2d_bytes,
        h2d_time_ns=h2d_ns,
    )


class _Measurement:
    """Mutable holder filled when a :func:`measure_transfers` block exits."""

    def __init__(self) -> None:
        self.stats: TransferStats | None = None

    def __getattr__(self, name: str) -> Any:
        stats = self.__dict__.get("stats")
        if stats is None:
            raise RuntimeError("transfer statistics are available once the measured block has exited")
        return getattr(stats, name)

    def __repr__(self) -> str:
        return f"Measurement({self.stats!r})"


@contextlib.contextmanager
def measure_transfers() -> Iterator[_Measurement]:
    """Measure the transfer metrics' deltas over exactly the enclosed block.

    ``with measure_transfers() as m: ...`` then ``m.d2h_bytes``, ``m.device_to_host``,
    ``m.report()`` and every other :class:`TransferStats` field. Reading the
    metrics moves no data.
    """
    m = _Measurement()
    before = _read_stats()
    try:
        yield m
    finally:
        m.stats = _read_stats() - before


# --------------------------------------------------------------------------- #
# Layer (a): Python-level interception of explicit transfers.
# --------------------------------------------------------------------------- #

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
_FACTORIES_WITH_DATA = {
    torch.tensor: "torch.tensor(..., device=xla)",
    torch.as_tensor: "torch.as_tensor(..., device=xla)",
    torch.asarray: "torch.asarray(..., device=xla)",
}


def _is_xla(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "xla"


def _is_device(device: Any, kind: str) -> bool:
    if device is None:
        return False
    try:
        return torch.device(device).type == kind
    except (RuntimeError, TypeError):
        return False


def _describe(t: torch.Tensor) -> str:
    desc = f"shape {tuple(t.shape)} dtype {t.dtype}"
    if _is_xla(t):
        try:
            import torch_xla

            spec = torch_xla._XLAC._get_xla_sharding_spec(t)
        except Exception:  # pragma: no cover - describing must never fail
            spec = ""
        desc += f" sharding {spec or '{replicated}'}"
    return desc


def _classify(func: Any, args: tuple, kwargs: dict) -> tuple[str, str, torch.Tensor] | None:
    """(direction, op description, tensor) if ``func(*args, **kwargs)`` transfers."""
    if func in _ALWAYS_D2H:
        t = args[0] if args else None
        if _is_xla(t):
            return _D2H, _ALWAYS_D2H[func], t
        if len(args) > 1 and _is_xla(args[1]) and func in (_T.equal, _T.allclose, torch.equal, torch.allclose):
            return _D2H, _ALWAYS_D2H[func], args[1]
        return None
    if func is _T.to:
        src = args[0] if args else None
        if not isinstance(src, torch.Tensor):
            return None
        try:
            target, _, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        except (RuntimeError, TypeError):
            return None
        if target is None:
            return None
        if _is_xla(src) and not _is_device(target, "xla"):
            return _D2H, f"Tensor.to({target})", src
        if not _is_xla(src) and _is_device(target, "xla"):
            return _H2D, f"Tensor.to({target})", src
        return None
    if func is _T.copy_:
        dst = args[0] if args else None
        src = args[1] if len(args) > 1 else kwargs.get("src")
        if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor):
            if _is_xla(src) and not _is_xla(dst):
                return _D2H, "Tensor.copy_(xla -> host)", src
            if _is_xla(dst) and not _is_xla(src):
                return _H2D, "Tensor.copy_(host -> xla)", src
        return None
    if func in _FACTORIES_WITH_DATA and _is_device(kwargs.get("device"), "xla"):
        data = args[0] if args else kwargs.get("data")
        if isinstance(data, torch.Tensor) and _is_xla(data):
            return None
        what = (f"data of shape {tuple(data.shape)}" if hasattr(data, "shape")
                else f"Python {type(data).__name__}")
        return _H2D, f"{_FACTORIES_WITH_DATA[func]} from {what}", data if isinstance(data, torch.Tensor) else None
    return None


class _GuardMode(TorchFunctionMode):
    """Intercepts explicit transfers and consults the innermost guard frame."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        frame = _top()
        if frame is not None:
            hit = _classify(func, args, kwargs)
            if hit is not None:
                direction, op, tensor = hit
                mode = frame.effective(direction)
                if mode != "allow":
                    what = f"{op} on {_describe(tensor)}" if isinstance(tensor, torch.Tensor) else op
                    arrow = "device->host" if direction == _D2H else "host->device"
                    message = (
                        f"{arrow} transfer inside transfer_guard('{mode}'): {what}. "
                        f"Keep the data on the device, move this call outside the guarded block, "
                        f"or wrap it in transfer_guard_{direction}('allow')."
                    )
                    if mode == "disallow":
                        raise HostTransferError(message)
                    warnings.warn(message, stacklevel=3)
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- #
# Guard frames.
# --------------------------------------------------------------------------- #

_local = threading.local()


@dataclasses.dataclass
class _Frame:
    d2h: str | None
    h2d: str | None
    parent: _Frame | None
    start: TransferStats = dataclasses.field(default_factory=TransferStats)
    excused: TransferStats = dataclasses.field(default_factory=TransferStats)

    def effective(self, direction: str) -> str:
        frame: _Frame | None = self
        while frame is not None:
            mode = frame.d2h if direction == _D2H else frame.h2d
            if mode is not None:
                return mode
            frame = frame.parent
        return "allow"


def _stack() -> list[_Frame]:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _top() -> _Frame | None:
    stack = _stack()
    return stack[-1] if stack else None


def _validated(mode: Any) -> str:
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(
            f"transfer guard mode must be one of {', '.join(repr(m) for m in _MODES)}, got {mode!r}"
        )
    return mode


@contextlib.contextmanager
def _guard(d2h: str | None, h2d: str | None) -> Iterator[None]:
    stack = _stack()
    frame = _Frame(d2h=d2h, h2d=h2d, parent=stack[-1] if stack else None)
    needs_mode = not stack
    frame.start = _read_stats()
    stack.append(frame)
    mode_cm = _GuardMode() if needs_mode else contextlib.nullcontext()
    body_raised = False
    try:
        with mode_cm:
            yield
    except BaseException:
        body_raised = True
        raise
    finally:
        stack.pop()
        moved = _read_stats() - frame.start
        if frame.parent is not None:
            frame.parent.excused = frame.parent.excused + moved
        if not body_raised:
            _judge(frame, moved - frame.excused)


def _judge(frame: _Frame, own: TransferStats) -> None:
    problems: list[tuple[str, str]] = []
    for direction, moved in ((_D2H, own.device_to_host), (_H2D, own.host_to_device)):
        mode = frame.effective(direction)
        if moved and mode != "allow":
            problems.append((mode, own.report(direction)))
    if not problems:
        return
    message = (
        "transfers between host and XLA device inside a transfer guard "
        "(measured by torch_xla metrics around the block; they may come from C++, "
        "e.g. a host parameter mapping or a sharded-data gather): "
        + "; ".join(report for _, report in problems)
    )
    if any(mode == "disallow" for mode, _ in problems):
        raise HostTransferError(message)
    warnings.warn(message, stacklevel=4)


def transfer_guard(mode: Mode) -> contextlib.AbstractContextManager[None]:
    """Guard both directions of host<->device transfers in the enclosed block.

    ``mode`` is ``"allow"``, ``"log"`` (warn) or ``"disallow"`` (raise
    :class:`HostTransferError`). Nothing is moved by the guard itself.
    """
    mode = _validated(mode)
    return _guard(mode, mode)


def transfer_guard_device_to_host(mode: Mode) -> contextlib.AbstractContextManager[None]:
    """Guard device->host transfers only (host->device inherits the enclosing guard)."""
    return _guard(_validated(mode), None)


def transfer_guard_host_to_device(mode: Mode) -> contextlib.AbstractContextManager[None]:
    """Guard host->device transfers only (device->host inherits the enclosing guard)."""
    return _guard(None, _validated(mode))


def no_host_transfers() -> contextlib.AbstractContextManager[None]:
    """Fail if any data moves from an XLA device to the host inside the block.

    Equivalent to ``transfer_guard_device_to_host("disallow")``.
    """
    return transfer_guard_device_to_host("disallow")
