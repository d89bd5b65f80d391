"""Keeping the guard's own frames out of the tracebacks of the errors it raises.

A ``HostTransferError`` raised before an explicit transfer passes through the
guard's frames: the recording wrapper of :mod:`.calls`, torch's own Python
frames for methods such as ``Tensor.__repr__`` (``handle_torch_function``), the
intercepting mode's ``__torch_function__`` and the guard's callback. One raised
when a guarded block exits passes through ``contextlib`` and the guard's
generator. None of these frames says anything about the code under test.

* :func:`hide_from_pytest` is the module-level ``__tracebackhide__`` of the
  guard's modules: pytest leaves their frames out of the traceback of a
  ``HostTransferError`` (of that error only: a bug in the guard itself still
  shows them).
* :func:`cut_guard_frames` ends such a traceback at the last frame before the
  guard's first one, which also drops torch's frames in between, so the line
  that made the transfer is the last frame shown. The pytest plugin applies it
  to the errors it reports (not under ``--full-trace``).
"""

from __future__ import annotations

import contextlib
import os
from types import CodeType, TracebackType
from typing import Any

from .errors import HostTransferError

_TRANSFER_DIR = os.path.dirname(os.path.abspath(__file__))
_GUARD_FILES = frozenset(
    [os.path.join(os.path.dirname(_TRANSFER_DIR), "transfer_guard.py")]
    + [os.path.join(_TRANSFER_DIR, name) for name in os.listdir(_TRANSFER_DIR) if name.endswith(".py")]
)
_CONTEXTLIB = os.path.abspath(contextlib.__file__)


def _is_host_transfer_error(exc: Any) -> bool:
    return isinstance(exc, HostTransferError)


def is_guard_code(code: CodeType) -> bool:
    """True for code of the guard (``transfer_guard.py`` and ``_transfer/``)."""
    return os.path.abspath(code.co_filename) in _GUARD_FILES


def hide_from_pytest(excinfo: Any) -> bool:
    """pytest's ``__tracebackhide__`` protocol: hide the guard's frames from a HostTransferError."""
    return excinfo is not None and _is_host_transfer_error(getattr(excinfo, "value", None))


def _cut(tb: TracebackType | None) -> bool:
    entries: list[TracebackType] = []
    while tb is not None:
        entries.append(tb)
        tb = tb.tb_next
    first = next((i for i, e in enumerate(entries) if is_guard_code(e.tb_frame.f_code)), None)
    if first is None:
        return False
    # A guard entered with `with` raises on exit through contextlib's __exit__: drop it too.
    while first > 0 and os.path.abspath(entries[first - 1].tb_frame.f_code.co_filename) == _CONTEXTLIB:
        first -= 1
    if first == 0:
        return False
    entries[first - 1].tb_next = None
    return True


def cut_guard_frames(exc: BaseException | None) -> bool:
    """Cut the traceback of each HostTransferError in ``exc``'s chain before the guard's frames.

    Edits the tracebacks in place; True when any was cut. Exceptions of other
    types, and the frames before the guard's, are left as they are.
    """
    cut = False
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if _is_host_transfer_error(e):
            cut = _cut(e.__traceback__) or cut
        todo += [e.__cause__, e.__context__]
    return cut
