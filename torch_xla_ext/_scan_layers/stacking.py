"""Stacking homogeneous layers' members into one tensor per name, and handing gradients back (scan_layers)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sequence

import numpy as np
import torch

from .._annotate import is_replicated_spec
from .._format import parse_tiled_spec
from .._xla import torch_xla_device, xla_builder, xlac
from .._scan.backend import _guard, computation_name, cpu_codegen, runtime_bound
from .._scan.cache import on_clear
from .._scan.loop import _slice_op
from .._scan.sharding import _apply_shardings, _sharding_of


def _tiling(member: torch.Tensor) -> tuple[tuple[int, ...], str, bool] | None:
    """``member``'s tiled sharding (see :func:`parse_tiled_spec`); ``((1,) * dim, "", False)`` if unsharded.

    None for a sharding that is neither tiled nor replicated (e.g. manual).
    """
    spec = xlac()._get_xla_sharding_spec(member)
    if is_replicated_spec(spec):
        return (1,) * member.dim(), "", False
    return parse_tiled_spec(spec)


def _merged(shape: tuple[int, ...], tiles: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``shape`` with each unsharded dim merged into the dim before it, and the tiles of the result.

    ``(128, 512)`` tiled ``(8, 1)`` gives ``(65536,)`` tiled ``(8,)``: each
    device's block is still one contiguous piece, so the reshape moves no data
    between devices. ``(128, 512)`` tiled ``(1, 8)`` stays as it is, and so
    does ``(10, 512)`` tiled ``(8, 1)`` (uneven, padded blocks).
    """
    dims: list[int] = []
    kept: list[int] = []
    for size, tile in zip(shape, tiles):
        # A dim sharded unevenly is padded per device: its blocks would not
        # line up with the merged dim's, so nothing merges into it.
        if dims and tile == 1 and dims[-1] % kept[-1] == 0:
            dims[-1] *= size
        else:
            dims.append(size)
            kept.append(tile)
    return tuple(dims), tuple(kept)


def _stacked_layout(member: torch.Tensor) -> tuple[tuple[int, ...], Callable[[torch.Tensor], None]]:
    """The shape each member has inside the stacked tensor, and how to shard the stacked tensor.

    With :func:`~torch_xla_ext._scan.backend.cpu_codegen`, members are stacked
    with unsharded dims merged (:func:`_merged`). XLA:CPU emits a copy of a
    small multi-dim block as a nest of constant-trip loops that LLVM unrolls
    completely (a ``[16, 512]`` block is ~2000 vector instructions per kernel);
    a 1-D block stays a loop. The stacking copies the merged blocks; the
    scan's reads of each layer and handing the gradients back produce blocks
    of the member's own shape (XLA fuses the reshape into the read).
    Otherwise members keep their shape.
    """
    shape = tuple(member.shape)
    tiling = _tiling(member)
    if tiling is None:
        return shape, lambda stacked: None
    tiles, devices_text, _ = tiling
    if cpu_codegen():
        flat, flat_tiles = _merged(shape, tiles[:len(shape)])
    else:
        flat, flat_tiles = shape, tiles[:len(shape)]

    def shard(stacked: torch.Tensor) -> None:
        # An unsharded member or a device list in a form (iota) only
        # propagation should decide leaves the stacked tensor unannotated.
        if not devices_text or not re.fullmatch(r"[\d,]+", devices_text):
            return
        xlac()._xla_mark_sharding(stacked, _stacked_sharding(flat_tiles + tiles[len(shape):], devices_text, len(flat)))

    return flat, shard


@functools.lru_cache(maxsize=256)
def _stacked_sharding(dims: tuple[int, ...], devices_text: str, member_dims: int):
    """The ``OpSharding`` of a stacked tensor: unsharded leading dim, then a member's tiles (made once per tiling).

    Applied with ``_xla_mark_sharding`` directly: ``xs.mark_sharding`` tries to
    import torchax on every call, which re-runs the import each step where
    torchax is installed but cannot load.
    """
    import torch_xla.distributed.spmd as xs

    ids = np.array([int(v) for v in devices_text.split(",")])
    mesh = xs.Mesh(ids, dims, tuple(f"axis{i}" for i in range(len(dims))))
    return mesh.get_op_sharding((None, *mesh.axis_names[:member_dims]))


# Handing the stacked gradient back with L constant-offset ``slice``s costs one
# generated kernel per layer. With the offsets as runtime operands the L
# dynamic slices are one kernel, compiled once, so the compile time stays flat
# in L; the index scalars are device data, made once. Stacking needs no
# offsets: one ``concatenate`` per member is one kernel whatever L is, and
# unlike L dynamic-update-slices (each a pass over the whole buffer on XLA:CPU)
# it writes every element once.
_index_tensors: dict[str, list[torch.Tensor]] = {}


