"""scan: values and gradients against Python loops and jax.lax.scan, closures, RNG, SPMD, caching, errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.debug.metrics as met
import torch_xla.distributed.spmd as xs
from functorch.compile import min_cut_rematerialization_partition

import torch_xla_ext as txe
from torch_xla_ext.scan import clear_scan_cache, scan_cache_info
from torch_xla_ext.testing import measure_transfers
from torch_xla_ext.testing.tolerances import tolerance

from scan_reference import assert_close_derived, assert_close_trees, python_scan, to_cpu

X = torch_xla._XLAC


def spec(t: torch.Tensor) -> str:
    return X._get_xla_sharding_spec(t)


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


@pytest.mark.parametrize("partition", [None, min_cut_rematerialization_partition], ids=["save", "mincut"])
def test_backward_rereads_views_of_xs_instead_of_stacking_them(device, partition):
    from torch_xla_ext._scan.autograd import _GradPlan

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
    assert ("x", 0) in [src[1] for src in plan.saved_src if src[0] == "recompute"]
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


# ----------------------------------------------------------------------------- RNG


def noisy(c, x):
    y = c + torch.rand_like(c)
    return y, y - c


def test_random_ops_differ_per_iteration_and_are_reproducible(device):
    init = torch.zeros(16).to(device)
    torch.manual_seed(7)
    _, draws_a = txe.scan(noisy, init, None, length=5)
    torch.manual_seed(7)
    _, draws_b = txe.scan(noisy, init, None, length=5)  # served from the cache
    torch.manual_seed(8)
    _, draws_c = txe.scan(noisy, init, None, length=5)
    a, b, c = draws_a.cpu(), draws_b.cpu(), draws_c.cpu()
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert all(not torch.equal(a[i], a[j]) for i in range(5) for j in range(i))
    assert float(a.min()) >= 0.0 and float(a.max()) < 1.0


# ---------------------------------------------------------------------------- SPMD


def test_spmd_1d_forward_backward_without_host_transfers(device, mesh_1d):
    L, D = 4, 64
    ws = torch.randn(L, D, D).to(device) / D**0.5
    xs.mark_sharding(ws, mesh_1d, (None, "fsdp", None))
    ws.requires_grad_()
    emb = torch.randn(D, D).to(device)
    xs.mark_sharding(emb, mesh_1d, ("fsdp", None))
    emb.requires_grad_()
    h0 = torch.randn(16, D).to(device)
    xs.mark_sharding(h0, mesh_1d, ("fsdp", None))
    torch_xla.sync()

    def layer(h, w):
        out = torch.relu(h @ w) @ emb + h
        return out, out.mean()

    with measure_transfers() as m:
        with txe.no_host_transfers():
            carry, ys = txe.scan(layer, h0, ws)
            (carry.sum() + ys.sum()).backward()
            torch_xla.sync()
    assert not m.device_to_host, m.report()
    assert spec(carry) == spec(h0)
    assert spec(ws.grad) == spec(ws) and spec(emb.grad) == spec(emb)
    # numerics against an eager CPU loop
    ws_c, emb_c, h_c = ws.detach().cpu().requires_grad_(), emb.detach().cpu().requires_grad_(), h0.cpu()
    ref_carry, ref_ys = python_scan(lambda h, w: ((torch.relu(h @ w) @ emb_c + h),) * 2, h_c, ws_c)
    (ref_carry.sum() + ref_ys.mean(dim=(1, 2)).sum()).backward()
    assert_close_derived(carry, ref_carry, L * 2 * D)
    assert_close_derived(ws.grad, ws_c.grad, L * 2 * D * 16)
    assert_close_derived(emb.grad, emb_c.grad, L * 2 * D * 16)


def test_spmd_2d_shardings_and_mark_sharding_inside_fn(device, mesh_4x2):
    D = 32
    ws = torch.randn(3, D, D).to(device) / D**0.5
    xs.mark_sharding(ws, mesh_4x2, (None, "x", "y"))
    ws.requires_grad_()
    h0 = torch.randn(8, D).to(device)
    xs.mark_sharding(h0, mesh_4x2, ("x", "y"))
    h0.requires_grad_()
    torch_xla.sync()

    def layer(h, w):
        xs.mark_sharding(h, mesh_4x2, ("x", None))  # torch_xla issue 8742: the input is device data
        out = torch.tanh(h @ w)
        return out, None

    with measure_transfers() as m:
        with txe.no_host_transfers():
            carry, _ = txe.scan(layer, h0, ws)
            carry.sum().backward()
            torch_xla.sync()
    assert not m.device_to_host, m.report()
    assert spec(carry) == spec(h0) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert spec(ws.grad) == spec(ws) and spec(h0.grad) == spec(h0)
    ws_c, h_c = ws.detach().cpu().requires_grad_(), h0.detach().cpu().requires_grad_()
    ref, _ = python_scan(lambda h, w: (torch.tanh(h @ w), None), h_c, ws_c)
    ref.sum().backward()
    assert_close_derived(carry, ref, 3 * D)
    assert_close_derived(ws.grad, ws_c.grad, 3 * D * 8)
    assert_close_derived(h0.grad, h_c.grad, 3 * D * 8)


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
    compiles = met.metric_data("CompileTime")[0]
    init2, xs2 = torch.randn(4).to(device), torch.randn(3, 4).to(device)  # new values, same shapes
    out2 = txe.scan(scaled_step, init2, xs2)
    torch_xla.sync()
    info = scan_cache_info()
    assert info.traces == 1 and info.hits == 1
    assert met.metric_data("CompileTime")[0] == compiles  # no recompilation either
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


# ---------------------------------------------------------------------- scan_layers


class Block(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def make_blocks(n: int, dim: int = 16, hidden: int = 32, seed: int = 0) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block(dim, hidden) for _ in range(n))


def test_scan_layers_matches_the_plain_loop(device):
    cpu_layers = make_blocks(4)
    xla_layers = make_blocks(4).to(device)
    x_cpu = torch.randn(5, 16)
    out = txe.scan_layers(xla_layers, x_cpu.to(device))
    ref = x_cpu
    for layer in cpu_layers:
        ref = layer(ref)
    out.square().sum().backward()
    ref.square().sum().backward()
    assert_close_derived(out, ref, 4 * (16 + 32))
    for (name, p), (_, p_ref) in zip(xla_layers.named_parameters(), cpu_layers.named_parameters()):
        assert p.grad is not None, name
        assert_close_derived(p.grad, p_ref.grad, 4 * (16 + 32) * 5, msg=name)


def test_scan_layers_keeps_shardings_and_moves_nothing_to_host(device, mesh_1d):
    layers = make_blocks(3, dim=32, hidden=64).to(device)
    for layer in layers:
        xs.mark_sharding(layer.up.weight, mesh_1d, ("fsdp", None))
        xs.mark_sharding(layer.down.weight, mesh_1d, (None, "fsdp"))
    x = torch.randn(8, 32).to(device)
    xs.mark_sharding(x, mesh_1d, ("fsdp", None))
    torch_xla.sync()
    with measure_transfers() as m:
        with txe.no_host_transfers():
            out = txe.scan_layers(layers, x)
            out.sum().backward()
            torch_xla.sync()
    assert not m.device_to_host, m.report()
    for layer in layers:
        assert spec(layer.up.weight.grad) == spec(layer.up.weight) != ""
        assert spec(layer.down.weight.grad) == spec(layer.down.weight) != ""
    assert spec(out) == spec(x)


@pytest.mark.parametrize("shape, tiles, merged", [
    ((128, 512), (8, 1), ((65536,), (8,))),        # sharded major dim: one contiguous block per device
    ((128, 512), (1, 8), ((128, 512), (1, 8))),     # sharded minor dim: nothing to merge
    ((4, 6, 8), (1, 2, 1), ((4, 48), (1, 2))),      # the minor dims merge into the sharded one
    ((4, 6, 8), (1, 1, 1), ((192,), (1,))),         # unsharded: flat
    ((10, 512), (8, 1), ((10, 512), (8, 1))),       # uneven: padded blocks would not line up
    ((), (), ((), ())),
])
def test_stacked_members_merge_only_dims_that_keep_blocks_contiguous(shape, tiles, merged):
    from torch_xla_ext._scan.stacking import _merged

    assert _merged(shape, tiles) == merged


def test_scan_layers_on_a_2d_mesh_matches_the_plain_loop(device, mesh_4x2):
    # Weights sharded on both dims, on the minor dim only, partially
    # replicated, and a sharded bias: each takes another stacked layout.
    cpu_layers = make_blocks(3, dim=16, hidden=32)
    layers = make_blocks(3, dim=16, hidden=32).to(device)
    for layer in layers:
        xs.mark_sharding(layer.up.weight, mesh_4x2, ("x", "y"))
        xs.mark_sharding(layer.up.bias, mesh_4x2, ("y",))
        xs.mark_sharding(layer.down.weight, mesh_4x2, (None, "x"))
    x_cpu = torch.randn(8, 16)
    x = x_cpu.to(device)
    xs.mark_sharding(x, mesh_4x2, ("x", None))
    torch_xla.sync()
    with measure_transfers() as m:
        with txe.no_host_transfers():
            out = txe.scan_layers(layers, x)
            out.square().sum().backward()
            torch_xla.sync()
    assert not m.device_to_host, m.report()
    ref = x_cpu
    for layer in cpu_layers:
        ref = layer(ref)
    ref.square().sum().backward()
    assert_close_derived(out, ref, 3 * (16 + 32))
    annotated = {"up.weight", "up.bias", "down.weight"}  # the rest are left to propagation, as in a loop
    for (name, p), (_, p_ref) in zip(layers.named_parameters(), cpu_layers.named_parameters()):
        if name.split(".", 1)[1] in annotated:
            assert spec(p.grad) == spec(p) != "{replicated}", name
        assert_close_derived(p.grad, p_ref.grad, 3 * (16 + 32) * 8, msg=name)


def _stacking_profile(layers, x) -> tuple[int, int, int]:
    """(concatenates, slices, constants) in the lowered graph of scan_layers' per-layer gradients."""
    for p in layers.parameters():
        p.grad = None
    txe.scan_layers(layers, x).square().sum().backward()
    ctx = txe.LoweringContext("stacking")
    ctx.build([p.grad for p in layers.parameters()])
    ops = [inst.opcode for comp in ctx.module.computations for inst in comp.instructions]
    return ops.count("concatenate"), ops.count("slice"), ops.count("constant")


