"""Lowering choices made for one backend's code generation (XLA:CPU), behind one switch.

XLA:CPU emits each fusion as loops over its output's per-device shape (a
dynamic-update-slice fusion over the whole buffer), and LLVM unrolls a plain
copy loop over a small block completely: a ``[16, 512]`` block becomes ~350 KB
of IR that compiles slower than the rest of its fusion together. Two lowering
choices exist only to keep that code small:

* the **index guard** (:func:`_guard`): every slice a loop reads and every
  gradient ``scan_layers`` hands back goes through
  ``select(iota < bound, value, 0)``, the iota along the value's last
  dimension and ``bound`` a value always above that dimension's size that XLA
  cannot compute at compile time (:func:`runtime_bound`: ``index | 2**30`` of
  a runtime index already there, the loop counter or a member offset), so the
  copy loops stay loops; unlike arithmetic the select keeps every bit. The
  iota runs along the last dimension because SPMD layouts leave it unsharded
  (batch-sharded activations, FSDP's dim-0 parameter shards): an iota along
  a sharded dimension depends on the partition, XLA hoists it out of the loop
  as a table, and every iteration then reads that table from memory next to
  the value. Measured side by side (``fully_shard`` + ``scan_layers``, decoder
  blocks, 8 devices, L = 4 / 8 / 16): the last-dimension iota runs the step's
  device time 5-7% faster and compiles 15-20% faster than a first-dimension
  one. Every value a loop stores goes through the cheaper
  :func:`_scalar_guard`, ``select(bound > 0, value, 0)`` (measured with the
  first-dimension guard: 5-7% faster steps, the same compile time); a scalar
  guard on the reads instead compiles 1.5x slower;
* **merged stacking layouts** (:func:`~torch_xla_ext._scan_layers.stacking._merged`):
  stacked members with their unsharded dims merged, so each device's block is
  1-D. A loop's read of a member is still emitted in the member's shape:
  XLA fuses the step's reshape into the read as its root (a guarded read of a
  ``[16, 128]`` block measured 140 KB of straight-line IR, the same read kept
  1-D 12 KB with a loop).

:func:`cpu_codegen` turns both on exactly when the XLA device is a CPU; the
environment variable ``TORCH_XLA_EXT_CPU_CODEGEN`` (``1``/``0``) or
:func:`forced_cpu_codegen` forces them on or off, on the thread that enters it.
A scan's backward loop is lowered on autograd's thread, later: it keeps the
choice its forward was planned with. On any other backend a loop
has no select and stacked members keep their shape. The bound is never an
operand: no backend uploads anything for it. A computation built with either
choice carries :data:`CPU_CODEGEN_MARK` in its name (:func:`computation_name`),
so a program compiled for another backend (``tpu.compile``) can tell.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator

from .._xla import xla_builder

__all__ = ["CPU_CODEGEN_ENV", "CPU_CODEGEN_MARK", "computation_name", "cpu_codegen", "forced_cpu_codegen"]

#: Environment variable forcing the XLA:CPU lowering choices on (``1``) or off (``0``).
CPU_CODEGEN_ENV = "TORCH_XLA_EXT_CPU_CODEGEN"

#: Part of the name of every computation built with an XLA:CPU lowering choice.
CPU_CODEGEN_MARK = "_cpu_codegen"


class _Forced(threading.local):
    """The choices forced on this thread, innermost last."""

    def __init__(self) -> None:
        self.stack: list[bool] = []


_forced = _Forced()


def computation_name(name: str, cpu_choices: bool) -> str:
    """``name``, marked with :data:`CPU_CODEGEN_MARK` when the computation uses an XLA:CPU choice."""
    return name + CPU_CODEGEN_MARK if cpu_choices else name


def cpu_codegen() -> bool:
    """Whether loops are lowered with the XLA:CPU choices (see the module docstring)."""
    if _forced.stack:
        return _forced.stack[-1]
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
    """Lower with the XLA:CPU choices on or off inside the block, whatever the device; on this thread only."""
    _forced.stack.append(bool(on))
    try:
        yield
    finally:
        _forced.stack.pop()


#: The largest guarded dimension: a bound is ``index | _BOUND_BIT``, at least this.
_BOUND_BIT = 2**30


def runtime_bound(index):
    """An S32 scalar above every guarded dimension's size, known only at run time.

    ``index`` is an integer scalar the computation reads at run time and that
    is in ``[0, 2**30)`` (the loop counter, a member offset); XLA does not
    fold ``index | 2**30``, which lies in ``[2**30, 2**31)``.
    """
    xb = xla_builder()
    value = index.cast(xb.Type.S32) if index.shape().dtype != xb.Type.S32 else index
    return value | xb.Op.scalar(value.builder(), _BOUND_BIT, dtype=xb.Type.S32)


def _guard(bound, sizes: list[int], etype) -> Callable:
    """``value -> select(iota < bound, value, 0)`` for values of ``sizes``, the iota along the last dim.

    ``bound`` comes from :func:`runtime_bound`; with ``bound=None`` (not
    :func:`cpu_codegen`), for scalars, and for a last dim longer than the bound
    covers, the identity.
    """
    if bound is None or not sizes or sizes[-1] >= _BOUND_BIT:
        return lambda value: value
    xb = xla_builder()
    b = bound.builder()
    index = xb.Op.iota(b, xb.mkshape(xb.Type.S32, tuple(sizes)), len(sizes) - 1)
    keep = index < bound.broadcast(sizes)
    zeros = xb.Op.zero(b, dtype=etype).broadcast(sizes)
    return lambda value: keep.select(value, zeros)


def _scalar_guard(bound, sizes: list[int], etype) -> Callable:
    """``value -> select(bound > 0, value, 0)`` for values of ``sizes``: the guard of stored values.

    The predicate is one runtime scalar (always true), so no index is
    computed or read per element. The identity where :func:`_guard` is.
    """
    if bound is None or not sizes or sizes[-1] >= _BOUND_BIT:
        return lambda value: value
    xb = xla_builder()
    b = bound.builder()
    keep = (bound > xb.Op.scalar(b, 0, dtype=xb.Type.S32)).broadcast(sizes)
    zeros = xb.Op.zero(b, dtype=etype).broadcast(sizes)
    return lambda value: keep.select(value, zeros)
