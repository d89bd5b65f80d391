"""``hf.prepare``: the model's own outputs whatever mask the caller gives, nothing read on the host, clear refusals."""

from __future__ import annotations

import copy

import pytest
import torch
import torch_xla

from torch_xla_ext import ScanInputError, remat
from torch_xla_ext.distributed import FSDPModule, fully_shard
from torch_xla_ext.hf import ScannedLayers, prepare, prepared_options
from torch_xla_ext.scan import scan_cache_info
from torch_xla_ext.testing import measure_transfers

from hf_tiny import VOCAB, tiny

# float32 logits of a 3-layer model: the same math, another reduction order on 8 devices.
TOL = dict(rtol=1e-5, atol=1e-5)


def _packed_position_ids(batch: int, lengths: tuple[int, ...]) -> torch.Tensor:
    """Sequences of ``lengths`` packed into each row: position ids restart at every sequence."""
    return torch.cat([torch.arange(n) for n in lengths]).expand(batch, -1).clone()


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "loop"])
@pytest.mark.parametrize("kind, given", [("llama", "2d"), ("llama", "none"), ("llama", "packed"), ("gpt2", "2d")])
def test_prepared_model_gives_the_models_own_logits_and_reads_nothing(mesh, kind, given, scan):
    cpu = tiny(kind).eval()
    model = prepare(copy.deepcopy(cpu), mesh, scan=scan).eval()
    device = torch_xla.device()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, VOCAB, (8, 12), generator=g)
    kwargs: dict[str, torch.Tensor] = {}
    if given == "2d":
        mask = torch.ones(8, 12, dtype=torch.long)
        for row in range(8):
            mask[row, : row % 5] = 0  # left padding
        kwargs["attention_mask"] = mask
    elif given == "packed":  # no mask; Hugging Face finds the packed sequences from the position ids
        kwargs["position_ids"] = _packed_position_ids(8, (5, 4, 3))
    with torch.no_grad():
        expected = cpu(input_ids=ids, use_cache=False, **kwargs).logits
        on_device = {k: v.to(device) for k, v in kwargs.items()}
        ids_d = ids.to(device)
        torch_xla.sync()
        with measure_transfers() as moved:
            logits = model(input_ids=ids_d, **on_device).logits
            torch_xla.sync()
    assert not moved.device_to_host, moved.report()
    torch.testing.assert_close(logits.cpu(), expected, **TOL)
    if given == "packed":  # the packing mattered: the unpacked causal mask gives other logits
        unpacked = cpu(input_ids=ids, use_cache=False).logits
        assert not torch.allclose(unpacked, expected, **TOL)


def test_prepare_is_idempotent_and_refuses_other_arguments(mesh):
    model = prepare(tiny("llama"), mesh)
    hooks = len(model.model._forward_pre_hooks)
    assert prepare(model, mesh) is model
    assert len(model.model._forward_pre_hooks) == hooks
    assert prepared_options(model).scan is True and model.config.use_cache is False
    with pytest.raises(ValueError, match="prepared with"):
        prepare(model, mesh, remat=remat.nothing_saveable)
    with pytest.raises(ValueError, match="prepared with"):
        prepare(model, mesh, scan=False)


def test_a_deep_copy_of_a_prepared_model_builds_its_own_mask(mesh):
    cpu = tiny("llama").eval()
    original = prepare(copy.deepcopy(cpu), mesh).eval()
    model = copy.deepcopy(original)
    del original
    ids = torch.randint(0, VOCAB, (8, 12))
    mask = torch.ones(8, 12, dtype=torch.long)
    mask[:, :3] = 0
    with torch.no_grad():
        expected = cpu(input_ids=ids, attention_mask=mask, use_cache=False).logits
        device = torch_xla.device()
        ids_d, mask_d = ids.to(device), mask.to(device)
        torch_xla.sync()
        scans = scan_cache_info()
        with measure_transfers() as moved:
            logits = model(input_ids=ids_d, attention_mask=mask_d).logits
            torch_xla.sync()
    after = scan_cache_info()
    assert (after.traces + after.hits) - (scans.traces + scans.hits) == 1  # the copy's stack scanned
    assert not moved.device_to_host, moved.report()
    torch.testing.assert_close(logits.cpu(), expected, **TOL)
    model.model.layers.unscan()  # the copy's own hooks go; a forward now loops over the layers
    assert [type(h).__name__ for h in model.model._forward_pre_hooks.values()] == ["_MaskOnDevice"]
    assert not model.model._forward_hooks
    with torch.no_grad():
        looped = model(input_ids=ids_d, attention_mask=mask_d).logits
    torch.testing.assert_close(looped.cpu(), expected, **TOL)


