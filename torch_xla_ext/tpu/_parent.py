"""A ``tpu_fit`` child dies with the process that started it.

``fit`` kills its children when it stops watching them (a timeout, an
interrupt), but a parent that is itself killed (``timeout`` sends SIGTERM, a
scheduler SIGKILL) runs no Python cleanup: its child would lower or compile
on, orphaned, for minutes and up to tens of GiB of host memory. Each child
asks Linux to send it SIGKILL when its parent exits (``PR_SET_PDEATHSIG``)
and, in case the parent was gone before that request, checks that the
process that started it is still there (a launcher between the two, which
``sys.executable`` may be, is then its parent: that is no reason to exit).

Standard library only: the compile child loads this file alone, before it
imports torch (:mod:`._compile_child`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["PARENT_KEY", "ORPHAN_EXIT_STATUS", "exit_with_parent"]

#: The request's key holding the parent's pid.
PARENT_KEY = "parent_pid"

#: The exit status of a child that found its parent gone (no one reads it; a test tells it from an error's 1).
ORPHAN_EXIT_STATUS = 3

_PR_SET_PDEATHSIG = 1


def exit_with_parent(parent_pid: int | None) -> bool:
    """Be killed when the parent exits; exit at once, saying why on stderr, if process ``parent_pid`` is gone.

    ``parent_pid`` None (a caller that gives none) checks nothing. Returns
    whether the kernel took the request (False off Linux, where an orphan
    runs on).
    """
    try:
        taken = ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0
    except (OSError, AttributeError):  # no prctl: not Linux
        taken = False
    if parent_pid is not None and os.getppid() != parent_pid and not _alive(parent_pid):
        print(f"torch_xla_ext.tpu: process {parent_pid}, which started this one, is gone: exiting",
              file=sys.stderr, flush=True)
        os._exit(ORPHAN_EXIT_STATUS)  # it died before the request: nothing else would stop this process
    return taken


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # no signal sent: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's
        return True
    return True
