"""What a traced loop cannot do as the Python loop does is refused with a catchable error, never a crash.

Host reads inside ``fn`` (``.item()``, ``if t > 0``, ``print``, ``.cpu()``,
data-dependent shapes), tensors ``fn`` keeps beyond its call, and nested
scans used to kill the process (exit 139) while tracing or at the next
``torch_xla.sync()``. Those cases run in a child process, twice, which must
survive them, get a ``ScanUnsupportedError`` naming the user's line for each,
and then still compute correctly. The rest run here.
"""

from __future__ import annotations

import random
import textwrap

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm

import torch_xla_ext as txe

from child_process import run_surviving
from scan_reference import python_scan

_CHILD = textwrap.dedent('''
    import gc, os, sys
    os.environ.setdefault("PJRT_DEVICE", "CPU"); os.environ.setdefault("CPU_NUM_DEVICES", "8")
    import torch, torch_xla, torch_xla.runtime as xr
    xr.use_spmd()
    import torch_xla_ext as txe
    dev = torch_xla.device()
    kept = []

    def f_item(c, x): return c + x * (c.sum().item() + 1), None
    def f_if(c, x):
        if c.sum() > 0:
            return c + x, None
        return c - x, None
    def f_print(c, x):
        print(c)
        return c + x, None
    def f_nonzero(c, x): return c + x, torch.nonzero(x)
    def f_tolist(c, x): return c + x * len(c.tolist()), None
    def f_cpu(c, x): return c + x.cpu().to(dev), None
    def f_float(c, x): return c + float(x[0]), None
    def f_mask(c, x): return c + x, x[x > 0.5].sum()
    def f_repeat(c, x): return c + x, torch.repeat_interleave(x, (x > 0).long()).sum()  # not in the list
    def f_keep(c, x):
        h = c * 2 + x
        kept.append(h)
        return h, None
    def f_keep_view(c, x):
        h = c * 2 + x
        kept.append(h[1:])
        return c + x, None
    def f_keep_then_read(c, x):  # kept, then refused for another reason: the kept tensor must not crash a sync
        kept.append(c * 3)
        return c + x * c.sum().item(), None
    def f_nested(c, x):
        inner, _ = txe.scan(lambda a, b: (a + b, None), c, x.reshape(2, 2).repeat(1, 2))
        return inner, None

    cases = [name for name in dir() if name.startswith("f_")]
    init, xs = torch.zeros(4, device=dev), torch.ones(3, 4, device=dev)
    for name in sorted(cases):
        for grad in (False, True):
            i = init.clone().requires_grad_(grad)
            try:
                c, _ = txe.scan(globals()[name], i, xs)
                torch_xla.sync()
                print(name, grad, "not refused", c.cpu().tolist(), flush=True)
            except txe.ScanUnsupportedError as error:
                print(name, grad, "refused", "child.py" in str(error) or "<string>" in str(error), flush=True)
            torch_xla.sync()  # with what fn kept still alive
            kept.clear()
            gc.collect()
            torch_xla.sync()
    c, _ = txe.scan(lambda c, x: (c + x, None), init, xs)
    print("alive", c.cpu().tolist(), torch_xla._XLAC._get_allow_execution(), flush=True)
''')


def test_host_reads_kept_tensors_and_nested_scans_are_refused_and_the_process_survives(tmp_path):
    for _ in range(2):  # a crash could be intermittent: run the whole sequence twice
        out = run_surviving(tmp_path, _CHILD)
        lines = [line.split() for line in out.splitlines() if line.startswith(("f_", "alive"))]
        results = {(w[0], w[1]): w[2:] for w in lines if w[0].startswith("f_")}
        assert len(results) == 2 * 13, out
        for (name, grad), rest in results.items():
            # Refused, naming the script's line (the user's code), in both modes.
            assert rest == ["refused", "True"], f"{name} grad={grad}: {rest}\n{out}"
        assert lines[-1] == ["alive", "[3.0,", "3.0,", "3.0,", "3.0]", "True"], out


