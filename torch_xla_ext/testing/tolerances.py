"""Comparison tolerances derived from a dtype and the length of the reductions involved.

``torch.testing.assert_close(actual, expected, **tolerance(torch.float32, 512))``
compares two results of the same computation that were evaluated differently
(XLA against eager CPU, a ``while`` loop against an unrolled one, another
summation order) with bounds that follow from floating-point error analysis
instead of hand-picked constants.

Derivation. With unit roundoff ``u = eps / 2`` (``eps = torch.finfo(dtype).eps``),
one correctly rounded operation has relative error at most ``u``. A sum or dot
product of ``n`` terms accumulated in ``dtype`` has error at most
``gamma_n * sum|x_i|`` with ``gamma_n = n*u / (1 - n*u)`` (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., section 4.2): the worst case grows
linearly in ``n``. When rounding errors behave like independent zero-mean
random variables the bound becomes ``lambda * sqrt(n) * u`` with probability at
least ``1 - 2*exp(-lambda**2 / 2)`` (Higham and Mary, *A New Approach to
Probabilistic Rounding Error Analysis*, SIAM J. Sci. Comput. 41(5), 2019).
Two evaluations of the same expression can each be off by that much, in
opposite directions, so their difference is bounded by twice that.

This module therefore returns ``rtol = factor * eps * g(n)`` with
``g(n) = sqrt(n)`` (the default, probabilistic) or ``g(n) = n``
(``worst_case=True``). The default ``factor = 8`` is ``2 * lambda * u / eps``
with ``lambda = 8``: the probability that an honest implementation exceeds the
bound is below ``2 * exp(-32)``, about ``2.5e-14``, per element, so seeded tests
built on it do not fail by chance, while a real bug (a dropped term, a wrong
sign, a missing scale) is many orders of magnitude larger.

``atol = rtol * scale``, with ``scale`` the typical magnitude of the compared
values (for example the RMS of the expected tensor; default 1, right for
normalized activations, losses and means). Each element's rounding error is
relative to the size of its partial sums, which for terms of random sign is the
typical size of the outputs, not the size of that element: an element that
cancels to nearly zero still carries the absolute error of a typical one.
(Measured on sequential sums of ``n`` standard normal terms in float32,
bfloat16 and float16, ``n`` up to 8192, against the reverse order and against
a float64 sum: the largest difference is about 0.05 of this bound.)

``reduction_size`` is the number of terms in the longest chain of
accumulations that feeds one compared element: the inner dimension of a
matmul, the number of elements averaged by a mean; for stacked layers whose
errors feed each other, the sum of their lengths (``L`` layers of inner
dimension ``d``: ``L * d``). When in
doubt, overestimate it: the bound grows only with its square root.

Integer and boolean dtypes are exact: ``atol = rtol = 0``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["DEFAULT_FACTOR", "tolerance"]

#: Safety factor over the unit roundoff (``2 * lambda * u / eps`` with ``lambda = 8``).
DEFAULT_FACTOR = 8.0


def tolerance(
    dtype: torch.dtype,
    reduction_size: int = 1,
    *,
    factor: float = DEFAULT_FACTOR,
    scale: float = 1.0,
    worst_case: bool = False,
) -> dict[str, float]:
    """``{"atol": ..., "rtol": ...}`` for comparing results computed in ``dtype``.

    Args:
      dtype: the dtype the compared results were computed (and accumulated) in.
      reduction_size: terms in the longest accumulation feeding one element
        (>= 1; 1 for purely elementwise code).
      factor: multiple of ``eps`` per unit of growth (default 8; see the
        module docstring for what it buys).
      scale: typical magnitude of the compared values (e.g. the RMS of the
        expected tensor); ``atol = rtol * scale``.
      worst_case: grow linearly in ``reduction_size`` (the deterministic bound)
        instead of with its square root (the probabilistic one).

    Returns a dict to unpack into ``torch.testing.assert_close`` (or
    ``torch.allclose`` / ``numpy.testing.assert_allclose``). Moves no data.
    """
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}; pass e.g. torch.float32")
    if isinstance(reduction_size, bool) or not isinstance(reduction_size, int) or reduction_size < 1:
        raise ValueError(f"reduction_size must be an int >= 1 (the number of accumulated terms), "
                         f"got {reduction_size!r}; pass 1 for elementwise results")
    for name, value in (("factor", factor), ("scale", scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive finite number, got {value!r}")
    if not (dtype.is_floating_point or dtype.is_complex):
        return {"atol": 0.0, "rtol": 0.0}
    eps = torch.finfo(dtype).eps
    growth = float(reduction_size) if worst_case else math.sqrt(reduction_size)
    rtol = float(factor) * eps * growth
    return {"atol": rtol * float(scale), "rtol": rtol}