def test_scan_layers_stacking_does_not_grow_with_depth(device, mesh_1d):
    # Handing gradients back with one constant-offset slice per layer makes
    # XLA generate a kernel per layer: compile time grows with the depth. The
    # offsets are runtime operands, and stacking is one concatenate per
    # parameter whatever the depth, so the graph has no per-layer constants.
    profiles = {}
    for n in (2, 5):
        layers = make_blocks(n).to(device)
        for layer in layers:
            xs.mark_sharding(layer.up.weight, mesh_1d, ("fsdp", None))
        profiles[n] = _stacking_profile(layers, torch.randn(4, 16).to(device))
    concatenates, slices, constants = profiles[5]
    assert slices == 0, profiles
    assert concatenates == len(list(make_blocks(1).parameters())), profiles
    assert profiles[2] == profiles[5], profiles


def test_scan_does_not_keep_its_inputs_alive(device, mesh_1d):
    # A tensor that is still alive at the next sync becomes one more output of
    # the synced graph: the gradient step must not hold on to xs.
    import weakref

    w = torch.randn(8, 4).to(device).requires_grad_()
    xs_t = w * 2
    xs.mark_sharding(xs_t, mesh_1d, (None, "fsdp"))
    alive = weakref.ref(xs_t)
    carry, _ = txe.scan(cumsum_fn, torch.zeros(4, device=device), xs_t)
    del xs_t
    loss = carry.sum()
    loss.backward()
    assert alive() is None
    torch.testing.assert_close(w.grad.cpu(), torch.full((8, 4), 2.0))