_CHILD_AFTER_TRACE = textwrap.dedent('''
    import gc, os
    os.environ.setdefault("PJRT_DEVICE", "CPU"); os.environ.setdefault("CPU_NUM_DEVICES", "8")
    import torch, torch_xla, torch_xla.runtime as xr
    xr.use_spmd()
    import torch_xla_ext as txe
    dev = torch_xla.device()
    kept = []

    class Keeper(torch.nn.Module):  # keeps an intermediate; the second layer computes something else
        def __init__(self, scale):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.scale = scale
        def forward(self, h):
            out = self.lin(h) * 2 if self.scale > 1 else self.lin(h)
            kept.append(out)
            return out

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Keeper(1), Keeper(2)]).to(dev)
    x = torch.ones(2, 4, device=dev)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            try:
                txe.scan_layers(layers, x)
                print("case", grad, "not refused", flush=True)
            except (txe.ScanInputError, txe.ScanUnsupportedError) as error:
                print("case", grad, "refused", type(error).__name__, flush=True)
            torch_xla.sync()  # with what both layers' traces kept still alive
            print("kept", grad, len(kept), all(bool(t.isnan().all()) for t in kept), flush=True)
            kept.clear(); gc.collect(); torch_xla.sync()
    with torch.no_grad():
        on_device = layers[0](x).cpu()
        print("alive", torch.allclose(on_device, layers[0].cpu()(x.cpu()), rtol=1e-5, atol=1e-6), flush=True)
''')


def test_tensors_kept_by_a_trace_refused_after_it_ran_are_neutralized_too(tmp_path):
    # The first layer's trace succeeds and keeps a tensor; the second layer's trace (another attribute
    # value) is refused. Before every refusal neutralized what all traces of the call kept, the first
    # layer's kept tensor reached the next sync and killed the process (exit 139).
    for _ in range(2):
        out = run_surviving(tmp_path, _CHILD_AFTER_TRACE)
        assert out.splitlines() == [
            "case False refused ScanUnsupportedError", "kept False 2 True",
            "case True refused ScanUnsupportedError", "kept True 2 True", "alive True"], out


def test_a_refusal_names_the_user_line_and_switches_execution_back_on(device):
    def step(c, x):
        return c + x * c.sum().item(), None  # the host read under test

    with pytest.raises(txe.ScanUnsupportedError, match=r"item\(\).*test_scan_refusals.py:\d+ \(step\)"):
        txe.scan(step, torch.zeros(4, device=device), torch.ones(2, 4, device=device))
    assert torch_xla._XLAC._get_allow_execution()
    assert (torch.ones(2, device=device) * 3).sum().item() == 6.0  # executions work again


@pytest.mark.parametrize("source", ["torch", "random", "numpy"])
def test_host_random_draws_are_refused_and_no_generator_is_rewound(device, source):
    draw = {"torch": lambda: torch.rand(4).to(device),
            "random": lambda: random.random(),
            "numpy": lambda: float(np.random.rand())}[source]

    def step(c, x):
        return c + x * draw(), None

    before = (torch.random.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    at = r" at .*test_scan_refusals.py" if source != "numpy" else ""  # numpy's draw is seen after the trace
    with pytest.raises(txe.ScanUnsupportedError, match=f"draws random numbers from .*{at}"):
        txe.scan(step, torch.zeros(4, device=device), torch.ones(3, 4, device=device))
    # torch's draw is refused before it happens; numpy's is undone under numpy's own lock (no other
    # thread can draw meanwhile). Python's random cannot be put back without rewinding other threads'
    # draws: the first trace drew once, as the loop's first iteration would, and a watched second
    # trace refused the draw before it happened.
    after = random.getstate()
    assert torch.equal(torch.random.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[2])
    random.setstate(before[1])
    if source == "random":
        random.random()  # the one draw of the traced call
    assert after == random.getstate()


def test_device_random_draws_still_differ_per_iteration_and_reproduce(device):
    def step(c, x):
        return c, torch.rand(4, device=x.device) + x

    xm.set_rng_state(7)  # the device's generator (torch.manual_seed seeds the host's)
    _, a = txe.scan(step, torch.zeros(4, device=device), torch.zeros(3, 4, device=device))
    xm.set_rng_state(7)
    _, b = txe.scan(step, torch.zeros(4, device=device), torch.zeros(3, 4, device=device))
    a, b = a.cpu(), b.cpu()
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[1], a[2])


