"""Guards against host<->device transfers of XLA tensors.

Two layers, mirroring ``jax.transfer_guard``:

(a) *Explicit* transfers of XLA tensors made from Python inside the guarded
    block (``.cpu()``, ``.to("cpu")``, ``.item()``, ``.tolist()``, ``.numpy()``,
    ``bool()/int()/float()``, printing, ``torch.equal``...) are intercepted by a
    ``TorchFunctionMode`` and, in ``"disallow"`` mode, raise
    :class:`HostTransferError` *before* any data moves. This layer is per
    thread: torch keeps the mode stack per thread and the guard keeps its
    frames in thread-local storage, so a guard never intercepts another
    thread's calls.

(b) On exit, the deltas of torch_xla's transfer metrics over exactly the
    guarded block catch transfers made inside C++ (for example
    ``LoweringContext.parameter_id_tensor_mapping()``, which gathers sharded
    data with ``ReplicateShardedData`` and copies it to the host). In
    ``"disallow"`` mode they raise :class:`HostTransferError` with a report of
    what moved and how many bytes; ``"log"`` warns instead.

Guards nest: an inner ``"allow"`` inside an outer ``"disallow"`` is honoured,
and what moved inside the inner block is accounted to the inner block only.
Exceptions raised by the body propagate unchanged.

Threads. torch_xla's metrics are process-wide: they count every thread's
transfers and say nothing about which thread made them. Layer (b) therefore
tells threads apart only where the guard itself saw the transfer being made:

* The first guard opened in the process wraps the explicit device->host entry
  points (``Tensor.cpu``, ``Tensor.to``, ``Tensor.copy_``, ``Tensor.item``,
  ``bool()``, ``repr()``, ``torch.equal`` ... the list in
  :mod:`torch_xla_ext._transfer.calls`) on ``torch.Tensor`` and in
  ``torch``, for every thread and for the rest of the process. A wrapped call
  that reads an XLA tensor to the host records its thread and its start and
  end times (the latest 4096 calls are kept); a call still running is known
  as such. The wrappers move and copy nothing and add about 1 us per call.
* Each such call makes exactly one ``TransferFromDevice`` (one
  ``TransferFromDeviceTime`` and one ``InboundData`` sample; measured on
  torch_xla 2.9 for ``.cpu()``, ``.to("cpu")``, ``.tolist()``, ``repr``,
  ``copy_``, ``.item()``, ``bool()``, ``torch.equal``, ``torch.allclose``).
  torch_xla timestamps every sample, so a guard's exit matches the samples of
  its block against the recorded calls. A sample that every consistent
  matching gives to another thread's call is not blamed on this thread; any
  other sample is. Calls made in threads Python did not start (autograd's
  device threads run ``backward()`` hooks there) explain nothing.
* What cannot be told apart is reported as such: when a block is blamed
  while other Python threads were alive, the error names them and says that
  a transfer they made inside C++ (or through a path the guard does not wrap)
  cannot be distinguished from this thread's. Host->device transfers are never
  attributed to threads (torch_xla uploads host data lazily, in whichever
  thread runs the computation that reads it); the error says so when other
  threads were alive.
* Known gaps: a call another thread was already in the middle of when the
  first guard installed the wrappers is not seen (the error says so when it
  may apply); and if another thread's wrapped call moves nothing (its
  tensor's data was still on the host) while this thread transfers inside C++
  at that very moment, the sample is taken for the other thread's.

Host-to-device: torch_xla uploads Python scalars used in arithmetic
(``x * 2.0``) as small device-data tensors the first time it sees each value,
so a ``"disallow"`` host-to-device guard can fire on code that looks
transfer-free. That is real data movement and is reported as such.

Where each part lives: this module holds the public API, the guard frames
and their nesting, and the verdict; :mod:`torch_xla_ext._transfer` holds the
metric layer (``metrics``), layer (a) (``explicit``), the process-wide call
records (``calls``) and the sample-to-call matching (``attribution``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import warnings
from collections.abc import Iterator
from typing import Any, Literal

import torch

from ._format import format_bytes
from ._transfer import calls as _calls
from ._transfer.attribution import RUNNING_WAIT_S, Attribution, attribute
from ._transfer.calls import Call
from ._transfer.errors import HostTransferError
from ._transfer.explicit import InterceptMode, describe
from ._transfer.metrics import D2H, H2D, Snapshot, TransferStats, read_snapshot, read_stats
from ._transfer.tracebacks import hide_from_pytest

__all__ = [
    "HostTransferError",
    "TransferStats",
    "measure_transfers",
    "no_host_transfers",
    "transfer_guard",
    "transfer_guard_device_to_host",
    "transfer_guard_host_to_device",
]

# Public home of the stats record and the error (what help(), reprs of the classes and pickles name).
TransferStats.__module__ = __name__
HostTransferError.__module__ = __name__

# pytest leaves this module's frames out of a HostTransferError's traceback (see
# torch_xla_ext._transfer.tracebacks; the pytest plugin also drops torch's frames
# between the user's call and the guard).
__tracebackhide__ = hide_from_pytest

Mode = Literal["allow", "log", "disallow"]
_MODES: tuple[str, ...] = ("allow", "log", "disallow")


# --------------------------------------------------------------------------- #
# Measuring without judging.
# --------------------------------------------------------------------------- #

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
    metrics moves no data. The counts are process-wide: they include what
    other threads moved while the block ran.
    """
    m = _Measurement()
    before = read_stats()
    try:
        yield m
    finally:
        m.stats = read_stats() - before