def test_scan_layers_reuses_its_trace(device):
    layers = make_blocks(2).to(device)
    x = torch.randn(3, 16).to(device)
    with torch.no_grad():
        txe.scan_layers(layers, x)
        before = scan_cache_info()
        txe.scan_layers(layers, torch.randn(3, 16).to(device))
    after = scan_cache_info()
    assert after.traces == before.traces and after.hits == before.hits + 1


def test_scan_layers_rejects_heterogeneous_layers(device, mesh_1d):
    layers = make_blocks(3).to(device)
    x = torch.randn(2, 16).to(device)
    mixed = [layers[0], torch.nn.Linear(16, 16).to(device)]
    with pytest.raises(TypeError, match=r"layers\[1\] is a Linear"):
        txe.scan_layers(mixed, x)
    wide = make_blocks(1, hidden=48).to(device)[0]
    with pytest.raises(ValueError, match=r"layers\[2\].up.weight has shape \(48, 16\)"):
        txe.scan_layers([layers[0], layers[1], wide], x)
    xs.mark_sharding(layers[1].up.weight, mesh_1d, ("fsdp", None))
    with pytest.raises(ValueError, match=r"layers\[1\].up.weight has sharding"):
        txe.scan_layers(layers, x)
    assert txe.scan_layers([], x) is x


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


def test_training_steps_after_the_first_do_not_recompile(device, mesh_1d):
    """Unannotated parameters read '' before their first execution and '{replicated}' after it."""
    layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2)).to(device)
    for layer in layers:
        xs.mark_sharding(layer.weight, mesh_1d, ("fsdp", None))  # biases stay unannotated
    x = torch.randn(8, 16)
    compiles = []
    for _ in range(3):
        before = met.metric_data("CompileTime")[0]
        layers.zero_grad(set_to_none=True)
        xd = x.to(device)
        xs.mark_sharding(xd, mesh_1d, ("fsdp", None))
        txe.scan_layers(layers, xd).sum().backward()
        torch_xla.sync()
        compiles.append(met.metric_data("CompileTime")[0] - before)
    assert compiles[1:] == [0, 0], compiles


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


def test_scan_layers_with_a_layer_on_the_cpu_names_it_and_the_fix(device):
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4) for _ in range(3)])
    x = torch.ones(2, 4, device=device)
    with pytest.raises(TypeError, match=r"layers\[0\]\.weight is on cpu; move the layers to the XLA device"):
        txe.scan_layers(layers, x)
    layers[0].to(device)
    layers[2].to(device)
    with pytest.raises(TypeError, match=r"layers\[1\]\.weight is on cpu"):
        txe.scan_layers(layers, x)
