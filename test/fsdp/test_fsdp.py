"""fully_shard / replicate on the 8-device SPMD mesh: training, ownership, traversal, mixed precision, errors.

Loading state dicts into fully sharded models is tested in test_fsdp_state_dict.py.
"""

from __future__ import annotations

import copy
import inspect

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
from torch_xla_ext.testing import models

from fsdp_helpers import seeded  # noqa: F401  (a fixture: pytest finds it by name)
from fsdp_helpers import (EXACT, FSDP8, LAYERS, TiedAcrossLayers, assert_bookkeeping, batch, loss_fn, shard_decoder,
                          spec, tiny_decoder, train_like_eager)


@pytest.mark.parametrize("use_scan", [True, False], ids=["scan_layers", "loop"])
def test_tiny_decoder_trains_like_unsharded_eager(device, mesh, use_scan):
    reference = tiny_decoder(use_scan=False)
    model = copy.deepcopy(reference)
    model.use_scan = use_scan
    shard_decoder(model, mesh)
    assert model.embed.weight is model.head.weight
    train_like_eager(model, reference, device, mesh)


def test_class_swap_keeps_module_identity_and_state_dict_keys(mesh):
    torch.manual_seed(0)
    reference = tiny_decoder()
    model = shard_decoder(copy.deepcopy(reference), mesh)
    assert isinstance(model, models.Decoder) and isinstance(model, FSDPModule)
    # Name-based tooling (_no_split_modules, accelerate's get_module_class_from_name) still finds it.
    assert type(model).__name__ == "Decoder" and type(model).__qualname__ == models.Decoder.__qualname__
    assert type(model) is not models.Decoder
    assert isinstance(model.layers[0], models.MLPBlock) and isinstance(model.layers[0], FSDPModule)
    assert list(model.state_dict()) == list(reference.state_dict())
    for (key, value), ref in zip(model.state_dict().items(), reference.state_dict().values()):
        assert value.device.type == "xla"
        torch.testing.assert_close(value.cpu(), ref, **EXACT, msg=key)  # the unsharded values


def test_a_fully_sharded_module_keeps_its_forward_signature_for_introspection(device, mesh):
    class Annotated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, hidden: torch.Tensor, scale: float = 2.0, *, mask: torch.Tensor | None = None,
                    ) -> torch.Tensor:
            """Project, then scale."""
            return self.proj(hidden) * scale

    plain = Annotated()
    model = fully_shard(copy.deepcopy(plain).to(device), mesh=mesh)
    assert inspect.signature(model.forward) == inspect.signature(plain.forward)
    assert inspect.signature(type(model).forward) == inspect.signature(Annotated.forward)
    assert list(inspect.signature(model.forward).parameters) == ["hidden", "scale", "mask"]
    assert type(model).forward.__doc__ == "Project, then scale."
    assert type(model).forward.__name__ == "forward"
    assert type(model).forward.__annotations__ == Annotated.forward.__annotations__
    # The wrapper still runs (and binds arguments as the original does).
    x = torch.randn(2, 8)
    out = model(x.to(device), scale=3.0)
    torch.testing.assert_close(out.cpu(), plain(x, scale=3.0), rtol=1e-5, atol=1e-5)


def test_each_parameter_is_managed_by_exactly_one_state(mesh):
    model = shard_decoder(tiny_decoder(), mesh)
    owners: dict[int, list[str]] = {}
    for m in get_fully_sharded_modules(model):
        for _, p in m.managed_named_parameters():
            owners.setdefault(id(p), []).append(type(m).__name__)
    assert set(owners) == {id(p) for p in model.parameters()}
    assert all(len(v) == 1 for v in owners.values())
    assert [n for n, _ in model.managed_named_parameters()] == ["embed.weight"]  # the root skips layer params
    assert [n for n, _ in model.layers[2].managed_named_parameters()] == [
        "norm.weight", "norm.bias", "up.weight", "up.bias", "down.weight", "down.bias"]



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


def test_replicated_parameter_warning_once_per_parameter_and_never_lost(mesh):
    for _ in range(20):  # freed parameters' ids are reused: every new parameter still warns
        with pytest.warns(UserWarning, match="stays replicated") as record:
            fully_shard(nn.Linear(5, 3), mesh=mesh)
        assert sorted(" ".join(str(w.message).split()[4:6]) for w in record) == ["bias (3,)", "weight (3,"]
    model = nn.Module()
    model.a, model.b = nn.Linear(5, 3), nn.Linear(5, 3)
    model.b.weight = model.a.weight
    with pytest.warns(UserWarning) as record:
        fully_shard(model.a, mesh=mesh)
    assert sorted(str(w.message).split()[4] for w in record) == ["bias", "weight"]
    with pytest.warns(UserWarning) as record:  # a.weight moves to the root, already placed: not again
        fully_shard(model, mesh=mesh)
    assert [str(w.message).split()[4] for w in record] == ["b.bias"]


def _step_hlo_opcodes(model, device, mesh) -> list[str]:
    (_, _), (tx, gx) = batch(device, mesh)
    loss = loss_fn(model, tx, gx)
    loss.backward()
    ctx = txe.LoweringContext("fsdp_step")
    ctx.build([loss] + [p.grad for p in model.parameters()])
    ops = [inst.opcode for comp in ctx.module.computations for inst in comp.instructions]
    torch_xla.sync()
    return ops


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_in_scan_layers_regathers_behind_an_optimization_barrier(device, mesh, reshard):
    # scan's backward loop recomputes each marked gather from the sharded layer
    # parameter, behind a barrier so XLA cannot reuse the forward loop's value.
    model = shard_decoder(tiny_decoder(use_scan=True), mesh, reshard_after_forward=reshard)
    barriers = _step_hlo_opcodes(model, device, mesh).count("opt-barrier")
    if reshard:
        assert barriers > 0
    else:
        assert barriers == 0


