"""Remat policies for scan and scan_layers: the same values and gradients, fewer activations stacked."""

from __future__ import annotations

import math

import pytest
import torch

import torch_xla_ext as txe
from torch_xla_ext import remat
from torch_xla_ext._scan import cache
from torch_xla_ext.scan import clear_scan_cache

from scan_blocks import make_blocks
from scan_reference import assert_close_derived

N, D = 4, 8


def _stacked_saved(fn) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """Signatures of the activations the forward loop of fn's (only) cached plan stacks for the backward."""
    owner, _ = cache._cache_slot(fn, ())  # a function's plans live under its code
    (plan,) = [p for p in cache._cache[owner].values() if p.grad is not None]
    return list(plan.grad.saved_sig[:plan.grad.num_stacked])


def _run(device, policy):
    clear_scan_cache()  # fn's plans live under its code, shared by every _run: keep this policy's only
    torch.manual_seed(0)
    w1, w2 = (torch.randn(D, D).div(math.sqrt(D)).to(device).requires_grad_() for _ in range(2))

    def fn(c, x):
        a = remat.checkpoint_name(torch.tanh(c @ w1 + x), "a")
        b = torch.sin(a @ w2) * a
        return b, b.sum(-1)

    init, xs = torch.randn(3, D).to(device).requires_grad_(), torch.randn(N, 3, D).to(device)
    carry, ys = txe.scan(fn, init, xs, partition_fn=policy)
    (carry.square().sum() + ys.sum()).backward()
    return [carry, ys, init.grad, w1.grad, w2.grad], _stacked_saved(fn)


@pytest.mark.parametrize("policy, stacked", [
    (None, {"carry", "a", "dots", "more"}),
    (remat.nothing_saveable, {"carry"}),
    (remat.dots_saveable, {"carry", "dots"}),
    (remat.save_only_these_names("a"), {"carry", "a"}),
], ids=["default", "nothing", "dots", "names"])
def test_policies_keep_values_and_gradients_and_stack_less(device, policy, stacked):
    expected, default_saved = _run(device, None)
    got, saved = _run(device, policy)
    for g, e in zip(got, expected):
        assert_close_derived(g, e, N * D * 2)
    # Every saved activation here is [3, D] float32: count them. The carry of
    # each iteration is always stacked; "a" is one more, the two matmul outputs two.
    assert all(sig == ((3, D), torch.float32) for sig in saved), saved
    counts = {"carry": 1, "a": 1, "dots": 2}
    if "more" in stacked:
        assert len(saved) > 4, saved  # the default saves more than carry + a + dots
    else:
        assert len(saved) == sum(counts[k] for k in stacked), saved
    assert len(saved) <= len(default_saved)


def test_scan_layers_with_nothing_saveable_matches_the_loop(device):
    cpu = make_blocks(3)
    xla = make_blocks(3).to(device)
    x = torch.randn(4, 16)
    out = txe.scan_layers(xla, x.to(device), remat.nothing_saveable)
    ref = x
    for layer in cpu:
        ref = layer(ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert_close_derived(out, ref, 3 * 48)
    for p, q in zip(xla.parameters(), cpu.parameters()):
        assert_close_derived(p.grad, q.grad, 3 * 48 * 4)


def test_random_ops_are_saved_not_recomputed(device):
    # A recomputed dropout would draw another mask: the gradient identity of
    # test_scan's dropout test must hold under nothing_saveable too.
    w = torch.tensor(1.5, device=device, requires_grad=True)

    def fn(c, x):
        return torch.nn.functional.dropout(c * w, 0.25, training=True), None

    out, _ = txe.scan(fn, torch.ones(64).to(device), None, length=3, partition_fn=remat.nothing_saveable)
    out.sum().backward()
    assert w.grad.item() == pytest.approx(3 * out.sum().item() / 1.5, rel=1e-5)


def test_bad_names_are_refused(device):
    with pytest.raises(ValueError, match="one or more non-empty names"):
        remat.save_only_these_names()
    with pytest.raises(ValueError, match="non-empty string"):
        remat.checkpoint_name(torch.ones(1, device=device), "")
    assert remat.save_only_these_names("a", "b") is remat.save_only_these_names("b", "a")
