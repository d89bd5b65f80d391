"""torch_xla_ext: zero-host-transfer lowering, scan and composable FSDP for PyTorch/XLA SPMD.

Importing the package imports torch but never torch_xla; torch_xla is imported
by the functions that need it, so the pytest plugin this package registers
costs nothing to test suites that do not use XLA.
"""

from __future__ import annotations

from ._cpu_threads import widen_cpu_client_threads
from ._sdpa_autocast import register_sdpa_autocast
from .hlo import HloComputation, HloInstruction, HloModule, HloParameter, Shape, Sharding, read_hlo
from .lowering import LoweringContext
from .recompile_guard import RecompileError, no_recompiles
from .scan import ScanInputError, ScanUnsupportedError, StackedLayerError, scan, scan_layers, stack_layers
from .transfer_guard import (
    HostTransferError,
    TransferStats,
    measure_transfers,
    no_host_transfers,
    transfer_guard,
    transfer_guard_device_to_host,
    transfer_guard_host_to_device,
)

widen_cpu_client_threads()  # before torch_xla's CPU client exists (see _cpu_threads)
register_sdpa_autocast()  # the XLA autocast rule torch_xla lacks (see _sdpa_autocast)

__version__ = "0.1.0"

__all__ = [
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "HloParameter",
    "HostTransferError",
    "LoweringContext",
    "RecompileError",
    "ScanInputError",
    "ScanUnsupportedError",
    "StackedLayerError",
    "Shape",
    "Sharding",
    "TransferStats",
    "measure_transfers",
    "no_host_transfers",
    "no_recompiles",
    "read_hlo",
    "scan",
    "scan_layers",
    "stack_layers",
    "transfer_guard",
    "transfer_guard_device_to_host",
    "transfer_guard_host_to_device",
]
