"""scan_layers: the plain loop's values and gradients, stacking, trace reuse, homogeneity and placement checks.

scan_layers over sharded layers is tested in test_scan_spmd.py.
"""

from __future__ import annotations

import pytest
import torch
import torch_xla.distributed.spmd as xs

import torch_xla_ext as txe
from torch_xla_ext.scan import scan_cache_info

from scan_blocks import make_blocks
from scan_reference import assert_close_derived


def test_scan_layers_matches_the_plain_loop(device):
    cpu_layers = make_blocks(4)
    xla_layers = make_blocks(4).to(device)
    x_cpu = torch.randn(5, 16)
    out = txe.scan_layers(xla_layers, x_cpu.to(device))
    ref = x_cpu
    for layer in cpu_layers:
        ref = layer(ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert_close_derived(out, ref, 4 * (16 + 32))
    for (name, p), (_, p_ref) in zip(xla_layers.named_parameters(), cpu_layers.named_parameters()):
        assert p.grad is not None, name
        assert_close_derived(p.grad, p_ref.grad, 4 * (16 + 32) * 5, msg=name)


def test_a_member_the_layers_do_not_use_gets_no_gradient(device):
    # As in the plain loop: None, which optimizers skip (zeros would be decayed).
    layers = make_blocks(3).to(device)
    for layer in layers:
        layer.spare = torch.nn.Parameter(torch.randn(4).to(device))
    txe.scan_layers(layers, torch.randn(5, 16).to(device)).square().sum().backward()
    for name, p in layers.named_parameters():
        assert (p.grad is None) == name.endswith("spare"), name


@pytest.mark.parametrize("shape, tiles, merged", [
    ((128, 512), (8, 1), ((65536,), (8,))),        # sharded major dim: one contiguous block per device
    ((128, 512), (1, 8), ((128, 512), (1, 8))),     # sharded minor dim: nothing to merge
    ((4, 6, 8), (1, 2, 1), ((4, 48), (1, 2))),      # the minor dims merge into the sharded one
    ((4, 6, 8), (1, 1, 1), ((192,), (1,))),         # unsharded: flat
    ((10, 512), (8, 1), ((10, 512), (8, 1))),       # uneven: padded blocks would not line up
    ((), (), ((), ())),
])
def test_stacked_members_merge_only_dims_that_keep_blocks_contiguous(shape, tiles, merged):
    from torch_xla_ext._scan_layers.stacking import _merged

    assert _merged(shape, tiles) == merged


def _stacking_profile(layers, x) -> tuple[int, int, int]:
    """(concatenates, slices, constants) in the lowered graph of scan_layers' per-layer gradients."""
    for p in layers.parameters():
        p.grad = None
    txe.scan_layers(layers, x).square().sum().backward()
    ctx = txe.LoweringContext("stacking")
    ctx.build([p.grad for p in layers.parameters()])
    ops = [inst.opcode for comp in ctx.module.computations for inst in comp.instructions]
    return ops.count("concatenate"), ops.count("slice"), ops.count("constant")


def test_scan_layers_stacking_does_not_grow_with_depth(device, mesh):
    # Handing gradients back with one constant-offset slice per layer makes
    # XLA generate a kernel per layer: compile time grows with the depth. The
    # offsets are runtime operands, and stacking is one concatenate per
    # parameter whatever the depth, so the graph has no per-layer constants.
    profiles = {}
    for n in (2, 5):
        layers = make_blocks(n).to(device)
        for layer in layers:
            xs.mark_sharding(layer.up.weight, mesh, ("fsdp", None))
        profiles[n] = _stacking_profile(layers, torch.randn(4, 16).to(device))
    concatenates, slices, constants = profiles[5]
    assert slices == 0, profiles
    assert concatenates == len(list(make_blocks(1).parameters())), profiles
    assert profiles[2] == profiles[5], profiles


def test_scan_layers_reuses_its_trace(device):
    layers = make_blocks(2).to(device)
    x = torch.randn(3, 16).to(device)
    with torch.no_grad():
        txe.scan_layers(layers, x)
        before = scan_cache_info()
        txe.scan_layers(layers, torch.randn(3, 16).to(device))
    after = scan_cache_info()
    assert after.traces == before.traces and after.hits == before.hits + 1


def test_scan_layers_rejects_heterogeneous_layers(device, mesh):
    layers = make_blocks(3).to(device)
    x = torch.randn(2, 16).to(device)
    mixed = [layers[0], torch.nn.Linear(16, 16).to(device)]
    with pytest.raises(ValueError, match=r"Layer 1 has mismatched keys"):
        txe.scan_layers(mixed, x)
    wide = make_blocks(1, hidden=48).to(device)[0]
    with pytest.raises(ValueError, match=r"layers\[2\].up.weight has shape \(48, 16\)"):
        txe.scan_layers([layers[0], layers[1], wide], x)
    xs.mark_sharding(layers[1].up.weight, mesh, ("fsdp", None))
    with pytest.raises(ValueError, match=r"layers\[1\].up.weight has sharding"):
        txe.scan_layers(layers, x)
    assert txe.scan_layers([], x) is x


def test_scan_layers_with_a_layer_on_the_cpu_names_it_and_the_fix(device):
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
    x = torch.ones(2, 4, device=device)
    with pytest.raises(TypeError, match=r"layers\[0\]\.weight is on cpu; move the layers to the XLA device"):
        txe.scan_layers(layers, x)
    layers[0].to(device)
    layers[2].to(device)
    with pytest.raises(TypeError, match=r"layers\[1\]\.weight is on cpu"):
        txe.scan_layers(layers, x)
