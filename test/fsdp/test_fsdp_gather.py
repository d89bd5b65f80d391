"""How fully_shard gathers: kept, one gather per parameter; resharded, none (autograd saves the sharded
parameters and the partitioner gathers them at each use); and a backward after an in-place write."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch_xla

import torch_xla_ext as txe
from torch_xla_ext.distributed import MixedPrecisionPolicy, fully_shard

from fsdp_helpers import seeded  # noqa: F401  (a fixture: pytest finds it by name)
from fsdp_helpers import LAYERS, TRAIN_TOL, batch, loss_fn, shard_decoder, tiny_decoder, train_like_eager


def test_forward_gathers_each_parameter_once_when_kept(device, mesh):
    model = shard_decoder(tiny_decoder(use_scan=False), mesh, reshard_after_forward=False)
    _, (tx, _) = batch(device, mesh)
    ctx = txe.LoweringContext("forward")
    ctx.build([model(tx)])
    gathers = [inst.shape.dimensions for comp in ctx.module.computations for inst in comp.instructions
               if inst.opcode == "custom-call" and inst.custom_call_target == "Sharding"
               and inst.sharding is not None and inst.sharding.is_replicated]
    per_layer = [tuple(p.shape) for p in model.layers[0].parameters()]
    assert sorted(gathers) == sorted(per_layer * LAYERS + [tuple(model.embed.weight.shape)])


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_backward_after_an_in_place_write_to_a_parameter(device, mesh, reshard):
    # Resharding after forward, autograd saves the sharded parameter itself (a
    # LayerNorm weight as it is): after an in-place write the backward would
    # differentiate at the new values, so autograd's own version check raises.
    # Kept gathered, the backward uses the forward's gathered values.
    model = tiny_decoder(use_scan=False)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    _, (tx, _) = batch(device, mesh)
    norm = model.layers[1].norm.weight
    loss = model(tx).float().square().mean()
    with torch.no_grad():
        norm.add_(1.0)
    if reshard:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()
    else:
        loss.backward()
        assert norm.grad is not None


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
def test_reshard_after_forward_saves_the_sharded_parameters_for_the_backward(device, mesh, reshard):
    # Resharding, the step holds no gathered copy of a parameter from the forward to
    # the backward: autograd saves the sharded parameters (LayerNorm's as they are,
    # Linear's as weight.t()) and the lowered step annotates nothing replicated, so
    # the partitioner gathers each where it is used. Kept, every parameter is
    # gathered once and autograd saves the gathered copies.
    model = shard_decoder(tiny_decoder(use_scan=False), mesh, reshard_after_forward=reshard)
    (_, _), (tx, gx) = batch(device, mesh)
    params = {id(p): p for p in model.parameters()}
    saved_params: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        for candidate in (t, t._base):
            if candidate is not None and params.get(id(candidate)) is candidate:
                saved_params.add(id(candidate))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn(model, tx, gx)
    loss.backward()
    ctx = txe.LoweringContext("step")
    ctx.build([loss] + [p.grad for p in model.parameters()])
    gathers = collections.Counter(
        tuple(inst.shape.dimensions) for comp in ctx.module.computations for inst in comp.instructions
        if inst.opcode == "custom-call" and inst.custom_call_target == "Sharding"
        and inst.sharding is not None and inst.sharding.is_replicated)
    torch_xla.sync()
    read_by_backward = [w for layer in model.layers for w in (layer.norm.weight, layer.up.weight, layer.down.weight)]
    if reshard:
        assert {id(w) for w in read_by_backward + [model.embed.weight]} <= saved_params
        assert not gathers
    else:
        assert not saved_params
        assert gathers == collections.Counter(tuple(p.shape) for p in model.parameters())


def test_layer_norms_lower_to_ops_gspmd_partitions(device, mesh):
    # PyTorch's batch-norm fallback for LayerNorm would make GSPMD gather the
    # batch-sharded activation; fully_shard hooks the nn.LayerNorms it manages.
    model = shard_decoder(tiny_decoder(use_scan=False), mesh)
    _, (tx, _) = batch(device, mesh)
    loss = model(tx).float().square().mean()
    grads = torch.autograd.grad(loss, [layer.norm.weight for layer in model.layers])
    text = torch_xla._XLAC._get_xla_tensors_hlo([loss, *grads])
    assert "batch-norm" not in text and "rsqrt" in text


@pytest.mark.parametrize("use_scan", [False, True], ids=["loop", "scan"])
def test_frozen_and_unused_parameters_get_no_gradient(device, mesh, use_scan):
    # A module's parameters share one gather node; frozen ones are gathered
    # outside it. Both a frozen and an unused parameter keep .grad None.
    cpu = tiny_decoder(use_scan=use_scan)
    for layer in cpu.layers:
        layer.unused = torch.nn.Parameter(torch.randn(8, 4))
    reference = copy.deepcopy(cpu)
    reference.use_scan = False  # the eager CPU loop
    model = shard_decoder(cpu, mesh)
    for m in (model, reference):
        for layer in m.layers:
            layer.up.weight.requires_grad_(False)
    (tokens, targets), (tx, gx) = batch(device, mesh)
    loss_fn(model, tx, gx).backward()
    loss_fn(reference, tokens, targets).backward()
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters()):
        if name.endswith(("up.weight", "unused")):
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad.cpu(), ref.grad, **TRAIN_TOL, msg=name)


@pytest.mark.parametrize("kw", [dict(reshard_after_forward=False), dict(mp_policy=MixedPrecisionPolicy(
    param_dtype=torch.bfloat16)), dict()], ids=["keep", "reshard_bf16", "reshard"])
def test_a_forward_that_raises_leaves_every_sharded_parameter_registered_and_training(device, mesh, kw):
    # Kept, or cast to bf16, the forward swaps gathered or cast copies in for the
    # parameters; an exception in the middle (here in a block nested in the fully
    # sharded root) must leave the parameters themselves registered, or the next
    # optimizer step would update the copies. Then training goes on as in eager.
    reference = tiny_decoder(use_scan=False)
    model = shard_decoder(copy.deepcopy(reference), mesh, **kw)
    before = dict(model.named_parameters())

    class Boom(Exception):
        pass

    def boom(module, args):
        raise Boom

    handle = model.layers[1].up.register_forward_pre_hook(boom)
    (_, _), (tx, _) = batch(device, mesh)
    with pytest.raises(Boom):
        model(tx)
    handle.remove()
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[n] is p and isinstance(p, torch.nn.Parameter) for n, p in before.items())
    if "mp_policy" not in kw:  # bf16 compute is not the CPU's float32
        train_like_eager(model, reference, device, mesh)