def test_prepare_keeps_class_names_for_name_based_tooling(mesh):
    from accelerate.utils.dataclasses import get_module_class_from_name

    model = prepare(tiny("llama"), mesh)
    layer = model.model.layers[0]
    assert isinstance(layer, FSDPModule) and isinstance(model.model.layers, ScannedLayers)
    assert type(layer).__name__ == "LlamaDecoderLayer" and type(model).__name__ == "LlamaForCausalLM"
    assert "LlamaDecoderLayer" in model._no_split_modules
    assert get_module_class_from_name(model, "LlamaDecoderLayer") is type(layer)


def _untouched(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    assert prepared_options(model) is None and not isinstance(model, FSDPModule)
    assert type(model.model.layers) is torch.nn.ModuleList
    assert all(p.device.type == "cpu" for p in model.parameters())
    for (key, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value, expected), key


def test_prepare_refuses_before_changing_anything(mesh):
    reference = tiny("llama")
    model = copy.deepcopy(reference)
    with pytest.raises(ValueError, match="scan=True"):
        prepare(model, mesh, scan=False, remat=remat.nothing_saveable)
    with pytest.raises(TypeError, match="scan must be a bool"):
        prepare(model, mesh, scan="yes")
    with pytest.raises(TypeError, match="mp_policy"):
        prepare(model, mesh, mp_policy=torch.bfloat16)
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="'sdpa' and 'eager'"):
        prepare(model, mesh)
    model.config._attn_implementation = "sdpa"
    _untouched(model, reference)

    partly = copy.deepcopy(reference)
    fully_shard(partly.model.layers[0], mesh=mesh)
    with pytest.raises(ValueError, match="already fully sharded"):
        prepare(partly, mesh)
    assert not isinstance(partly, FSDPModule) and type(partly.model.layers) is torch.nn.ModuleList

    with pytest.raises(TypeError, match="nn.Module"):
        prepare(object(), mesh)


def test_prepared_generation_with_a_cache_is_refused_under_scan(mesh):
    model = prepare(tiny("llama"), mesh).eval()
    ids = torch.randint(0, VOCAB, (8, 6)).to(torch_xla.device())
    with pytest.raises(ValueError, match="KV cache"):
        model(input_ids=ids, use_cache=True)


def test_prepared_training_step_matches_cpu_with_remat(mesh):
    cpu = tiny("llama")
    model = prepare(copy.deepcopy(cpu), mesh, remat=remat.nothing_saveable)
    ids = torch.randint(0, VOCAB, (8, 12))
    loss = cpu(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    ids_d = ids.to(torch_xla.device())
    xla_loss = model(input_ids=ids_d, labels=ids_d).loss
    xla_loss.backward()
    torch_xla.sync()
    torch.testing.assert_close(xla_loss.cpu(), loss.detach(), **TOL)
    cpu_grads = dict(cpu.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), cpu_grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_layer_put_in_after_prepare_is_refused_until_fully_sharded_then_trains_like_cpu(mesh):
    cpu = tiny("llama")
    model = prepare(copy.deepcopy(cpu), mesh)
    torch.manual_seed(7)
    fresh = type(cpu.model.layers[1])(cpu.config, 1)
    cpu.model.layers[1] = fresh
    model.model.layers[1] = copy.deepcopy(fresh).to(torch_xla.device())
    ids = torch.randint(0, VOCAB, (8, 12), generator=torch.Generator().manual_seed(3))
    ids_d = ids.to(torch_xla.device())
    # Both classes are named LlamaDecoderLayer (fully_shard keeps the name): the message must say which is which.
    with pytest.raises(ScanInputError, match=r"two classes of one name .* layers\[0\]'s class is a subclass of "
                                             r"layers\[1\]'s .* must be fully sharded like the others"):
        model(input_ids=ids_d, labels=ids_d)
    fully_shard(model.model.layers[1], mesh=mesh)
    xla_loss = model(input_ids=ids_d, labels=ids_d).loss
    xla_loss.backward()
    torch_xla.sync()
    loss = cpu(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    torch.testing.assert_close(xla_loss.cpu(), loss.detach(), **TOL)
    cpu_grads = dict(cpu.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), cpu_grads[name].grad, rtol=1e-4, atol=1e-5, msg=name)
