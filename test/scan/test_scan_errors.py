"""scan's input errors.

Bad fn outputs name the pytree path, bad inputs raise clear errors catchable as torch_xla raises
them, positional arguments as in torch_xla.
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import min_cut_rematerialization_partition

import torch_xla_ext as txe
from torch_xla_ext.testing.tolerances import tolerance


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
