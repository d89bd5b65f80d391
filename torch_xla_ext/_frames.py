"""Where the user's code is: the innermost frame outside torch, torch_xla and this package (for messages)."""

from __future__ import annotations

import os
import sys
from types import FrameType, TracebackType

import torch

__all__ = ["user_frame"]

_LIBRARY_DIRS = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch,))  # torch_xla added lazily


def _library_dirs() -> tuple[str, ...]:
    import torch_xla

    import torch_xla_ext

    return _LIBRARY_DIRS + tuple(os.path.dirname(m.__file__) + os.sep for m in (torch_xla, torch_xla_ext))


def _is_user(filename: str, library: tuple[str, ...]) -> bool:
    return not filename.startswith(library) and not filename.startswith("<frozen")


def user_frame(frame: FrameType | None = None, tb: TracebackType | None = None) -> str:
    """``file:line (function)`` of the innermost frame outside torch, torch_xla and this package.

    With ``tb``, the innermost such frame of that traceback; otherwise the
    innermost one on the stack above ``frame`` (default: the caller).
    """
    library = _library_dirs()
    if tb is not None:
        found = None
        while tb is not None:
            if _is_user(tb.tb_frame.f_code.co_filename, library):
                found = (tb.tb_frame.f_code, tb.tb_lineno)
            tb = tb.tb_next
        if found is not None:
            return f"{found[0].co_filename}:{found[1]} ({found[0].co_name})"
    f = frame if frame is not None else sys._getframe(1)
    while f is not None:
        if _is_user(f.f_code.co_filename, library):
            return f"{f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "<unknown line>"