def _indices(n: int) -> list[torch.Tensor]:
    """``[0] .. [n-1]`` as int64 ``[1]`` tensors on the XLA device (cached; the host sends each once).

    Shape ``[1]``, not a scalar: torch_xla turns a 0-d 0 or 1 sent to the
    device into a graph constant, which would fold the offset back in.
    """
    device = torch_xla_device()
    have = _index_tensors.setdefault(str(device), [])
    have.extend(torch.tensor([i], dtype=torch.int64).to(device) for i in range(len(have), n))
    return have[:n]


def _index_params(b, n: int) -> list:
    """Parameters ``0 .. n-1`` of builder ``b``: the ``[1]`` tensors of :func:`_indices`, as scalars."""
    xb = xla_builder()
    return [xb.mkparam(b, k, xb.mkshape(xb.Type.S64, (1,))).reshape([]) for k in range(n)]


@functools.lru_cache(maxsize=256)
def _stack_computation(n: int, shape: tuple[int, ...], flat: tuple[int, ...], dtype: torch.dtype):
    """``(members...) -> concatenate([m.reshape([1, *flat]) for m in members])``.

    ``flat`` is the member's stacked layout (see :func:`_stacked_layout`).
    """
    xb = xla_builder()
    name = computation_name("txe_stack", flat != shape)
    b = xb.create_builder(name)
    etype = xb.Op.from_torch_type(dtype)
    members = [xb.mkparam(b, k, xb.mkshape(etype, shape)) for k in range(n)]
    stacked = xb.Op.concat_in_dim([m.reshape([1, *flat]) for m in members], 0, builder=b)
    return xb.Op.tuple([stacked]).build(name)


@functools.lru_cache(maxsize=256)
def _unstack_computation(n: int, shape: tuple[int, ...], flat: tuple[int, ...], dtype: torch.dtype, guarded: bool):
    """``(indices..., stacked) -> (stacked[indices[0]], ..., stacked[indices[n-1]])``, each in ``shape``.

    ``guarded``: with the index guard (see ``backend``), its bound from ``indices[0]``.
    """
    xb = xla_builder()
    name = computation_name("txe_unstack", guarded or flat != shape)
    b = xb.create_builder(name)
    etype = xb.Op.from_torch_type(dtype)
    indices = _index_params(b, n)
    stacked = xb.mkparam(b, n, xb.mkshape(etype, (n, *flat)))
    bound = runtime_bound(indices[0]) if guarded else None
    zero = xb.Op.scalar(b, 0, dtype=xb.Type.S64)
    guard = _guard(bound, list(shape), etype)
    members = [guard(_slice_op(stacked, idx, zero).reshape(list(shape))) for idx in indices]
    return xb.Op.tuple(members).build(name)


def _stack(members: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(members)`` with each member reshaped as :func:`_stacked_layout` says, and sharded like it."""
    first = members[0]
    n = len(members)
    flat, shard = _stacked_layout(first)
    computation = _stack_computation(n, tuple(first.shape), flat, first.dtype)
    (stacked,) = xlac()._xla_user_computation("xla::txe_stack", list(members), computation)
    shard(stacked)
    return stacked


def _unstack(stacked: torch.Tensor, shape: tuple[int, ...], guarded: bool | None = None) -> list[torch.Tensor]:
    """The members of ``stacked`` (see :func:`_stack`) in ``shape``, as new tensors rather than views.

    ``guarded``: with the index guard; by default as :func:`cpu_codegen` says on this thread.
    """
    n = stacked.shape[0]
    if guarded is None:
        guarded = cpu_codegen()
    computation = _unstack_computation(n, shape, tuple(stacked.shape[1:]), stacked.dtype, guarded)
    operands = [*_indices(n), stacked]
    return list(xlac()._xla_user_computation("xla::txe_unstack", operands, computation))


class _Stack(torch.autograd.Function):
    """Stack along a new leading dim; forward and backward keep each member's sharding."""

    @staticmethod
    def forward(ctx, *members: torch.Tensor) -> torch.Tensor:
        ctx.shardings = [_sharding_of(t) for t in members]
        ctx.shape = tuple(members[0].shape)
        ctx.guarded = cpu_codegen()  # the backward runs on autograd's thread: the forward's choice
        ctx.set_materialize_grads(False)
        return _stack(members)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        if grad is None:  # the members reach no output (see _ScanFunction.backward)
            return (None,) * len(ctx.shardings)
        grads = _unstack(grad, ctx.shape, ctx.guarded)
        _apply_shardings(grads, ctx.shardings)
        return tuple(grads)


@on_clear
def _clear_stacking() -> None:
    _stack_computation.cache_clear()
    _unstack_computation.cache_clear()
    _stacked_sharding.cache_clear()
    _index_tensors.clear()
