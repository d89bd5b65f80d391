"""fully_shard moves the buffers of the modules it manages to the XLA device, replicated, as FSDP2 does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch_xla
import torch_xla.distributed.spmd as xs

from torch_xla_ext._annotate import is_replicated_spec
from torch_xla_ext.distributed import fully_shard
from torch_xla_ext.testing import measure_transfers

from fsdp_helpers import seeded  # noqa: F401  (a fixture: pytest finds it by name)
from fsdp_helpers import BATCH, EXACT, LLAMA_STEPS, LLAMA_TOL, SEQ, VOCAB_LLAMA, spec, tiny_llama


class Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))
        self.register_buffer("cache", torch.arange(8.0), persistent=False)


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Inner()
        self.plain = nn.Linear(8, 8)  # not fully sharded: its buffers belong to the root
        self.plain.register_buffer("count", torch.tensor(3))
        self.register_buffer("shift", torch.ones(8))
        self.register_buffer("mask", torch.tensor([True, False] * 4), persistent=False)
        self.alias = nn.Module()
        self.alias.register_buffer("shift_again", self.shift)  # one tensor under two names


def test_fully_shard_moves_the_buffers_it_manages_and_keeps_their_registrations(mesh):
    model = Outer()
    reference = copy.deepcopy(model)
    shift = model.shift
    fully_shard(model.inner, mesh=mesh)
    # The inner state manages only its own module's buffers.
    assert {n: b.device.type for n, b in model.named_buffers(remove_duplicate=False)} == {
        "shift": "cpu", "mask": "cpu", "inner.scale": "xla", "inner.cache": "xla", "plain.count": "cpu",
        "alias.shift_again": "cpu"}
    fully_shard(model, mesh=mesh)
    assert all(b.device.type == "xla" for b in model.buffers())
    assert all(is_replicated_spec(spec(b)) for b in model.buffers())
    # The same tensor objects: attributes, named_buffers() and outside references agree.
    assert model.shift is shift and model.alias.shift_again is shift
    assert dict(model.named_buffers())["inner.cache"] is model.inner.cache
    assert model.inner._non_persistent_buffers_set == {"cache"} and model._non_persistent_buffers_set == {"mask"}
    assert list(model.state_dict()) == list(reference.state_dict())
    for (name, b), (_, r) in zip(model.named_buffers(), reference.named_buffers()):
        assert b.dtype == r.dtype, name
        torch.testing.assert_close(b.cpu(), r, **EXACT, msg=name)


def test_an_xla_buffer_keeps_its_sharding(device, mesh):
    model = Inner()
    model.scale = model.scale.to(device)
    xs.mark_sharding(model.scale, mesh, ("fsdp",))
    before = spec(model.scale)
    fully_shard(model, mesh=mesh)
    assert spec(model.scale) == before != ""
    assert is_replicated_spec(spec(model.cache))


def test_a_buffer_on_another_device_is_refused_before_anything_moves(mesh):
    model = Inner()
    model.register_buffer("elsewhere", torch.empty(4, device="meta"))
    with pytest.raises(ValueError, match="buffer elsewhere is on meta"):
        fully_shard(model, mesh=mesh)
    assert model.lin.weight.device.type == "cpu" and model.scale.device.type == "cpu"
    assert fully_shard.state(model) is None


# --------------------------------------------------------------------------- #
# A tiny Hugging Face Llama: the rotary inv_freq buffer is uploaded once, not every step.
# --------------------------------------------------------------------------- #

def test_tiny_llama_buffers_are_uploaded_once_and_training_matches_cpu(device, mesh):
    reference = tiny_llama()
    model = copy.deepcopy(reference)
    assert {n for n, _ in model.named_buffers()} >= {"model.rotary_emb.inv_freq"}
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for name, b in model.named_buffers():
        assert b.device.type == "xla" and is_replicated_spec(spec(b)), name
        torch.testing.assert_close(b.cpu(), reference.get_buffer(name), **EXACT, msg=name)

    tokens = torch.randint(0, VOCAB_LLAMA, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    tx = tokens.to(device)
    xs.mark_sharding(tx, mesh, ("fsdp", None))
    torch_xla.sync()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(LLAMA_STEPS):
        with measure_transfers() as m:
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=tx, labels=tx).loss
            loss.backward()
            opt.step()
            torch_xla.sync()
        if step:  # the first step may upload the optimizer's scalars; no step uploads a buffer
            assert not m.host_to_device, m.report()
        ref_opt.zero_grad()
        ref_loss = reference(input_ids=tokens, labels=tokens).loss
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss.cpu(), ref_loss.detach(), **LLAMA_TOL)
