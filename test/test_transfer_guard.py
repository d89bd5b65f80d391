"""transfer_guard: explicit-transfer interception, metric deltas, nesting, threads, pytest plugin."""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
import warnings

import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

import torch_xla_ext as txe
from torch_xla_ext._transfer import attribution as _attribution
from torch_xla_ext._transfer import calls as _calls
from torch_xla_ext._transfer import metrics as _metrics
from torch_xla_ext.testing import measure_transfers


@pytest.fixture
def sharded(device, mesh_4x2):
    t = torch.randn(32, 16).to(device)
    xs.mark_sharding(t, mesh_4x2, ("x", "y"))
    torch_xla.sync()
    return t


EXPLICIT_D2H = [
    ("Tensor.cpu()", lambda t: t.cpu()),
    ("Tensor.to(cpu)", lambda t: t.to("cpu")),
    ("Tensor.item()", lambda t: t.sum().item()),
    ("Tensor.tolist()", lambda t: t.tolist()),
    ("Tensor.numpy()", lambda t: t.numpy()),
    ("bool(Tensor)", lambda t: bool(t.sum() > 0)),
    ("int(Tensor)", lambda t: int(t.sum())),
    ("float(Tensor)", lambda t: float(t.sum())),
    ("repr(Tensor)", lambda t: repr(t)),
    ("format(Tensor)", lambda t: f"{t}"),
    ("torch.equal()", lambda t: torch.equal(t, t)),
    ("Tensor.copy_(xla -> host)", lambda t: torch.empty(32, 16).copy_(t)),
]


def _source(fn) -> str:
    import inspect

    return inspect.getsource(fn)


@pytest.mark.parametrize("op,fn", EXPLICIT_D2H, ids=[e[0] for e in EXPLICIT_D2H])
def test_explicit_transfer_raises_before_moving(sharded, op, fn):
    with measure_transfers() as m:
        with pytest.raises(txe.HostTransferError) as info:
            with txe.no_host_transfers():
                fn(sharded)
    message = str(info.value)
    assert op.split("(")[0] in message
    if "sum()" not in _source(fn):  # ops on the sharded tensor itself name its sharding
        assert "devices=[4,2]" in message
    assert not m.device_to_host, m.report()


def test_explicit_transfer_names_shape(sharded):
    with pytest.raises(txe.HostTransferError, match=r"shape \(32, 16\)"):
        with txe.no_host_transfers():
            sharded.cpu()


def test_device_side_work_is_allowed(sharded, device):
    with measure_transfers() as m:
        with txe.no_host_transfers():
            y = (sharded * 2).sum(0)
            torch_xla.sync()
    assert not m.device_to_host, m.report()
    # outside the guard the value is readable again
    torch.testing.assert_close(y.cpu(), (sharded.cpu() * 2).sum(0))


def test_transfer_inside_cpp_is_caught_by_metrics(device, mesh_4x2, sharded):
    out = sharded + 1
    ctx = torch_xla._XLAC.lowering.LoweringContext("guard")
    ctx.build([out])
    with pytest.raises(txe.HostTransferError) as info:
        with txe.no_host_transfers():
            ctx.parameter_id_tensor_mapping()  # C++: gathers and copies to host
    message = str(info.value)
    assert "ReplicateShardedData=" in message and "device->host" in message
    assert "ReplicateShardedData=0" not in message


def test_log_mode_warns_and_lets_data_move(sharded):
    with pytest.warns(UserWarning, match="device->host"):
        with txe.transfer_guard("log"):
            value = sharded.cpu()
    assert value.shape == (32, 16)


def test_allow_mode_is_silent(sharded):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with txe.transfer_guard("allow"):
            sharded.cpu()


def test_inner_allow_is_honoured_and_not_blamed_on_outer(sharded):
    with txe.no_host_transfers():
        with txe.transfer_guard_device_to_host("allow"):
            host = sharded.cpu()  # explicit, allowed
            ctx = torch_xla._XLAC.lowering.LoweringContext("inner")
            ctx.build([sharded * 3])
            ctx.parameter_id_tensor_mapping()  # C++ transfer, allowed
        y = sharded + 1  # device-only work after the inner block
    assert host.shape == (32, 16) and y.device.type == "xla"


