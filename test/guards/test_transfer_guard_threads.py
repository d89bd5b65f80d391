"""transfer_guard with other threads: per-thread interception and attribution of process-wide transfers."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import torch
import torch_xla

import torch_xla_ext as txe
from torch_xla_ext._transfer import calls as _calls
from torch_xla_ext.testing import measure_transfers

from transfer_guard_fixtures import sharded  # noqa: F401  (fixture: pytest finds it by name)


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
