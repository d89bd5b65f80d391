"""``prepare`` reduces the output head's weight gradient to its shard before the decoder's backward (hf/_head_grad)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch_xla

from torch_xla_ext.distributed import MixedPrecisionPolicy
from torch_xla_ext.hf import prepare

from hf_tiny import VOCAB, tiny

# float32, a 3-layer model of width 64: the same math in another reduction order on 8 devices.
TOL = dict(rtol=1e-4, atol=1e-5)
BATCH, SEQ, WIDTH = 8, 12, 64


def _barrier_types(tensors: list[torch.Tensor]) -> list[str]:
    """The operand types of every optimization barrier in the pending graph of ``tensors``."""
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(tensors)
    return re.findall(r"= \(([^)]*)\) opt-barrier\(", hlo)


def _tied_barriers(model: torch.nn.Module, ids: torch.Tensor) -> list[str]:
    model(input_ids=ids, labels=ids).loss.backward()
    head = model.get_output_embeddings().weight.grad
    pair = re.compile(rf"f32\[{VOCAB},{WIDTH}\]\{{[0-9,]+\}}, f32\[{BATCH},{SEQ},{WIDTH}\]\{{[0-9,]+\}}")
    found = [t for t in _barrier_types([head, *[p.grad for p in model.parameters() if p.grad is not None]])
             if pair.fullmatch(t)]
    torch_xla.sync()
    return found


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "loop"])
def test_the_decoder_backward_waits_for_the_head_gradient_and_the_numbers_are_the_models(mesh, scan):
    cpu = tiny("llama")
    model = prepare(copy.deepcopy(cpu), mesh, scan=scan)
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    ids_d = ids.to(torch_xla.device())
    # One barrier holds the head weight's gradient and the gradient of the head's input.
    assert len(_tied_barriers(model, ids_d)) == 1
    cpu(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids_d, labels=ids_d).loss.backward()
    torch_xla.sync()
    reference = dict(cpu.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), reference[name].grad, **TOL, msg=name)


def test_a_head_tied_to_the_embedding_is_left_alone(mesh):
    model = prepare(tiny("gpt2"), mesh)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    ids = torch.randint(0, VOCAB, (BATCH, SEQ)).to(torch_xla.device())
    assert _tied_barriers(model, ids) == []


def test_a_frozen_head_is_left_alone_and_trains_the_rest(mesh):
    cpu = tiny("llama")
    cpu.get_output_embeddings().weight.requires_grad_(False)
    model = prepare(copy.deepcopy(cpu), mesh)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    cpu(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    ids_d = ids.to(torch_xla.device())
    model(input_ids=ids_d, labels=ids_d).loss.backward()
    torch_xla.sync()
    assert model.get_output_embeddings().weight.grad is None
    reference = dict(cpu.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad.cpu(), reference[name].grad, **TOL, msg=name)


def test_a_gradient_of_another_backward_is_never_tied_in(mesh):
    """``autograd.grad`` of the head's weight alone (the tie's backward never runs), then two forwards and one
    backward of their sum: the held gradient of the first pass is dropped, and every gradient is the model's."""
    cpu = tiny("llama")
    model = prepare(copy.deepcopy(cpu), mesh)
    torch.manual_seed(4)
    first, second = (torch.randint(0, VOCAB, (BATCH, SEQ)) for _ in range(2))
    d1, d2 = first.to(torch_xla.device()), second.to(torch_xla.device())
    head = model.get_output_embeddings().weight
    (only_head,) = torch.autograd.grad(model(input_ids=d1, labels=d1).loss, [head])
    torch_xla.sync()
    (model(input_ids=d1, labels=d1).loss + model(input_ids=d2, labels=d2).loss).backward()
    torch_xla.sync()
    (cpu_head,) = torch.autograd.grad(cpu(input_ids=first, labels=first, use_cache=False).loss,
                                      [cpu.get_output_embeddings().weight])
    (cpu(input_ids=first, labels=first, use_cache=False).loss
     + cpu(input_ids=second, labels=second, use_cache=False).loss).backward()
    torch.testing.assert_close(only_head.cpu(), cpu_head, **TOL)
    reference = dict(cpu.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), reference[name].grad, **TOL, msg=name)


def test_a_mixed_precision_policy_leaves_the_head_alone(mesh):
    """A cast between the head and its weight runs the weight's hook after the head input's backward: no tie is
    installed (it would never find the gradient), and the step is the plain one."""
    model = prepare(tiny("llama"), mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    ids = torch.randint(0, VOCAB, (BATCH, SEQ)).to(torch_xla.device())
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([model.get_output_embeddings().weight.grad])
    assert not re.search(rf"f32\[{VOCAB},{WIDTH}\]\{{[0-9,]+\}}, bf16\[{BATCH},{SEQ},{WIDTH}\]\{{[0-9,]+\}}\) opt-barrier", hlo)
    torch_xla.sync()
    assert torch.isfinite(loss.cpu())
