"""One fully sharded parameter: its mesh axis, placement, gather and gradient sharding.

Everything about a single parameter lives here; which state manages which
parameter is decided in :mod:`._ownership`.

Data movement: :func:`place` uploads a host parameter once (host to device)
and reshards an XLA parameter on the device; the gather and the gradient hook
only add sharding annotations. Nothing here reads device data back to the host.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from .._contract import applied_spec, record_applied
from .._weak import WeakIdMap

from .._annotate import Annotator, annotate_sharding, fresh_node, is_replicated_spec, mark_sharding
from .._xla import torch_xla_device, xla_builder, xlac

__all__ = [
    "Gather",
    "axis_size",
    "current_spec",
    "default_placement",
    "grad_sharder",
    "hook_gradient",
    "move_to",
    "place",
    "resolve_mesh",
    "shard_new",
    "spec_for",
    "spec_string",
]


# --------------------------------------------------------------------------- #
# Mesh and placement.
# --------------------------------------------------------------------------- #


def resolve_mesh(mesh: Any) -> tuple[Any, str | int]:
    """``(mesh, fsdp axis)``: the given mesh, else the global one, else a 1-D ``('fsdp',)`` mesh."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    if mesh is None:
        mesh = xs.get_global_mesh()
        if mesh is None:
            n = xr.global_runtime_device_count()
            mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    if not isinstance(mesh, xs.Mesh):
        raise TypeError(f"mesh must be a torch_xla.distributed.spmd.Mesh, got {type(mesh).__name__}")
    names = tuple(mesh.axis_names) if mesh.axis_names is not None else None
    if names is not None and "fsdp" in names:
        return mesh, "fsdp"
    if len(mesh.mesh_shape) == 1:
        return mesh, (names[0] if names else 0)
    raise ValueError(f"the mesh has axes {names} and shape {tuple(mesh.mesh_shape)}: fully_shard needs an "
                     f"axis named 'fsdp' or a 1-D mesh")


def axis_size(mesh: Any, axis: str | int) -> int:
    """Number of devices along ``axis`` of ``mesh``."""
    index = axis if isinstance(axis, int) else list(mesh.axis_names).index(axis)
    return int(mesh.mesh_shape[index])


def default_placement(param: torch.Tensor, fqn: str, size: int, fn: Callable | None,
                      stacked: bool = False) -> int | None:
    """The dimension ``param`` is sharded on over a ``size``-way axis (None: replicated, with a warning).

    ``fn(param)`` decides when it returns a dimension; otherwise dim 0 when it
    divides, else the largest dimension that does. A ``stacked`` parameter
    (:func:`~torch_xla_ext.stack_layers`) gets the same rule over the dims
    after its layers' one.
    """
    dim = fn(param) if fn is not None else None
    if dim is not None:
        if isinstance(dim, bool) or not isinstance(dim, int) or not -param.dim() <= dim < param.dim():
            raise ValueError(f"shard_placement_fn returned {dim!r} for {fqn} of shape {tuple(param.shape)}; "
                             f"expected a dimension index or None")
        dim %= param.dim()
        if param.shape[dim] % size:
            raise ValueError(f"shard_placement_fn chose dim {dim} of {fqn} (size {param.shape[dim]}), "
                             f"which does not divide over the {size}-way fsdp axis")
        return dim
    # A stacked parameter (stack_layers) is sharded like each layer's slice, never over the layers:
    # a scan reads one layer per iteration.
    first = 1 if stacked else 0
    if param.dim() == first:
        return None
    if param.shape[first] % size == 0:
        return first
    divisible = [d for d in range(first, param.dim()) if param.shape[d] % size == 0]
    if divisible:
        return max(divisible, key=lambda d: (param.shape[d], -d))
    warnings.warn(f"fully_shard: no dimension of {fqn} {tuple(param.shape)} divides over the {size}-way "
                  f"fsdp axis; it stays replicated", stacklevel=3)
    return None


def spec_for(param: torch.Tensor, dim: int | None, axis: str | int) -> tuple:
    """The partition spec sharding ``dim`` of ``param`` over ``axis`` (all None: replicated)."""
    return tuple(axis if d == dim else None for d in range(param.dim()))


def spec_string(mesh: Any, spec: tuple, param: torch.Tensor) -> str:
    """What ``mark_sharding(param, mesh, spec)`` would record, computed on a stand-in."""
    if all(s is None for s in spec):
        return ""
    standin = fresh_node(xla_builder().create_placeholder_tensor(tuple(param.shape), param.dtype))
    mark_sharding(standin, mesh, spec)
    return xlac()._get_xla_sharding_spec(standin)


def current_spec(t: torch.Tensor) -> str:
    """The sharding string ``t`` carries now ('' for host tensors and replicated ones)."""
    if t.device.type != "xla":
        return ""
    spec = xlac()._get_xla_sharding_spec(t)
    return "" if is_replicated_spec(spec) else spec




