"""torch_xla's transfer metrics: absolute values, deltas and timestamped samples.

Everything here reads ``torch_xla.debug.metrics`` and moves no data between
host and device. The metrics are process-wide: they count every thread's
transfers and do not say which thread made them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from .._format import format_bytes

# Directions, as they appear in the guard's public names (transfer_guard_<direction>).
D2H = "device_to_host"
H2D = "host_to_device"

# Metrics with one timestamped sample per device->host transfer.
TRANSFERS = "TransferFromDeviceTime"
INBOUND = "InboundData"


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

    def _combine(self, other: TransferStats, sign: int) -> TransferStats:
        return TransferStats(**{
            f.name: getattr(self, f.name) + sign * getattr(other, f.name)
            for f in dataclasses.fields(self)
        })

    def __sub__(self, other: TransferStats) -> TransferStats:
        return self._combine(other, -1)

    def __add__(self, other: TransferStats) -> TransferStats:
        return self._combine(other, 1)

    def report(self, direction: str | None = None) -> str:
        """A one-line human-readable account of what moved."""
        parts = []
        if direction in (None, D2H) and self.device_to_host:
            parts.append(
                f"device->host: {self.d2h_transfers} transfer(s), {format_bytes(self.d2h_bytes)} "
                f"in {self.d2h_time_ns / 1e6:.2f} ms (TransferFromDeviceTime/InboundData), "
                f"ReplicateShardedData={self.replicate_sharded_data}, "
                f"xla::_to_cpu={self.to_cpu}, "
                f"aten::_local_scalar_dense={self.local_scalar_dense}"
            )
        if direction in (None, H2D) and self.host_to_device:
            parts.append(
                f"host->device: {self.h2d_transfers} transfer(s), {format_bytes(self.h2d_bytes)} "
                f"in {self.h2d_time_ns / 1e6:.2f} ms (TransferToDeviceTime/OutboundData)"
            )
        return "; ".join(parts) if parts else "nothing moved"


def _metric(name: str) -> tuple[int, int, list[Any]]:
    """(samples recorded in total, accumulated value, kept samples) of a torch_xla metric."""
    import torch_xla.debug.metrics as met

    data = met.metric_data(name)
    if data is None:
        return 0, 0, []
    return int(data[0]), int(data[1]), data[2]


def _counter(name: str) -> int:
    """The value of a torch_xla counter, 0 when it was never bumped."""
    import torch_xla.debug.metrics as met

    value = met.counter_value(name)
    return 0 if value is None else int(value)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Absolute metric values at one moment, with the wall-clock time they were read."""

    stats: TransferStats
    inbound_count: int  # InboundData samples recorded so far (one per device->host transfer)
    time_ns: int


def read_snapshot() -> Snapshot:
    """Read the transfer metrics (no data moves)."""
    now = time.time_ns()
    d2h_n, d2h_ns, _ = _metric(TRANSFERS)
    inbound_n, d2h_bytes, _ = _metric(INBOUND)
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
    return Snapshot(stats=stats, inbound_count=inbound_n, time_ns=now)


def read_stats() -> TransferStats:
    """Current absolute values of the transfer metrics (no data moves)."""
    return read_snapshot().stats


@dataclasses.dataclass(frozen=True)
class Samples:
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
        """Absolute index of the oldest kept sample."""
        return self.count - len(self.times_ns)


def read_samples(name: str, earlier: Samples | None = None) -> Samples | None:
    """The kept samples of a metric, joined onto ``earlier`` ones of the same metric.

    None when samples were dropped between the two reads (the join would have a hole).
    Reads metrics only; moves nothing.
    """
    count, _, samples = _metric(name)
    # torch_xla reports each sample as (wall-clock seconds, value).
    fresh = Samples(
        count=count,
        times_ns=tuple(round(ts * 1e9) for ts, _ in samples),
        values=tuple(float(v) for _, v in samples),
    )
    if earlier is None or fresh.first <= earlier.first:
        return fresh
    if fresh.first > earlier.count:
        return None
    keep = fresh.first - earlier.first  # earlier samples the fresh read no longer has
    return Samples(count=fresh.count, times_ns=earlier.times_ns[:keep] + fresh.times_ns,
                   values=earlier.values[:keep] + fresh.values)
