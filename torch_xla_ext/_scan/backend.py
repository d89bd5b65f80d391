"""Lowering choices made for one backend's code generation (XLA:CPU), behind one switch.

XLA:CPU emits each fusion as loops over its output's per-device shape (a
dynamic-update-slice fusion over the whole buffer), and LLVM unrolls a plain
copy loop over a small block completely: a ``[16, 512]`` block becomes ~350 KB
of IR that compiles slower than the rest of its fusion together. Two lowering
choices exist only to keep that code small:

* the **row guard** (:func:`_guard`): every slice a loop reads, every value it
  stores and every gradient ``scan_layers`` hands back goes through
  ``select(iota(rows) < bound, value, 0)``, ``bound`` an S32 operand always
  above the row count that is known only at run time, so the copy loops stay
  loops; unlike arithmetic the select keeps every bit;
* **merged stacking layouts** (:func:`~torch_xla_ext._scan.stacking._merged`):
  stacked members with their unsharded dims merged, so each device copies 1-D
  blocks.

:func:`cpu_codegen` turns both on exactly when the XLA device is a CPU; the
environment variable ``TORCH_XLA_EXT_CPU_CODEGEN`` (``1``/``0``) or
:func:`forced_cpu_codegen` forces them on or off. On any other backend a loop
has no bound operand and no select, stacked members keep their shape, and the
first scan uploads nothing.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator

import torch

from .._xla import torch_xla_device, xla_builder
from .cache import on_clear

__all__ = ["CPU_CODEGEN_ENV", "cpu_codegen", "forced_cpu_codegen"]

#: Environment variable forcing the XLA:CPU lowering choices on (``1``) or off (``0``).
CPU_CODEGEN_ENV = "TORCH_XLA_EXT_CPU_CODEGEN"

_forced: list[bool] = []


def cpu_codegen() -> bool:
    """Whether loops are lowered with the XLA:CPU choices (see the module docstring)."""
    if _forced:
        return _forced[-1]
    value = os.environ.get(CPU_CODEGEN_ENV)
    if value is not None:
        if value not in ("0", "1"):
            raise ValueError(f"{CPU_CODEGEN_ENV} must be 1 (XLA:CPU lowering choices on) or 0 (off), got {value!r}")
        return value == "1"
    return _device_is_cpu()


@functools.lru_cache(maxsize=1)
def _device_is_cpu() -> bool:
    import torch_xla.runtime as xr

    return xr.device_type() == "CPU"


@contextlib.contextmanager
def forced_cpu_codegen(on: bool) -> Iterator[None]:
    """Lower with the XLA:CPU choices on or off inside the block, whatever the device (for tests)."""
    _forced.append(bool(on))
    try:
        yield
    finally:
        _forced.pop()


_BOUND = 2**31 - 1


def _guard(bound, sizes: list[int], etype) -> Callable:
    """``value -> select(iota(rows) < bound, value, 0)`` for values of ``sizes``.

    ``bound`` is the S32 scalar :data:`_BOUND`, passed in at run time (see
    :func:`_bound`); with ``bound=None`` (not :func:`cpu_codegen`), for
    scalars, and for more rows than an S32 iota counts, the identity.
    """
    if bound is None or not sizes or sizes[0] > _BOUND:
        return lambda value: value
    xb = xla_builder()
    b = bound.builder()
    rows = xb.Op.iota(b, xb.mkshape(xb.Type.S32, tuple(sizes)), 0)
    keep = rows < bound.broadcast(sizes)
    zeros = xb.Op.zero(b, dtype=etype).broadcast(sizes)
    return lambda value: keep.select(value, zeros)


_bound_tensors: dict[str, torch.Tensor] = {}


def _bound() -> torch.Tensor:
    """An int32 ``[_BOUND]`` on the XLA device (cached): the runtime bound of :func:`_guard`."""
    device = str(torch_xla_device())
    if device not in _bound_tensors:
        _bound_tensors[device] = torch.tensor([_BOUND], dtype=torch.int32).to(device)
    return _bound_tensors[device]


@on_clear
def _clear_bound() -> None:
    _bound_tensors.clear()
