"""Frozen parameters under fully_shard: fine-tuning a model whose base weights do not train (LoRA-style).

``fully_shard`` on a module with a parameter whose ``requires_grad`` is False
raised (autograd refuses a gradient hook on it) and left the module half
moved. A frozen parameter is now placed and sharded like the others, gets no
gradient and no hook, and does not move during training; the trainable ones
train as in eager CPU training.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fsdp_helpers import seeded  # noqa: F401  (a fixture: pytest finds it by name)
from fsdp_helpers import EXACT, STEPS, TRAIN_TOL, batch, loss_fn, shard_decoder, spec, step_like_eager, tiny_decoder


def _freeze_base(model: torch.nn.Module) -> list[str]:
    """Freeze the embedding (tied with the head) and every block's ``up`` projection; the names frozen."""
    frozen = []
    for name, p in model.named_parameters():
        if name == "embed.weight" or ".up." in name:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


@pytest.mark.parametrize("use_scan", [True, False], ids=["scan_layers", "loop"])
def test_frozen_base_weights_stay_put_and_the_rest_trains_like_eager(device, mesh, use_scan):
    reference = tiny_decoder(use_scan=False)
    frozen = _freeze_base(reference)
    model = copy.deepcopy(reference)
    model.use_scan = use_scan
    shard_decoder(model, mesh)
    assert frozen and all(not model.get_parameter(n).requires_grad for n in frozen)
    for name, p in model.named_parameters():
        assert p.device.type == "xla" and spec(p), name  # placed and sharded, frozen or not
    initial = {n: model.get_parameter(n).detach().cpu().clone() for n in frozen}

    (tokens, targets), (tx, gx) = batch(device, mesh)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=0.01, foreach=False)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=0.01)
    for _ in range(STEPS):
        step_like_eager(model, opt, (tx, gx), reference, ref_opt, (tokens, targets))
        for name in frozen:
            assert model.get_parameter(name).grad is None, name
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach().cpu(), reference.get_parameter(name).detach(), **TRAIN_TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
        if name in initial:
            torch.testing.assert_close(p.detach().cpu(), initial[name], **EXACT)
        else:
            assert spec(p.grad) == spec(p), name


def test_a_parameter_frozen_before_fully_shard_can_be_unfrozen_and_trains(device, mesh):
    reference = tiny_decoder(use_scan=False)
    _freeze_base(reference)
    model = shard_decoder(copy.deepcopy(reference), mesh)
    for m in (model, reference):
        m.layers[1].up.weight.requires_grad_(True)
    (tokens, targets), (tx, gx) = batch(device, mesh)
    loss_fn(model, tx, gx).backward()
    loss_fn(reference, tokens, targets).backward()
    got = model.layers[1].up.weight.grad
    assert spec(got) == spec(model.layers[1].up.weight)
    torch.testing.assert_close(got.cpu(), reference.layers[1].up.weight.grad, **TRAIN_TOL)


def test_a_refused_call_on_a_model_with_frozen_parameters_leaves_it_exactly_as_it_was(num_devices):
    import numpy as np
    import torch_xla.distributed.spmd as xs

    from torch_xla_ext.distributed import FSDPModule, fully_shard

    model = tiny_decoder(use_scan=False)
    _freeze_base(model)
    before = {n: (p, p.device, p.requires_grad, p.detach().clone()) for n, p in model.named_parameters()}
    classes = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(ValueError, match="axis named 'fsdp'"):
        fully_shard(model.layers[0], mesh=xs.Mesh(np.arange(num_devices), (4, 2), ("x", "y")))
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert not any(isinstance(m, FSDPModule) for m in model.modules())
    for n, p in model.named_parameters():
        obj, device, grad, value = before[n]
        assert p is obj and p.device == device and p.requires_grad == grad and torch.equal(p.detach(), value), n
