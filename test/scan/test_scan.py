"""scan: values and gradients against Python loops and jax.lax.scan, closures, autograd.

Random numbers: test_scan_random.py; the cache: test_scan_cache.py; input errors: test_scan_errors.py;
scan_layers: test/scan_layers/; scan on an SPMD mesh: test_scan_spmd.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
from functorch.compile import min_cut_rematerialization_partition

import torch_xla_ext as txe

from scan_reference import assert_close_derived, assert_close_trees, python_scan, to_cpu

X = torch_xla._XLAC


# --------------------------------------------------------------------------- values


def cumsum_fn(c, x):
    c = c + x
    return c, c


@pytest.mark.parametrize("reverse", [False, True])
def test_cumsum_matches_loop(device, reverse):
    xs_ = torch.randn(7, 3).to(device)
    init = torch.zeros(3).to(device)
    got = txe.scan(cumsum_fn, init, xs_, reverse=reverse)
    assert_close_trees(got, python_scan(cumsum_fn, init.cpu(), xs_.cpu(), reverse=reverse))


def test_pytrees_and_none_outputs(device):
    def fn(carry, x):
        h, count = carry["h"], carry["n"]
        h = torch.tanh(h @ x["w"] + x["b"])
        return {"h": h, "n": count + 1}, (h.sum(-1), None, {"sq": h * h})

    init = {"h": torch.randn(2, 4).to(device), "n": torch.zeros((), dtype=torch.int32).to(device)}
    xs_ = {"w": torch.randn(5, 4, 4).to(device), "b": torch.randn(5, 4).to(device)}
    carry, ys = txe.scan(fn, init, xs_)
    ref_carry, ref_ys = python_scan(fn, to_cpu(init), to_cpu(xs_))
    assert carry["n"].dtype == torch.int32 and int(carry["n"].cpu()) == 5
    assert ys[1] is None
    assert_close_trees(carry, ref_carry, reduction_size=5 * 4)
    assert_close_trees((ys[0], ys[2]), (ref_ys[0], ref_ys[2]), reduction_size=5 * 4)


def test_xs_none_with_length(device):
    def fn(c, x):
        assert x is None
        return c * 2, c.sum()

    carry, ys = txe.scan(fn, torch.ones(3).to(device), None, length=4)
    torch.testing.assert_close(carry.cpu(), torch.full((3,), 16.0))
    torch.testing.assert_close(ys.cpu(), torch.tensor([3.0, 6.0, 12.0, 24.0]))


def test_zero_length_returns_init_and_empty_ys(device):
    init = torch.randn(3).to(device)

    def fn(c, x):
        return c + x.sum(), {"a": c * 2, "b": x[:2].to(torch.int64)}

    carry, ys = txe.scan(fn, init, torch.zeros(0, 5).to(device))
    assert carry is init
    assert ys["a"].shape == (0, 3) and ys["a"].dtype == torch.float32
    assert ys["b"].shape == (0, 2) and ys["b"].dtype == torch.int64
    carry, ys = txe.scan(lambda c, x: (c, c), init, None, length=0)
    assert carry is init and ys.shape == (0, 3)


def test_closures_read_outside_tensors(device):
    w = torch.randn(4, 4).to(device)
    bias = torch.randn(4).to(device)
    torch_xla.sync()

    def fn(c, x):
        table = torch.tensor([1.0, 2.0, 3.0, 4.0], device=device)  # created inside fn
        h = torch.tanh(c @ w + x + bias) * table
        return h, h.mean()

    init, xs_ = torch.randn(4).to(device), torch.randn(6, 4).to(device)
    got = txe.scan(fn, init, xs_)
    w_c, b_c = w.cpu(), bias.cpu()

    def ref(c, x):
        h = torch.tanh(c @ w_c + x + b_c) * torch.tensor([1.0, 2.0, 3.0, 4.0])
        return h, h.mean()

    assert_close_trees(got, python_scan(ref, init.cpu(), xs_.cpu()), reduction_size=6 * 4)


def test_mutating_an_outside_tensor_is_an_error(device):
    state = torch.zeros(3).to(device)

    def fn(c, x):
        state.add_(x)
        return c, x

    with pytest.raises(RuntimeError, match="writes into a tensor defined outside"):
        txe.scan(fn, torch.zeros(3).to(device), torch.ones(2, 3).to(device))


def test_bool_inputs_and_saved_bool_activations(device):
    masks = torch.rand(3, 4) > 0.5
    init = torch.zeros(4)
    carry, _ = txe.scan(lambda c, m: (c.masked_fill(m, 0.0) + 1, None), init.to(device), masks.to(device))
    ref = init
    for m in masks:
        ref = ref.masked_fill(m, 0.0) + 1
    torch.testing.assert_close(carry.cpu(), ref)

    w = torch.randn(4, 4).to(device).requires_grad_()
    keep = (torch.arange(4) % 2 == 0).to(device)
    out, _ = txe.scan(lambda h, x: ((h @ w).masked_fill(~keep, 0.0) + x, None),
                      torch.ones(4).to(device), torch.ones(3, 4).to(device))
    out.sum().backward()
    w_ref = w.detach().cpu().requires_grad_()
    h = torch.ones(4)
    for _ in range(3):
        h = (h @ w_ref).masked_fill(~keep.cpu(), 0.0) + 1
    h.sum().backward()
    assert_close_derived(w.grad, w_ref.grad, 3 * 4 * 2)


# ------------------------------------------------------------------------ autograd


def rnn_cell(params):
    w, u = params

    def fn(h, x):
        h = torch.tanh(h @ w + x @ u)
        return h, (h * h).sum(-1)

    return fn


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("partition", [None, min_cut_rematerialization_partition], ids=["save", "mincut"])
def test_gradients_match_loop(device, reverse, partition):
    torch.manual_seed(0)
    cpu = {"w": torch.randn(4, 4) * 0.5, "u": torch.randn(3, 4), "h": torch.randn(2, 4), "x": torch.randn(6, 2, 3)}

    def run(dev, use_scan):
        t = {k: v.clone().to(dev).requires_grad_() for k, v in cpu.items()}
        fn = rnn_cell((t["w"], t["u"]))
        if use_scan:
            carry, ys = txe.scan(fn, t["h"], t["x"], reverse=reverse, partition_fn=partition)
        else:
            carry, ys = python_scan(fn, t["h"], t["x"], reverse=reverse)
        loss = (carry * carry).sum() + (ys * torch.linspace(0, 1, 6, device=dev)[:, None]).sum()
        loss.backward()
        return to_cpu((carry, ys)), {k: v.grad.cpu() for k, v in t.items()}

    got, got_grads = run(device, True)
    ref, ref_grads = run("cpu", False)
    assert_close_trees(got, ref, reduction_size=6 * 4 * 2)
    assert_close_trees(got_grads, ref_grads, reduction_size=6 * 4 * 2 * 2)


def test_gradient_only_to_closure(device):
    w = torch.randn(3, 3).to(device).requires_grad_()
    init, xs_ = torch.randn(3).to(device), torch.randn(4, 3).to(device)
    carry, _ = txe.scan(lambda c, x: (torch.sin(c @ w) + x, None), init, xs_)
    carry.sum().backward()
    w_ref = w.detach().cpu().requires_grad_()
    c = init.cpu()
    for i in range(4):
        c = torch.sin(c @ w_ref) + xs_.cpu()[i]
    c.sum().backward()
    assert_close_derived(w.grad, w_ref.grad, 4 * 3)


@pytest.mark.parametrize("loss", ["carry", "ys", "both"])
def test_inputs_no_output_depends_on_get_no_gradient(device, loss):
    # As in the Python loop, .grad stays None (an optimizer skips the tensor)
    # for a tensor no output depends on; zeros would let weight decay move it.
    host = [torch.randn(3, 3), torch.randn(3, 3), torch.randn(3), torch.randn(4, 3)]

    def run(w, unused, init, xs_, scan):
        def step(c, x):
            return torch.sin(x @ w), c.sum() + (unused * 0).detach().sum()

        carry, ys = scan(step, init, xs_)
        {"carry": carry.sum(), "ys": ys.sum(), "both": carry.sum() + ys.sum()}[loss].backward()
        return [t.grad is None for t in (w, unused, init, xs_)]

    ours = run(*[t.to(device).requires_grad_() for t in host], txe.scan)
    eager = run(*[t.clone().requires_grad_() for t in host], python_scan)
    assert ours == eager
    assert ours[1], "the unused tensor must get no gradient"


@pytest.mark.parametrize("length", [1, 2, 3, 6, 7])
def test_no_gradient_through_carry_components_that_swap_each_iteration(device, length):
    # (a, b) -> (b * w, a): which init component reaches carry[0] depends on the parity.
    host = [torch.randn(3), torch.randn(3), torch.randn(3)]

    def run(a, b, w, scan):
        (c0, _), _ = scan(lambda c, x: ((c[1] * w, c[0]), None), (a, b), None, length=length)
        c0.sum().backward()
        return [t.grad is None for t in (a, b, w)]

    ours = run(*[t.to(device).requires_grad_() for t in host], txe.scan)
    assert ours == run(*[t.clone().requires_grad_() for t in host], python_scan)
    assert ours[:2] == ([True, False] if length % 2 else [False, True])


def test_zero_iterations_still_pass_the_carry_gradient(device):
    init = torch.randn(3).to(device).requires_grad_()
    carry, _ = txe.scan(lambda c, x: (x * 2, None), init, torch.zeros(0, 3).to(device))
    carry.sum().backward()
    torch.testing.assert_close(init.grad.cpu(), torch.ones(3))


@pytest.mark.parametrize("partition", [None, min_cut_rematerialization_partition], ids=["save", "mincut"])
def test_backward_rereads_views_of_xs_instead_of_stacking_them(device, partition):
    from torch_xla_ext._scan.autograd import _GradPlan
    from torch_xla_ext._scan.saved import _Input, _Recompute

    def fn(c, w):  # c @ w.t() saves a transposed view of the x slice w for the backward
        return c * 2, c @ w.t()

    cpu = {"h": torch.randn(4, 8), "w": torch.randn(3, 6, 8)}
    t = {k: v.to(device).requires_grad_() for k, v in cpu.items()}
    _, ys = txe.scan(fn, t["h"], t["w"], partition_fn=partition)
    (ys * ys).sum().backward()
    ref = {k: v.clone().requires_grad_() for k, v in cpu.items()}
    _, ys_ref = python_scan(fn, ref["h"], ref["w"])
    (ys_ref * ys_ref).sum().backward()
    assert_close_derived(ys, ys_ref, 8 * 3)
    for k in cpu:
        assert_close_derived(t[k].grad, ref[k].grad, 3 * 8 * 6, msg=k)

    f32 = torch.float32
    plan = _GradPlan(lambda c, x: tuple([v] for v in fn(c[0], x[0])), [((4, 8), f32)], [((6, 8), f32)], [True],
                     [], (), length=3, reverse=False, partition_fn=partition)
    assert _Input("x", 0) in [src.base for src in plan.saved_src if isinstance(src, _Recompute)]
    stacked = [shape for shape, _ in plan.saved_sig]
    assert stacked and all(sorted(shape) == [4, 8] for shape in stacked), stacked  # only the carry c


def test_no_grad_mode_builds_no_backward(device):
    w = torch.randn(3, 3).to(device).requires_grad_()
    init = torch.randn(3).to(device)
    with torch.no_grad():
        carry, _ = txe.scan(lambda c, x: (torch.tanh(c @ w), None), init, None, length=5)
    assert not carry.requires_grad
    # A forward built for autograd stacks what the backward needs (f32[5,...]
    # buffers, one row per iteration); the no-grad loop stores nothing per iteration.
    assert "f32[5," not in X._get_xla_tensors_hlo([carry])
    carry_grad, _ = txe.scan(lambda c, x: (torch.tanh(c @ w), None), init, None, length=5)
    assert carry_grad.requires_grad and "f32[5," in X._get_xla_tensors_hlo([carry_grad])


def test_scan_does_not_keep_its_inputs_alive(device, mesh):
    # A tensor that is still alive at the next sync becomes one more output of
    # the synced graph: the gradient step must not hold on to xs.
    import weakref

    w = torch.randn(8, 4).to(device).requires_grad_()
    xs_t = w * 2
    xs.mark_sharding(xs_t, mesh, (None, "fsdp"))
    alive = weakref.ref(xs_t)
    carry, _ = txe.scan(cumsum_fn, torch.zeros(4, device=device), xs_t)
    del xs_t
    loss = carry.sum()
    loss.backward()
    assert alive() is None
    torch.testing.assert_close(w.grad.cpu(), torch.full((8, 4), 2.0))


# ----------------------------------------------------------------------------- jax


def test_cumsum_against_jax_lax_scan(device):
    import jax  # in the test extra: without it the comparison fails rather than skips
    xs_np = np.random.default_rng(1).standard_normal((9, 3)).astype(np.float32)
    jcarry, jys = jax.lax.scan(lambda c, x: (c + x, c + x), jax.numpy.zeros(3), jax.numpy.asarray(xs_np))
    carry, ys = txe.scan(cumsum_fn, torch.zeros(3).to(device), torch.from_numpy(xs_np).to(device))
    np.testing.assert_allclose(carry.cpu().numpy(), np.asarray(jcarry), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ys.cpu().numpy(), np.asarray(jys), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("reverse", [False, True])
def test_against_jax_lax_scan(device, reverse):
    import jax  # in the test extra: without it the comparison fails rather than skips
    jnp = jax.numpy
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 4)).astype(np.float32) * 0.5
    xs_np = rng.standard_normal((6, 4)).astype(np.float32)
    h0 = rng.standard_normal(4).astype(np.float32)

    def jfn(h, x):
        h = jnp.tanh(h @ w + x)
        return h, jnp.cumsum(h)

    jcarry, jys = jax.lax.scan(jfn, jnp.asarray(h0), jnp.asarray(xs_np), reverse=reverse)
    wt = torch.from_numpy(w).to(device)

    def tfn(h, x):
        h = torch.tanh(h @ wt + x)
        return h, torch.cumsum(h, 0)

    carry, ys = txe.scan(tfn, torch.from_numpy(h0).to(device), torch.from_numpy(xs_np).to(device),
                         reverse=reverse)
    np.testing.assert_allclose(carry.cpu().numpy(), np.asarray(jcarry), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(ys.cpu().numpy(), np.asarray(jys), atol=1e-5, rtol=1e-5)


def test_scan_stores_ys_bit_exactly(device):
    # Each stored y goes through a multiply by a runtime one (a compile-time
    # workaround for XLA:CPU); -0.0, inf, nan and integers must come out unchanged.
    special = torch.tensor([[-0.0, float("inf")], [float("nan"), -float("inf")], [1e-45, -3.5]])
    ints = torch.tensor([[2**31 - 1, -2**31], [0, -1], [7, 8]], dtype=torch.int32)
    flags = torch.tensor([[True, False], [False, True], [True, True]])

    def fn(c, x):
        return c, x

    _, ys = txe.scan(fn, torch.zeros((), device=device),
                     (special.to(device), ints.to(device), flags.to(device)))
    assert torch.equal(ys[0].cpu().view(torch.int32), special.view(torch.int32))
    assert torch.equal(ys[1].cpu(), ints) and torch.equal(ys[2].cpu(), flags)
