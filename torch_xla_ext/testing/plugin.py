"""pytest plugin: ``@pytest.mark.no_host_transfers`` / ``no_recompiles`` and the fixtures of the same names.

``no_recompiles`` runs the test body (or, as a fixture, the rest of the test)
under :func:`torch_xla_ext.no_recompiles`: the test fails if XLA compiled
anything, and the report says what changed (see :mod:`torch_xla_ext.recompile_guard`).
Warm the compiled programs up in a fixture when using the marker.

Both run the test body under :func:`torch_xla_ext.no_host_transfers`: explicit
device->host transfers of XLA tensors raise ``HostTransferError`` at the call,
and transfers made inside C++ fail the test when the body returns (measured by
torch_xla's metrics around the test call only; fixture setup is not guarded
when the marker is used). torch_xla is imported only by tests that use them.

Failure reports. pytest reads the failed test's tensors to report them (the
repr of locals with ``--showlocals``, a failed ``assert``'s operands, the
debugger of ``--pdb``); that reading must not trip the guard a second time:

* The marker's guard is open only around the test call (the innermost
  ``pytest_runtest_call`` wrapper), so it is closed, whether the body raised or
  not, before pytest builds the report.
* The fixture's guard stays open until the fixture's teardown. While pytest
  makes, logs or debugs a report, and while a failed ``assert`` formats its
  operands (pytest's assertion rewriting helpers ``_saferepr`` and
  ``_call_reprcompare``, wrapped while the plugin is active), transfers are
  allowed: a nested ``transfer_guard("allow")``, whose transfers are not counted
  against the enclosing guard. This applies to any guard open in the thread.
* A ``HostTransferError``'s traceback ends at the line that made the transfer:
  the guard's frames and torch's frames below that line are cut, and the
  plugin's own frames are hidden (``--full-trace`` shows everything).
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable
from typing import Any

import pytest

_MARKER = "no_host_transfers"
_RECOMPILE_MARKER = "no_recompiles"
_GUARD_MODULE = "torch_xla_ext.transfer_guard"
# pytest's assertion-rewriting helpers that repr a failed assert's operands, called
# from the test's own frame (so inside its guard). Private to pytest: a name that is
# gone is skipped, and the operands then read as "<[HostTransferError(...) raised in repr()]>".
_ASSERTION_REPR_HELPERS = ("_saferepr", "_call_reprcompare")
_originals = pytest.StashKey[dict[str, Callable[..., Any]]]()


def _host_transfer_error(excinfo: Any) -> bool:
    """``__tracebackhide__`` of the plugin's frames: hidden from a HostTransferError's traceback."""
    guard = sys.modules.get(_GUARD_MODULE)
    return guard is not None and isinstance(getattr(excinfo, "value", None), guard.HostTransferError)


def _guard_off() -> contextlib.AbstractContextManager[None]:
    """Allow transfers (a nested ``transfer_guard("allow")``) when a guard is open in this thread."""
    guard = sys.modules.get(_GUARD_MODULE)
    if guard is None or not guard._stack():
        return contextlib.nullcontext()
    return guard.transfer_guard("allow")


def _reporting(helper: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(helper)
    def reporting(*args: Any, **kwargs: Any) -> Any:
        with _guard_off():
            return helper(*args, **kwargs)

    reporting._torch_xla_ext_reporting = True  # type: ignore[attr-defined]
    return reporting


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{_MARKER}: fail the test if its body moves data from an XLA device to the host",
    )
    config.addinivalue_line(
        "markers",
        f"{_RECOMPILE_MARKER}: fail the test if XLA compiles anything while its body runs",
    )
    from _pytest.assertion import rewrite

    originals = {}
    for name in _ASSERTION_REPR_HELPERS:
        helper = getattr(rewrite, name, None)
        if helper is None or getattr(helper, "_torch_xla_ext_reporting", False):
            continue  # gone from this pytest, or wrapped by an enclosing session (pytester)
        originals[name] = helper
        setattr(rewrite, name, _reporting(helper))
    config.stash[_originals] = originals


def pytest_unconfigure(config: pytest.Config) -> None:
    from _pytest.assertion import rewrite

    for name, helper in config.stash.get(_originals, {}).items():
        setattr(rewrite, name, helper)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item):
    __tracebackhide__ = _host_transfer_error
    with contextlib.ExitStack() as guards:
        if item.get_closest_marker(_RECOMPILE_MARKER) is not None:
            from ..recompile_guard import no_recompiles

            guards.enter_context(no_recompiles())
        if item.get_closest_marker(_MARKER) is not None:
            from ..transfer_guard import no_host_transfers

            guards.enter_context(no_host_transfers())
        return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    excinfo = call.excinfo
    if excinfo is not None and _GUARD_MODULE in sys.modules and not item.config.getoption("fulltrace", False):
        from .._transfer.tracebacks import cut_guard_frames

        if cut_guard_frames(excinfo.value):
            excinfo.traceback = type(excinfo.traceback)(excinfo.tb)
    with _guard_off():
        return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport):
    with _guard_off():
        return (yield)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_exception_interact(node: Any, call: Any, report: Any):
    with _guard_off():
        return (yield)


@pytest.fixture
def no_host_transfers():
    """Guard the rest of the test (from this fixture's setup on) against device->host transfers."""
    __tracebackhide__ = _host_transfer_error
    from ..transfer_guard import no_host_transfers as guard

    with guard():
        yield


@pytest.fixture(name="no_recompiles")
def no_recompiles_fixture():
    """Fail the rest of the test (from this fixture's setup on) if XLA compiles anything."""
    from ..recompile_guard import no_recompiles as guard

    with guard():
        yield
