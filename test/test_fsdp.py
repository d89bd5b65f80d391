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
from torch_xla_ext._xla import xlac
from torch_xla_ext.testing import measure_transfers, models
from torch_xla_ext.testing.tolerances import tolerance

FSDP8 = "{devices=[8,1]0,1,2,3,4,5,6,7}"
FSDP8_1D = "{devices=[8]0,1,2,3,4,5,6,7}"
EXACT = {"atol": 0.0, "rtol": 0.0}  # values copied or moved, never computed

# The tiny decoder: vocabulary, width, layers; a batch of 8 x 6 tokens.
VOCAB, WIDTH, LAYERS, TOKENS = 32, 16, 4, 48
STEPS = 3
# Longest accumulation feeding one trained value: per step, each block's
# LayerNorm (WIDTH), up (WIDTH) and down (2 * WIDTH) reductions, the head and
# the softmax (VOCAB), the mean over tokens (TOKENS), for every step.
TRAIN_TOL = tolerance(torch.float32, STEPS * (LAYERS * 4 * WIDTH + VOCAB + TOKENS))


@pytest.fixture(autouse=True)
def seeded():
    """Every random draw of a test (module init, randn, XLA RNG) is seeded."""
    torch.manual_seed(0)
    torch_xla.manual_seed(0)


def spec(t: torch.Tensor) -> str:
    return xlac()._get_xla_sharding_spec(t)


def tiny_decoder(vocab: int = VOCAB, d: int = WIDTH, layers: int = LAYERS, use_scan: bool = True) -> models.Decoder:
    """The tiny decoder: tied embedding and LM head, ReLU MLP blocks of hidden size 2 * d, no final norm."""
    return models.Decoder(vocab, d, layers, lambda: models.MLPBlock(d, 2 * d, torch.relu), use_scan=use_scan)


@pytest.fixture
def mesh(num_devices):
    return xs.Mesh(np.arange(num_devices), (num_devices,), ("fsdp",))


def shard_decoder(model: models.Decoder, mesh, **kw) -> models.Decoder:
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def batch(device, mesh, vocab=VOCAB):
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


def train_like_eager(model: models.Decoder, reference: models.Decoder, device, mesh) -> None:
    """STEPS of SGD on the sharded model and on an unsharded eager CPU reference; they must agree.

    Each sharded step moves nothing to the host, and every parameter and
    gradient keeps fully_shard's sharding.
    """
    (tokens, targets), (tx, gx) = batch(device, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, foreach=False)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    for _ in range(STEPS):
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
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), **TRAIN_TOL)
        for name, p in model.named_parameters():
            expected = FSDP8 if p.dim() == 2 else FSDP8_1D
            assert spec(p) == expected, name
            assert spec(p.grad) == spec(p), name
    for (name, p), (_, r) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p.cpu(), r.detach(), **TRAIN_TOL, msg=name)


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
    assert type(model).__name__ == "FSDPDecoder"
    assert isinstance(model.layers[0], models.MLPBlock) and isinstance(model.layers[0], FSDPModule)
    assert list(model.state_dict()) == list(reference.state_dict())
    for (key, value), ref in zip(model.state_dict().items(), reference.state_dict().values()):
        assert value.device.type == "xla"
        torch.testing.assert_close(value.cpu(), ref, **EXACT, msg=key)  # the unsharded values


def trained_state(mesh) -> tuple[models.Decoder, dict[str, torch.Tensor]]:
    """A sharded decoder whose parameters were updated on the device, and its state on the host."""
    torch.manual_seed(2)
    trained = shard_decoder(tiny_decoder(use_scan=False), mesh)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    torch_xla.sync()
    return trained, {k: v.cpu() for k, v in trained.state_dict().items()}


def state_dict_from(source: str, trained: models.Decoder, saved: dict, device, mesh) -> dict[str, torch.Tensor]:
    """The same values held as: host tensors; the trained model's own XLA state dict (sharded like
    the target); XLA tensors left unsharded; XLA tensors sharded on another dimension where one divides.
    Tied keys share one tensor, as in a state_dict() of a tied model."""
    if source == "cpu":
        return dict(saved)
    if source == "xla":
        return trained.state_dict()
    out = {}
    for key, value in saved.items():
        t = value.to(device)
        if source == "xla_other" and t.dim() == 2 and t.shape[1] % 8 == 0:
            xs.mark_sharding(t, mesh, (None, "fsdp"))
        out[key] = t
    out["head.weight"] = out["embed.weight"]
    torch_xla.sync()
    return out