def test_inner_disallow_inside_outer_allow(sharded):
    with txe.transfer_guard("allow"):
        sharded.cpu()
        with pytest.raises(txe.HostTransferError):
            with txe.no_host_transfers():
                sharded.cpu()
        sharded.cpu()


def test_outer_still_catches_its_own_transfers_after_inner(sharded):
    with pytest.raises(txe.HostTransferError, match="device->host"):
        with txe.no_host_transfers():
            with txe.transfer_guard("allow"):
                pass
            ctx = torch_xla._XLAC.lowering.LoweringContext("outer")
            ctx.build([sharded * 5])
            ctx.parameter_id_tensor_mapping()


def test_body_exception_propagates_unchanged(sharded):
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        with txe.no_host_transfers():
            ctx = torch_xla._XLAC.lowering.LoweringContext("boom")
            ctx.build([sharded * 7])
            ctx.parameter_id_tensor_mapping()  # would be reported, but the body fails first
            raise Boom()


def test_host_to_device_guard(device):
    cpu = torch.randn(4, 4)
    with pytest.raises(txe.HostTransferError, match="host->device"):
        with txe.transfer_guard_host_to_device("disallow"):
            cpu.to(device)
    with pytest.raises(txe.HostTransferError, match="host->device"):
        with txe.transfer_guard("disallow"):
            torch.tensor([1.0, 2.0], device=device)
    # device->host "disallow" does not restrict host->device
    with txe.no_host_transfers():
        x = cpu.to(device)
    assert x.device.type == "xla"


def test_host_to_device_metrics_are_caught(device):
    x = torch.randn(8).to(device)
    torch_xla.sync()
    value = 3.7182818  # a scalar nothing else in the suite uploads: torch_xla must send it
    with pytest.raises(txe.HostTransferError, match="host->device"):
        with txe.transfer_guard_host_to_device("disallow"):
            y = x * value
            torch_xla.sync()
    assert y.device.type == "xla"


@pytest.mark.parametrize("bad", ["deny", None, 0, "ALLOW"])
def test_bad_mode_is_rejected_before_anything(bad):
    with pytest.raises(ValueError, match="transfer guard mode"):
        txe.transfer_guard(bad)


def test_measure_transfers_reports_bytes(sharded):
    with measure_transfers() as m:
        sharded.cpu()
    assert m.d2h_transfers >= 1
    assert m.d2h_bytes >= 32 * 16 * 4
    assert m.replicate_sharded_data >= 1
    assert "device->host" in m.report()


def test_measure_transfers_before_exit_is_an_error():
    with measure_transfers() as m:
        with pytest.raises(RuntimeError, match="exited"):
            m.d2h_bytes


@pytest.mark.no_host_transfers
def test_marker_passes_for_device_only_work(sharded):
    (sharded @ sharded.T).sum()
    torch_xla.sync()


def test_fixture_guards_the_test_body(sharded, no_host_transfers):
    with pytest.raises(txe.HostTransferError):
        sharded.cpu()


PLUGIN_TESTS = """
import pytest, torch, torch_xla

@pytest.fixture
def t():
    t = torch.ones(4, device=torch_xla.device())
    torch_xla.sync()
    return t

@pytest.mark.no_host_transfers
def test_bad(t):
    t.cpu()

@pytest.mark.no_host_transfers
def test_good(t):
    (t * 2).sum()
    torch_xla.sync()

def test_unmarked(t):
    t.cpu()
"""


def test_pytest_marker_fails_transferring_tests(pytester):
    pytester.makepyfile(test_plugin_usage=PLUGIN_TESTS)
    result = pytester.runpytest_inprocess("-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*HostTransferError*Tensor.cpu()*"])
    assert "test_bad" in "\n".join(result.stdout.lines)


