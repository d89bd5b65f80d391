"""scan's contract with eager semantics: cached calls read this call's values, in-place code, buffers, refusals.

Every case compares against the Python loop (on the CPU, or on the XLA device
where torch_xla itself differs from the CPU) with values that change between
calls, so a stale plan or a dropped write shows up as a wrong number.
"""

from __future__ import annotations

import math

import copy

import numpy as np
import pytest
import torch
import torch_xla

import torch_xla_ext as txe
from torch_xla_ext.scan import scan_cache_info
from torch_xla_ext.testing.tolerances import tolerance

from scan_reference import assert_close_trees, python_scan, to_cpu

F32 = tolerance(torch.float32, 64)


# ------------------------------------------------------------------ no stale values


def test_tensor_read_from_a_dict_is_read_on_every_call(device):
    ctx = {}

    def step(c, x):
        return c + x + ctx["bias"], c

    results = []
    for b in (0.0, 10.0, -2.5):
        ctx["bias"] = torch.full((4,), b, device=device)
        c, _ = txe.scan(step, torch.zeros(4, device=device), torch.ones(3, 4, device=device))
        results.append(c.cpu())
    for b, got in zip((0.0, 10.0, -2.5), results):
        torch.testing.assert_close(got, torch.full((4,), 3 + 3 * b))


def test_python_numbers_are_read_on_every_call_and_equal_numbers_reuse_the_plan(device):
    cfg = {"scale": 2.0, "shift": 1}

    def step(c, x):
        return c + x * cfg["scale"] + cfg["shift"], None

    init, xs_ = torch.zeros(4, device=device), torch.ones(3, 4, device=device)
    before = scan_cache_info()
    for scale, shift in ((2.0, 1), (3.0, 1), (3.0, -4), (2.0, 1), (3.0, 1)):
        cfg.update(scale=scale, shift=shift)
        c, _ = txe.scan(step, init, xs_)
        torch.testing.assert_close(c.cpu(), torch.full((4,), 3 * (scale + shift)))
    after = scan_cache_info()
    assert after.traces - before.traces == 3  # one plan per distinct (scale, shift)
    assert after.hits - before.hits == 2


def test_host_tensor_changed_in_place_between_calls_is_not_served_stale(device):
    table = torch.tensor([1.0, 2.0, 3.0, 4.0])  # a host tensor fn uploads

    def step(c, x):
        return c + x * table.to(device), None

    init, xs_ = torch.zeros(4, device=device), torch.ones(2, 4, device=device)
    first, _ = txe.scan(step, init, xs_)
    table.mul_(10)
    second, _ = txe.scan(step, init, xs_)
    torch.testing.assert_close(first.cpu(), torch.tensor([2.0, 4.0, 6.0, 8.0]))
    torch.testing.assert_close(second.cpu(), torch.tensor([20.0, 40.0, 60.0, 80.0]))


@pytest.mark.parametrize("upload", ["tensor", "as_tensor"])
def test_numpy_table_changed_in_place_between_calls_is_read_as_it_is_now(device, upload):
    # torch.tensor(table) and torch.as_tensor(table) bake the array's values into the trace; the plan
    # used to be keyed by the array's identity, so every call computed with the first call's table.
    table = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)

    def step(c, x):
        t = torch.tensor(table, device=device) if upload == "tensor" else torch.as_tensor(table).to(device)
        return c + x * t, None

    init, xs_ = torch.zeros(4, device=device), torch.ones(2, 4, device=device)
    first, _ = txe.scan(step, init, xs_)
    table *= 10
    second, _ = txe.scan(step, init, xs_)
    torch.testing.assert_close(first.cpu(), torch.tensor([2.0, 4.0, 6.0, 8.0]))
    torch.testing.assert_close(second.cpu(), torch.tensor([20.0, 40.0, 60.0, 80.0]))


@pytest.mark.parametrize("zero", [np.float32, np.float64, float], ids=["np.float32", "np.float64", "float"])
def test_numbers_are_told_apart_by_their_bits(device, zero):
    # -0.0 == 0.0 in Python, so a key by value reused the +0.0 loop: +inf where the loop gives -inf.
    def step(c, x):
        return c + 1.0 / (x * scale + scale), None

    init, xs_ = torch.zeros(2, device=device), torch.ones(1, 2, device=device)
    got = []
    for scale in (zero(0.0), zero(-0.0), zero(0.0)):
        got.append(txe.scan(step, init, xs_)[0].cpu().tolist())
    assert got == [[math.inf] * 2, [-math.inf] * 2, [math.inf] * 2]