def assert_bookkeeping(model: nn.Module) -> None:
    """Every current parameter is managed by exactly one state, under the name that reaches it."""
    managed = []
    for m in get_fully_sharded_modules(model):
        for fqn, p in m.managed_named_parameters():
            assert m.get_parameter(fqn) is p, fqn
            managed.append(p)
    assert sorted(map(id, managed)) == sorted(map(id, model.parameters()))


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
@pytest.mark.parametrize("source", ["cpu", "xla", "xla_replicated", "xla_other"])
def test_load_state_dict_keeps_sharding_ties_and_bookkeeping(device, mesh, source, assign):
    trained, saved = trained_state(mesh)
    state_dict = state_dict_from(source, trained, saved, device, mesh)
    torch.manual_seed(1)
    fresh = shard_decoder(tiny_decoder(use_scan=False), mesh)
    torch_xla.sync()
    before = dict(fresh.named_parameters())
    shardings = {n: spec(p) for n, p in before.items()}
    with measure_transfers() as m:
        fresh.load_state_dict(state_dict, assign=assign)
        torch_xla.sync()
    assert m.d2h_transfers == 0 and m.d2h_bytes == 0 and m.replicate_sharded_data == 0, m.report()
    if source == "cpu":  # each value uploaded once, already sharded (not replicated to all 8 devices)
        assert m.h2d_bytes == sum(v.numel() * v.element_size() for k, v in saved.items() if k != "head.weight"), \
            m.report()
    assert {n: spec(p) for n, p in fresh.named_parameters()} == shardings
    assert fresh.embed.weight is fresh.head.weight
    after = dict(fresh.named_parameters())
    if assign:  # the state dict's tensors became the parameters
        assert all(after[n] is not before[n] for n in before)
    else:  # copied in place: the same parameter objects
        assert all(after[n] is before[n] for n in before)
    assert_bookkeeping(fresh)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value.cpu(), saved[key], **EXACT, msg=key)


@pytest.mark.parametrize("source", ["cpu", "xla"])
def test_training_after_load_with_assign_updates_the_loaded_parameters(device, mesh, source):
    trained, saved = trained_state(mesh)
    state_dict = state_dict_from(source, trained, saved, device, mesh)
    torch.manual_seed(1)
    model = shard_decoder(tiny_decoder(use_scan=False), mesh)
    model.load_state_dict(state_dict, assign=True)
    reference = tiny_decoder(use_scan=False)
    reference.load_state_dict(saved)
    train_like_eager(model, reference, device, mesh)


def test_load_state_dict_assign_refuses_what_it_cannot_keep_sharded_before_changing_anything(device, mesh):
    _, saved = trained_state(mesh)
    torch.manual_seed(1)
    fresh = shard_decoder(tiny_decoder(use_scan=False), mesh)
    torch_xla.sync()
    params = dict(fresh.named_parameters())
    values = {n: p.cpu() for n, p in params.items()}
    shardings = {n: spec(p) for n, p in params.items()}
    managed = [list(m.managed_named_parameters()) for m in get_fully_sharded_modules(fresh)]

    def assert_unchanged() -> None:
        now = dict(fresh.named_parameters())
        assert list(now) == list(params) and all(now[n] is params[n] for n in params)
        assert {n: spec(p) for n, p in now.items()} == shardings
        for n, p in now.items():
            torch.testing.assert_close(p.cpu(), values[n], **EXACT, msg=n)
        assert [list(m.managed_named_parameters()) for m in get_fully_sharded_modules(fresh)] == managed

    last = list(saved)[-1]  # every other key would be assigned before torch reached it
    on_meta = {**saved, last: torch.empty(saved[last].shape, device="meta")}
    with pytest.raises(ValueError, match=rf"cannot assign '{last}': the tensor is on meta.*assign=False"):
        fresh.load_state_dict(on_meta, assign=True)
    assert_unchanged()

    untied = {**saved, "head.weight": saved["embed.weight"] + 1}
    with pytest.raises(ValueError, match=r"'embed.weight' and 'head.weight' are one tied parameter.*same tensor "
                                         r"under both keys.*assign=False"):
        fresh.load_state_dict(untied, assign=True)
    assert_unchanged()

    separate = {**saved, "embed.weight": saved["embed.weight"].to(device), "head.weight": saved["embed.weight"].to(device)}
    with pytest.raises(ValueError, match="one tied parameter"):
        fresh.load_state_dict(separate, assign=True)
    assert_unchanged()

    fresh.load_state_dict({**saved, "head.weight": saved["embed.weight"].clone()}, assign=True)  # equal values: fine
    assert fresh.embed.weight is fresh.head.weight
    assert_bookkeeping(fresh)