def test_create_graph_through_scan_is_refused_naming_it(device):
    w = torch.full((4,), 0.5, device=device, requires_grad=True)

    def step(c, x):
        return torch.tanh(c * w + x), None

    c, _ = txe.scan(step, torch.zeros(4, device=device), torch.ones(3, 4, device=device))
    loss = c.square().sum()
    with pytest.raises(txe.ScanUnsupportedError, match="create_graph"):
        torch.autograd.grad(loss, w, create_graph=True)
    # Without create_graph the same scan still trains.
    c, _ = txe.scan(step, torch.zeros(4, device=device), torch.ones(3, 4, device=device))
    (g,) = torch.autograd.grad(c.square().sum(), w)
    ref_w = w.detach().cpu().requires_grad_()
    ref, _ = python_scan(lambda c, x: (torch.tanh(c * ref_w + x), None), torch.zeros(4), torch.ones(3, 4))
    (ref_g,) = torch.autograd.grad(ref.square().sum(), ref_w)
    torch.testing.assert_close(g.cpu(), ref_g)


@pytest.mark.parametrize("route", ["data", "numpy"])
def test_host_tensor_written_behind_its_version_counter_is_read_anew(device, route):
    table = torch.tensor([1.0, 2.0, 3.0, 4.0])

    def step(c, x):
        return c + x * table.to(x.device), None

    init, xs_ = torch.zeros(4, device=device), torch.ones(3, 4, device=device)
    first, _ = txe.scan(step, init, xs_)
    if route == "data":
        table.data.mul_(10)
    else:
        table.numpy()[:] *= 10
    second, _ = txe.scan(step, init, xs_)
    torch.testing.assert_close(first.cpu(), torch.tensor([3.0, 6.0, 9.0, 12.0]))
    torch.testing.assert_close(second.cpu(), torch.tensor([30.0, 60.0, 90.0, 120.0]))


def test_equal_host_contents_in_a_new_tensor_reuse_the_loop(device):
    from torch_xla_ext.scan import scan_cache_info

    def step(c, x):
        return c + x * torch.tensor([1.0, 2.0, 3.0, 4.0]).to(x.device), None  # a new host tensor each call

    init, xs_ = torch.zeros(4, device=device), torch.ones(3, 4, device=device)
    txe.scan(step, init, xs_)
    before = scan_cache_info()
    c, _ = txe.scan(step, init, xs_)
    after = scan_cache_info()
    assert (after.hits - before.hits, after.traces - before.traces) == (1, 0)
    torch.testing.assert_close(c.cpu(), torch.tensor([3.0, 6.0, 9.0, 12.0]))


_FIRST_MARK_SHARDING = textwrap.dedent('''
    import os, sys
    os.environ.setdefault("PJRT_DEVICE", "CPU"); os.environ.setdefault("CPU_NUM_DEVICES", "8")
    sys.modules["torchax"] = None
    import numpy as np, torch, torch_xla, torch_xla.runtime as xr
    xr.use_spmd()
    import torch_xla.distributed.spmd as xs
    import torch_xla_ext as txe
    dev = torch_xla.device()
    mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
    assert "jax" not in sys.modules
    state = np.random.get_state()[1].copy()

    def fn(c, x):
        xs.mark_sharding(c, mesh, ("fsdp",))  # its first call imports jax, whose import draws from numpy
        return c + x, None

    c, _ = txe.scan(fn, torch.zeros(8, device=dev), torch.ones(3, 8, device=dev))
    assert "jax" in sys.modules
    print("ok", c.cpu().tolist() == [3.0] * 8, np.array_equal(np.random.get_state()[1], state))
''')


def test_a_module_imported_while_tracing_is_not_taken_for_a_host_draw(tmp_path):
    # In a fresh process: in this one jax is imported already.
    out = run_surviving(tmp_path, _FIRST_MARK_SHARDING)
    # The scan ran, and the first trace's draws (the import's) were undone before the second trace.
    assert "ok True True" in out, out


