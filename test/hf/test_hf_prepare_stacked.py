"""``prepare(..., stacked=True)``: the decoder layers stored stacked train as the CPU model does, or are refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch_xla

from torch_xla_ext import remat
from torch_xla_ext.distributed import FSDPModule
from torch_xla_ext.hf import ScannedLayers, prepare, prepared_options
from torch_xla_ext.testing import measure_transfers

from hf_tiny import VOCAB, tiny

LAYERS = 3


def _step(model, optimizer, ids):
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_stacked_training_matches_the_cpu_model_and_reads_nothing(mesh, kind):
    cpu = tiny(kind)
    model = prepare(copy.deepcopy(cpu), mesh, remat=remat.nothing_saveable, stacked=True)
    stack = model.transformer.h if kind == "gpt2" else model.model.layers
    assert isinstance(stack, ScannedLayers) and isinstance(stack, torch.nn.ModuleList)
    assert not any(p is not None for layer in stack for m in layer.modules() for p in m._parameters.values())
    stacked = {name: p for name, p in stack.named_parameters(recurse=False)}
    assert stacked and all(p.shape[0] == LAYERS for p in stacked.values())
    assert list(model.state_dict()) == list(cpu.state_dict())  # the checkpoint keys stay per layer

    # SGD: its update is linear in the gradient, so the weights compare within float32 rounding (Adam divides
    # each gradient by its own magnitude, and turns an element's rounding noise near zero into a full step).
    cpu_opt = torch.optim.SGD(cpu.parameters(), lr=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, VOCAB, (8, 12), generator=g) for _ in range(3)]
    for n, ids in enumerate(batches):
        expected = _step(cpu, cpu_opt, ids)
        ids_d = ids.to(torch_xla.device())
        torch_xla.sync()
        with measure_transfers() as moved:
            loss = _step(model, opt, ids_d)
            torch_xla.sync()
        if n:  # the steady steps: nothing read on the host, nothing gathered
            assert not moved.device_to_host, moved.report()
        torch.testing.assert_close(loss.cpu(), expected.detach(), rtol=1e-5, atol=1e-5)
    for (key, value), want in zip(model.state_dict().items(), cpu.state_dict().values()):
        torch.testing.assert_close(value.cpu(), want, rtol=1e-4, atol=1e-5, msg=key)


def test_stacked_unscan_keeps_the_storage_and_the_logits(mesh):
    cpu = tiny("llama").eval()
    model = prepare(copy.deepcopy(cpu), mesh, stacked=True).eval()
    ids = torch.randint(0, VOCAB, (8, 12))
    with torch.no_grad():
        expected = cpu(input_ids=ids, use_cache=False).logits
        scanned = model(input_ids=ids.to(torch_xla.device())).logits.cpu()
        stack = model.model.layers.unscan()
        assert not isinstance(stack, ScannedLayers) and stack.get_parameter("mlp/up_proj/weight").shape[0] == LAYERS
        looped = model(input_ids=ids.to(torch_xla.device()), use_cache=False).logits.cpu()
    torch.testing.assert_close(scanned, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(looped, expected, rtol=1e-5, atol=1e-5)


def test_stacked_is_refused_before_anything_changes(mesh):
    reference = tiny("llama")
    model = copy.deepcopy(reference)
    with pytest.raises(ValueError, match="pass scan=True"):
        prepare(model, mesh, scan=False, stacked=True)
    with pytest.raises(TypeError, match="stacked must be a bool"):
        prepare(model, mesh, stacked=1)
    # What stack_layers cannot keep per layer: one layer frozen apart from the others (the layers go back to
    # the CPU they came from) ...
    model.model.layers[1].mlp.up_proj.weight.requires_grad_(False)
    with pytest.raises(ValueError, match="cannot store model.layers stacked: .*requires_grad"):
        prepare(model, mesh, stacked=True)
    _untouched(model, reference, "cpu")
    # ... or a hook on one layer's parameter (on the device: moving a module there makes new parameters,
    # which have no hooks, as in plain PyTorch).
    model = copy.deepcopy(reference).to(torch_xla.device())
    model.model.layers[1].mlp.up_proj.weight.register_hook(lambda g: g)
    with pytest.raises(ValueError, match="cannot store model.layers stacked: .*gradient hook"):
        prepare(model, mesh, stacked=True)
    _untouched(model, reference, "xla")
    assert model.model.layers[1].mlp.up_proj.weight._backward_hooks


def _untouched(model, reference, device: str) -> None:
    assert prepared_options(model) is None and not isinstance(model, FSDPModule)
    assert type(model.model.layers) is torch.nn.ModuleList
    assert all(p.device.type == device for p in model.parameters())
    for (key, value), expected in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(value.cpu(), expected), key


def test_stacked_is_part_of_what_prepare_was_asked(mesh):
    model = prepare(tiny("llama"), mesh, stacked=True)
    assert prepare(model, mesh, stacked=True) is model and prepared_options(model).stacked
    with pytest.raises(ValueError, match="cannot be prepared again"):
        prepare(model, mesh)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_spmd_trainer_trains_a_stacked_model_as_trainer_on_the_cpu(tmp_path, mesh):
    from hf_tiny import arguments, token_rows
    from hf_trainer_helpers import StepCounts, cpu_reference, losses
    from torch_xla_ext.hf import SPMDTrainer

    train = token_rows(32, 16)
    steps = StepCounts()
    # Trainer's AdamW groups leave norms out of weight decay by name: the stacked norms' names keep "layernorm".
    trainer = SPMDTrainer(model=prepare(tiny("llama"), mesh, stacked=True),
                          args=arguments(tmp_path / "xla", max_steps=3, logging_steps=1, save_strategy="no",
                                         weight_decay=0.1),
                          train_dataset=train, callbacks=[steps])
    trainer.train()
    reference = cpu_reference("llama", tmp_path / "cpu", train, max_steps=3, logging_steps=1, save_strategy="no",
                              weight_decay=0.1)
    assert losses(trainer) == pytest.approx(reference.losses, rel=1e-5)
    assert [(m.d2h, m.gathers) for m in steps.inside[1:]] == [(0, 0)] * 2
