"""The pytest plugin's failure reports: the user's line last, the guard's frames hidden, tensors readable.

One inner pytest run, in a subprocess so that its XLA runtime starts fresh,
with the environment test/conftest.py gives this process (PJRT's CPU client,
its number of virtual devices, SPMD mode).
"""

from __future__ import annotations

import os
import re
import textwrap

import torch_xla.runtime as xr

pytest_plugins = ["pytester"]

INNER_CONFTEST = """
import os

import torch
import torch_xla
import torch_xla.runtime as xr

assert os.environ["PJRT_DEVICE"] == "CPU", os.environ.get("PJRT_DEVICE")
xr.use_spmd()
torch.zeros(1, device=torch_xla.device())
"""

# Each line that moves data device->host ends with "# transfer".
INNER_TESTS = """
import os
import sys

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr


@pytest.fixture
def t():
    t = torch.ones(4, device=torch_xla.device())
    torch_xla.sync()
    return t


def test_env():
    assert os.environ["PJRT_DEVICE"] == "CPU"
    assert xr.global_runtime_device_count() == int(os.environ["CPU_NUM_DEVICES"]) == {devices}
    assert xr.is_spmd()


@pytest.mark.no_host_transfers
def test_marker_cpu(t):
    y = t * 2
    y.cpu()  # transfer


@pytest.mark.no_host_transfers
def test_marker_print(t):
    print(t)  # transfer


def test_fixture_item(t, no_host_transfers):
    t.sum().item()  # transfer


@pytest.mark.no_host_transfers
def test_marker_assert(t):
    assert isinstance(t, list)


def test_fixture_assert(t, no_host_transfers):
    assert isinstance(t, list)


@pytest.fixture
def sharded():
    mesh = xs.Mesh(np.arange({devices}), ({devices},), ("x",))
    s = torch.ones(2 * {devices}, 4).to(torch_xla.device())
    xs.mark_sharding(s, mesh, ("x", None))
    torch_xla.sync()
    return s


@pytest.mark.no_host_transfers
def test_marker_transfer_in_cxx(sharded):
    ctx = torch_xla._XLAC.lowering.LoweringContext("inner")
    ctx.build([sharded * 3])
    ctx.parameter_id_tensor_mapping()  # gathers and copies the sharded data to the host


def test_guard_is_off_after_failures(t):
    assert not sys.modules["torch_xla_ext.transfer_guard"]._stack()
    assert torch._C._len_torch_function_stack() == 0
    assert t.cpu().tolist() == [1.0] * 4
"""

# Names of the guard's (and torch's dispatching) frames that a report must not show.
GUARD_FRAMES = (
    "__torch_function__", "_on_explicit_transfer", "handle_torch_function", "in wrapper",
    "torch_xla_ext/_transfer", "transfer_guard.py", "testing/plugin.py", "contextlib.py", "torch/_tensor.py",
)
LOCATION = re.compile(r"^(\S+\.py):(\d+): (\w*)")


def _sections(output: str) -> dict[str, str]:
    """The report of each failed test, by test name."""
    parts = re.split(r"^_{3,} (test_\w+) _{3,}$", output, flags=re.M)
    return {name: body.split("=" * 20)[0] for name, body in zip(parts[1::2], parts[2::2])}


def test_failure_reports_show_the_users_line_and_tensor_values(pytester, monkeypatch):
    # What test/conftest.py set for this process, passed on explicitly; a user's
    # PYTEST_DISABLE_PLUGIN_AUTOLOAD would keep the plugin out of the inner run.
    for name in ("PJRT_DEVICE", "CPU_NUM_DEVICES"):
        monkeypatch.setenv(name, os.environ[name])
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    devices = xr.global_runtime_device_count()
    source = textwrap.dedent(INNER_TESTS).replace("{devices}", str(devices))
    pytester.makeconftest(INNER_CONFTEST)
    written = pytester.makepyfile(test_reports=source).read_text().splitlines()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--showlocals")
    output = result.stdout.str()
    result.assert_outcomes(passed=2, failed=6)

    assert "raised in repr" not in output
    for frame in GUARD_FRAMES:
        assert frame not in output, frame
    sections = _sections(output)
    transfer_lines = {i + 1 for i, line in enumerate(written) if line.endswith("# transfer")}
    for name in ("test_marker_cpu", "test_marker_print", "test_fixture_item"):
        locations = [LOCATION.match(line) for line in sections[name].splitlines()]
        locations = [m.groups() for m in locations if m]
        # One frame, the test's own, ending at the line that made the transfer.
        assert len(locations) == 1, (name, locations)
        path, lineno, error = locations[0]
        assert (path, error) == ("test_reports.py", "HostTransferError"), sections[name]
        assert int(lineno) in transfer_lines, sections[name]
        # --showlocals reads the test's tensors once the guard is off.
        assert "t          = tensor([1., 1., 1., 1.], device='xla:0')" in sections[name]
    for name in ("test_marker_assert", "test_fixture_assert"):
        # pytest's assertion introspection reads the operand inside the guarded body.
        assert "where False = isinstance(tensor([1., 1., 1., 1.], device='xla:0'), list)" in sections[name]
    cxx = sections["test_marker_transfer_in_cxx"]
    assert "HostTransferError: transfers between host and XLA device" in cxx
    assert "ReplicateShardedData=" in cxx
