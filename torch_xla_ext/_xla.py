"""The door to torch_xla's private API: ``torch_xla._XLAC`` and ``torch_xla.core.xla_builder``.

Everything here is imported lazily, on first use: ``torch_xla`` must not be
imported before the user has chosen the PJRT device and SPMD mode.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

__all__ = ["xlac", "xla_builder", "torch_xla_device"]


def xlac() -> Any:
    """``torch_xla._XLAC``, the C++ binding (lowering contexts, shardings, device data, graph hashes)."""
    import torch_xla

    return torch_xla._XLAC


def xla_builder() -> ModuleType:
    """``torch_xla.core.xla_builder``: XLA ops from Python, computations, placeholder tensors."""
    import torch_xla.core.xla_builder as xb

    return xb


def torch_xla_device() -> torch.device:
    """The XLA device of this process (``torch_xla.device()``)."""
    import torch_xla

    return torch_xla.device()
