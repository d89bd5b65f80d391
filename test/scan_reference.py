"""The references scan is tested against: the Python loop with jax.lax.scan's semantics, and tree comparison."""

from __future__ import annotations

import torch
import torch.utils._pytree as pt

from torch_xla_ext.testing.tolerances import tolerance


def python_scan(fn, init, xs, length=None, reverse=False):
    """``jax.lax.scan``'s semantics as a Python loop (ys of every iteration stacked)."""
    n = length if xs is None else pt.tree_leaves(xs)[0].shape[0]
    carry, ys = init, [None] * n
    for i in reversed(range(n)) if reverse else range(n):
        x = None if xs is None else pt.tree_map(lambda v, i=i: v[i], xs)
        carry, ys[i] = fn(carry, x)
    if n == 0:
        return carry, None
    return carry, pt.tree_map(lambda *v: None if v[0] is None else torch.stack(v), *ys)


def to_cpu(tree):
    return pt.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, tree)


def assert_close_trees(a, b, reduction_size: int | None = None, **kw):
    """Leaf by leaf: with ``reduction_size``, tolerances as :func:`assert_close_derived`; else ``kw``."""
    la, sa = pt.tree_flatten(to_cpu(a))
    lb, sb = pt.tree_flatten(to_cpu(b))
    assert sa == sb
    for x, y in zip(la, lb):
        if reduction_size is not None and isinstance(y, torch.Tensor) and y.is_floating_point():
            assert_close_derived(x, y, reduction_size)
        else:
            torch.testing.assert_close(x, y, **kw)


def assert_close_derived(actual, expected, reduction_size: int, msg: str | None = None) -> None:
    """``assert_close`` with tolerances from ``expected``'s dtype, ``reduction_size`` and its RMS (see tolerances)."""
    actual, expected = actual.detach().cpu(), expected.detach().cpu()
    scale = max(1.0, float(expected.double().pow(2).mean().sqrt())) if expected.numel() else 1.0
    torch.testing.assert_close(actual, expected, **tolerance(expected.dtype, reduction_size, scale=scale), msg=msg)