def test_branch_on_a_python_value_reuses_no_plan_of_the_other_branch(device):
    flags = {"sin_first": True}
    w1, w2 = torch.full((4,), 0.5, device=device), torch.full((4,), 2.0, device=device)

    def step(c, x):  # same lazy graph either way; which tensor feeds sin differs
        if flags["sin_first"]:
            a, b = torch.sin(w1), torch.cos(w2)
        else:
            b, a = torch.cos(w2), torch.sin(w1)
        return c + a - b, None

    init, xs_ = torch.zeros(4, device=device), torch.ones(1, 4, device=device)
    expected = torch.sin(torch.tensor(0.5)) - torch.cos(torch.tensor(2.0))
    for flag in (True, False, True):
        flags["sin_first"] = flag
        c, _ = txe.scan(step, init, xs_)
        torch.testing.assert_close(c.cpu(), expected.expand(4), **F32)


def test_changing_mask_through_a_shared_context_trains_like_the_loop(device):
    """The Hugging Face adapter pattern: layers read a mask from a context dict that changes every step."""
    torch.manual_seed(0)

    class Layer(torch.nn.Module):
        def __init__(self, ctx):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.__dict__["ctx"] = ctx  # not a submodule

        def forward(self, h):
            return torch.tanh(self.lin(h)) * self.ctx["mask"] + h

    def run(dev, use_scan):
        ctx = {}
        torch.manual_seed(1)
        layers = torch.nn.ModuleList([Layer(ctx) for _ in range(3)]).to(dev)
        losses = []
        gen = torch.Generator().manual_seed(2)
        for _ in range(3):
            h = torch.randn(4, 8, generator=gen).to(dev)
            ctx["mask"] = (torch.rand(4, 1, generator=gen) > 0.5).float().to(dev)
            if use_scan:
                out = txe.scan_layers(layers, h)
            else:
                out = h
                for layer in layers:
                    out = layer(out)
            loss = (out * out).mean()
            loss.backward()
            losses.append(loss.detach().cpu())
            grads = [p.grad.detach().cpu().clone() for p in layers.parameters()]
            layers.zero_grad()
        return torch.stack(losses), grads

    got, got_grads = run(device, True)
    ref, ref_grads = run("cpu", False)
    torch.testing.assert_close(got, ref, **tolerance(torch.float32, 3 * 8))
    for g, r in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, r, **tolerance(torch.float32, 3 * 8 * 4))


def test_backward_uses_the_outside_tensors_of_its_forward(device):
    ctx = {"w": torch.full((4,), 2.0, device=device).requires_grad_()}
    first = ctx["w"]

    def step(c, x):
        return c * ctx["w"] + x, None

    init = torch.ones(4, device=device).requires_grad_()
    c1, _ = txe.scan(step, init, torch.ones(2, 4, device=device))
    ctx["w"] = torch.full((4,), 3.0, device=device).requires_grad_()  # the next step's weight
    c2, _ = txe.scan(step, init, torch.ones(2, 4, device=device))
    (c1.sum() + c2.sum()).backward()
    # c = (init * w + 1) * w + 1: d/dw = 2 * init * w + 1, d/dinit = w**2
    torch.testing.assert_close(first.grad.cpu(), torch.full((4,), 5.0))
    torch.testing.assert_close(ctx["w"].grad.cpu(), torch.full((4,), 7.0))
    torch.testing.assert_close(init.grad.cpu(), torch.full((4,), 4.0 + 9.0))


def test_outside_tensor_modified_before_backward_is_refused_like_eager(device):
    w = torch.full((4,), 2.0, device=device).requires_grad_()
    init = torch.ones(4, device=device).requires_grad_()
    c, _ = txe.scan(lambda c, x: (c * w + x, None), init, torch.ones(2, 4, device=device))
    with torch.no_grad():
        w.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        c.sum().backward()


# ---------------------------------------------------------------- in-place inside fn


