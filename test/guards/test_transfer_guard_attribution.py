"""transfer_guard's attribution arithmetic: matching metric samples to other threads' calls, against brute force."""

from __future__ import annotations

import random

from torch_xla_ext._transfer import attribution as _attribution
from torch_xla_ext._transfer import calls as _calls
from torch_xla_ext._transfer import metrics as _metrics


def _brute_force_certain(points, intervals):
    def best(skip=None):
        match = {}

        def augment(i, seen):
            for k, (lo, hi) in enumerate(intervals):
                if lo <= points[i] <= hi and k not in seen:
                    seen.add(k)
                    if k not in match or augment(match[k], seen):
                        match[k] = i
                        return True
            return False

        return sum(augment(i, set()) for i in range(len(points)) if i != skip)

    full = best()
    return [best(skip=i) < full for i in range(len(points))]


def test_certainly_matched_agrees_with_brute_force():
    rng = random.Random(7)
    for _ in range(500):
        points = sorted(rng.randint(0, 20) for _ in range(rng.randint(0, 7)))
        intervals = []
        for _ in range(rng.randint(1, 6)):
            lo = rng.randint(0, 20)
            intervals.append((lo, lo + rng.randint(0, 8)))
        assert _attribution.certainly_matched(points, intervals) == _brute_force_certain(points, intervals)


def _call(start: int, end: int) -> object:
    return _calls.Call(thread=-1, thread_name="other", op="Tensor.cpu()", start_ns=start, end_ns=end)


def test_a_call_explains_one_sample_not_two():
    # Another thread's call [1000 us, 2000 us] and two samples inside it (its
    # own, and one made at the same moment inside C++ by the guarded thread):
    # either could be the call's, so neither is certainly the other thread's.
    us = 1000
    samples = _metrics.Samples(count=2, times_ns=(1200 * us, 1800 * us), values=(64.0, 128.0))
    result = _attribution.unexplained(samples, [0, 1], [_call(1000 * us, 2000 * us)], running=[])
    assert (result.count, result.total, result.value) == (2, 2, 64.0 + 128.0)
    # The same with the second sample outside the block's window: the one inside
    # may still be the guarded thread's (the call's own may be the later one).
    assert _attribution.unexplained(samples, [0], [_call(1000 * us, 2000 * us)], running=[]).count == 1
    # One sample per call: both explained.
    calls = [_call(1000 * us, 1500 * us), _call(1500 * us + 10 * us, 2000 * us)]
    assert _attribution.unexplained(samples, [0, 1], calls, running=[]).count == 0
    # A sample outside every call's span is unexplained.
    assert _attribution.unexplained(samples, [0, 1], calls[:1], running=[]).count == 1


def test_a_running_call_explains_nothing():
    # A call still running may make its transfer later, so it cannot claim a
    # sample of the block.
    us = 1000
    samples = _metrics.Samples(count=3, times_ns=(1200 * us, 1800 * us), values=(64.0, 128.0))
    result = _attribution.unexplained(samples, [1, 2], [], running=[1000 * us])
    assert (result.count, result.value) == (2, 64.0 + 128.0)
    # Sample 0 has left the buffer. A call that started before the oldest kept
    # sample may own the dropped one, so it is not certain to own sample 1 ...
    result = _attribution.unexplained(samples, [0, 1], [_call(1100 * us, 1300 * us)], running=[])
    assert (result.count, result.evicted) == (2, 1)
    # ... while a call that started after it does own the one sample it spans.
    assert _attribution.unexplained(samples, [2], [_call(1700 * us, 1900 * us)], running=[]).count == 0


def test_unexplained_agrees_with_brute_force_matching():
    # unexplained() keeps only the calls chained to the block's samples; the
    # answer must be the one the whole matching problem gives.
    rng = random.Random(11)
    slack, never = _attribution.SLACK_NS, _attribution.NEVER
    for _ in range(300):
        first = rng.choice([0, 0, 2])
        times = tuple(sorted(rng.randint(0, 100_000) for _ in range(rng.randint(1, 8))))
        samples = _metrics.Samples(count=first + len(times), times_ns=times, values=tuple(1.0 for _ in times))
        calls = []
        for _ in range(rng.randint(0, 6)):
            start = rng.randint(-10_000, 100_000)
            calls.append(_call(start, start + rng.randint(0, 30_000)))
        running = [rng.randint(0, 100_000) for _ in range(rng.randint(0, 1))]
        window = sorted(rng.sample(range(samples.count), rng.randint(1, samples.count)))

        intervals = [(c.start_ns - slack, c.end_ns + slack) for c in calls] + [(r - slack, never) for r in running]
        stand_ins = [c.start_ns - slack for c in calls if first and c.start_ns - slack <= times[0]]
        points = sorted([(t, i) for i, t in enumerate(times)] + [(t, -1) for t in stand_ins + [never] * len(running)])
        certain = _brute_force_certain([t for t, _ in points], intervals)
        explained = {i for (_, i), flag in zip(points, certain) if flag and i >= 0}
        expected = sum(1 for index in window if index < first or index - first not in explained)
        assert _attribution.unexplained(samples, window, calls, running).count == expected