# --------------------------------------------------------------------------- #
# Threads: the Python layer is per thread; the metric layer is process-wide and
# subtracts only what it saw other threads move through explicit calls.
# --------------------------------------------------------------------------- #



@pytest.fixture
def worker():
    """One other Python thread; ``worker.submit(fn).result()`` runs ``fn`` there, start to end.

    Submitting from inside a guarded block and waiting for the result puts the
    other thread's whole call inside the block, whatever the scheduling.
    """
    with txe.transfer_guard("allow"):  # the first guard wraps torch's device->host calls
        pass
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="xla-worker") as pool:
        yield pool


@pytest.fixture
def host_mapping(sharded):
    """A lowering whose host parameter mapping transfers inside C++ (no Python tensor call)."""
    ctx = torch_xla._XLAC.lowering.LoweringContext("threads")
    ctx.build([sharded * 11])
    with measure_transfers() as m:
        ctx.parameter_id_tensor_mapping()
    assert m.d2h_transfers >= 1, m.report()
    return ctx, m.d2h_transfers


def test_python_layer_does_not_intercept_other_threads(sharded, worker):
    with measure_transfers() as m:
        with txe.no_host_transfers():
            host = worker.submit(sharded.cpu).result()  # not this thread's call: no error
    assert host.shape == (32, 16)
    assert m.d2h_transfers == 1, m.report()  # it did move, inside the guarded block

    # And a guard open in the other thread does not intercept this thread.
    opened, release = threading.Event(), threading.Event()

    def guarded_wait() -> None:
        with txe.no_host_transfers():
            opened.set()
            assert release.wait(60)

    done = worker.submit(guarded_wait)
    assert opened.wait(60)
    with measure_transfers() as m:
        sharded.cpu()
    release.set()
    done.result()  # the other thread's guard does not blame it on itself either
    assert m.d2h_transfers == 1, m.report()


def test_other_threads_explicit_transfers_are_not_blamed(sharded, worker):
    # The reproducer, made deterministic: the other thread's .cpu() runs
    # entirely inside each guarded block (the block waits for it).
    for _ in range(20):
        with measure_transfers() as m:
            with txe.no_host_transfers():
                worker.submit(lambda: [sharded.cpu() for _ in range(3)]).result()
        assert m.d2h_transfers == 3 and m.replicate_sharded_data == 3, m.report()


def test_other_thread_transferring_in_a_loop_is_not_blamed(sharded, worker):
    # The literal reproducer: another thread calls .cpu() back to back, so its
    # calls also straddle the start and the end of each block. Each block waits
    # until at least two of that thread's calls completed inside it.
    stop = threading.Event()
    completed = [0]

    def loop() -> None:
        while not stop.is_set():
            sharded.cpu()
            completed[0] += 1

    running = worker.submit(loop)
    try:
        for _ in range(20):
            with measure_transfers() as m:
                with txe.no_host_transfers():
                    first = completed[0]
                    while completed[0] < first + 2:
                        time.sleep(0.0005)
            assert m.d2h_transfers >= 1, m.report()
    finally:
        stop.set()
        running.result()


def test_own_transfer_in_cpp_still_raises_while_another_thread_transfers(sharded, worker, host_mapping):
    ctx, mapping_transfers = host_mapping
    with measure_transfers() as m:
        with pytest.raises(txe.HostTransferError) as info:
            with txe.no_host_transfers():
                worker.submit(sharded.cpu).result()
                ctx.parameter_id_tensor_mapping()  # this thread, inside C++
                worker.submit(lambda: sharded.sum().item()).result()
    assert m.d2h_transfers == mapping_transfers + 2, m.report()
    message = str(info.value)
    total = mapping_transfers + 2
    assert f"device->host: {mapping_transfers} of the block's {total} transfer(s)" in message
    assert "2 matched to" in message and "xla-worker" in message
    assert "Tensor.cpu()" in message and "Tensor.item()" in message
    assert "Other Python threads were alive" in message