def test_fn_changing_the_python_state_it_computes_with_is_refused(device):
    # The loop would multiply by 1, 2, 3; one trace for all iterations would multiply by one value.
    calls = [0]

    def counting(c, x):
        calls[0] += 1
        return c * calls[0] + x, None

    with pytest.raises(txe.ScanUnsupportedError,
                       match=r"counting \(.*test_scan_refusals.py:\d+\), changes Python state it can reach "
                             r"\(calls\), and computes with it: iteration 1"):
        txe.scan(counting, torch.zeros(4, device=device), torch.ones(3, 4, device=device))

    class Clocked(torch.nn.Module):  # a value that changes between runs (a clock), as an attribute read
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.ticks = iter(range(1, 10**6))

        def forward(self, h):
            return self.lin(h) * next(self.ticks)

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Clocked() for _ in range(3)]).to(device)
    with pytest.raises(txe.ScanUnsupportedError, match="traced twice in one call"):
        txe.scan_layers(layers, torch.ones(2, 4, device=device))
    assert torch_xla._XLAC._get_allow_execution()


def test_side_effects_that_do_not_change_the_computation_run_once_per_iteration_as_in_the_loop(device):
    log = []

    def logging_step(c, x):
        log.append("traced")  # changes a list fn reaches, but nothing fn computes
        return c + x, None

    init, xs = torch.zeros(4, device=device), torch.ones(3, 4, device=device)
    c, _ = txe.scan(logging_step, init, xs)
    assert c.cpu().tolist() == [3.0] * 4
    assert log == ["traced"] * 3  # traced once per iteration, each alike: the loop's three appends
    txe.scan(logging_step, init, xs)
    assert log == ["traced"] * 6


@pytest.mark.parametrize("period", [2, 3])
def test_fn_computing_with_state_it_changes_is_refused_on_the_first_call_whatever_the_period(device, period):
    # Two traces in one call compared n // 2 at n and n + 1: equal at every other call, so the loop was
    # accepted or refused by the counter's parity, and when accepted gave [4, 4] where the loop gives [6, 6].
    state = {"n": 0}

    def periodic(c, x):
        state["n"] += 1
        return c + x * (state["n"] // period), None

    init, xs = torch.zeros(2, device=device), torch.ones(2 * period, 2, device=device)
    for _ in range(3):
        with pytest.raises(txe.ScanUnsupportedError, match=r"changes Python state it can reach \(state\)"):
            txe.scan(periodic, init, xs)


def test_fn_changing_state_that_every_iteration_computes_alike_gives_the_loop(device):
    # A step counter read only through a branch both sides of which compute the same: traced per
    # iteration, every trace alike, the loop's values and the loop's count.
    seen = {"calls": 0}

    def counted(c, x):
        seen["calls"] += 1
        return c * 0.5 + x, None

    c, _ = txe.scan(counted, torch.zeros(3, device=device), torch.arange(12.0).reshape(4, 3).to(device))
    expected = torch.zeros(3)
    for x in torch.arange(12.0).reshape(4, 3):
        expected = expected * 0.5 + x
    torch.testing.assert_close(c.cpu(), expected)
    assert seen["calls"] == 4


def test_a_method_changing_an_attribute_it_computes_with_is_refused(device):
    class Scaler:
        def __init__(self) -> None:
            self.scale = 1.0

        def step(self, c, x):
            self.scale *= 2.0
            return c + x * self.scale, None

    with pytest.raises(txe.ScanUnsupportedError, match=r"changes Python state it can reach \(self\)"):
        txe.scan(Scaler().step, torch.zeros(2, device=device), torch.ones(3, 2, device=device))


def test_a_long_loop_over_a_state_changing_fn_is_refused_naming_the_bound(device):
    log = []

    def logging_step(c, x):
        log.append(1)
        return c + x, None

    with pytest.raises(txe.ScanUnsupportedError, match=r"this loop has 65 iterations \(at most 64"):
        txe.scan(logging_step, torch.zeros(2, device=device), torch.ones(65, 2, device=device))
    assert len(log) == 1


def test_a_layer_forward_changing_its_own_state_is_refused_by_scan_layers(device):
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)
            self.calls = 0

        def forward(self, h):
            self.calls += 1  # each layer counts its own calls in the loop
            return self.lin(h)

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([Counting() for _ in range(3)]).to(device)
    with pytest.raises(txe.ScanUnsupportedError, match=r"Counting.forward .* changes Python state"):
        txe.scan_layers(layers, torch.ones(2, 4, device=device))
