"""torch.compile(backend="openxla") of a fully sharded model: no graph break, the eager (lazy) model's training."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs

from torch_xla_ext.distributed import fully_shard

from fsdp_helpers import seeded  # noqa: F401  (a fixture: pytest finds it by name)
from fsdp_helpers import (BATCH, FSDP8, FSDP8_1D, LLAMA_STEPS, LLAMA_TOL, SEQ, STEPS, TRAIN_TOL, VOCAB, VOCAB_LLAMA, batch,
                          loss_fn, shard_decoder, spec, tiny_decoder, tiny_llama)

# Two XLA evaluations of the same training steps (one graph per step, or the
# compiled forward and backward graphs): the tiny decoder's bound applies.
COMPILED_TOL = TRAIN_TOL


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(model, run, batches, lr=0.5, step_loss=None, seed=None):
    """One SGD step of ``model`` through ``run`` (itself, or compiled) per ``(tokens, targets)`` batch: the losses.

    ``step_loss(tokens, targets)`` replaces ``loss_fn(run, ...)`` where given;
    ``seed`` is the gradient ``loss.backward`` starts from.
    """
    opt = torch.optim.SGD(model.parameters(), lr=lr, foreach=False)
    losses = []
    for tx, gx in batches:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(run, tx, gx) if step_loss is None else step_loss(tx, gx)
        loss.backward(seed)
        opt.step()
        torch_xla.sync()
        losses.append(loss.detach().cpu())
    return torch.stack(losses)


def _new_batches(device, mesh, seed):
    """``STEPS`` new ``(tokens, targets)`` batches on the device, the tokens sharded over the batch."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(STEPS):
        tx, gx = (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device) for _ in range(2))
        xs.mark_sharding(tx, mesh, ("fsdp", None))
        batches.append((tx, gx))
    torch_xla.sync()
    return batches


def test_fully_sharded_forward_has_no_graph_break(device, mesh):
    model = shard_decoder(tiny_decoder(use_scan=False), mesh)
    (_, _), (tx, _) = batch(device, mesh)
    explained = torch._dynamo.explain(model)(tx)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.parametrize("fullgraph", [False, True], ids=["graph", "fullgraph"])
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_compiled_fully_sharded_model_trains_like_the_eager_one(device, mesh, fullgraph, reshard_after_forward):
    reference = tiny_decoder(use_scan=False)
    eager = shard_decoder(copy.deepcopy(reference), mesh, reshard_after_forward=reshard_after_forward)
    model = shard_decoder(copy.deepcopy(reference), mesh, reshard_after_forward=reshard_after_forward)
    (_, _), (tx, gx) = batch(device, mesh)
    compiled = torch.compile(model, backend="openxla", fullgraph=fullgraph)
    expected = _train(eager, eager, [(tx, gx)] * STEPS)
    if reshard_after_forward:
        with pytest.warns(UserWarning, match="reshard_after_forward=True. under torch.compile"):
            losses = _train(model, compiled, [(tx, gx)] * STEPS)
    else:
        losses = _train(model, compiled, [(tx, gx)] * STEPS)
    torch.testing.assert_close(losses, expected, **COMPILED_TOL)
    for (name, p), (_, e) in zip(model.named_parameters(), eager.named_parameters()):
        expected_spec = FSDP8 if p.dim() == 2 else FSDP8_1D
        assert spec(p) == expected_spec and spec(p.grad) == expected_spec, name
        torch.testing.assert_close(p.cpu(), e.cpu(), **COMPILED_TOL, msg=name)


