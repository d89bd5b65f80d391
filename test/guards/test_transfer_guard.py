"""transfer_guard on one thread: explicit-transfer interception, metric deltas, modes, nesting, pytest plugin."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch_xla

import torch_xla_ext as txe
from torch_xla_ext.testing import measure_transfers

from transfer_guard_fixtures import sharded  # noqa: F401  (fixture: pytest finds it by name)


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


def test_log_mode_warns_once_per_transfer_and_lets_data_move(sharded):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with txe.transfer_guard("log"):
            value = sharded.cpu()
    assert value.shape == (32, 16)
    # The explicit call is reported at its line; the block's metric report does not repeat it.
    assert [str(w.message).split(":")[0] for w in caught] == ["device->host transfer inside transfer_guard('log')"]
    ctx = torch_xla._XLAC.lowering.LoweringContext("logged")
    ctx.build([sharded * 2])
    with pytest.warns(UserWarning, match="ReplicateShardedData=") as caught:
        with txe.transfer_guard("log"):
            ctx.parameter_id_tensor_mapping()  # inside C++: only the metrics see it
    assert len(caught) == 1


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
