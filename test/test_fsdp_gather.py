"""How fully_shard gathers: one all-gather per state on XLA:CPU, one per parameter elsewhere; the regather's version check.

XLA:CPU combines no collectives, so there the parameters a state shards on
dim 0 are gathered together (``GatherFlat``); on other backends each
parameter has its own gather (``Gather``). ``forced_cpu_codegen`` picks either
path on this CPU mesh, so both are trained against eager here.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torch_xla_ext as txe
from torch_xla_ext._scan.backend import forced_cpu_codegen
from torch_xla_ext.distributed import fully_shard

from fsdp_helpers import mesh, seeded  # noqa: F401  (fixtures: pytest finds them by name)
from fsdp_helpers import LAYERS, batch, shard_decoder, tiny_decoder, train_like_eager


@pytest.mark.parametrize("flat", [True, False], ids=["one_gather_per_state", "one_gather_per_parameter"])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_both_gathers_train_like_unsharded_eager(device, mesh, flat, reshard):
    reference = tiny_decoder(use_scan=False)
    model = shard_decoder(copy.deepcopy(reference), mesh, reshard_after_forward=reshard)
    with forced_cpu_codegen(flat):
        train_like_eager(model, reference, device, mesh)


def _replicated_annotations(model, tokens) -> list[tuple[int, ...]]:
    """Shapes of the replicated sharding annotations (the gathers) in the lowered forward."""
    ctx = txe.LoweringContext("forward")
    ctx.build([model(tokens)])
    return [inst.shape.dimensions for comp in ctx.module.computations for inst in comp.instructions
            if inst.opcode == "custom-call" and inst.custom_call_target == "Sharding"
            and inst.sharding is not None and inst.sharding.is_replicated]


@pytest.mark.parametrize("flat", [True, False], ids=["one_gather_per_state", "one_gather_per_parameter"])
def test_forward_gathers_once_per_state_on_xla_cpu(device, mesh, num_devices, flat):
    model = shard_decoder(tiny_decoder(use_scan=False), mesh)
    _, (tx, _) = batch(device, mesh)
    with forced_cpu_codegen(flat):
        gathers = _replicated_annotations(model, tx)
    per_layer = list(model.layers[0].parameters())
    if flat:
        # each block's parameters as one [devices, numel / devices] tensor; the root's one embedding alone
        width = sum(p.numel() for p in per_layer) // num_devices
        assert sorted(gathers) == sorted([(num_devices, width)] * LAYERS + [tuple(model.embed.weight.shape)])
    else:
        assert sorted(gathers) == sorted([tuple(p.shape) for p in per_layer] * LAYERS
                                         + [tuple(model.embed.weight.shape)])


@pytest.mark.parametrize("flat", [True, False], ids=["one_gather_per_state", "one_gather_per_parameter"])
def test_backward_refuses_a_parameter_written_in_place_after_the_forward(device, mesh, flat):
    # Resharding after forward gathers a saved parameter again in the backward (a
    # LayerNorm weight is saved as it is): after an in-place write that would
    # differentiate at the new values, so it must raise, as autograd does for a saved
    # tensor written in place.
    model = tiny_decoder(use_scan=False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    _, (tx, _) = batch(device, mesh)
    with forced_cpu_codegen(flat):
        loss = model(tx).float().square().mean()
        with torch.no_grad():
            model.layers[1].norm.weight.add_(1.0)
        with pytest.raises(RuntimeError, match="modified in place after the forward"):
            loss.backward()
