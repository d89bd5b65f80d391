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
  ``_OBSERVED_METHODS``/``_OBSERVED_FUNCTIONS``) on ``torch.Tensor`` and in
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
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import heapq
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Literal, NamedTuple

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


# Metrics with one timestamped sample per device->host transfer.
_TRANSFERS = "TransferFromDeviceTime"
_INBOUND = "InboundData"


def _metric(name: str) -> tuple[int, int, list]:
    """(samples recorded in total, accumulated value, kept samples) of a torch_xla metric."""
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    if data is None:
        return 0, 0, []
    return int(data[0]), int(data[1]), data[2]


def _counter(name: str) -> int:
    import torch_xla.debug.metrics as met

    value = met.counter_value(name)
    return 0 if value is None else int(value)


@dataclasses.dataclass(frozen=True)
class _Snapshot:
    """Absolute metric values at one moment, with the wall-clock time they were read."""

    stats: TransferStats
    inbound_count: int  # InboundData samples recorded so far (one per device->host transfer)
    time_ns: int


def _read_snapshot() -> _Snapshot:
    """Read the transfer metrics (no data moves)."""
    now = time.time_ns()
    d2h_n, d2h_ns, _ = _metric(_TRANSFERS)
    inbound_n, d2h_bytes, _ = _metric(_INBOUND)
    h2d_n, h2d_ns, _ = _metric("TransferToDeviceTime")
    _, h2d_bytes, _ = _metric("OutboundData")
    stats = TransferStats(
        d2h_transfers=d2h_n,
        d2h_bytes=d2h_bytes,
        d2h_time_ns=d2h_ns,
        replicate_sharded_data=_counter("ReplicateShardedData"),
        to_cpu=_counter("xla::_to_cpu"),
        local_scalar_dense=_counter("aten::_local_scalar_dense"),
        h2d_transfers=h2d_n,
        h2d_bytes=h2d_bytes,
        h2d_time_ns=h2d_ns,
    )
    return _Snapshot(stats=stats, inbound_count=inbound_n, time_ns=now)


def _read_stats() -> TransferStats:
    """Current absolute values of the transfer metrics (no data moves)."""
    return _read_snapshot().stats


@dataclasses.dataclass(frozen=True)
class _Samples:
    """The samples torch_xla still keeps for one metric, oldest first.

    ``count`` samples were recorded in total; the kept ones are the last
    ``len(times_ns)`` of them, so absolute sample ``i`` sits at position
    ``i - first``.
    """

    count: int
    times_ns: tuple[int, ...]
    values: tuple[float, ...]

    @property
    def first(self) -> int:
        return self.count - len(self.times_ns)


def _read_samples(name: str, earlier: _Samples | None = None) -> _Samples | None:
    """The kept samples of a metric, joined onto ``earlier`` ones of the same metric.

    None when samples were dropped between the two reads (the join would have a hole).
    """
    count, _, samples = _metric(name)
    # torch_xla reports each sample as (wall-clock seconds, value).
    fresh = _Samples(
        count=count,
        times_ns=tuple(round(ts * 1e9) for ts, _ in samples),
        values=tuple(float(v) for _, v in samples),
    )
    if earlier is None or fresh.first <= earlier.first:
        return fresh
    if fresh.first > earlier.count:
        return None
    keep = fresh.first - earlier.first  # earlier samples the fresh read no longer has
    return _Samples(count=fresh.count, times_ns=earlier.times_ns[:keep] + fresh.times_ns,
                    values=earlier.values[:keep] + fresh.values)


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
# Captured before the observer wraps them (see _install_observer), so that the
# identity checks below keep matching the torch callables themselves.
_TO = _T.to
_COPY_ = _T.copy_
_TWO_TENSOR_READS = (_T.equal, _T.allclose, torch.equal, torch.allclose)
_FACTORIES_WITH_DATA = {
    torch.tensor: "torch.tensor(..., device=xla)",
    torch.as_tensor: "torch.as_tensor(..., device=xla)",
    torch.asarray: "torch.asarray(..., device=xla)",
}


