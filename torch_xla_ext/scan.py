"""``scan``, ``scan_layers`` and ``stack_layers`` (implemented in :mod:`torch_xla_ext._scan` and
:mod:`torch_xla_ext._scan_layers`; this module keeps their import path)."""

from __future__ import annotations

from ._scan import (ScanCacheInfo, ScanInputError, ScanUnsupportedError, StackedLayerError, clear_scan_cache, scan,
                    scan_cache_info)
from ._scan_layers import scan_layers, stack_layers

__all__ = ["scan", "scan_layers", "stack_layers", "scan_cache_info", "clear_scan_cache", "ScanCacheInfo", "ScanInputError",
           "ScanUnsupportedError", "StackedLayerError"]