def move_to(p: nn.Parameter, device: torch.device) -> None:
    """Move ``p`` to ``device`` in place: the same Parameter object, so ties survive."""
    with torch.no_grad():
        moved = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, moved)


def grad_sharder(mesh: Any, spec: tuple, param: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """A parameter hook giving the gradient the parameter's sharding.

    A gradient that already carries it (the forward's gather gave it) is
    returned as it is: annotating it again would add a node to every step's
    graph for nothing.
    """
    if all(s is None for s in spec):
        return lambda grad: grad
    text = spec_string(mesh, spec, param)
    annotate = Annotator(mesh, spec)
    spec_of = xlac()._get_xla_sharding_spec

    def hook(grad: torch.Tensor) -> torch.Tensor:
        # None: a parameter the forward left unused (the gather node hands back None).
        if grad is None or grad.device.type != "xla" or spec_of(grad) == text:
            return grad
        return annotate(grad)

    return hook


def shard_new(p: nn.Parameter, mesh: Any, spec: tuple, device: torch.device) -> None:
    """First placement of a parameter fully_shard checked: upload if on the host, shard, hook its gradient."""
    if p.device.type != "xla":
        move_to(p, device)
    if any(s is not None for s in spec):
        mark_sharding(p, mesh, spec)
    record_applied(p, spec)
    hook_gradient(p, mesh, spec)


# Parameters whose gradient hook is registered. Keyed by identity, held weakly.
_hooked: WeakIdMap = WeakIdMap()


def hook_gradient(p: nn.Parameter, mesh: Any, spec: tuple) -> bool:
    """Give ``p``'s gradients its sharding with a hook, once; returns whether ``p`` has the hook now.

    A frozen parameter (a LoRA base weight, a frozen embedding) gets none yet:
    autograd refuses hooks on it, and it has no gradient. The state managing
    it calls this again before each forward until it is unfrozen.
    """
    if p in _hooked:
        return True
    if not p.requires_grad:
        return False
    p.register_hook(grad_sharder(mesh, spec, p))
    _hooked[p] = True
    return True


def place(p: nn.Parameter, mesh: Any, spec: tuple, target_text: str) -> None:
    """Put ``p`` on the XLA device with partition ``spec``, in place, with the gradient hook.

    ``target_text`` is the sharding string ``spec`` gives (see
    :func:`spec_string`). A host tensor is uploaded and sharded (host to
    device only); an XLA tensor whose sharding differs is resharded on the
    device. Nothing moves from the device to the host.
    """
    if p.device.type != "xla":
        move_to(p, torch_xla_device())
        if any(s is not None for s in spec):
            mark_sharding(p, mesh, spec)
    elif current_spec(p) != target_text:
        # mark_sharding would read device data back to the host; an
        # annotated copy is resharded by the compiler on the device.
        with torch.no_grad():
            p.copy_(annotate_sharding(p.detach(), mesh, spec))
    if applied_spec(p) is None:
        record_applied(p, spec)
        hook_gradient(p, mesh, spec)


# --------------------------------------------------------------------------- #
# Gather / reduce-scatter as an autograd function.
# --------------------------------------------------------------------------- #


class Gather(torch.autograd.Function):
    """Forward: all-gather each tensor (annotate replicated), or pass it on sharded. Backward: reduce-scatter.

    One call handles all the parameters a forward uses, so a step pays one
    autograd node per fully-sharded module, not one per parameter. With
    ``gather=False`` the tensors go on as they are (the partitioner gathers
    them where they are used) and the node only gives their gradients the
    parameters' sharding in ``reduce_dtype``. With ``reshard``, a ``scan``
    backward recomputes each gather from the sharded input instead of keeping
    the gathered value from the forward.
    """

    @staticmethod
    def forward(ctx, mesh, specs: tuple, reduce_dtype: torch.dtype | None, gather: bool, reshard: bool,
                *sources: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.mesh, ctx.specs, ctx.reduce_dtype = mesh, specs, reduce_dtype
        ctx.dtypes = tuple(t.dtype for t in sources)
        # A parameter the forward leaves unused gets no gradient (None), as in eager.
        ctx.set_materialize_grads(False)
        if not gather:
            return tuple(t.view_as(t) for t in sources)
        return tuple(annotate_sharding(t, mesh, (None,) * t.dim(), recompute_in_backward=reshard)
                     for t in sources)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        out: list[torch.Tensor | None] = [None, None, None, None, None]
        for grad, spec, dtype in zip(grads, ctx.specs, ctx.dtypes):
            if grad is not None:
                if ctx.reduce_dtype is not None:
                    grad = grad.to(ctx.reduce_dtype)
                grad = annotate_sharding(grad, ctx.mesh, spec).to(dtype)
            out.append(grad)
        return tuple(out)