def _is_xla(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_xla


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
        if len(args) > 1 and _is_xla(args[1]) and func in _TWO_TENSOR_READS:
            return _D2H, _ALWAYS_D2H[func], args[1]
        return None
    if func is _TO:
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
    if func is _COPY_:
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


# --------------------------------------------------------------------------- #
# Observing explicit device->host calls in every thread (for layer b).
# --------------------------------------------------------------------------- #

# Wrapped once, by the first guard, for the rest of the process.
_OBSERVED_METHODS: tuple[str, ...] = (
    "cpu", "to", "copy_", "numpy", "item", "tolist", "is_nonzero", "equal", "allclose",
    "__bool__", "__int__", "__float__", "__complex__", "__index__", "__repr__", "__format__",
    "__array__",
)
_OBSERVED_FUNCTIONS: tuple[str, ...] = ("equal", "allclose", "is_nonzero")

# Timestamps: the call's are time.time_ns(); torch_xla's samples are wall-clock
# seconds as doubles (about 0.25 us apart at today's epoch), so an interval is
# widened by this much on each side.
_SLACK_NS = 2_000
# How long a guard's exit waits for another thread's call that was still running
# when the block ended, before it gives up on placing that call's transfer.
_RUNNING_WAIT_S = 1.0
# Completed calls kept for matching (torch_xla keeps 1024 samples per metric by default).
_MAX_CALLS = 4096


class _Call(NamedTuple):
    """An explicit device->host call on an XLA tensor that returned normally."""

    thread: int  # threading.get_ident() of the thread that made it
    thread_name: str
    op: str
    start_ns: int
    end_ns: int


_registry_lock = threading.Lock()
# The latest calls, guard or no guard: a call that ends between two guards may
# still own a sample that an overlapping call of another thread could be taken for.
_calls: collections.deque[_Call] = collections.deque(maxlen=_MAX_CALLS)  # guarded by _registry_lock
# Thread ident -> start of the outermost wrapped call it is running. Single dict
# operations are atomic, so the wrappers touch it without the lock.
_running: dict[int, int] = {}
_original_of: dict[Any, Any] = {}  # wrapper -> the torch callable it wraps
_installed_ns: int | None = None  # when the wrappers went in
_threads_at_install: frozenset[int] = frozenset()  # idents alive then: their running call was not seen


def _attributable_thread() -> bool:
    """False in threads Python did not start (autograd's device threads, C++ pools).

    Such a thread works for whoever queued the work (``backward()`` on an XLA
    tensor runs its hooks there), so its calls explain nobody's transfers.
    """
    return not isinstance(threading.current_thread(), threading._DummyThread)


def _may_read_xla(original: Any, args: tuple, kwargs: dict) -> bool:
    """Cheap filter before :func:`_classify`: False for calls that cannot read an XLA tensor."""
    if original is _TO:
        return bool(args) and _is_xla(args[0]) and (
            "device" in kwargs or any(isinstance(a, (str, torch.device, int, torch.Tensor)) for a in args[1:])
        )
    if original is _COPY_:
        return _is_xla(args[1] if len(args) > 1 else kwargs.get("src"))
    return bool(args) and (_is_xla(args[0]) or (len(args) > 1 and _is_xla(args[1])))


def _record(original: Any, args: tuple, kwargs: dict, ident: int) -> bool:
    """Register a finished call if it read an XLA tensor to the host; never raises."""
    end = time.time_ns()
    try:
        if not _may_read_xla(original, args, kwargs):
            return False
        hit = _classify(original, args, kwargs)
        if hit is None or hit[0] != _D2H or not _attributable_thread():
            return False
        name = threading.current_thread().name
        with _registry_lock:
            start = _running.pop(ident)
            _calls.append(_Call(ident, name, hit[1], start, end))
        return True
    except Exception:  # pragma: no cover - observing must never break the caller
        return False


def _observed(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` with its running time noted, and recorded when it read an XLA tensor."""

    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ident = threading.get_ident()
        if ident in _running:  # nested inside an observed call of this thread
            return original(*args, **kwargs)
        recorded = False
        try:
            _running[ident] = time.time_ns()
            result = original(*args, **kwargs)
            recorded = _record(original, args, kwargs, ident)
            return result
        finally:
            if not recorded:
                _running.pop(ident, None)

    return wrapper


def _install_observer() -> None:
    """Wrap the explicit device->host entry points once per process (moves nothing)."""
    global _installed_ns, _threads_at_install
    if _installed_ns is not None:
        return
    with _registry_lock:
        if _installed_ns is not None:
            return
        for owner, names in ((torch.Tensor, _OBSERVED_METHODS), (torch, _OBSERVED_FUNCTIONS)):
            for name in names:
                original = getattr(owner, name)
                wrapper = _observed(original)
                _original_of[wrapper] = original
                setattr(owner, name, wrapper)
        _installed_ns = time.time_ns()
        _threads_at_install = frozenset(t.ident for t in threading.enumerate() if t.ident is not None)


def _unwrapped(func: Any) -> Any:
    try:
        return _original_of.get(func, func)
    except TypeError:  # unhashable callable
        return func


# --------------------------------------------------------------------------- #
# Matching a block's samples against other threads' calls.
# --------------------------------------------------------------------------- #

_NEVER = 1 << 62  # end of a call still running; also the time of its not-yet-seen sample


def _certainly_matched(points: list[int], intervals: list[tuple[int, int]]) -> list[bool]:
    """For each point, whether every maximum matching of points to intervals uses it.

    A point may be given to any one interval that contains it, an interval
    takes at most one point. ``points`` sorted ascending. One maximum matching
    comes from the greedy sweep that gives each point the open interval ending
    first; a point is then optional exactly when an alternating path leads
    from it to an unmatched point (Gallai-Edmonds): its interval contains
    another point that is unmatched or itself optional.
    """
    n = len(points)
    partner = [-1] * n  # point -> interval
    ends: list[tuple[int, int]] = []
    by_start = sorted(range(len(intervals)), key=lambda k: intervals[k][0])
    j = 0
    for i, p in enumerate(points):
        while j < len(by_start) and intervals[by_start[j]][0] <= p:
            k = by_start[j]
            heapq.heappush(ends, (intervals[k][1], k))
            j += 1
        while ends and ends[0][0] < p:
            heapq.heappop(ends)
        if ends:
            partner[i] = heapq.heappop(ends)[1]
    # The points each matched interval contains, as an index range into `points`.
    span = {
        partner[i]: (bisect.bisect_left(points, intervals[partner[i]][0]),
                     bisect.bisect_right(points, intervals[partner[i]][1]))
        for i in range(n) if partner[i] >= 0
    }
    optional = [partner[i] < 0 for i in range(n)]
    changed = True
    while changed:
        changed = False
        prefix = [0]
        for flag in optional:
            prefix.append(prefix[-1] + flag)
        for i in range(n):
            if not optional[i]:
                lo, hi = span[partner[i]]
                if prefix[hi] - prefix[lo] > 0:  # point i itself is not optional
                    optional[i] = changed = True
    return [not flag for flag in optional]


@dataclasses.dataclass
class _Unexplained:
    """Samples of a block's window that no other thread's call accounts for."""

    count: int  # window samples not certainly another thread's
    total: int  # window samples
    value: float  # sum of the unexplained samples' values (bytes for InboundData)
    evicted: int  # window samples torch_xla no longer keeps


def _unexplained(samples: _Samples, window: list[int], calls: list[_Call],
                 running: list[int]) -> _Unexplained:
    """Which of the samples with absolute indices ``window`` belong to other threads' calls.

    Every completed call made exactly one sample inside its interval. A call
    still running may make its sample later, and a call older than the oldest
    kept sample may own one that torch_xla dropped: each such call gets a
    stand-in point of its own. A window sample is another thread's when every
    maximum matching of points to calls uses it. Any other window sample may be
    this thread's (or come from a path the guard does not see) and stays
    unexplained.
    """
    oldest = samples.times_ns[0] if samples.times_ns else _NEVER
    spans: list[tuple[int, int, bool]] = []  # (lo, hi, may own a dropped sample: stand-in at lo)
    for c in calls:
        lo, hi = c.start_ns - _SLACK_NS, c.end_ns + _SLACK_NS
        spans.append((lo, hi, samples.first > 0 and lo <= oldest))
    spans += [(start - _SLACK_NS, _NEVER, False) for start in running]
    # Only calls chained by overlaps to a window sample can change its answer:
    # keep the stretches of time the calls cover that contain one.
    wanted = {samples.times_ns[i - samples.first] for i in window
              if 0 <= i - samples.first < len(samples.times_ns)}
    stretches: list[list[int]] = []
    for lo, hi, _ in sorted(spans):
        if stretches and lo <= stretches[-1][1]:
            stretches[-1][1] = max(stretches[-1][1], hi)
        else:
            stretches.append([lo, hi])
    starts = [lo for lo, _ in stretches]

    def stretch_of(t: int) -> int:
        k = bisect.bisect_right(starts, t) - 1
        return k if k >= 0 and t <= stretches[k][1] else -1

    keep = {stretch_of(t) for t in wanted} - {-1}
    intervals = [(lo, hi) for lo, hi, _ in spans if stretch_of(lo) in keep]
    stand_ins = [lo for lo, _, may_own_dropped in spans if may_own_dropped and stretch_of(lo) in keep]
    stand_ins += [_NEVER] * sum(1 for lo, hi, _ in spans if hi == _NEVER and stretch_of(lo) in keep)
    # (time, position in `samples` or -1 for a stand-in), in time order.
    points = sorted([(t, i) for i, t in enumerate(samples.times_ns) if stretch_of(t) in keep]
                    + [(t, -1) for t in stand_ins])
    certain = _certainly_matched([t for t, _ in points], intervals)
    explained = {pos for (_, pos), flag in zip(points, certain) if flag and pos >= 0}
    result = _Unexplained(count=0, total=len(window), value=0.0, evicted=0)
    for index in window:
        pos = index - samples.first
        if pos < 0 or pos >= len(samples.times_ns):
            result.evicted += 1
            result.count += 1
        elif pos not in explained:
            result.count += 1
            result.value += samples.values[pos]
    return result


def _window(start: int, end: int, children: list[tuple[int, int]]) -> list[int]:
    """Absolute sample indices in [start, end) outside the child frames' ranges."""
    inside = set()
    for lo, hi in children:
        inside.update(range(lo, hi))
    return [i for i in range(start, end) if i not in inside]


@dataclasses.dataclass
class _Attribution:
    """What the block's device->host samples look like once other threads' calls are matched."""

    transfers: _Unexplained
    inbound: _Unexplained
    calls: list[_Call]  # other threads' calls that overlap the block
    running: list[int]  # idents of other threads whose call was still running after the wait

    @property
    def explained(self) -> bool:
        return self.transfers.count == 0 and self.inbound.count == 0


def _attribute(frame: _Frame, end: _Snapshot) -> _Attribution | None:
    """Match the block's device->host samples against other threads' explicit calls.

    None when no other thread made (or was making) an observed call around the
    block: then every transfer of the block is this thread's as far as the
    guard can tell. Reads metrics only; moves nothing.
    """
    assert frame.start is not None
    me = threading.get_ident()
    since = frame.start.time_ns - _SLACK_NS
    until = end.time_ns + _SLACK_NS
    deadline = time.monotonic() + _RUNNING_WAIT_S
    transfer_window = _window(frame.start.stats.d2h_transfers, end.stats.d2h_transfers,
                              [(a.stats.d2h_transfers, b.stats.d2h_transfers) for a, b in frame.children])
    inbound_window = _window(frame.start.inbound_count, end.inbound_count,
                             [(a.inbound_count, b.inbound_count) for a, b in frame.children])
    transfers: _Samples | None = None
    inbound: _Samples | None = None
    attribution: _Attribution | None = None
    while True:
        with _registry_lock:
            recorded = list(_calls)
            running = {i: s for i, s in _running.copy().items() if i != me and s <= until}  # copy: atomic
        others = [c for c in recorded if c.thread != me]
        if not running and not any(c.end_ns >= since for c in others):
            return None
        # Samples are joined across reads, so that waiting does not lose the block's.
        more_transfers, more_inbound = _read_samples(_TRANSFERS, transfers), _read_samples(_INBOUND, inbound)
        if attribution is not None and (more_transfers is None or more_inbound is None):
            return attribution  # samples were dropped while waiting: keep the last complete answer
        transfers, inbound = more_transfers or transfers, more_inbound or inbound
        assert transfers is not None and inbound is not None
        # This thread's calls from before the block constrain the matching too;
        # its calls during the block are left out (they are its own transfers).
        calls = others + [c for c in recorded if c.thread == me and c.end_ns < since]
        attribution = _Attribution(
            transfers=_unexplained(transfers, transfer_window, calls, list(running.values())),
            inbound=_unexplained(inbound, inbound_window, calls, list(running.values())),
            calls=[c for c in others if c.end_ns >= since and c.start_ns <= until],
            running=list(running),
        )
        if attribution.explained or not running or time.monotonic() >= deadline:
            return attribution
        # A call that finished its transfer but has not returned yet: give it the GIL.
        time.sleep(0.0005)


class _GuardMode(TorchFunctionMode):
    """Intercepts explicit transfers and consults this thread's innermost guard frame."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        frame = _top()
        if frame is not None:
            hit = _classify(_unwrapped(func), args, kwargs)
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
    start: _Snapshot | None = None
    excused: TransferStats = dataclasses.field(default_factory=TransferStats)
    # (start, end) snapshots of the direct child frames: their samples are theirs.
    children: list[tuple[_Snapshot, _Snapshot]] = dataclasses.field(default_factory=list)
    # Other threads alive when the block opened: ident -> name.
    others: dict[int, str] = dataclasses.field(default_factory=dict)

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


def _other_threads() -> dict[int, str]:
    me = threading.get_ident()
    return {t.ident: t.name for t in threading.enumerate() if t.ident is not None and t.ident != me}


@contextlib.contextmanager
def _guard(d2h: str | None, h2d: str | None) -> Iterator[None]:
    _install_observer()
    stack = _stack()
    frame = _Frame(d2h=d2h, h2d=h2d, parent=stack[-1] if stack else None)
    needs_mode = not stack
    frame.others = _other_threads()
    frame.start = _read_snapshot()
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
        end = _read_snapshot()
        if frame.parent is not None:
            frame.parent.excused = frame.parent.excused + (end.stats - frame.start.stats)
            frame.parent.children.append((frame.start, end))
        if not body_raised:
            _judge(frame, end)


def _names(threads: dict[int, str], limit: int = 5) -> str:
    names = sorted(threads.values())
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _calls_summary(calls: list[_Call], limit: int = 4) -> str:
    tally = collections.Counter((c.thread_name, c.op) for c in calls)
    parts = [f"{thread}: {n} x {op}" for (thread, op), n in tally.most_common(limit)]
    if len(tally) > limit:
        parts.append(f"{len(tally) - limit} more")
    return "; ".join(parts)


def _d2h_report(own: TransferStats, attribution: _Attribution | None) -> str | None:
    """The device->host part of the error, or None when nothing is blamed on this thread."""
    if not own.device_to_host:
        return None
    if attribution is None:
        return own.report(_D2H)
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
    return text + f". Block totals, all threads: {own.report(_D2H)}"


def _judge(frame: _Frame, end: _Snapshot) -> None:
    assert frame.start is not None
    own = (end.stats - frame.start.stats) - frame.excused
    d2h_mode, h2d_mode = frame.effective(_D2H), frame.effective(_H2D)
    problems: list[tuple[str, str]] = []
    notes: list[str] = []
    attribution: _Attribution | None = None
    if d2h_mode != "allow" and own.device_to_host:
        attribution = _attribute(frame, end)
        report = _d2h_report(own, attribution)
        if report is not None:
            problems.append((d2h_mode, report))
    if h2d_mode != "allow" and own.host_to_device:
        problems.append((h2d_mode, own.report(_H2D)))
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
    since_install_ms = (frame.start.time_ns - (_installed_ns or 0)) / 1e6
    older = {i: name for i, name in others.items() if i in _threads_at_install}
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
            f"{_RUNNING_WAIT_S:.1f} s later, so its transfer could not be placed."
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
