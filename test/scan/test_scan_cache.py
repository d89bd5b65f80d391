"""scan's cache.

A pure fn is traced and compiled once, cached plans read the current values of outside tensors,
bound methods and lambdas made anew reuse their loop.
"""

from __future__ import annotations

import torch
import torch_xla

import torch_xla_ext as txe
from torch_xla_ext.scan import clear_scan_cache, scan_cache_info

from scan_reference import assert_close_derived, assert_close_trees, python_scan


# --------------------------------------------------------------------------- cache


def scaled_step(c, x):
    return c * 0.5 + x, c


def test_pure_fn_is_traced_and_compiled_once(device):
    clear_scan_cache()
    torch_xla.sync()  # what an earlier test left pending would ride along with the first scan's sync only
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
