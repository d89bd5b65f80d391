"""The ``sharded`` fixture shared by the transfer_guard tests (a 32x16 tensor sharded over ``mesh_4x2``)."""

from __future__ import annotations

import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs


@pytest.fixture
def sharded(device, mesh_4x2):
    t = torch.randn(32, 16).to(device)
    xs.mark_sharding(t, mesh_4x2, ("x", "y"))
    torch_xla.sync()
    return t
