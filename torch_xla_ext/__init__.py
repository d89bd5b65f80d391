"""torch_xla_ext: zero-host-transfer lowering, scan and composable FSDP for PyTorch/XLA SPMD.

Attributes are imported on first use, so ``import torch_xla_ext`` (and the
pytest plugin it registers) stays cheap and never imports torch_xla by itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "HloComputation": ".hlo",
    "HloInstruction": ".hlo",
    "HloModule": ".hlo",
    "HloParameter": ".hlo",
    "Shape": ".hlo",
    "Sharding": ".hlo",
    "read_hlo": ".hlo",
    "LoweringContext": ".lowering",
    "HostTransferError": ".transfer_guard",
    "TransferStats": ".transfer_guard",
    "measure_transfers": ".transfer_guard",
    "no_host_transfers": ".transfer_guard",
    "transfer_guard": ".transfer_guard",
    "transfer_guard_device_to_host": ".transfer_guard",
    "transfer_guard_host_to_device": ".transfer_guard",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:
    from .hlo import HloComputation, HloInstruction, HloModule, HloParameter, Shape, Sharding, read_hlo
    from .lowering import LoweringContext
    from .transfer_guard import (
        HostTransferError,
        TransferStats,
        measure_transfers,
        no_host_transfers,
        transfer_guard,
        transfer_guard_device_to_host,
        transfer_guard_host_to_device,
    )
