"""fully_shard's backward on the TPU compiler: each module's gradients reduced before the backward goes on.

Without the backward barrier (``_state._BackwardBarrier``) XLA's combiner
merges every block's gradient reduce-scatter into one at the end of the
backward, and every block's full, unreduced weight gradient is live until then.
Compiled for ``v5e:2x4``, nothing runs.
"""

from __future__ import annotations

import pytest
import torch

from torch_xla_ext import tpu
from torch_xla_ext.distributed import _state

from torch_xla_ext.testing import models

from fsdp_helpers import seeded, shard_decoder  # noqa: F401  (seeded: a fixture)

WIDTH, LAYERS = 128, 4


def _compiled_step(device, mesh) -> tpu.CompiledForTpu:
    torch.manual_seed(0)
    with tpu.lowering():
        model = models.Decoder(64, WIDTH, LAYERS, lambda: models.CausalBlock(WIDTH, 4, 4), use_scan=False)
        model = shard_decoder(model, mesh)
        tokens = torch.randint(0, 64, (16, 32)).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        loss.backward()
        opt.step()
    return tpu.compile([loss, *model.parameters()], topology="v5e:2x4")


def test_each_block_gradient_is_reduced_before_the_backward_goes_on(device, mesh, monkeypatch):
    with_barrier = _compiled_step(device, mesh)
    monkeypatch.setattr(_state._BackwardBarrier, "backward", staticmethod(lambda ctx, *grads: (None, *grads)))
    without = _compiled_step(device, mesh)
    # Without it the combiner merges the blocks' gradient reduce-scatters into one at the end of the
    # backward; with it each block reduce-scatters its own before the backward goes on, and fewer full
    # gradients are live at the peak.
    assert with_barrier.collectives["reduce-scatter"] == (LAYERS, without.collectives["reduce-scatter"][1])
    assert without.collectives["reduce-scatter"][0] == 1
    assert with_barrier.peak_bytes < without.peak_bytes
    assert with_barrier.flops == pytest.approx(without.flops, rel=1e-6)  # the same program, scheduled differently