# --------------------------------------------------------------------------- #
# Guard frames: one per open guard, a stack per thread.
# --------------------------------------------------------------------------- #

_local = threading.local()


@dataclasses.dataclass
class _Frame:
    d2h: str | None
    h2d: str | None
    parent: _Frame | None
    start: Snapshot | None = None
    excused: TransferStats = dataclasses.field(default_factory=TransferStats)
    # (start, end) snapshots of the direct child frames: their samples are theirs.
    children: list[tuple[Snapshot, Snapshot]] = dataclasses.field(default_factory=list)
    # Other threads alive when the block opened: ident -> name.
    others: dict[int, str] = dataclasses.field(default_factory=dict)
    # Explicit device->host calls of this block already warned about in "log" mode (one transfer each).
    logged: int = 0

    def effective(self, direction: str) -> str:
        """The mode of the innermost frame that sets one for ``direction``; "allow" when none does."""
        frame: _Frame | None = self
        while frame is not None:
            mode = frame.d2h if direction == D2H else frame.h2d
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


def _other_threads() -> dict[int, str]:
    me = threading.get_ident()
    return {t.ident: t.name for t in threading.enumerate() if t.ident is not None and t.ident != me}


def _on_explicit_transfer(direction: str, op: str, tensor: torch.Tensor | None) -> None:
    """Layer (a): refuse (or warn about) an explicit transfer of this thread before it moves data."""
    frame = _top()
    if frame is None:
        return
    mode = frame.effective(direction)
    if mode == "allow":
        return
    what = f"{op} on {describe(tensor)}" if isinstance(tensor, torch.Tensor) else op
    arrow = "device->host" if direction == D2H else "host->device"
    message = (
        f"{arrow} transfer inside transfer_guard('{mode}'): {what}. "
        f"Keep the data on the device, move this call outside the guarded block, "
        f"or wrap it in transfer_guard_{direction}('allow')."
    )
    if mode == "disallow":
        raise HostTransferError(message)
    if direction == D2H:
        frame.logged += 1  # the block's metric report leaves this transfer out
    warnings.warn(message, stacklevel=4)