def test_own_explicit_transfer_raises_before_moving_while_another_thread_transfers(sharded, worker):
    with measure_transfers() as m:
        with pytest.raises(txe.HostTransferError, match=r"Tensor\.cpu\(\) on shape \(32, 16\)"):
            with txe.no_host_transfers():
                worker.submit(sharded.cpu).result()
                sharded.cpu()
    assert m.d2h_transfers == 1, m.report()  # the other thread's only


def test_other_threads_transfer_inside_cpp_cannot_be_told_apart(worker, host_mapping):
    ctx, mapping_transfers = host_mapping
    with measure_transfers() as m:
        with pytest.raises(txe.HostTransferError) as info:
            with txe.no_host_transfers():  # this thread moves nothing
                worker.submit(ctx.parameter_id_tensor_mapping).result()
    assert m.d2h_transfers == mapping_transfers, m.report()
    message = str(info.value)
    # Every live thread is named (the suite may have others alive); the worker is one.
    assert "Other Python threads were alive during the block (" in message and "xla-worker" in message
    assert "process-wide" in message and "cannot be told apart" in message


def test_host_to_device_is_not_attributed_to_threads(device, worker):
    x = torch.randn(8).to(device)
    torch_xla.sync()
    value = 5.1415926  # a scalar nothing else in the suite uploads: torch_xla must send it

    def upload() -> None:
        (x * value).sum()
        torch_xla.sync()

    with measure_transfers() as m:
        with pytest.raises(txe.HostTransferError) as info:
            with txe.transfer_guard_host_to_device("disallow"):
                worker.submit(upload).result()
    assert m.h2d_transfers >= 1 and not m.device_to_host, m.report()
    message = str(info.value)
    assert "Host->device transfers cannot be attributed to threads" in message
    assert "xla-worker" in message


def test_transfer_from_this_threads_backward_is_blamed(device):
    # backward() of XLA tensors runs in autograd's device thread, not this one.
    # A transfer made there is on this thread's behalf and is not excused.
    w = torch.randn(4, device=device, requires_grad=True)
    threads = []

    def hook(grad):
        threads.append(threading.current_thread())
        grad.cpu()
        return grad

    w.register_hook(hook)
    loss = (w * 2).sum()
    with measure_transfers() as m:
        with pytest.raises(txe.HostTransferError, match="device->host"):
            with txe.no_host_transfers():
                loss.backward()
    assert m.d2h_transfers == 1, m.report()
    assert threads and threads[0] is not threading.main_thread()


def test_explicit_reads_are_recorded_with_or_without_a_guard(sharded, worker):
    # A call that ends between two guards may still own a sample that another
    # thread's overlapping call could be taken for, so every read is recorded.
    before = list(_calls._calls)
    worker.submit(sharded.cpu).result()
    worker.submit(lambda: sharded.to(torch.float16)).result()  # device-side cast: no transfer
    worker.submit(lambda: torch.ones(3).cpu()).result()  # host tensor: no transfer
    new = [c for c in _calls._calls if c not in before]
    assert [(c.thread_name.startswith("xla-worker"), c.op) for c in new] == [(True, "Tensor.cpu()")]
    assert new[0].start_ns < new[0].end_ns and _calls._calls.maxlen == _calls.MAX_CALLS


def test_wrapped_torch_methods_behave_like_torch(sharded, worker):
    assert torch.Tensor.cpu.__name__ == "cpu" and torch.Tensor.to.__doc__
    cpu = torch.arange(6.0).reshape(2, 3)
    assert cpu.to(torch.float16).dtype == torch.float16
    assert bool(cpu[0, 1]) and int(cpu[1, 2]) == 5 and cpu.tolist()[1] == [3.0, 4.0, 5.0]
    assert torch.equal(cpu, cpu.clone()) and torch.allclose(cpu, cpu + 1e-9)
    assert f"{cpu[0, 1]:.1f}" == "1.0" and "tensor" in repr(cpu)

    def f(x):
        return (x.to(torch.float16).cpu().float() + torch.empty_like(x).copy_(x)).sum()

    explained = torch._dynamo.explain(f)(cpu)
    assert explained.graph_count == 1 and explained.graph_break_count == 0


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