def test_load_state_dict_with_assign_into_a_submodule_keeps_ties_and_sharding(device, mesh):
    model = TiedAcrossLayers()
    for m in list(model.layers) + [model]:
        fully_shard(m, mesh=mesh)
    linear = model.layers[0][0]  # a plain nn.Linear inside the fully sharded layers[0]
    old = linear.weight
    g = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(8, 8, generator=g), torch.randn(8, generator=g)
    with measure_transfers() as m:
        linear.load_state_dict({"weight": weight, "bias": bias}, assign=True)
        torch_xla.sync()
    assert not m.device_to_host, m.report()
    new = linear.weight
    assert new is not old and model.layers[3][0].weight is new  # the tie survives
    assert spec(new) == FSDP8 and spec(linear.bias) == FSDP8_1D
    assert [p for _, p in model.managed_named_parameters()] == [new]
    assert [p for _, p in model.layers[0].managed_named_parameters()] == [linear.bias]
    assert_bookkeeping(model)
    torch.testing.assert_close(new.cpu(), weight, **EXACT)
    torch.testing.assert_close(linear.bias.cpu(), bias, **EXACT)
    # Gradients reach the loaded parameters and are sharded like them.
    h = torch.randn(16, 8, generator=g).to(device)
    for layer in model.layers:
        h = layer(h)
    h.sum().backward()
    torch_xla.sync()
    assert spec(new.grad) == FSDP8 and spec(linear.bias.grad) == FSDP8_1D


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_load_state_dict_keeps_a_replicated_subtree_on_the_device(mesh, assign):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    replicate(model[1])
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(4)
    saved = {k: torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"cannot assign '1.bias': the tensor is on meta.*replicate"):
        model.load_state_dict({**saved, "1.bias": torch.empty(8, device="meta")}, assign=True)
    assert all(p.device.type == "xla" for p in model.parameters())
    model.load_state_dict(saved, assign=assign)
    assert all(p.device.type == "xla" for p in model.parameters())
    assert spec(model[0].weight) == FSDP8 and spec(model[1].weight) in ("", "{replicated}")
    assert [p for _, p in model.managed_named_parameters()] == [model[0].weight, model[0].bias]
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value.cpu(), saved[key], **EXACT, msg=key)


def test_load_state_dict_with_swapping_parameters_is_refused(mesh):
    model = fully_shard(nn.Linear(8, 16), mesh=mesh)
    saved = {k: v.cpu() + 1 for k, v in model.state_dict().items()}
    weight = model.weight
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with pytest.raises(RuntimeError, match=r"set_swap_module_params_on_conversion\(True\).*Set it to False"):
            model.load_state_dict(saved)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    assert model.weight is weight and spec(weight) == FSDP8
    model.load_state_dict(saved)
    torch.testing.assert_close(model.weight.cpu(), saved["weight"], **EXACT)


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


@pytest.mark.parametrize("use_scan", [True, False], ids=["scan_layers", "loop"])
@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_puts_an_optimization_barrier_before_the_backward_gather(
        device, mesh, reshard, use_scan):
    model = shard_decoder(tiny_decoder(use_scan=use_scan), mesh, reshard_after_forward=reshard)
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


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None], ids=["reduce_f32", "reduce_in_compute_dtype"])
def test_mixed_precision(device, mesh, reduce_dtype):
    model = shard_decoder(tiny_decoder(use_scan=False), mesh, mp_policy=MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, output_dtype=torch.float32))
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
    assert gathers >= n_params  # each parameter is gathered after its cast to bf16
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

    from torch_xla_ext.distributed import _param, _state
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
    before = (_state.registry_size(), _param.applied_count(), len(_fsdp_classes))
    refs = [shard_and_drop() for _ in range(100)]
    gc.collect()
    assert all(r() is None for r in refs)
    assert (_state.registry_size(), _param.applied_count(), len(_fsdp_classes)) == before


def test_deepcopy_of_a_fully_sharded_model_is_fully_sharded(device, mesh):
    model = shard_decoder(tiny_decoder(use_scan=False), mesh)
    copied = copy.deepcopy(model)
    assert type(copied) is type(model) and copied.embed.weight is copied.head.weight
    assert get_fully_sharded_modules(copied) == [copied] + list(copied.layers)
    assert_bookkeeping(copied)
    (_, _), (tx, _) = batch(device, mesh)
    torch.testing.assert_close(copied(tx).cpu(), model(tx).cpu(), **EXACT)