@contextlib.contextmanager
def _guard(d2h: str | None, h2d: str | None) -> Iterator[None]:
    _calls.install()
    stack = _stack()
    frame = _Frame(d2h=d2h, h2d=h2d, parent=stack[-1] if stack else None)
    needs_mode = not stack
    frame.others = _other_threads()
    frame.start = read_snapshot()
    stack.append(frame)
    mode_cm = InterceptMode(_on_explicit_transfer) if needs_mode else contextlib.nullcontext()
    body_raised = False
    try:
        with mode_cm:
            yield
    except BaseException:
        body_raised = True
        raise
    finally:
        stack.pop()
        end = read_snapshot()
        if frame.parent is not None:
            frame.parent.excused = frame.parent.excused + (end.stats - frame.start.stats)
            frame.parent.children.append((frame.start, end))
        if not body_raised:
            _judge(frame, end)


# --------------------------------------------------------------------------- #
# Layer (b): the verdict on a block's metric deltas.
# --------------------------------------------------------------------------- #

def _names(threads: dict[int, str], limit: int = 5) -> str:
    names = sorted(threads.values())
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _calls_summary(calls: list[Call], limit: int = 4) -> str:
    tally = collections.Counter((c.thread_name, c.op) for c in calls)
    parts = [f"{thread}: {n} x {op}" for (thread, op), n in tally.most_common(limit)]
    if len(tally) > limit:
        parts.append(f"{len(tally) - limit} more")
    return "; ".join(parts)


def _d2h_report(own: TransferStats, attribution: Attribution | None) -> str | None:
    """The device->host part of the error, or None when nothing is blamed on this thread."""
    if not own.device_to_host:
        return None
    if attribution is None:
        return own.report(D2H)
    if attribution.explained:
        return None
    t, b = attribution.transfers, attribution.inbound
    matched = t.total - t.count
    text = (
        f"device->host: {t.count} of the block's {t.total} transfer(s) "
        f"({format_bytes(b.value)} of {format_bytes(own.d2h_bytes)}"
        f"{', plus bytes no longer sampled' if b.evicted else ''}) could not be matched with "
        f"certainty to explicit calls in other threads"
    )
    if attribution.calls:
        text += f" ({matched} matched to: {_calls_summary(attribution.calls)})"
    return text + f". Block totals, all threads: {own.report(D2H)}"


