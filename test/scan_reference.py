"""The references scan is tested against: the Python loop with jax.lax.scan's semantics, and tree comparison."""

from __future__ import annotations

import torch
import torch.utils._pytree as pt


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


def assert_close_trees(a, b, **kw):
    la, sa = pt.tree_flatten(to_cpu(a))
    lb, sb = pt.tree_flatten(to_cpu(b))
    assert sa == sb
    for x, y in zip(la, lb):
        torch.testing.assert_close(x, y, **kw)