def _inplace_cases():
    def add_to_carry(c, x):
        c += x
        return c, c * 10

    def mul_carry(c, x):
        c.mul_(0.5)
        c.add_(x)
        return c, c.sum()

    def add_to_x(c, x):
        x.add_(1)
        return c + x, x * 2

    def setitem_on_created(c, x):
        t = torch.zeros_like(c)
        t[1:3] = x[1:3]
        t.mul_(c)
        return c + t, t

    return [add_to_carry, mul_carry, add_to_x, setitem_on_created]


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("fn", _inplace_cases(), ids=lambda f: f.__name__)
def test_inplace_updates_inside_fn_match_the_loop(device, fn, grad):
    gen = torch.Generator().manual_seed(3)
    cpu = {"init": torch.randn(4, generator=gen), "xs": torch.randn(3, 4, generator=gen)}

    def run(dev, use_scan):
        t = {k: v.clone().to(dev).requires_grad_(grad) for k, v in cpu.items()}
        # The loop gets copies: scan never writes into init or xs.
        args = (t["init"] * 1, t["xs"] * 1)
        with torch.set_grad_enabled(grad):
            carry, ys = (txe.scan if use_scan else python_scan)(fn, *args)
        if grad:
            ((carry * carry).sum() + (ys * ys).sum()).backward()
            return to_cpu((carry, ys)), {k: v.grad.cpu() for k, v in t.items()}
        return to_cpu((carry, ys)), {}

    (got, got_grads), (ref, ref_grads) = run(device, True), run("cpu", False)
    assert_close_trees(got, ref, **F32)
    assert_close_trees(got_grads, ref_grads, **F32)


def test_scan_does_not_write_into_init_or_xs(device):
    init, xs_ = torch.zeros(4, device=device), torch.ones(3, 4, device=device)

    def fn(c, x):
        c += x
        x.mul_(5)
        return c, x

    c, ys = txe.scan(fn, init, xs_)
    torch.testing.assert_close(c.cpu(), torch.full((4,), 3.0))
    torch.testing.assert_close(ys.cpu(), torch.full((3, 4), 5.0))
    torch.testing.assert_close(init.cpu(), torch.zeros(4))
    torch.testing.assert_close(xs_.cpu(), torch.ones(3, 4))


def test_y_aliasing_a_carry_updated_in_place_is_refused(device):
    def fn(c, x):
        c.add_(x)
        return c, c  # in the loop every y would be the final carry

    with pytest.raises(ValueError, match="updates carry leaf 0 in place and also returns it as y leaf 0"):
        txe.scan(fn, torch.zeros(4, device=device), torch.ones(3, 4, device=device))


def test_y_that_is_a_carry_only_annotated_with_a_sharding_is_not_refused(device, mesh):
    import torch_xla.distributed.spmd as xs

    def fn(c, x):
        xs.mark_sharding(c, mesh, ("fsdp",))  # changes c's graph, writes nothing
        return c + x, c

    carry, ys = txe.scan(fn, torch.zeros(8, device=device), torch.ones(3, 8, device=device))
    torch.testing.assert_close(carry.cpu(), torch.full((8,), 3.0))
    torch.testing.assert_close(ys.cpu(), torch.arange(3.0)[:, None].expand(3, 8))


def _outside_writes(state):
    return {
        "inplace": lambda c, x: (state.add_(x), (c, x))[1],
        "out=": lambda c, x: (torch.add(x, 1, out=state), (c, x))[1],
        ".data": lambda c, x: (state.data.add_(x), (c, x))[1],
        "copy_": lambda c, x: (state.copy_(x), (c, x))[1],
        "setitem": lambda c, x: (state.__setitem__(0, 1.0), (c, x))[1],
        "view": lambda c, x: (state.view(3).mul_(2), (c, x))[1],
    }


@pytest.mark.parametrize("route", list(_outside_writes(None)))
def test_writes_into_outside_tensors_are_refused_before_anything_runs(device, route):
    state = torch.zeros(3, device=device)
    torch_xla.sync()
    fn = _outside_writes(state)[route]
    before = scan_cache_info()
    with pytest.raises(RuntimeError, match="writes into a tensor defined outside it"):
        txe.scan(fn, torch.zeros(3, device=device), torch.ones(2, 3, device=device))
    assert scan_cache_info() == before  # nothing lowered, nothing cached
    torch.testing.assert_close(state.cpu(), torch.zeros(3))


# --------------------------------------------------------------------------- buffers


