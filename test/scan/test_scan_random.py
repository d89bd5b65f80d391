"""scan and random numbers.

Device draws per iteration and reproducible, the host generators left where the loop leaves them, a
user's own generator in fn, dropout's mask kept for the backward.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.core.xla_model as xm

import torch_xla_ext as txe
from torch_xla_ext.testing.tolerances import tolerance


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