def test_reshard_after_forward_in_scan_does_not_stack_gathered_weights(device, mesh):
    """The forward loop of scan_layers stacks per-layer activations but not the gathered weights."""
    def loop_state_elements(reshard: bool) -> int:
        torch.manual_seed(0)
        model = shard_decoder(tiny_decoder(use_scan=True), mesh, reshard_after_forward=reshard)
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


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "keep"])
@pytest.mark.parametrize("reduce_dtype", [torch.float32, None], ids=["reduce_f32", "reduce_in_compute_dtype"])
def test_mixed_precision(device, mesh, reduce_dtype, reshard):
    model = shard_decoder(tiny_decoder(use_scan=False), mesh, reshard_after_forward=reshard,
                          mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype,
                                                         output_dtype=torch.float32))
    (_, _), (tx, gx) = batch(device, mesh)
    logits = model(tx)
    assert logits.dtype == torch.float32  # output_dtype
    loss = loss_fn(model, tx, gx)
    loss.backward()
    ctx = txe.LoweringContext("mixed_precision")
    ctx.build([loss] + [p.grad for p in model.parameters()])
    dots, gathers, scatters = [], 0, []
    for comp in ctx.module.computations:
        for inst in comp.instructions:
            if inst.opcode == "dot":
                dots.append(inst.shape.element_type)
            elif inst.opcode == "custom-call" and inst.custom_call_target == "Sharding" and inst.sharding is not None:
                if inst.sharding.is_replicated:
                    gathers += inst.shape.element_type == "bf16"
                elif inst.shape.dimensions in {tuple(p.shape) for p in model.parameters()}:
                    scatters.append(inst.shape.element_type)
    torch_xla.sync()
    n_params = len(list(model.parameters()))
    assert dots.count("bf16") >= 3 * LAYERS  # param_dtype: the blocks compute in bf16
    if reshard:  # the sharded bf16 casts go on; the partitioner gathers them where they are used
        assert gathers == 0
    else:  # each parameter is gathered after its cast to bf16
        assert gathers >= n_params
    if reduce_dtype is torch.float32:  # gradients are reduce-scattered in f32
        assert "bf16" not in scatters and scatters.count("f32") >= n_params
    else:  # ... or in the compute dtype
        assert scatters.count("bf16") >= n_params
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
    model = shard_decoder(tiny_decoder(use_scan=False), mesh)
    (_, _), (tx, _) = batch(device, mesh)
    h = model.embed(tx)
    out = model.layers[0](h)
    assert spec(out) == "{devices=[8,1,1]0,1,2,3,4,5,6,7}"
    odd = model.layers[1](h[:3])  # a leading dimension that does not divide is left alone
    assert spec(odd) in ("", "{replicated}")
    torch_xla.sync()


def test_each_fully_shard_call_walks_the_module_tree_once(mesh, monkeypatch):
    """One tree per call: the enclosing top's, reused for ownership, LCA and dynamo marks
    (plus the module's own when another fully sharded module encloses it)."""
    from torch_xla_ext.distributed import _traversal

    builds = []
    real = _traversal.module_tree
    monkeypatch.setattr(_traversal, "module_tree", lambda *a, **k: builds.append(a[0]) or real(*a, **k))

    def walks(m: nn.Module) -> int:
        builds.clear()
        fully_shard(m, mesh=mesh)
        return len(builds)

    model = tiny_decoder(layers=8)
    assert [walks(layer) for layer in model.layers] + [walks(model)] == [1] * 9  # bottom-up
    top_down = tiny_decoder(layers=8)
    assert walks(top_down) == 1
    assert [walks(layer) for layer in top_down.layers] == [2] * 8  # the layer's tree and the root's
    assert_bookkeeping(model)
    assert_bookkeeping(top_down)


def test_no_registry_grows_with_modules_created_and_dropped(mesh):
    """States live in weak, identity-keyed maps: sharding and dropping modules leaves nothing behind."""
    import gc
    import weakref

    from torch_xla_ext import _contract
    from torch_xla_ext.distributed import _registry
    from torch_xla_ext.distributed.fully_shard import _fsdp_classes

    def shard_and_drop() -> weakref.ref:
        model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 8))
        replicate(model[1])
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert fully_shard.state(model) is not None and replicate.state(model[1]) is not None
        assert fully_shard.state(model[1]) is None and replicate.state(model) is None
        return weakref.ref(model)

    shard_and_drop()  # the FSDP classes of Linear and Sequential: one per class, made once
    gc.collect()
    before = (_registry.registry_size(), _contract.applied_count(), len(_fsdp_classes))
    refs = [shard_and_drop() for _ in range(100)]
    gc.collect()
    assert all(r() is None for r in refs)
    assert (_registry.registry_size(), _contract.applied_count(), len(_fsdp_classes)) == before


def test_deepcopy_of_a_fully_sharded_model_is_fully_sharded(device, mesh):
    model = shard_decoder(tiny_decoder(use_scan=False), mesh)
    copied = copy.deepcopy(model)
    assert type(copied) is type(model) and copied.embed.weight is copied.head.weight
    assert get_fully_sharded_modules(copied) == [copied] + list(copied.layers)
    assert_bookkeeping(copied)
    (_, _), (tx, _) = batch(device, mesh)
    torch.testing.assert_close(copied(tx).cpu(), model(tx).cpu(), **EXACT)