def _judge(frame: _Frame, end: Snapshot) -> None:
    """Raise or warn when the block moved data its modes disallow (reads metrics; moves nothing)."""
    assert frame.start is not None
    own = (end.stats - frame.start.stats) - frame.excused
    d2h_mode, h2d_mode = frame.effective(D2H), frame.effective(H2D)
    problems: list[tuple[str, str]] = []
    notes: list[str] = []
    attribution: Attribution | None = None
    if d2h_mode == "log" and own.device_to_host and own.d2h_transfers <= frame.logged:
        own = dataclasses.replace(own, d2h_transfers=0, d2h_bytes=0, d2h_time_ns=0, replicate_sharded_data=0,
                                  to_cpu=0, local_scalar_dense=0)  # each one was warned about at its call
    if d2h_mode != "allow" and own.device_to_host:
        attribution = attribute(frame.start, end, frame.children)
        report = _d2h_report(own, attribution)
        if report is not None:
            problems.append((d2h_mode, report))
    if h2d_mode != "allow" and own.host_to_device:
        problems.append((h2d_mode, own.report(H2D)))
    if not problems:
        return
    others = {**frame.others, **_other_threads()}
    blamed_d2h = any(report.startswith("device->host") for _, report in problems)
    if blamed_d2h and others:
        notes.append(
            f"Other Python threads were alive during the block ({_names(others)}). torch_xla's "
            f"transfer metrics are process-wide: the guard leaves out only transfers it saw another "
            f"thread make through an explicit call (.cpu(), .to('cpu'), .item(), bool(), repr(), ...; "
            f"one transfer per call), so a transfer another thread made inside C++ (e.g. "
            f"parameter_id_tensor_mapping()) or through a path the guard does not wrap cannot be told "
            f"apart from one made by this thread. If this thread moved nothing, keep the other "
            f"threads' transfers out of the guarded span or make them through explicit calls."
        )
    since_install_ms = (frame.start.time_ns - (_calls.installed_ns() or 0)) / 1e6
    older = {i: name for i, name in others.items() if i in _calls.threads_at_install()}
    if blamed_d2h and older and since_install_ms < 1000:
        notes.append(
            f"The guard started watching other threads' calls {since_install_ms:.1f} ms before this "
            f"block opened (the process's first guard wraps torch's device->host calls); a call "
            f"that {_names(older)} was in the middle of at that moment is not seen. Open any guard (e.g. "
            f"`with transfer_guard('allow'): pass`) before starting threads that move data."
        )
    if attribution is not None and attribution.running:
        running = {i: others.get(i, f"thread {i}") for i in attribution.running}
        notes.append(
            f"A call in {_names(running)} started before the block ended and was still running "
            f"{RUNNING_WAIT_S:.1f} s later, so its transfer could not be placed."
        )
    if attribution is not None and attribution.transfers.evicted:
        notes.append(
            f"{attribution.transfers.evicted} transfer sample(s) had already left torch_xla's sample "
            f"buffer, so they could not be matched to calls; set XLA_METRICS_SAMPLES (1024 by "
            f"default) above the transfers one block sees, before torch_xla is imported."
        )
    if any(report.startswith("host->device") for _, report in problems) and others:
        notes.append(
            f"Host->device transfers cannot be attributed to threads: torch_xla uploads host data "
            f"lazily, when a computation that reads it runs, in whichever thread runs it, and other "
            f"Python threads were alive ({_names(others)}). Guard only device->host "
            f"(no_host_transfers()) while other threads feed the device."
        )
    message = (
        "transfers between host and XLA device inside a transfer guard "
        "(measured by torch_xla metrics around the block; they may come from C++, "
        "e.g. a host parameter mapping or a sharded-data gather): "
        + "; ".join(report for _, report in problems)
        + "".join(f" {note}" for note in notes)
    )
    if any(mode == "disallow" for mode, _ in problems):
        raise HostTransferError(message)
    warnings.warn(message, stacklevel=4)


def transfer_guard(mode: Mode) -> contextlib.AbstractContextManager[None]:
    """Guard both directions of host<->device transfers in the enclosed block.

    ``mode`` is ``"allow"``, ``"log"`` (warn) or ``"disallow"`` (raise
    :class:`HostTransferError`). Nothing is moved by the guard itself. The
    first guard in a process wraps torch's explicit device->host entry points
    for every thread (see the module docstring); the wrappers move nothing.
    """
    mode = _validated(mode)
    return _guard(mode, mode)


def transfer_guard_device_to_host(mode: Mode) -> contextlib.AbstractContextManager[None]:
    """Guard device->host transfers only (host->device inherits the enclosing guard).

    Device->host transfers that another thread made through an explicit call
    (``.cpu()``, ``.item()``, ...) while the block ran are not blamed on it.
    """
    return _guard(_validated(mode), None)


def transfer_guard_host_to_device(mode: Mode) -> contextlib.AbstractContextManager[None]:
    """Guard host->device transfers only (device->host inherits the enclosing guard).

    Host->device transfers cannot be attributed to threads; with other threads
    uploading, the error says so.
    """
    return _guard(None, _validated(mode))


def no_host_transfers() -> contextlib.AbstractContextManager[None]:
    """Fail if any data moves from an XLA device to the host inside the block.

    Equivalent to ``transfer_guard_device_to_host("disallow")``: explicit
    transfers in this thread raise before moving; transfers found by the
    metrics on exit raise unless they are matched to another thread's call.
    """
    return transfer_guard_device_to_host("disallow")
