"""scan: values and gradients against Python loops and jax.lax.scan, closures, RNG, caching, errors.

scan_layers is tested in test_scan_layers.py, scan on an SPMD mesh in test_scan_spmd.py.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
from functorch.compile import min_cut_rematerialization_partition

import torch_xla_ext as txe
from torch_xla_ext.scan import clear_scan_cache, scan_cache_info

from scan_reference import assert_close_derived, assert_close_trees, python_scan, to_cpu
from torch_xla_ext.testing.tolerances import tolerance

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


# ----------------------------------------------------------------------------- RNG


def noisy(c, x):
    y = c + torch.rand_like(c)
    return y, y - c


def test_random_ops_differ_per_iteration_and_are_reproducible(device):
    # Reproducible as eager random ops on the device are: under torch_xla's seed (torch.manual_seed does not
    # seed the device's generator, in eager code or in a scan).
    init = torch.zeros(16).to(device)
    xm.set_rng_state(7)
    _, draws_a = txe.scan(noisy, init, None, length=5)
    xm.set_rng_state(7)
    _, draws_b = txe.scan(noisy, init, None, length=5)  # served from the cache
    xm.set_rng_state(8)
    _, draws_c = txe.scan(noisy, init, None, length=5)
    a, b, c = draws_a.cpu(), draws_b.cpu(), draws_c.cpu()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert all(not torch.equal(a[i], a[j]) for i in range(5) for j in range(i))
    assert float(a.min()) >= 0.0 and float(a.max()) < 1.0


def _host_generators() -> tuple:
    return torch.get_rng_state(), random.getstate(), np.random.get_state(legacy=False)


def _same_generators(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and pickle.dumps(a[2]) == pickle.dumps(b[2])


def test_a_scan_that_draws_on_the_device_leaves_the_host_generators_where_the_loop_does(device):
    # Dropout on the device draws from torch_xla's generator; a scan of it must not draw its per-call seed from
    # torch's CPU generator, or the next data shuffle (randperm) differs from the eager loop's.
    layers = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5))
                                 for _ in range(3)).to(device)
    x = torch.randn(4, 8).to(device)
    for run in (lambda: txe.scan(noisy, torch.zeros(16).to(device), None, length=3),
                lambda: txe.scan_layers(layers, x).sum().backward()):
        torch.manual_seed(0)
        before = _host_generators()
        run()
        torch_xla.sync()
        assert _same_generators(before, _host_generators())
        assert torch.equal(torch.randperm(10), (torch.manual_seed(0), torch.randperm(10))[1])


@pytest.mark.parametrize("kind", ["numpy", "random"])
@pytest.mark.parametrize("threshold", [0.5, 2.0])
def test_a_users_own_generator_drawn_in_fn_gives_the_loops_numbers_or_a_refusal(device, kind, threshold):
    # LayerDrop with the user's generator: the trace's draw changes the generator, which the scan sees by its
    # state, so every iteration is traced (drawing as the loop draws) and the scan refuses iterations that trace
    # differently; never the first iteration's draw baked into all of them. threshold 2.0 keeps every layer:
    # every iteration traces alike, and the scan must give the loop's value and leave the generator where the
    # loop leaves it.
    xs = torch.arange(6, dtype=torch.float32).reshape(6, 1).to(device)
    outcomes = []
    for seed in range(12):
        results = []
        for scanned in (True, False):
            rng = np.random.default_rng(seed) if kind == "numpy" else random.Random(seed)

            def drop(c, x):
                return (c, None) if rng.random() > threshold else (c + 2 * x, None)

            if scanned:
                try:
                    c, _ = txe.scan(drop, torch.zeros(1).to(device), xs)
                except txe.ScanUnsupportedError as error:
                    assert "changes Python state it can reach (rng)" in str(error)
                    outcomes.append("refused")
                    break
            else:
                c = torch.zeros(1).to(device)
                for x in xs:
                    c, _ = drop(c, x)
            results.append((float(c.cpu()), rng.random()))  # the value, and where the generator was left
        else:
            assert results[0] == results[1], seed
            outcomes.append("equal")
    assert set(outcomes) <= {"refused", "equal"}
    if threshold > 1:
        assert outcomes == ["equal"] * 12


def test_scan_layers_refuses_layers_that_draw_from_a_generator_of_their_own(device):
    class LayerDrop(torch.nn.Module):
        def __init__(self, rng: np.random.Generator) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.rng = rng

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x if self.rng.random() < 0.5 else x + self.lin(x)

    for rngs in ([np.random.default_rng(0)] * 4, [np.random.default_rng(i) for i in range(4)]):
        layers = torch.nn.ModuleList(LayerDrop(r) for r in rngs).to(device)
        with pytest.raises(txe.ScanUnsupportedError, match=r"changes Python state it can reach \(layer\)"):
            txe.scan_layers(layers, torch.randn(2, 4).to(device))


def test_dropout_under_grad_keeps_its_mask_for_the_backward(device):
    # c_{t+1} = dropout(c_t * w) with a scalar w: c_3 = w^3 m_1 m_2 m_3 c_0 / (1-p)^3
    # whatever masks the iterations draw, so d(sum c_3)/dw = 3 sum(c_3) / w, and
    # every element is 0 or w^3 / (1-p)^3 (torch_xla's own native_dropout, which
    # AOTAutograd's graphs would call, keeps with probability p and scales by 1/p).
    w = torch.tensor(1.5, device=device, requires_grad=True)

    def fn(c, x):
        return torch.nn.functional.dropout(c * w, 0.25, training=True), None

    init = torch.ones(64).to(device)
    out, _ = txe.scan(fn, init, None, length=3)
    out.sum().backward()
    values, total, grad = out.detach().cpu(), out.sum().item(), w.grad.item()
    kept = 1.5**3 / 0.75**3
    assert set(values.unique().tolist()) <= {0.0, kept}
    assert 0 < total < 64 * kept  # some elements dropped, some kept
    assert grad == pytest.approx(3 * total / 1.5, rel=tolerance(torch.float32, 64 * 3)["rtol"])


# --------------------------------------------------------------------------- cache


def scaled_step(c, x):
    return c * 0.5 + x, c


def test_pure_fn_is_traced_and_compiled_once(device):
    clear_scan_cache()
    init, xs_ = torch.randn(4).to(device), torch.randn(3, 4).to(device)
    out1 = txe.scan(scaled_step, init, xs_)
    torch_xla.sync()
    info = scan_cache_info()
    assert info.traces == 1 and info.hits == 0
    init2, xs2 = torch.randn(4).to(device), torch.randn(3, 4).to(device)  # new values, same shapes
    with txe.no_recompiles():  # no recompilation either
        out2 = txe.scan(scaled_step, init2, xs2)
        torch_xla.sync()
    info = scan_cache_info()
    assert info.traces == 1 and info.hits == 1
    assert_close_trees(out2, python_scan(scaled_step, init2.cpu(), xs2.cpu()))
    assert_close_trees(out1, python_scan(scaled_step, init.cpu(), xs_.cpu()))
    txe.scan(scaled_step, torch.randn(5).to(device), torch.randn(3, 5).to(device))  # new shapes
    assert scan_cache_info().traces == 2
    txe.scan(scaled_step, init2, xs2, is_fn_pure=False)
    assert scan_cache_info().traces == 3


def test_cached_plan_reads_current_values_of_outside_tensors(device):
    w = torch.ones(3).to(device)

    def fn(c, x):
        return c + w * x, None

    init, xs_ = torch.zeros(3).to(device), torch.ones(2, 3).to(device)
    first, _ = txe.scan(fn, init, xs_)
    torch.testing.assert_close(first.cpu(), torch.full((3,), 2.0))
    with torch.no_grad():
        w.mul_(10)  # an optimizer-style in-place update between calls
    torch_xla.sync()
    second, _ = txe.scan(fn, init, xs_)
    torch.testing.assert_close(second.cpu(), torch.full((3,), 20.0))


def test_bound_methods_are_cached(device):
    class Stepper:
        def __init__(self) -> None:
            self.scale = 0.5

        def step(self, c, x):
            return c * self.scale + x, None

    stepper = Stepper()
    init, xs_ = torch.zeros(3).to(device), torch.ones(2, 3).to(device)
    txe.scan(stepper.step, init, xs_)
    before = scan_cache_info()
    carry, _ = txe.scan(stepper.step, init, xs_)  # a new bound-method object, same function and instance
    after = scan_cache_info()
    assert after.traces == before.traces and after.hits == before.hits + 1
    torch.testing.assert_close(carry.cpu(), torch.full((3,), 1.5))


def test_a_lambda_made_anew_each_step_reuses_its_loop_and_reads_its_own_closure(device):
    # Functions are cached under their code: a lambda written inside a training step is a new object every
    # step and used to lower its loop again every time. Closures of one code over other tensors or numbers
    # must still compute with their own.
    def make(w, scale):
        return lambda c, x: (torch.tanh(c @ w) * scale + x, None)

    ws = [torch.randn(4, 4) for _ in range(3)]
    init, xs_ = torch.randn(2, 4), torch.randn(3, 2, 4)
    cases = [(ws[0], 1.0), (ws[1], 1.0), (ws[2], 1.0), (ws[0], 0.5), (ws[1], 0.5)]
    before = scan_cache_info()
    for w, scale in cases:
        got, _ = txe.scan(make(w.to(device), scale), init.to(device), xs_.to(device))
        want, _ = python_scan(make(w, scale), init, xs_)
        assert_close_derived(got, want, reduction_size=4)
    after = scan_cache_info()
    # One loop per distinct trace (the two scales), reused by the other closures.
    assert after.traces - before.traces == 2 and after.hits - before.hits == 3


# -------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "fn,match",
    [
        (lambda c, x: ({"a": c["a"]}, None), r"structure"),
        (lambda c, x: ({"a": c["a"], "b": c["b"][:1]}, None), r"carry\['b'\].*shape"),
        (lambda c, x: ({"a": c["a"].double(), "b": c["b"]}, None), r"carry\['a'\].*float64"),
        (lambda c, x: c, r"pair"),
        (lambda c, x: ({"a": c["a"], "b": 3.0}, None), r"carry\['b'\].*torch.Tensor"),
        (lambda c, x: (c, [x, "text"]), r"y\[1\].*torch.Tensor"),
    ],
    ids=["structure", "shape", "dtype", "not-a-pair", "non-tensor-carry", "non-tensor-y"],
)
def test_bad_fn_errors_name_the_pytree_path(device, fn, match):
    init = {"a": torch.zeros(2).to(device), "b": torch.zeros(3).to(device)}
    with pytest.raises((ValueError, TypeError), match=match):
        txe.scan(fn, init, torch.zeros(2, 1).to(device))


def test_bad_inputs_raise_clear_errors(device):
    ok = lambda c, x: (c, None)  # noqa: E731
    c = torch.zeros(2).to(device)
    with pytest.raises(ValueError, match=r"xs\['b'\] has 3"):
        txe.scan(ok, c, {"a": torch.zeros(2, 1).to(device), "b": torch.zeros(3, 1).to(device)})
    with pytest.raises(TypeError, match=r"init\[1\].*torch.Tensor"):
        txe.scan(ok, (c, 1.0), torch.zeros(2, 1).to(device))
    with pytest.raises(TypeError, match=r"xs\[0\].*XLA device"):
        txe.scan(ok, c, [torch.zeros(2, 1)])
    with pytest.raises(ValueError, match="length is required"):
        txe.scan(ok, c, None)
    with pytest.raises(ValueError, match="length=3"):
        txe.scan(ok, c, torch.zeros(2, 1).to(device), length=3)
    with pytest.raises(ValueError, match=r"xs\[0\] is a scalar"):
        txe.scan(ok, c, [torch.zeros(()).to(device)])
    with pytest.raises(TypeError, match="callable"):
        txe.scan(None, c, None, length=1)
    with pytest.raises(ValueError, match="non-negative"):
        txe.scan(ok, c, None, length=-1)
    with pytest.raises(ValueError, match="32-bit counter"):  # the loop counter is s32
        txe.scan(ok, c, None, length=2**31)


def test_errors_are_catchable_as_torch_xla_raises_them(device):
    # torch_xla's scan raises ValueError for a non-callable fn; ours raises a
    # ScanInputError, both a TypeError and a ValueError.
    c = torch.zeros(2).to(device)
    for bad in (1000, None):
        with pytest.raises(ValueError, match="callable") as info:
            txe.scan(bad, c, torch.zeros(2, 1).to(device))
        assert isinstance(info.value, TypeError) and isinstance(info.value, txe.ScanInputError)
    with pytest.raises(ValueError, match=r"partition_fn must be callable.*length="):
        txe.scan(lambda c, x: (c, None), c, None, 3)


def test_partition_fn_and_is_fn_pure_by_position_as_in_torch_xla(device):
    w = torch.randn(3, 3).to(device).requires_grad_()

    def fn(c, x):
        return torch.tanh(c @ w + x), None

    init, xs_ = torch.randn(3).to(device), torch.randn(4, 3).to(device)
    expected, _ = txe.scan(fn, init, xs_)
    (expected.sum()).backward()
    g_default = w.grad.cpu()
    w.grad = None
    got, _ = txe.scan(fn, init, xs_, min_cut_rematerialization_partition, False)
    got.sum().backward()
    assert torch.equal(got.cpu(), expected.cpu())
    torch.testing.assert_close(w.grad.cpu(), g_default, **tolerance(torch.float32, 4 * 3))


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
