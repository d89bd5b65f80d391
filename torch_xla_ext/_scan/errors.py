"""The exception for bad arguments to ``scan`` and ``scan_layers``."""

from __future__ import annotations

__all__ = ["ScanInputError"]


class ScanInputError(TypeError, ValueError):
    """A bad argument to ``scan`` or ``scan_layers``, raised before anything is traced or run.

    Both a ``TypeError`` and a ``ValueError``: torch_xla's ``scan`` and
    ``scan_layers`` raise ``ValueError`` for a non-callable ``fn`` and for
    layers that differ, and code written against either keeps catching it.
    """
