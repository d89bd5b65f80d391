"""torch_xla_ext.testing.tolerances: bounds follow from eps and the reduction length, and hold."""

from __future__ import annotations

import math

import pytest
import torch

from torch_xla_ext.testing.tolerances import DEFAULT_FACTOR, tolerance


def test_formula():
    eps = torch.finfo(torch.float32).eps
    assert tolerance(torch.float32) == {"atol": DEFAULT_FACTOR * eps, "rtol": DEFAULT_FACTOR * eps}
    assert tolerance(torch.float32, 512)["rtol"] == pytest.approx(DEFAULT_FACTOR * eps * math.sqrt(512))
    assert tolerance(torch.float32, 512, worst_case=True)["rtol"] == pytest.approx(DEFAULT_FACTOR * eps * 512)
    assert tolerance(torch.bfloat16, 4, factor=2.0, scale=10.0) == pytest.approx(
        {"atol": 2.0 * 2.0**-7 * 2 * 10.0, "rtol": 2.0 * 2.0**-7 * 2})
    assert tolerance(torch.float64)["rtol"] < tolerance(torch.float32)["rtol"] < tolerance(torch.float16)["rtol"]
    assert tolerance(torch.int32, 100) == {"atol": 0.0, "rtol": 0.0}
    assert tolerance(torch.bool) == {"atol": 0.0, "rtol": 0.0}


def _sequential_sum(x: torch.Tensor, reverse: bool) -> torch.Tensor:
    total = torch.zeros(x.shape[0], dtype=x.dtype)
    for i in reversed(range(x.shape[1])) if reverse else range(x.shape[1]):
        total = total + x[:, i]
    return total


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [16, 512, 8192])
def test_bound_holds_for_sums_in_another_order(dtype, n):
    """Sums of n terms accumulated in dtype agree, in either order and with a float64 sum,
    within tolerance(dtype, n, scale=RMS of the sums) -- and with a margin of 4x at least."""
    g = torch.Generator().manual_seed(1000 + n)
    x = torch.randn(256, n, generator=g).to(dtype)
    forward, backward = _sequential_sum(x, False), _sequential_sum(x, True)
    exact = x.double().sum(1)
    tol = tolerance(dtype, n, scale=exact.pow(2).mean().sqrt().item())
    torch.testing.assert_close(forward, backward, **tol)
    torch.testing.assert_close(forward.double(), exact, **tol)
    tight = {k: v / 4 for k, v in tol.items()}
    torch.testing.assert_close(forward, backward, **tight)


def test_tolerance_catches_a_dropped_term():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64, 512, generator=g)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(x[:, 1:].sum(1), x.sum(1), **tolerance(torch.float32, 512))


@pytest.mark.parametrize("bad, error", [
    (dict(dtype="float32"), TypeError),
    (dict(dtype=torch.float32, reduction_size=0), ValueError),
    (dict(dtype=torch.float32, reduction_size=2.5), ValueError),
    (dict(dtype=torch.float32, reduction_size=True), ValueError),
    (dict(dtype=torch.float32, factor=0), ValueError),
    (dict(dtype=torch.float32, scale=float("nan")), ValueError),
])
def test_bad_arguments(bad, error):
    with pytest.raises(error, match="dtype|reduction_size|factor|scale"):
        tolerance(**bad)
