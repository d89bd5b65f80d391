"""fully_shard and load_state_dict: sharding, ties and bookkeeping survive loading, copied or assigned."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch_xla
import torch_xla.distributed.spmd as xs

from torch_xla_ext.distributed import fully_shard, get_fully_sharded_modules, replicate
from torch_xla_ext.testing import measure_transfers, models

from fsdp_helpers import seeded  # noqa: F401  (a fixture: pytest finds it by name)
from fsdp_helpers import (EXACT, FSDP8, FSDP8_1D, TiedAcrossLayers, assert_bookkeeping, shard_decoder, spec,
                          tiny_decoder, train_like_eager)


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


def test_fully_shard_and_load_never_import_torchax(mesh, monkeypatch):
    """torch_xla's ``xs.mark_sharding`` imports torchax where it is installed, which renames PyTorch's
    ``privateuse1`` backend for the whole process (DCP's default writer then fails). Placing, training and
    loading a fully sharded model annotate without that detour, whether or not torchax is installed."""
    from torch_xla.distributed.spmd import xla_sharding

    calls = []
    original = xla_sharding.maybe_get_torchax
    monkeypatch.setattr(xla_sharding, "maybe_get_torchax", lambda: calls.append(1) or original())
    trained, saved = trained_state(mesh)  # fully_shard uploads and shards host parameters
    loss = trained(torch.zeros(8, 6, dtype=torch.long, device=torch_xla.device())).sum()
    loss.backward()
    torch_xla.sync()
    torch.manual_seed(3)
    target = shard_decoder(tiny_decoder(use_scan=False), mesh)
    target.load_state_dict(saved)  # host values uploaded and sharded like the parameters they replace
    torch_xla.sync()
    assert calls == []
    assert spec(target.layers[0].up.weight) == FSDP8
    for key, value in saved.items():
        torch.testing.assert_close(target.state_dict()[key].cpu(), value, **EXACT, msg=key)
