"""fully_shard / replicate on the 8-device SPMD mesh: training, ownership, traversal, state dict, errors."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch_xla
import torch_xla.distributed.spmd as xs

import torch_xla_ext as txe
from torch_xla_ext.distributed import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    get_fully_sharded_modules,
    replicate,
)
from torch_xla_ext.testing import measure_transfers

X = torch_xla._XLAC
FSDP8 = "{devices=[8,1]0,1,2,3,4,5,6,7}"


def spec(t: torch.Tensor) -> str:
    return X._get_xla_sharding_spec(t)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Decoder(nn.Module):
    """A tiny decoder whose embedding is tied to the LM head."""

    def __init__(self, vocab: int = 32, d: int = 16, layers: int = 4, use_scan: bool = True) -> None:
        super().__init__()
        self.use_scan = use_scan
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        if self.use_scan:
            h = txe.scan_layers(self.layers, h)
        else:
            for layer in self.layers:
                h = layer(h)
        return self.head(h)


@pytest.fixture
def mesh(num_devices):
    return xs.Mesh(np.arange(num_devices), (num_devices,), ("fsdp",))


def shard_decoder(model: Decoder, mesh, **kw) -> Decoder:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def batch(device, mesh, vocab=32):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (8, 6), generator=g)
    targets = torch.randint(0, vocab, (8, 6), generator=g)
    tx, gx = tokens.to(device), targets.to(device)
    xs.mark_sharding(tx, mesh, ("fsdp", None))
    xs.mark_sharding(gx, mesh, ("fsdp", None))
    torch_xla.sync()
    return (tokens, targets), (tx, gx)


def loss_fn(model, tokens, targets):
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


@pytest.mark.parametrize("use_scan", [True, False], ids=["scan_layers", "loop"])
def test_tiny_decoder_trains_like_unsharded_eager(device, mesh, use_scan):
    torch.manual_seed(0)
    reference = Decoder(use_scan=False)
    model = copy.deepcopy(reference)
    model.use_scan = use_scan
    shard_decoder(model, mesh)
    assert model.embed.weight is model.head.weight
    (tokens, targets), (tx, gx) = batch(device, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(3):
        with measure_transfers() as m:
            with txe.no_host_transfers():
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model, tx, gx)
                loss.backward()
                opt.step()
                torch_xla.sync()
        assert not m.device_to_host, m.report()
        ref_opt.zero_grad()
        ref_loss = loss_fn(reference, tokens, targets)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
        for name, p in model.named_parameters():
            expected = FSDP8 if p.dim() == 2 else "{devices=[8]0,1,2,3,4,5,6,7}"
            assert spec(p) == expected, name
            assert spec(p.grad) == spec(p), name
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.cpu(), r.detach(), atol=1e-5, rtol=1e-5, msg=name)


def test_class_swap_keeps_module_identity_and_state_dict_keys(mesh):
    torch.manual_seed(0)
    reference = Decoder()
    model = shard_decoder(copy.deepcopy(reference), mesh)
    assert isinstance(model, Decoder) and isinstance(model, FSDPModule)
    assert type(model).__name__ == "FSDPDecoder"
    assert isinstance(model.layers[0], Block) and isinstance(model.layers[0], FSDPModule)
    assert list(model.state_dict()) == list(reference.state_dict())
    for (key, value), ref in zip(model.state_dict().items(), reference.state_dict().values()):
        assert value.device.type == "xla"
        torch.testing.assert_close(value.cpu(), ref, msg=key)  # the unsharded values


def test_load_state_dict_into_a_fresh_sharded_model(device, mesh):
    torch.manual_seed(0)
    trained = shard_decoder(Decoder(), mesh)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.25)
    torch_xla.sync()
    saved = {k: v.cpu() for k, v in trained.state_dict().items()}
    torch.manual_seed(1)
    fresh = shard_decoder(Decoder(), mesh)
    before = {n: spec(p) for n, p in fresh.named_parameters()}
    fresh.load_state_dict(saved)
    torch_xla.sync()
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value.cpu(), saved[key], msg=key)
    assert {n: spec(p) for n, p in fresh.named_parameters()} == before
    assert fresh.embed.weight is fresh.head.weight


def test_each_parameter_is_managed_by_exactly_one_state(mesh):
    model = shard_decoder(Decoder(), mesh)
    owners: dict[int, list[str]] = {}
    for m in get_fully_sharded_modules(model):
        for _, p in m.managed_named_parameters():
            owners.setdefault(id(p), []).append(type(m).__name__)
    assert set(owners) == {id(p) for p in model.parameters()}
    assert all(len(v) == 1 for v in owners.values())
    assert [n for n, _ in model.managed_named_parameters()] == ["embed.weight"]  # the root skips layer params
    assert [n for n, _ in model.layers[2].managed_named_parameters()] == [
        "norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight", "down.bias"]


class TiedAcrossLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8)) for _ in range(4))
        self.layers[3][0].weight = self.layers[0][0].weight


@pytest.mark.parametrize("order", ["bottom_up", "top_down"])
def test_parameter_shared_by_two_layers_belongs_to_their_lowest_common_fully_sharded_ancestor(mesh, order):
    model = TiedAcrossLayers()
    shared = model.layers[0][0].weight
    mods = list(model.layers) + [model] if order == "bottom_up" else [model] + list(model.layers)
    for m in mods:
        fully_shard(m, mesh=mesh)
    assert model.layers[3][0].weight is model.layers[0][0].weight is shared
    assert [n for n, _ in model.managed_named_parameters()] == ["layers.0.0.weight"]
    assert [n for n, _ in model.layers[0].managed_named_parameters()] == ["0.bias"]
    assert [n for n, _ in model.layers[3].managed_named_parameters()] == ["0.bias"]


class Tree(nn.Module):
    """mod(submod1, submod2(subsubmod))"""

    def __init__(self) -> None:
        super().__init__()
        self.submod1 = nn.Linear(8, 8)
        self.submod2 = nn.Sequential()
        self.submod2.add_module("subsubmod", nn.Linear(8, 8))


@pytest.mark.parametrize("order", [0, 1, 2])
def test_fully_sharded_modules_in_left_to_right_dfs_order(mesh, order):
    mod = Tree()
    modules = [mod, mod.submod1, mod.submod2, mod.submod2.subsubmod]
    application = [list(reversed(modules)), modules, [modules[2], modules[0], modules[3], modules[1]]][order]
    for m in application:
        fully_shard(m, mesh=mesh)
    assert get_fully_sharded_modules(mod) == modules


def test_replicate_subtree_is_ignored_by_enclosing_fully_shard(mesh):
    mod = Tree()
    inner = mod.submod2.subsubmod
    fully_shard(inner, mesh=mesh)
    replicate(mod.submod2)
    fully_shard(mod, mesh=mesh)
    assert get_fully_sharded_modules(mod) == [mod]
    assert [n for n, _ in mod.managed_named_parameters()] == ["submod1.weight", "submod1.bias"]
    assert spec(inner.weight) == FSDP8  # keeps its own sharding
    assert getattr(mod.submod1, "_is_fsdp_managed_module", False) is True
    assert getattr(mod.submod1, "_fsdp_use_orig_params", None) is True
    assert not hasattr(mod.submod2, "_is_fsdp_managed_module")


def test_default_placement_and_override(mesh):
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.randn(16, 4))   # dim 0 divides
            self.b = nn.Parameter(torch.randn(3, 24))   # only dim 1 divides
            self.c = nn.Parameter(torch.randn(3, 5))    # nothing divides: replicated + warning
            self.d = nn.Parameter(torch.randn(8, 16))   # overridden to dim 1

    m = Odd()
    with pytest.warns(UserWarning, match=r"c \(3, 5\).*replicated"):
        fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: 1 if p is m.d else None)
    assert spec(m.a) == FSDP8
    assert spec(m.b) == "{devices=[1,8]0,1,2,3,4,5,6,7}"
    assert spec(m.c) in ("", "{replicated}")
    assert spec(m.d) == "{devices=[1,8]0,1,2,3,4,5,6,7}"


def _step_hlo_opcodes(model, device, mesh) -> list[str]:
    (_, _), (tx, gx) = batch(device, mesh)
    loss = loss_fn(model, tx, gx)
    loss.backward()
    ctx = txe.LoweringContext("fsdp_step")
    ctx.build([loss] + [p.grad for p in model.parameters()])
    ops = [inst.opcode for comp in ctx.module.computations for inst in comp.instructions]
    torch_xla.sync()
    return ops


@pytest.mark.parametrize("use_scan", [True, False], ids=["scan_layers", "loop"])
@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_puts_an_optimization_barrier_before_the_backward_gather(
        device, mesh, reshard, use_scan):
    torch.manual_seed(0)
    model = shard_decoder(Decoder(use_scan=use_scan), mesh, reshard_after_forward=reshard)
    ops = _step_hlo_opcodes(model, device, mesh)
    barriers = ops.count("opt-barrier")
    if reshard:
        assert barriers > 0
    else:
        assert barriers == 0


def test_reshard_after_forward_in_scan_does_not_stack_gathered_weights(device, mesh):
    """The forward loop of scan_layers stacks per-layer activations but not the gathered weights."""
    def loop_state_elements(reshard: bool) -> int:
        torch.manual_seed(0)
        model = shard_decoder(Decoder(use_scan=True), mesh, reshard_after_forward=reshard)
        (_, _), (tx, gx) = batch(device, mesh)
        loss = loss_fn(model, tx, gx)
        ctx = txe.LoweringContext("forward")
        ctx.build([loss])
        loop = ctx.module.while_loops()[0]
        body = ctx.module.computation(loop.body)
        state = body.instruction(body.root_id).shape
        torch_xla.sync()
        return state.num_elements

    gathered_weights = 4 * (32 * 16 + 16 * 32)  # L x (up + down), what the backward would read back
    assert loop_state_elements(False) - loop_state_elements(True) >= gathered_weights


def test_mixed_precision(device, mesh):
    torch.manual_seed(0)
    model = shard_decoder(Decoder(use_scan=False), mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32))
    (_, _), (tx, gx) = batch(device, mesh)
    logits = model(tx)
    assert logits.dtype == torch.float32
    loss_fn(model, tx, gx).backward()
    torch_xla.sync()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
        assert spec(p.grad) == spec(p), name
    with pytest.raises(TypeError, match="param_dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int32)


def test_errors_are_raised_before_anything_is_touched(num_devices, mesh):
    mesh2d = xs.Mesh(np.arange(num_devices), (4, 2), ("x", "y"))
    m = Tree()
    with pytest.raises(ValueError, match="axis named 'fsdp'"):
        fully_shard(m, mesh=mesh2d)
    assert m.submod1.weight.device.type == "cpu" and not isinstance(m, FSDPModule)

    meta = nn.Linear(8, 8, device="meta")
    with pytest.raises(ValueError, match="meta"):
        fully_shard(meta, mesh=mesh)
    assert not isinstance(meta, FSDPModule)

    conflicted = Tree()
    conflicted.submod1.to(torch_xla.device())
    xs.mark_sharding(conflicted.submod1.weight, mesh, (None, "fsdp"))
    with pytest.raises(ValueError, match="conflicts"):
        fully_shard(conflicted, mesh=mesh)
    assert conflicted.submod2.subsubmod.weight.device.type == "cpu"  # nothing was moved

    r = Tree()
    replicate(r)
    with pytest.raises(ValueError, match="replicated or fully sharded"):
        fully_shard(r, mesh=mesh)
    s = Tree()
    fully_shard(s, mesh=mesh)
    with pytest.raises(ValueError, match="already applied"):
        fully_shard(s, mesh=mesh)
    with pytest.raises(ValueError, match="replicated or fully sharded"):
        replicate(s)
    with pytest.raises(TypeError, match="nn.Module"):
        fully_shard("model", mesh=mesh)


def test_fully_shard_on_a_3000_deep_module_chain(mesh):
    class Link(nn.Module):
        def __init__(self, child: nn.Module | None) -> None:
            super().__init__()
            if child is not None:
                self.child = child

    depth = 3000
    leaf = nn.Linear(8, 8)
    chain: nn.Module = Link(leaf)
    middle = None
    for i in range(depth - 1):
        chain = Link(chain)
        if i == depth // 2:
            middle = chain
    fully_shard(leaf, mesh=mesh)
    fully_shard(middle, mesh=mesh)
    fully_shard(chain, mesh=mesh)
    assert get_fully_sharded_modules(chain) == [chain, middle, leaf]
    assert [n for n, _ in leaf.managed_named_parameters()] == ["weight", "bias"]
    assert list(chain.managed_named_parameters()) == [] and list(middle.managed_named_parameters()) == []
    assert spec(leaf.weight) == FSDP8
    assert getattr(leaf, "_is_fsdp_managed_module", False) is True


def test_fully_sharded_module_outputs_stay_batch_sharded(device, mesh):
    torch.manual_seed(0)
    model = shard_decoder(Decoder(use_scan=False), mesh)
    (_, _), (tx, _) = batch(device, mesh)
    h = model.embed(tx)
    out = model.layers[0](h)
    assert spec(out) == "{devices=[8,1,1]0,1,2,3,4,5,6,7}"
    odd = model.layers[1](h[:3])  # a leading dimension that does not divide is left alone
    assert spec(odd) in ("", "{replicated}")
    torch_xla.sync()
