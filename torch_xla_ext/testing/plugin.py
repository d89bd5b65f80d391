"""pytest plugin: ``@pytest.mark.no_host_transfers`` and the ``no_host_transfers`` fixture.

Both run the test body under :func:`torch_xla_ext.no_host_transfers`: explicit
device->host transfers of XLA tensors raise ``HostTransferError`` at the call,
and transfers made inside C++ fail the test when the body returns (measured by
torch_xla's metrics around the test call only; fixture setup is not guarded
when the marker is used). torch_xla is imported only by tests that use them.
"""

from __future__ import annotations

import pytest

_MARKER = "no_host_transfers"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}: fail the test if its body moves data from an XLA device to the host",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    if item.get_closest_marker(_MARKER) is None:
        return (yield)
    from ..transfer_guard import no_host_transfers

    with no_host_transfers():
        return (yield)


@pytest.fixture
def no_host_transfers():
    """Guard the rest of the test (from this fixture's setup on) against device->host transfers."""
    from ..transfer_guard import no_host_transfers as guard

    with guard():
        yield
