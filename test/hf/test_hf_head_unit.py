"""``prepare`` makes an untied output head a fully sharded unit of its own, so its weight gradient is reduced
to its shard before the decoder's backward (``hf/_prepare.py``, ``_untied_head``)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch_xla

from torch_xla_ext.distributed import MixedPrecisionPolicy
from torch_xla_ext.distributed._registry import is_fully_sharded
from torch_xla_ext.hf import _prepare, prepare
from torch_xla_ext.testing.tolerances import tolerance

from hf_tiny import VOCAB, tiny

# float32, a 3-layer model of width 64: the same math in another reduction order on 8 devices.
TOL = dict(rtol=1e-4, atol=1e-5)
BATCH, SEQ, WIDTH = 8, 12, 64


def _head_barriers(model: torch.nn.Module, ids: torch.Tensor, hidden: str = "f32") -> int:
    """Optimization barriers in one step's backward holding exactly the head weight's fp32 gradient and the
    gradient (of dtype ``hidden``) the head passes back to the decoder."""
    model(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    hlo = torch_xla._XLAC._get_xla_tensors_hlo(grads)
    pair = re.compile(rf"f32\[{VOCAB},{WIDTH}\]\{{[0-9,]+\}}, {hidden}\[{BATCH},{SEQ},{WIDTH}\]\{{[0-9,]+\}}")
    found = sum(1 for types in re.findall(r"= \(([^)]*)\) opt-barrier\(", hlo) if pair.fullmatch(types))
    torch_xla.sync()
    return found


def _assert_gradients_are(model: torch.nn.Module, cpu: torch.nn.Module, **tol: float) -> None:
    reference = dict(cpu.named_parameters())
    for name, p in model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad.cpu(), reference[name].grad.float(), **tol, msg=name)


@pytest.mark.parametrize("scan", [True, False], ids=["scan", "loop"])
def test_the_decoder_backward_waits_for_the_head_gradient_and_the_numbers_are_the_models(mesh, scan):
    cpu = tiny("llama")
    model = prepare(copy.deepcopy(cpu), mesh, scan=scan)
    assert is_fully_sharded(model.get_output_embeddings())
    torch.manual_seed(3)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    ids_d = ids.to(torch_xla.device())
    assert _head_barriers(model, ids_d) == 1
    cpu(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    model.zero_grad(set_to_none=True)
    model(input_ids=ids_d, labels=ids_d).loss.backward()
    torch_xla.sync()
    _assert_gradients_are(model, cpu, **TOL)


def test_without_a_unit_of_its_own_nothing_orders_the_head_gradient(mesh, monkeypatch):
    """The control of the test above: the head left in the model's unit, no barrier holds its gradient."""
    monkeypatch.setattr(_prepare, "_untied_head", lambda model: None)
    model = prepare(tiny("llama"), mesh)
    assert not is_fully_sharded(model.get_output_embeddings())
    torch.manual_seed(3)
    assert _head_barriers(model, torch.randint(0, VOCAB, (BATCH, SEQ)).to(torch_xla.device())) == 0


def test_a_head_tied_to_the_embedding_stays_in_the_models_unit(mesh):
    model = prepare(tiny("gpt2"), mesh)
    head = model.get_output_embeddings()
    assert head.weight is model.get_input_embeddings().weight and not is_fully_sharded(head)
    torch.manual_seed(3)
    assert _head_barriers(model, torch.randint(0, VOCAB, (BATCH, SEQ)).to(torch_xla.device())) == 0


def test_a_frozen_head_trains_the_rest_as_the_model(mesh):
    cpu = tiny("llama")
    cpu.get_output_embeddings().weight.requires_grad_(False)
    model = prepare(copy.deepcopy(cpu), mesh)
    torch.manual_seed(5)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    cpu(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    ids_d = ids.to(torch_xla.device())
    model(input_ids=ids_d, labels=ids_d).loss.backward()
    torch_xla.sync()
    assert model.get_output_embeddings().weight.grad is None
    _assert_gradients_are(model, cpu, **TOL)


def test_a_gradient_of_another_backward_changes_nothing(mesh):
    """``autograd.grad`` of the head's weight alone (the barrier's backward never runs), then two forwards and
    one backward of their sum: every gradient is the model's."""
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
    _assert_gradients_are(model, cpu, **TOL)


def test_under_bf16_compute_the_head_gradient_is_ordered_and_the_numbers_are_the_models(mesh):
    """With ``param_dtype=bfloat16`` the head's cast is made in its own forward, after the barrier, so autograd
    reaches the weight's gradient before the decoder's; the gradients are those of the CPU model in bf16."""
    cpu = tiny("llama")
    model = prepare(copy.deepcopy(cpu), mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    torch.manual_seed(6)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ))
    ids_d = ids.to(torch_xla.device())
    assert _head_barriers(model, ids_d, hidden="bf16") == 1
    model.zero_grad(set_to_none=True)
    model(input_ids=ids_d, labels=ids_d).loss.backward()
    torch_xla.sync()
    cpu_bf16 = cpu.to(torch.bfloat16)
    cpu_bf16(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    # bf16 products and sums over the step's tokens, rounded differently on 8 devices than on the CPU.
    _assert_gradients_are(model, cpu_bf16, **tolerance(torch.bfloat16, BATCH * SEQ))


def test_the_head_casts_neither_its_input_nor_its_logits(mesh, monkeypatch):
    """A policy's ``output_dtype`` and input cast stay the model's unit's: the head's logits, the model's output
    and the loss are those of the model whose head is not a unit of its own."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    torch.manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ)).to(torch_xla.device())
    results = []
    for own_unit in (True, False):
        if not own_unit:
            monkeypatch.setattr(_prepare, "_untied_head", lambda model: None)
        model = prepare(tiny("llama"), mesh, mp_policy=policy)
        assert is_fully_sharded(model.get_output_embeddings()) == own_unit
        seen = []
        model.get_output_embeddings().register_forward_hook(
            lambda m, args, out: seen.append((args[0].dtype, out.dtype)))
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
        torch_xla.sync()
        results.append((seen, out.logits.dtype, out.logits.cpu(), out.loss.cpu()))
    (seen, dtype, logits, loss), (seen_ref, dtype_ref, logits_ref, loss_ref) = results
    assert seen == seen_ref and dtype == dtype_ref
    torch.testing.assert_close(logits, logits_ref, rtol=0, atol=0)
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)


def test_a_head_sharing_a_parameter_with_any_other_module_stays_in_the_models_unit():
    """Not only a tied embedding: any other module registering one of the head's parameters keeps the head in
    the model's unit (that parameter's gradient is complete only after the other module's backward)."""
    model = tiny("llama")
    assert _prepare._untied_head(model) is model.get_output_embeddings()
    model.aux = torch.nn.Linear(WIDTH, VOCAB, bias=False)
    assert _prepare._untied_head(model) is model.get_output_embeddings()
    model.aux.weight = model.get_output_embeddings().weight
    assert _prepare._untied_head(model) is None
