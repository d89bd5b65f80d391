"""scan over an autograd.Function built on a custom operator: the loop's values and gradients.

torch_xla's Pallas kernels (flash attention) come to a model this way: a
``torch.library.custom_op`` returning several tensors, called in an
``autograd.Function`` that saves some of them for its backward. AOTAutograd
hands such a call's values, unwrapped, to the ops it runs for it; scan must
take them for what they are (its own trace's values), not for tensors fn
read from outside.
"""

from __future__ import annotations

import torch

import torch_xla_ext as txe
from scan_reference import python_scan
from torch_xla_ext.testing.tolerances import tolerance


@torch.library.custom_op("txe_test::square_doubled_and_kept", mutates_args=())
def square_doubled_and_kept(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return x * x * scale, x.clone()


@square_doubled_and_kept.register_fake
def _(x: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


class _ScaleBySquare(torch.autograd.Function):
    """``2 x^2``: the operator's first output, returned and saved with the second, as torch_xla's flash
    attention saves its output; the backward ``4 x g`` from what was saved."""

    @staticmethod
    def forward(ctx, x):
        out, kept = square_doubled_and_kept(x, 2.0)
        ctx.save_for_backward(kept, out)
        return out

    @staticmethod
    def backward(ctx, grad):
        kept, out = ctx.saved_tensors
        return torch.where(out >= 0, 4.0 * kept * grad, torch.nan)


def _step(c, x):
    c = _ScaleBySquare.apply(torch.tanh(c)) + x
    return c, c.sum()


def test_a_custom_operator_in_an_autograd_function_gives_the_loops_values_and_gradients(device):
    gen = torch.Generator().manual_seed(0)
    init, xs = torch.randn(5, generator=gen), torch.randn(4, 5, generator=gen)
    cpu_init = init.clone().requires_grad_()
    want_c, want_ys = python_scan(_step, cpu_init, xs)
    (want_c.sum() + want_ys.sum()).backward()

    xla_init = init.to(device).requires_grad_()
    got_c, got_ys = txe.scan(_step, xla_init, xs.to(device))
    (got_c.sum() + got_ys.sum()).backward()
    tol = tolerance(torch.float32, 4 * 5)
    torch.testing.assert_close(got_c.cpu(), want_c.detach(), **tol)
    torch.testing.assert_close(got_ys.cpu(), want_ys.detach(), **tol)
    torch.testing.assert_close(xla_init.grad.cpu(), cpu_init.grad, **tol)


def test_a_new_outside_tensor_is_still_read_beside_such_a_call(device):
    # What scan takes for its own trace's values is only those: a tensor fn reads from outside on a later
    # call, and did not read the first time, is still seen (and read), never baked in from the first.
    w = [torch.ones(5, device=device)]

    def step(c, x):
        return _ScaleBySquare.apply(c) * w[0] + x, None

    init, xs = torch.ones(5, device=device), torch.ones(3, 5, device=device)
    txe.scan(step, init, xs)
    w[0] = torch.full((5,), 2.0, device=device)
    out, _ = txe.scan(step, init, xs)  # a new outside tensor: read fresh, as the loop would
    want = torch.ones(5)
    for _ in range(3):
        want = 2 * want * want * 2.0 + 1
    torch.testing.assert_close(out.cpu(), want, **tolerance(torch.float32, 3))
