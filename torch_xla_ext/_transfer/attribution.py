"""Matching a block's device->host metric samples against other threads' explicit calls.

Each explicit device->host call makes exactly one ``TransferFromDevice`` (one
``TransferFromDeviceTime`` and one ``InboundData`` sample; measured on
torch_xla 2.9 for ``.cpu()``, ``.to("cpu")``, ``.tolist()``, ``repr``,
``copy_``, ``.item()``, ``bool()``, ``torch.equal``, ``torch.allclose``).
torch_xla timestamps every sample, so the samples of a block can be matched
against the calls :mod:`.calls` recorded. A sample that every consistent
matching gives to another thread's call is not this thread's; any other
sample may be. Everything here reads metrics and the call records; nothing
moves between host and device.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import threading
import time

from . import calls as _calls
from .calls import Call
from .metrics import INBOUND, TRANSFERS, Samples, Snapshot, read_samples

# Timestamps: the call's are time.time_ns(); torch_xla's samples are wall-clock
# seconds as doubles (about 0.25 us apart at today's epoch), so an interval is
# widened by this much on each side.
SLACK_NS = 2_000
# How long a guard's exit waits for another thread's call that was still running
# when the block ended, before it gives up on placing that call's transfer.
RUNNING_WAIT_S = 1.0
NEVER = 1 << 62  # end of a call still running; also the time of its not-yet-seen sample


def certainly_matched(points: list[int], intervals: list[tuple[int, int]]) -> list[bool]:
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
class Unexplained:
    """Samples of a block's window that no other thread's call accounts for."""

    count: int  # window samples not certainly another thread's
    total: int  # window samples
    value: float  # sum of the unexplained samples' values (bytes for InboundData)
    evicted: int  # window samples torch_xla no longer keeps


def unexplained(samples: Samples, window: list[int], calls: list[Call],
                running: list[int]) -> Unexplained:
    """Which of the samples with absolute indices ``window`` belong to other threads' calls.

    Every completed call made exactly one sample inside its interval. A call
    still running may make its sample later, and a call older than the oldest
    kept sample may own one that torch_xla dropped: each such call gets a
    stand-in point of its own. A window sample is another thread's when every
    maximum matching of points to calls uses it. Any other window sample may be
    this thread's (or come from a path the guard does not see) and stays
    unexplained.
    """
    oldest = samples.times_ns[0] if samples.times_ns else NEVER
    spans: list[tuple[int, int, bool]] = []  # (lo, hi, may own a dropped sample: stand-in at lo)
    for c in calls:
        lo, hi = c.start_ns - SLACK_NS, c.end_ns + SLACK_NS
        spans.append((lo, hi, samples.first > 0 and lo <= oldest))
    spans += [(start - SLACK_NS, NEVER, False) for start in running]
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
    stand_ins += [NEVER] * sum(1 for lo, hi, _ in spans if hi == NEVER and stretch_of(lo) in keep)
    # (time, position in `samples` or -1 for a stand-in), in time order.
    points = sorted([(t, i) for i, t in enumerate(samples.times_ns) if stretch_of(t) in keep]
                    + [(t, -1) for t in stand_ins])
    certain = certainly_matched([t for t, _ in points], intervals)
    explained = {pos for (_, pos), flag in zip(points, certain) if flag and pos >= 0}
    result = Unexplained(count=0, total=len(window), value=0.0, evicted=0)
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
class Attribution:
    """What the block's device->host samples look like once other threads' calls are matched."""

    transfers: Unexplained
    inbound: Unexplained
    calls: list[Call]  # other threads' calls that overlap the block
    running: list[int]  # idents of other threads whose call was still running after the wait

    @property
    def explained(self) -> bool:
        """True when every device->host sample of the block is another thread's."""
        return self.transfers.count == 0 and self.inbound.count == 0


def attribute(start: Snapshot, end: Snapshot,
              children: list[tuple[Snapshot, Snapshot]]) -> Attribution | None:
    """Match the device->host samples of the block [start, end) against other threads' calls.

    ``children`` are the (start, end) snapshots of nested blocks: their samples
    are theirs and left out. None when no other thread made (or was making) an
    observed call around the block: then every transfer of the block is this
    thread's as far as the guard can tell. Reads metrics only; moves nothing.
    """
    me = threading.get_ident()
    since = start.time_ns - SLACK_NS
    until = end.time_ns + SLACK_NS
    deadline = time.monotonic() + RUNNING_WAIT_S
    transfer_window = _window(start.stats.d2h_transfers, end.stats.d2h_transfers,
                              [(a.stats.d2h_transfers, b.stats.d2h_transfers) for a, b in children])
    inbound_window = _window(start.inbound_count, end.inbound_count,
                             [(a.inbound_count, b.inbound_count) for a, b in children])
    transfers: Samples | None = None
    inbound: Samples | None = None
    attribution: Attribution | None = None
    while True:
        recorded, running = _calls.recorded_and_running(started_by=until)
        running.pop(me, None)
        others = [c for c in recorded if c.thread != me]
        if not running and not any(c.end_ns >= since for c in others):
            return None
        # Samples are joined across reads, so that waiting does not lose the block's.
        more_transfers, more_inbound = read_samples(TRANSFERS, transfers), read_samples(INBOUND, inbound)
        if attribution is not None and (more_transfers is None or more_inbound is None):
            return attribution  # samples were dropped while waiting: keep the last complete answer
        transfers, inbound = more_transfers or transfers, more_inbound or inbound
        assert transfers is not None and inbound is not None
        # This thread's calls from before the block constrain the matching too;
        # its calls during the block are left out (they are its own transfers).
        calls = others + [c for c in recorded if c.thread == me and c.end_ns < since]
        attribution = Attribution(
            transfers=unexplained(transfers, transfer_window, calls, list(running.values())),
            inbound=unexplained(inbound, inbound_window, calls, list(running.values())),
            calls=[c for c in others if c.end_ns >= since and c.start_ns <= until],
            running=list(running),
        )
        if attribution.explained or not running or time.monotonic() >= deadline:
            return attribution
        # A call that finished its transfer but has not returned yet: give it the GIL.
        time.sleep(0.0005)