class _NormBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        self.bn = torch.nn.BatchNorm1d(6)

    def forward(self, h):
        return torch.tanh(self.bn(self.lin(h))) + h


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_scan_layers_writes_buffer_updates_back_like_the_loop(device, grad):
    torch.manual_seed(4)
    cpu_layers = torch.nn.ModuleList([_NormBlock() for _ in range(3)])
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randn(16, 6, generator=gen) for _ in range(2)]
    scanned, looped = copy.deepcopy(cpu_layers).to(device), copy.deepcopy(cpu_layers).to(device)
    for h in batches:  # two steps: the second reads the first step's running stats
        with torch.set_grad_enabled(grad):
            out = txe.scan_layers(scanned, h.to(device))
            ref = h.to(device)
            for layer in looped:
                ref = layer(ref)
        # The same loop on the XLA device: torch_xla's batch_norm keeps the biased
        # variance in running_var, the CPU kernel the unbiased one.
        torch.testing.assert_close(out.cpu(), ref.cpu(), **F32)
    for (name, got), (_, want) in zip(scanned.named_buffers(), looped.named_buffers()):
        torch.testing.assert_close(got.cpu(), want.cpu(), **F32, msg=name)
    assert int(scanned[0].bn.num_batches_tracked.cpu()) == 2


def test_scan_layers_eval_mode_leaves_buffers_alone(device):
    torch.manual_seed(6)
    layers = torch.nn.ModuleList([_NormBlock() for _ in range(2)]).to(device).eval()
    before = [b.cpu().clone() for b in layers.buffers()]
    # (Under grad, eval-mode batch_norm fails in the backward loop: AOTAutograd's
    # meta kernel saves size-0 statistics that torch_xla's backward kernel rejects.)
    with torch.no_grad():
        txe.scan_layers(layers, torch.randn(8, 6).to(device))
    for got, want in zip(layers.buffers(), before):
        torch.testing.assert_close(got.cpu(), want)


def test_scan_layers_refuses_a_forward_that_writes_into_a_parameter(device):
    class Decaying(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(4))

        def forward(self, h):
            with torch.no_grad():
                self.w.mul_(0.9)
            return h * self.w

    layers = torch.nn.ModuleList([Decaying() for _ in range(2)]).to(device)
    with pytest.raises(RuntimeError, match=r"Decaying.forward writes into its parameter 'w'"):
        txe.scan_layers(layers, torch.ones(2, 4, device=device))
    for layer in layers:
        torch.testing.assert_close(layer.w.detach().cpu(), torch.ones(4))


def test_the_scan_fsdp_contract_is_read_by_name_and_scoped_to_the_trace(device):
    from torch_xla_ext._annotate import ANNOTATE_OP, in_scan_step_trace, regather_mark, scan_step_trace

    class Node:  # the two fields of an FX node the contract reads
        def __init__(self, target, args, kwargs):
            self.target, self.args, self.kwargs = target, args, kwargs

    assert regather_mark(Node(ANNOTATE_OP, ("t", "mesh", "spec", True), {})) is True
    assert regather_mark(Node(ANNOTATE_OP, ("t", "mesh", "spec"), {"recompute_in_backward": False})) is False
    assert regather_mark(Node(torch.ops.aten.add.Tensor, ("a", "b"), {})) is None
    assert not in_scan_step_trace()
    with scan_step_trace():
        with scan_step_trace():
            assert in_scan_step_trace()
        assert in_scan_step_trace()
    assert not in_scan_step_trace()


# ------------------------------------------------------------------ inference mode


def test_scan_and_scan_layers_under_inference_mode_compute_the_loop(device):
    # Inference tensors have no version counter, which the trace reads: it used to fail with
    # "Inference tensors do not track version counter".
    torch.manual_seed(0)
    w = torch.randn(8, 8)
    xs = torch.randn(3, 2, 8)
    cpu_layers = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(3)])
    layers = copy.deepcopy(cpu_layers).to(device)
    w_d = w.to(device)

    def step(c, x):
        c = torch.tanh(c @ w_d + x)
        return c, c.sum()

    def step_cpu(c, x):
        c = torch.tanh(c @ w + x)
        return c, c.sum()

    def loop(h):
        for layer in cpu_layers:
            h = layer(h)
        return h

    with torch.inference_mode():
        got = txe.scan(step, torch.zeros(2, 8, device=device), xs.to(device))
        got_layers = txe.scan_layers(layers, xs[0].to(device))
        want = python_scan(step_cpu, torch.zeros(2, 8), xs)
        want_layers = loop(xs[0])
    assert not got[0].requires_grad and not got_layers.requires_grad
    assert_close_trees(got, want, reduction_size=8)
    assert_close_trees(got_layers, want_layers, reduction_size=8)
