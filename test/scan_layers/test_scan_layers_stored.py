"""stack_layers: a stack's parameters stored as one [L, ...] parameter per name, read by scan_layers with no copy.

Against the same layers stored per layer and the CPU loop: values, gradients, an optimizer step, the loop
over the layers, state dicts (keys, order, values, loading), fully_shard's placement, refusals.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

import torch_xla_ext as txe
from torch_xla_ext.distributed import fully_shard
from torch_xla_ext.testing import measure_transfers

from scan_blocks import make_blocks
from scan_reference import assert_close_derived

X = torch_xla._XLAC
L, D, H, B = 4, 16, 32, 8


def _stacked_copy(device, mesh=None):
    """(per-layer blocks, the same blocks stored stacked), both on the device, up.weight sharded when a mesh."""
    plain, stacked = make_blocks(L, D, H).to(device), make_blocks(L, D, H).to(device)
    if mesh is not None:
        for layers in (plain, stacked):
            for layer in layers:
                xs.mark_sharding(layer.up.weight, mesh, ("fsdp", None))
    txe.stack_layers(stacked)
    return plain, stacked


def test_scan_and_loop_over_stacked_layers_match_the_per_layer_scan_and_cpu(device, mesh):
    cpu = make_blocks(L, D, H)
    plain, stacked = _stacked_copy(device, mesh)
    x = torch.randn(B, D)
    out_plain = txe.scan_layers(plain, x.to(device))
    out_stacked = txe.scan_layers(stacked, x.to(device))
    h = x.to(device)
    for layer in stacked:  # the loop reads each layer's slice
        h = layer(h)
    ref = x
    for layer in cpu:
        ref = layer(ref)
    out_plain.square().sum().backward()
    out_stacked.square().sum().backward()
    ref.square().sum().backward()
    for out in (out_plain, out_stacked, h):
        assert_close_derived(out, ref, L * (D + H))
    assert [n for n, _ in stacked.named_parameters()] == ["up/weight", "up/bias", "down/weight", "down/bias",
                                                          "norm/weight", "norm/bias"]
    for name, p in stacked.named_parameters():
        assert p.shape[0] == L and p.grad is not None and p.grad.shape == p.shape, name
        module, _, leaf = name.replace("/", ".").rpartition(".")
        for i in range(L):
            ref_grad = cpu[i].get_submodule(module)._parameters[leaf].grad
            assert_close_derived(p.grad[i], ref_grad, L * (D + H) * B, msg=f"{name}[{i}]")
    weight = stacked.get_parameter("up/weight")
    # The stacked weight and its gradient keep each layer's sharding, and never shard over the layers.
    assert X._get_xla_sharding_spec(weight) == X._get_xla_sharding_spec(weight.grad)
    assert X._get_xla_sharding_spec(weight).startswith("{devices=[1,8,1]")


def test_an_optimizer_step_on_the_stacked_parameters_is_what_every_layer_reads(device):
    plain, stacked = _stacked_copy(device)
    x = torch.randn(B, D).to(device)
    for layers in (plain, stacked):
        opt = torch.optim.SGD(layers.parameters(), lr=0.1)
        txe.scan_layers(layers, x).square().sum().backward()
        opt.step()
    torch_xla.sync()
    for i in range(L):
        torch.testing.assert_close(stacked[i].up.weight.cpu(), plain[i].up.weight.cpu(), rtol=1e-5, atol=1e-6)
    # The next step reads the updated values.
    torch.testing.assert_close(txe.scan_layers(stacked, x).cpu(), txe.scan_layers(plain, x).cpu(),
                               rtol=1e-5, atol=1e-5)


def test_the_scan_reads_the_stacked_parameters_without_stacking_or_moving_anything(device, mesh):
    _, stacked = _stacked_copy(device, mesh)
    x = torch.randn(B, D).to(device)
    torch_xla.sync()
    with measure_transfers() as moved:
        out = txe.scan_layers(stacked, x)
        out.sum().backward()
        hlo = X._get_xla_tensors_hlo([out, *(p.grad for p in stacked.parameters())])
        torch_xla.sync()
    assert not moved.device_to_host, moved.report()
    # No stacking of per-layer members and no handing back of per-layer gradients: the parameters and their
    # gradients go in and out of the loops whole.
    assert "txe_stack" not in hlo and "txe_unstack" not in hlo


def test_the_stacking_records_do_not_make_layers_differ(device):
    # Each layer records its index; scan_layers must not take that for a per-layer attribute (which would
    # trace every layer again at every call).
    from torch_xla_ext._scan_layers.homogeneous import attribute_groups

    _, stacked = _stacked_copy(device)
    assert attribute_groups(list(stacked)) == []


def test_state_dict_keys_order_and_values_are_the_per_layer_models(device):
    plain, stacked = _stacked_copy(device)
    want = plain.state_dict()
    got = stacked.state_dict()
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k].cpu(), msg=k)
    # keep_vars gives tensors that still reach the stacked parameter's gradient.
    kept = stacked.state_dict(keep_vars=True)
    assert kept["1.up.weight"].requires_grad


def test_a_list_edited_after_stacking_maps_each_layer_to_its_own_rows(device):
    # Deleting a layer renumbers the list; each remaining layer must still save and load its own row.
    plain, stacked = _stacked_copy(device)
    del plain[0]
    del stacked[0]
    want = plain.state_dict()
    got = stacked.state_dict()
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k].cpu(), msg=k)
    new = {k: torch.full_like(v.cpu(), float(k[0]) + 1) for k, v in want.items()}  # layer i holds i + 1
    result = stacked.load_state_dict(new)
    assert not result.missing_keys and not result.unexpected_keys
    torch_xla.sync()
    for i in range(L - 1):
        assert torch.equal(stacked[i].up.weight.cpu(), torch.full((H, D), float(i + 1)))
    # The row the deleted layer held is kept as it was.
    assert torch.equal(stacked.get_parameter("up/weight")[0].cpu(), make_blocks(L, D, H)[0].up.weight)


def test_a_single_layers_state_dict_and_load_state_dict_see_its_slices(device):
    plain, stacked = _stacked_copy(device)
    want = plain[2].state_dict()
    got = stacked[2].state_dict()
    assert list(got) == list(want)
    for k in want:
        torch.testing.assert_close(got[k].cpu(), want[k].cpu(), msg=k)
    assert list(stacked[2].up.state_dict()) == ["weight", "bias"]
    new = {k: torch.full_like(v.cpu(), 3.0) for k, v in want.items()}
    assert not stacked[2].load_state_dict(new).missing_keys
    torch_xla.sync()
    assert torch.equal(stacked[2].up.weight.cpu(), torch.full((H, D), 3.0))
    assert torch.equal(stacked[1].up.weight.cpu(), plain[1].up.weight.cpu())  # the other layers are untouched
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "up.bias"'):
        stacked[2].load_state_dict({k: v for k, v in new.items() if k != "up.bias"})


def test_a_load_that_raised_midway_does_not_make_a_later_single_layer_load_skip_its_slices(device):
    # The list's load pre-hook takes the per-layer keys and the holders' hooks stand aside for that load;
    # a load that raises before the list's post-hook must not leave them standing aside for the next one.
    def fail(*args):
        raise ValueError("boom")

    plain, stacked = _stacked_copy(device)
    boom = stacked[1].register_load_state_dict_pre_hook(fail)
    with pytest.raises(ValueError, match="boom"):
        stacked.load_state_dict(plain.state_dict())
    boom.remove()
    new = {k: torch.full_like(v.cpu(), 5.0) for k, v in plain[2].state_dict().items()}
    assert not stacked[2].load_state_dict(new).missing_keys
    torch_xla.sync()
    assert torch.equal(stacked[2].up.weight.cpu(), torch.full((H, D), 5.0))


def test_load_state_dict_from_a_per_layer_checkpoint_keeps_the_sharding(device, mesh):
    _, stacked = _stacked_copy(device, mesh)
    source = make_blocks(L, D, H, seed=3)
    spec = X._get_xla_sharding_spec(stacked.get_parameter("up/weight"))
    with measure_transfers() as moved:
        result = stacked.load_state_dict(source.state_dict())
        torch_xla.sync()
    assert not moved.device_to_host, moved.report()
    assert not result.missing_keys and not result.unexpected_keys
    assert X._get_xla_sharding_spec(stacked.get_parameter("up/weight")) == spec
    for i in range(L):
        torch.testing.assert_close(stacked[i].down.weight.cpu(), source[i].down.weight)
    partial = {k: v for k, v in source.state_dict().items() if k != "2.norm.bias"}
    before = stacked[2].norm.bias.cpu()
    with torch.no_grad():
        partial["1.norm.bias"] = torch.full((D,), 7.0)
    assert stacked.load_state_dict(partial, strict=False).missing_keys == ["2.norm.bias"]
    # The layers the checkpoint has are loaded; the missing one keeps its value.
    assert torch.equal(stacked[1].norm.bias.cpu(), torch.full((D,), 7.0))
    assert torch.equal(stacked[2].norm.bias.cpu(), before)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "2.norm.bias"'):
        stacked.load_state_dict(partial)
    wrong = dict(source.state_dict(), **{"1.up.weight": torch.zeros(3, 3)})
    with pytest.raises(RuntimeError, match=r"size mismatch for 1.up.weight"):
        stacked.load_state_dict(wrong)


def test_deepcopy_gives_an_independent_stacked_model(device):
    _, stacked = _stacked_copy(device)
    twin = copy.deepcopy(stacked)
    assert twin.get_parameter("up/weight") is not stacked.get_parameter("up/weight")
    with torch.no_grad():
        twin.get_parameter("up/weight").add_(1.0)
    assert torch.equal(twin[1].up.weight.cpu(), stacked[1].up.weight.cpu() + 1.0)
    x = torch.randn(B, D).to(device)
    h = x
    for layer in twin:
        h = layer(h)
    torch.testing.assert_close(txe.scan_layers(twin, x).cpu(), h.cpu(), rtol=1e-5, atol=1e-5)


def test_fully_shard_shards_a_stacked_parameter_on_a_layer_dim_and_trains_like_per_layer(device, mesh):
    class Net(torch.nn.Module):
        def __init__(self, layers):
            super().__init__()
            self.layers = layers

        def forward(self, h):
            return txe.scan_layers(self.layers, h)

    n = 8  # a layer count the fsdp axis divides: the rule for a plain parameter would shard over the layers
    plain, stacked = make_blocks(n, D, H).to(device), make_blocks(n, D, H).to(device)
    txe.stack_layers(stacked)
    nets = [Net(plain), Net(stacked)]
    for net in nets:
        for layer in net.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    weight = stacked.get_parameter("up/weight")  # [8, 32, 16]
    assert X._get_xla_sharding_spec(weight).startswith("{devices=[1,8,1]")
    assert X._get_xla_sharding_spec(stacked.get_parameter("up/bias")).startswith("{devices=[1,8]")
    x = torch.randn(B, D).to(device)
    losses = []
    for net in nets:
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        run = []
        for _ in range(2):
            loss = net(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss)
        torch_xla.sync()
        losses.append([float(v.detach()) for v in run])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    # Nested under a fully sharded root, the state dict is still the per-layer model's.
    plain_state, stacked_state = nets[0].state_dict(), nets[1].state_dict()
    assert list(stacked_state) == list(plain_state)
    torch.testing.assert_close(stacked_state["layers.5.up.weight"].cpu(), plain_state["layers.5.up.weight"].cpu(),
                               rtol=1e-5, atol=1e-6)
    # ... and a fully sharded root loads a per-layer checkpoint into it, shardings kept.
    spec = X._get_xla_sharding_spec(weight)
    fresh = {k: torch.full_like(v.cpu(), 0.5) for k, v in plain_state.items()}
    nets[1].load_state_dict(fresh)
    torch_xla.sync()
    assert X._get_xla_sharding_spec(stacked.get_parameter("up/weight")) == spec
    assert torch.equal(stacked[7].up.weight.cpu(), torch.full((H, D), 0.5))


def test_bad_stacks_are_refused_before_anything_changes(device, mesh):
    with pytest.raises(txe.ScanInputError, match="must be an nn.ModuleList"):
        txe.stack_layers([torch.nn.Linear(2, 2)])
    with pytest.raises(txe.ScanInputError, match="empty"):
        txe.stack_layers(torch.nn.ModuleList())
    mixed = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 5)]).to(device)
    with pytest.raises(txe.ScanInputError, match="Shape mismatch"):
        txe.stack_layers(mixed)
    tied = make_blocks(2, D, H).to(device)
    tied[1].up.weight = tied[0].up.weight
    with pytest.raises(txe.ScanInputError, match="same tensor as layers"):
        txe.stack_layers(tied)
    assert isinstance(tied[0].up.weight, torch.nn.Parameter)  # untouched
    on_cpu = make_blocks(2, D, H)
    with pytest.raises(TypeError, match="XLA"):
        txe.stack_layers(on_cpu)
    sharded = make_blocks(2, D, H).to(device)
    for layer in sharded:
        fully_shard(layer, mesh=mesh)
    with pytest.raises(txe.ScanInputError, match="before fully_shard"):
        txe.stack_layers(sharded)
    done = make_blocks(2, D, H).to(device)
    txe.stack_layers(done)
    with pytest.raises(txe.ScanInputError, match="already stored stacked"):
        txe.stack_layers(done)


def test_scans_that_would_read_the_wrong_slices_are_refused(device):
    _, stacked = _stacked_copy(device)
    x = torch.randn(B, D).to(device)
    with pytest.raises(txe.ScanInputError, match="stacked order"):
        txe.scan_layers([stacked[1], stacked[0]], x)
    with pytest.raises(txe.ScanInputError, match="mix"):
        txe.scan_layers([stacked[0], make_blocks(1, D, H).to(device)[0]], x)
    with pytest.raises(txe.ScanInputError, match="group_size > 1"):
        txe.scan_layers(stacked, x, group_size=2)
    # A parameter assigned over a stacked name after stacking: refused at the assignment (stored_contract);
    # one written into _parameters behind nn.Module's back is still refused by the scan.
    stacked[2].up._parameters["weight"] = torch.nn.Parameter(torch.zeros(H, D, device=device))
    with pytest.raises(txe.ScanInputError, match=r"layers\[2\].up.weight was assigned"):
        txe.scan_layers(stacked, x)


def test_a_contiguous_part_of_a_stacked_stack_scans_its_own_slices(device):
    _, stacked = _stacked_copy(device)
    x = torch.randn(B, D).to(device)
    h = x
    for layer in stacked[1:3]:
        h = layer(h)
    torch.testing.assert_close(txe.scan_layers(stacked[1:3], x).cpu(), h.cpu(), rtol=1e-5, atol=1e-5)