@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_compiled_fully_sharded_model_trains_like_the_eager_one_on_new_batches(device, mesh, reshard_after_forward):
    # A new batch every step: torch_xla 2.9's openxla backend would compute the
    # embedding's gradient from the first call's token ids (scripts/compile_divergence.py);
    # fully_shard hands the compiled forward views of its inputs, which it saves instead.
    reference = tiny_decoder(use_scan=False)
    eager = shard_decoder(copy.deepcopy(reference), mesh, reshard_after_forward=reshard_after_forward)
    model = shard_decoder(copy.deepcopy(reference), mesh, reshard_after_forward=reshard_after_forward)
    compiled = torch.compile(model, backend="openxla")
    batches = _new_batches(device, mesh, seed=2)
    expected = _train(eager, eager, batches, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the compiled reshard warning
        losses = _train(model, compiled, batches, lr=0.1)
    torch.testing.assert_close(losses, expected, **COMPILED_TOL)
    for (name, p), (_, e) in zip(model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(p.cpu(), e.cpu(), **COMPILED_TOL, msg=name)


def test_a_batch_an_earlier_compiled_graph_took_is_frozen_in_a_later_one_unless_copied(device, mesh):
    # torch_xla 2.9's dynamo bridge finds a graph's inputs among the call's
    # arguments by the tensor id stamped on each device buffer, and compiling a
    # graph restamps the buffers of the tensors it took. A tensor another
    # compiled graph took first is then not recognised as an argument of a graph
    # compiled later: that graph keeps its buffer as a constant and reads the
    # first call's batch on every call (docs/limitations.md). A copy made
    # on the device (clone, then sync) owns a buffer of its own and trains right.
    reference = tiny_decoder(use_scan=False)
    batches = _new_batches(device, mesh, seed=3)
    eager = shard_decoder(copy.deepcopy(reference), mesh, reshard_after_forward=False)
    expected = _train(eager, eager, batches, lr=0.1)

    def compiled_losses(batches):
        torch._dynamo.reset()
        model = shard_decoder(copy.deepcopy(reference), mesh, reshard_after_forward=False)
        step_loss = torch.compile(functools.partial(loss_fn, model), backend="openxla")
        return _train(model, None, batches, lr=0.1, step_loss=step_loss)

    torch.testing.assert_close(compiled_losses(batches), expected, **COMPILED_TOL)  # the first graphs to take them
    stale = compiled_losses(batches)
    torch.testing.assert_close(stale[0], expected[0], **COMPILED_TOL)
    assert not torch.allclose(stale[1:], expected[1:], **COMPILED_TOL), (stale, expected)
    copies = [(tx.clone(), gx.clone()) for tx, gx in batches]
    torch_xla.sync()
    torch.testing.assert_close(compiled_losses(copies), expected, **COMPILED_TOL)


def _input_syncs() -> int:
    return met.counter_value("DynamoSyncInputExecuteTime") or 0


def test_a_compiled_loss_seeded_on_the_device_runs_its_backward_without_a_blocking_sync(device, mesh):
    # torch_xla's dynamo bridge syncs any input of a compiled graph that is still
    # lazy, and waits for it: the backward's seed is such an input when autograd
    # makes it (loss.backward()), or when an eager loss computes it after a compiled
    # model. With the loss compiled and a seed already on the device, nothing
    # outside the compiled graphs feeds them, and the host never waits mid-step.
    reference = tiny_decoder(use_scan=False)
    eager = shard_decoder(copy.deepcopy(reference), mesh, reshard_after_forward=False)
    model = shard_decoder(copy.deepcopy(reference), mesh, reshard_after_forward=False)
    (_, _), (tx, gx) = batch(device, mesh)
    step_loss = torch.compile(functools.partial(loss_fn, model), backend="openxla")
    one = torch.ones((), device=device)
    torch_xla.sync()
    expected = _train(eager, eager, [(tx, gx)] * STEPS)
    _train(model, None, [(tx, gx)], step_loss=step_loss, seed=one)  # compiles
    before = _input_syncs()
    losses = _train(model, None, [(tx, gx)] * (STEPS - 1), step_loss=step_loss, seed=one)
    assert _input_syncs() == before
    torch.testing.assert_close(losses, expected[1:], **COMPILED_TOL)
    # The counter sees the lazy seed autograd makes: the check above can fail.
    before = _input_syncs()
    _train(model, None, [(tx, gx)] * 2, step_loss=step_loss)
    assert _input_syncs() - before == 2


def test_compiled_tiny_llama_trains_like_the_eager_one(device, mesh):
    reference = tiny_llama()
    models = []
    for _ in range(2):
        m = copy.deepcopy(reference)
        for layer in m.model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        models.append(fully_shard(m, mesh=mesh, reshard_after_forward=False))
    eager, model = models
    tokens = torch.randint(0, VOCAB_LLAMA, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)).to(device)
    xs.mark_sharding(tokens, mesh, ("fsdp", None))
    torch_xla.sync()
    compiled = torch.compile(model, backend="openxla", fullgraph=True)

    def train(m, run):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        losses = []
        for _ in range(LLAMA_STEPS):
            opt.zero_grad(set_to_none=True)
            loss = run(input_ids=tokens, labels=tokens).loss
            loss.backward()
            opt.step()
            torch_xla.sync()
            losses.append(loss.detach().cpu())
        return torch.stack(losses)

    torch.testing.assert_close(train(model, compiled), train(eager, eager), **LLAMA_TOL)


def test_an_in_place_write_to_a_compiled_fully_sharded_forward_input_reaches_the_caller(device, mesh):
    # The compiled forward reads its tensor arguments through views (see the test
    # above): a write into an argument still lands in the caller's tensor, as in eager.
    class AddsOne(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x.add_(1.0)
            return self.lin(x)

    reference = AddsOne()
    eager = fully_shard(copy.deepcopy(reference), mesh=mesh, reshard_after_forward=False)
    model = torch.compile(fully_shard(copy.deepcopy(reference), mesh=mesh, reshard_after_forward=False),
                          backend="openxla")
    g = torch.Generator().manual_seed(3)
    for _ in range(2):
        host = torch.randn(8, 16, generator=g)
        outs, inputs = [], []
        for run in (eager, model):
            x = host.to(device)
            outs.append(run(x).detach().cpu())
            inputs.append(x.cpu())
        torch.testing.assert_close(inputs[0], host + 1.0, rtol=0, atol=0)
        torch.testing.assert_close(inputs[1], host + 1.0, rtol=0, atol=0)
        torch.testing.assert_close(outs[1], outs[0], **COMPILED_TOL)
