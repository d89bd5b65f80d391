"""Composable FSDP on XLA SPMD: ``fully_shard`` and ``replicate``.

``fully_shard(module)`` keeps the module (its class is swapped to a subclass of
both its class and :class:`FSDPModule`, so ``isinstance`` checks and
``state_dict()`` keys are unchanged) and shards the parameters its state
manages over the mesh's ``fsdp`` axis with GSPMD sharding annotations. In the
module's forward each managed parameter is gathered (annotated replicated),
optionally cast for mixed precision, and used; its gradient is annotated with
the parameter's sharding (a reduce-scatter), so ``.grad`` is sharded exactly
like the parameter.

Ownership: every parameter is managed by exactly one state. A parameter used by
several modules (a tied embedding and LM head) belongs to the lowest fully
sharded module containing all the modules that register it, found with an
offline lowest-common-ancestor pass over the module tree. Ownership is
recomputed over the whole enclosing fully sharded tree whenever ``fully_shard``
is applied, so it does not depend on the order of application.

``replicate(module)`` marks a subtree whose parameters stay replicated; an
enclosing ``fully_shard`` neither traverses nor manages it, including any
``fully_shard``-ed modules inside it.

Data movement: sharding parameters that are still on the host uploads them
once, at ``fully_shard`` time. Forward and backward move nothing to the host.

``load_state_dict`` keeps the sharding and the bookkeeping, whether it is called
on a fully sharded module, an ancestor, or a submodule:

- ``assign=False`` (the default) copies into the existing sharded parameters in
  place. Host tensors in the state dict are uploaded (their bytes, once); XLA
  tensors are copied on the device, and one sharded differently is resharded
  there. Nothing moves from the device to the host.
- ``assign=True`` makes the state dict's tensors the parameters, then places
  them as ``fully_shard`` does: a host tensor is uploaded and sharded, an XLA
  tensor is kept (it aliases the state dict's tensor, as in torch) and resharded
  on the device only if its sharding differs. The new parameters get the
  gradient sharding hook, ``managed_named_parameters()`` lists them, and tied
  parameters stay tied (every key of a tied parameter must then hold the same
  data). Optimizers built before the load still hold the old parameters, as for
  any module loaded with ``assign=True``: build them after loading. Nothing
  moves from the device to the host.

Problems (a tensor on another device, tied keys holding different data) raise
before anything changes under the outermost fully sharded module the call
reaches: called on the fully sharded root, the check covers every managed
parameter before any is replaced.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .._annotate import annotate_sharding, behind_barrier, fresh_node, is_replicated_spec, shard_activation
from ._dynamo import annotate_modules_for_dynamo
from ._lca import param_owners
from ._traversal import lr_dfs, module_tree

__all__ = [
    "FSDPModule",
    "MixedPrecisionPolicy",
    "fully_shard",
    "get_fully_sharded_modules",
    "replicate",
]

_STATE = "_txe_fsdp_state"
_REPLICATE = "_txe_replicate_state"


@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Mixed precision for a fully sharded module, as in FSDP2.

    Attributes:
      param_dtype: dtype the gathered parameters are cast to for compute
        (None: keep the parameter dtype).
      reduce_dtype: dtype gradients are reduced (reduce-scattered) in
        (None: the compute dtype).
      output_dtype: dtype floating-point forward outputs are cast to (None: leave).
      cast_forward_inputs: cast floating-point forward inputs to ``param_dtype``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise TypeError(f"MixedPrecisionPolicy.{name} must be a floating-point torch.dtype or None, "
                                f"got {value!r}")


class FSDPModule:
    """Mixin of every module ``fully_shard`` was applied to."""

    def managed_named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """``(fqn relative to this module, parameter)`` for the parameters this module's state shards."""
        yield from _state(self).managed

    @property
    def fsdp_mesh(self):
        """The torch_xla ``Mesh`` this module's parameters are sharded over."""
        return _state(self).mesh

    @property
    def reshard_after_forward(self) -> bool:
        return _state(self).reshard_after_forward


def _state(module: nn.Module) -> _FSDPState:
    return module.__dict__[_STATE]


def _is_fully_sharded(module: nn.Module) -> bool:
    return _STATE in module.__dict__


def _is_replicated(module: nn.Module) -> bool:
    return _REPLICATE in module.__dict__


def get_fully_sharded_modules(root: nn.Module) -> list[nn.Module]:
    """The fully sharded modules under ``root`` (itself included) in left-to-right DFS order.

    The order of ``root.modules()``, each module once, never entering a
    ``replicate``-d subtree, whatever order ``fully_shard`` was applied in.
    """
    if not isinstance(root, nn.Module):
        raise TypeError(f"root must be an nn.Module, got {type(root).__name__}")
    return [m for _, m in lr_dfs(root, skip=_is_replicated) if _is_fully_sharded(m)]


# --------------------------------------------------------------------------- #
# Mesh and placement.
# --------------------------------------------------------------------------- #


def _resolve_mesh(mesh: Any):
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


def _axis_size(mesh, axis) -> int:
    index = axis if isinstance(axis, int) else list(mesh.axis_names).index(axis)
    return int(mesh.mesh_shape[index])


def _placement(param: torch.Tensor, fqn: str, size: int, fn: Callable | None) -> int | None:
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
    if param.dim() == 0:
        return None
    if param.shape[0] % size == 0:
        return 0
    divisible = [d for d in range(param.dim()) if param.shape[d] % size == 0]
    if divisible:
        return max(divisible, key=lambda d: (param.shape[d], -d))
    warnings.warn(f"fully_shard: no dimension of {fqn} {tuple(param.shape)} divides over the {size}-way "
                  f"fsdp axis; it stays replicated", stacklevel=3)
    return None


def _spec(param: torch.Tensor, dim: int | None, axis) -> tuple:
    return tuple(axis if d == dim else None for d in range(param.dim()))


def _spec_string(mesh, spec: tuple, param: torch.Tensor) -> str:
    """What ``mark_sharding(param, mesh, spec)`` would record, computed on a stand-in."""
    import torch_xla
    import torch_xla.core.xla_builder as xb

    if all(s is None for s in spec):
        return ""
    standin = fresh_node(xb.create_placeholder_tensor(tuple(param.shape), param.dtype))
    torch_xla._XLAC._xla_mark_sharding(standin, mesh.get_op_sharding(spec))
    return torch_xla._XLAC._get_xla_sharding_spec(standin)


def _current_spec(t: torch.Tensor) -> str:
    import torch_xla

    if t.device.type != "xla":
        return ""
    spec = torch_xla._XLAC._get_xla_sharding_spec(t)
    return "" if is_replicated_spec(spec) else spec


# Parameters this library sharded: id -> (weak reference, partition spec applied).
# (Keyed by id: tensors compare elementwise, so they make poor weak dict keys.)
_applied: dict[int, tuple[weakref.ref, tuple]] = {}


def _applied_spec(p: torch.Tensor) -> tuple | None:
    entry = _applied.get(id(p))
    return entry[1] if entry is not None and entry[0]() is p else None


def _record_applied(p: torch.Tensor, spec: tuple) -> None:
    key = id(p)
    _applied[key] = (weakref.ref(p, lambda _ref, key=key: _applied.pop(key, None)), spec)


# --------------------------------------------------------------------------- #
# Gather / reduce-scatter as an autograd function.
# --------------------------------------------------------------------------- #


class _Gather(torch.autograd.Function):
    """Forward: all-gather (annotate replicated). Backward: reduce-scatter (annotate sharded).

    With ``reshard``, a ``scan`` backward recomputes the gather from the
    sharded input instead of keeping the gathered value from the forward.
    """

    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh, sharded: tuple, reduce_dtype: torch.dtype | None,
                reshard: bool) -> torch.Tensor:
        ctx.mesh, ctx.sharded, ctx.reduce_dtype, ctx.dtype = mesh, sharded, reduce_dtype, t.dtype
        return annotate_sharding(t, mesh, (None,) * t.dim(), recompute_in_backward=reshard)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce_dtype is not None:
            grad = grad.to(ctx.reduce_dtype)
        grad = annotate_sharding(grad, ctx.mesh, ctx.sharded)
        return grad.to(ctx.dtype), None, None, None, None


class _Regather:
    """What a saved gathered parameter is packed into when resharding after forward."""

    __slots__ = ("source", "dtype", "mesh", "dims")

    def __init__(self, source: torch.Tensor, dtype: torch.dtype, mesh, dims: int) -> None:
        self.source, self.dtype, self.mesh, self.dims = source, dtype, mesh, dims

    def unpack(self) -> torch.Tensor:
        with torch.no_grad():
            fresh = behind_barrier(self.source.detach())
            return annotate_sharding(fresh.to(self.dtype), self.mesh, (None,) * self.dims)


# --------------------------------------------------------------------------- #
# State.
# --------------------------------------------------------------------------- #


@dataclasses.dataclass
class _Slot:
    """One registration (holder module, local name) of a managed parameter."""

    holder: nn.Module
    name: str
    param: nn.Parameter
    spec: tuple   # partition spec of the parameter over the mesh
    fqn: str      # relative to the managing module


class _FSDPState:
    def __init__(self, mesh, axis, reshard_after_forward: bool,
                 shard_placement_fn: Callable | None, mp_policy: MixedPrecisionPolicy,
                 ignored_params: set[nn.Parameter]) -> None:
        self.mesh, self.axis = mesh, axis
        self.reshard_after_forward = reshard_after_forward
        self.shard_placement_fn = shard_placement_fn
        self.mp_policy = mp_policy
        self.ignored_params = ignored_params
        self.managed: list[tuple[str, nn.Parameter]] = []
        self.slots: list[_Slot] = []
        self._spec_texts: dict[tuple[tuple, int], str] = {}

    def spec_text(self, spec: tuple, param: torch.Tensor) -> str:
        """The sharding string ``param`` carries once placed with ``spec`` ('' when replicated)."""
        key = (spec, param.dim())
        text = self._spec_texts.get(key)
        if text is None:
            text = self._spec_texts[key] = _spec_string(self.mesh, spec, param)
        return text

    def adopt(self, replaced: dict[int, nn.Parameter | None]) -> None:
        """After ``load_state_dict``: make each registration's current parameter the managed one.

        ``replaced`` maps ``id(old managed parameter)`` to the parameter that
        replaces it (None: kept). Every registration of a tied parameter is
        pointed at its replacement, which is placed on the device with the
        slot's sharding (see :meth:`place`).
        """
        groups: dict[int, list[_Slot]] = {}
        for slot in self.slots:
            if id(slot.param) in replaced:
                groups.setdefault(id(slot.param), []).append(slot)
        changed = False
        for key, slots in groups.items():
            new = replaced[key]
            if new is None:
                new = slots[0].param
            for slot in slots:
                if slot.holder._parameters.get(slot.name) is not new:
                    slot.holder._parameters[slot.name] = new
                changed |= slot.param is not new
                slot.param = new
            self.place(new, slots[0].spec)
        if changed:
            self.managed = _unique_managed(self.slots)

    def place(self, p: nn.Parameter, spec: tuple) -> None:
        """Put ``p`` on the XLA device with partition ``spec``, in place, with the gradient hook.

        A host tensor is uploaded and sharded (host to device only); an XLA
        tensor whose sharding differs is resharded on the device. Nothing moves
        from the device to the host.
        """
        import torch_xla
        import torch_xla.distributed.spmd as xs

        if p.device.type != "xla":
            _move_to(p, torch_xla.device())
            if any(s is not None for s in spec):
                xs.mark_sharding(p, self.mesh, spec)
        elif _current_spec(p) != self.spec_text(spec, p):
            # mark_sharding would read device data back to the host; an
            # annotated copy is resharded by the compiler on the device.
            with torch.no_grad():
                p.copy_(annotate_sharding(p.detach(), self.mesh, spec))
        if _applied_spec(p) is None:
            _record_applied(p, spec)
            p.register_hook(_grad_sharder(self.mesh, spec))

    def forward(self, forward: Callable, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        mp = self.mp_policy
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(mp.param_dtype) if t.is_floating_point() else t, (args, kwargs))
        swapped: list[tuple[nn.Module, str, Any]] = []
        gathered: dict[int, tuple[torch.Tensor, _Regather]] = {}
        try:
            for slot in self.slots:
                current = slot.holder._parameters[slot.name]
                value = gathered.get(id(current))
                if value is None:
                    source = current
                    if mp.param_dtype is not None and source.is_floating_point():
                        source = source.to(mp.param_dtype)
                    full = _Gather.apply(source, self.mesh, slot.spec, mp.reduce_dtype, self.reshard_after_forward)
                    value = (full, _Regather(current, source.dtype, self.mesh, current.dim()))
                    gathered[id(current)] = value
                slot.holder._parameters[slot.name] = value[0]
                swapped.append((slot.holder, slot.name, current))
            if self.reshard_after_forward and gathered and torch.is_grad_enabled() and not _tracing(swapped):
                packed = {id(full): (full, regather) for full, regather in gathered.values()}

                def pack(t: torch.Tensor) -> Any:
                    hit = packed.get(id(t))
                    return hit[1] if hit is not None and hit[0] is t else t

                def unpack(obj: Any) -> torch.Tensor:
                    return obj.unpack() if isinstance(obj, _Regather) else obj

                with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
                    out = forward(module, *args, **kwargs)
            else:
                out = forward(module, *args, **kwargs)
        finally:
            for holder, name, current in reversed(swapped):
                holder._parameters[name] = current
        if mp.output_dtype is not None:
            out = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(mp.output_dtype) if t.is_floating_point() else t, out)
        # Keep activations sharded over the fsdp axis on their leading (batch)
        # dimension, so the compiler gathers weights rather than activations.
        return pytree.tree_map_only(torch.Tensor, self._shard_batch, out)

    def _shard_batch(self, t: torch.Tensor) -> torch.Tensor:
        if (t.device.type != "xla" or not t.is_floating_point() or t.dim() == 0
                or t.shape[0] % _axis_size(self.mesh, self.axis)):
            return t
        spec = (self.axis,) + (None,) * (t.dim() - 1)
        return shard_activation(t, self.mesh, spec) if t.requires_grad else annotate_sharding(t, self.mesh, spec)


def _tracing(swapped: list[tuple[nn.Module, str, Any]]) -> bool:
    """True while AOTAutograd traces the forward (inside scan): its partitioner decides what is saved."""
    from torch._subclasses.fake_tensor import is_fake

    return any(isinstance(current, torch.Tensor) and is_fake(current) for _, _, current in swapped)


_fsdp_classes: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    if cls not in _fsdp_classes:
        def forward(self, *args, **kwargs):
            return _state(self).forward(cls.forward, self, args, kwargs)

        _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls),
                                  {"forward": forward, "__module__": cls.__module__})
    return _fsdp_classes[cls]


# --------------------------------------------------------------------------- #
# Ownership.
# --------------------------------------------------------------------------- #

_registry: weakref.WeakSet = weakref.WeakSet()


def _enclosing_top(module: nn.Module) -> nn.Module:
    """The topmost fully sharded module whose (non-replicated) tree contains ``module``."""
    top = module
    changed = True
    while changed:
        changed = False
        for other in list(_registry):
            if other is top or not _is_fully_sharded(other):
                continue
            if any(m is top for m in module_tree(other, skip=_is_replicated).modules):
                top, changed = other, True
                break
    return top


def _plan(top: nn.Module, fsdp_ids: set[int], ignored: Iterable[nn.Parameter]) -> dict[int, list[_Slot]]:
    """Which state manages which parameter, over ``top``'s tree.

    Returns ``{id(fully sharded module): [slots]}``: one slot per registration
    (holder module, local name) of each parameter the module manages, the
    first registration first. A parameter belongs to the nearest fully sharded
    ancestor-or-self of the LCA of all modules registering it.
    """
    tree = module_tree(top, skip=_is_replicated)
    nearest: list[int] = []
    for i, m in enumerate(tree.modules):  # parents precede children
        parent = tree.parents[i]
        nearest.append(i if id(m) in fsdp_ids else (nearest[parent] if parent >= 0 else -1))
    index = {id(m): i for i, m in enumerate(tree.modules)}
    owners = param_owners(top, ignored, skip=_is_replicated)
    plan: dict[int, list[_Slot]] = {fid: [] for fid in fsdp_ids}
    for i, holder in enumerate(tree.modules):
        for local, param in holder._parameters.items():
            if param is None or param not in owners:
                continue
            owner = nearest[index[id(owners[param])]]
            if owner < 0:
                continue
            base = tree.fqn(owner)
            full = f"{tree.fqn(i)}.{local}" if tree.fqn(i) else local
            plan[id(tree.modules[owner])].append(_Slot(holder, local, param, (), full[len(base) + 1:] if base else full))
    return plan


# --------------------------------------------------------------------------- #
# load_state_dict.
# --------------------------------------------------------------------------- #

# On every module holding a managed registration: {local name: (state, slot)}.
_OWNERS = "_txe_fsdp_owners"
# On every module holding a parameter of a replicate()-d subtree: {local names}.
_REPLICAS = "_txe_replicate_params"
_LOAD_HOOKS = "_txe_fsdp_load_hooks"
_load_local = threading.local()


@dataclasses.dataclass
class _LoadSession:
    """One ``load_state_dict`` call, opened by the outermost hooked module it reaches.

    torch passes the same ``missing_keys`` list to every module of one call
    (and to the post-hooks, in ``incompatible_keys``), so that list identifies
    the call; a session left open by a call that raised is never mistaken for
    a later one.
    """

    owner: nn.Module
    missing_keys: list
    registrations: list[tuple[nn.Module, str]]
    replicas: list[tuple[nn.Module, str]]


def _hook_loads(module: nn.Module) -> None:
    if not module.__dict__.get(_LOAD_HOOKS, False):
        module.register_load_state_dict_pre_hook(_load_pre_hook)
        module.register_load_state_dict_post_hook(_load_post_hook)
        module.__dict__[_LOAD_HOOKS] = True


def _registrations_under(module: nn.Module, attribute: str) -> list[tuple[nn.Module, str, str]]:
    """``(holder, local name, key relative to module)`` of every registration under ``module``
    listed in its holder's ``attribute`` (managed ones: ``_OWNERS``; replicated ones: ``_REPLICAS``)."""
    tree = module_tree(module)
    found = []
    for i, holder in enumerate(tree.modules):
        names = holder.__dict__.get(attribute)
        if names:
            base = tree.fqn(i)
            found.extend((holder, name, f"{base}.{name}" if base else name) for name in names)
    return found


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two state dict tensors certainly hold the same values, without a device-to-host transfer."""
    if a is b:
        return True
    if a.device != b.device or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device.type == "xla":
        import torch_xla

        try:  # the same device buffer (state_dict() of a tied model gives that)
            ha, hb = torch_xla._XLAC._get_tensors_handle([a, b])
        except RuntimeError:  # a pending computation: unknown without running it
            return False
        return ha == hb
    if (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset() and a.stride() == b.stride()):
        return True
    return bool(torch.equal(a, b))  # host memory only


def _check_assignable(registrations: list[tuple[nn.Module, str, str]], state_dict: dict, prefix: str) -> None:
    """Raise, before anything is assigned, what ``load_state_dict(assign=True)`` could not keep sharded."""
    tied: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for holder, name, key in registrations:
        key = prefix + key
        value = state_dict.get(key)
        param = holder._parameters.get(name)
        if value is None or param is None or not isinstance(value, torch.Tensor) or value.shape != param.shape:
            continue  # torch reports missing keys, non-tensors and shape mismatches itself
        _, slot = holder.__dict__[_OWNERS][name]
        if value.device.type not in ("cpu", "xla"):
            raise ValueError(
                f"load_state_dict(assign=True) cannot assign '{key}': the tensor is on {value.device}, and a fully "
                f"sharded parameter lives on the XLA device. Pass CPU or XLA tensors (CPU tensors are uploaded and "
                f"sharded like the parameter they replace), or load with assign=False (the default), which copies "
                f"into the existing sharded parameter.")
        applied = _applied_spec(value)
        if applied is not None and applied != slot.spec:
            raise ValueError(
                f"load_state_dict(assign=True) cannot assign '{key}': it is a parameter fully_shard already sharded "
                f"as {applied} for another module, and this module shards it as {slot.spec}. Load with "
                f"assign=False (the default), which copies its values into this module's own parameter.")
        tied.setdefault(id(slot.param), []).append((key, value))
    for entries in tied.values():
        first_key, first = entries[0]
        for key, value in entries[1:]:
            if not _same_data(first, value):
                raise ValueError(
                    f"load_state_dict(assign=True): '{first_key}' and '{key}' are one tied parameter, but the state "
                    f"dict holds different tensors for them (values that differ, or separate XLA tensors that cannot "
                    f"be compared without a device-to-host transfer); assigning both would untie them. Pass the same "
                    f"tensor under both keys, or load with assign=False (the default), which copies into the tied "
                    f"parameter in place.")


def _stage_host_values(registrations: list[tuple[nn.Module, str, str]], state_dict: dict, prefix: str) -> None:
    """Upload the host values ``assign=False`` will copy, already sharded like their parameters.

    ``param.copy_(host_tensor)`` would upload the whole tensor to every device
    and reshard it there (8x the bytes, and a full copy in each device's
    memory); a sharded upload sends each shard once. ``state_dict`` is
    torch's per-call copy, so the caller's dict is not modified. The keys of
    a tied parameter that hold the same values are uploaded once.
    """
    import torch_xla
    import torch_xla.distributed.spmd as xs

    staged: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # id(parameter) -> [(host value, upload)]
    for holder, name, key in registrations:
        key = prefix + key
        value = state_dict.get(key)
        param = holder._parameters.get(name)
        if (not isinstance(value, torch.Tensor) or value.device.type != "cpu" or param is None
                or param.device.type != "xla" or value.shape != param.shape):
            continue  # left to torch: it reports what does not fit
        state, slot = holder.__dict__[_OWNERS][name]
        uploads = staged.setdefault(id(slot.param), [])
        upload = next((up for host, up in uploads if _same_data(host, value)), None)
        if upload is None:
            upload = value.detach().to(torch_xla.device())
            if any(s is not None for s in slot.spec):
                xs.mark_sharding(upload, state.mesh, slot.spec)
            uploads.append((value, upload))
        state_dict[key] = upload


def _load_pre_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                   missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    session = getattr(_load_local, "session", None)
    if session is not None and session.missing_keys is missing_keys:
        return  # an enclosing module of this call opened the session
    if torch.__future__.get_swap_module_params_on_conversion():
        raise RuntimeError(
            "load_state_dict into a fully sharded module does not support "
            "torch.__future__.set_swap_module_params_on_conversion(True): swapping would drop the parameters' "
            "sharding and gradient hooks. Set it to False around load_state_dict; assign=False and assign=True "
            "both keep the sharding without it.")
    registrations = _registrations_under(module, _OWNERS)
    replicas = _registrations_under(module, _REPLICAS)
    if local_metadata.get("assign_to_params_buffers", False):
        _check_assignable(registrations, state_dict, prefix)
        for _, _, key in replicas:
            value = state_dict.get(prefix + key)
            if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "xla"):
                raise ValueError(
                    f"load_state_dict(assign=True) cannot assign '{prefix + key}': the tensor is on {value.device}, "
                    f"and a parameter of a replicate()-d module lives on the XLA device. Pass CPU or XLA tensors "
                    f"(CPU tensors are uploaded), or load with assign=False (the default), which copies in place.")
    else:
        _stage_host_values(registrations, state_dict, prefix)
    _load_local.session = _LoadSession(module, missing_keys, [(h, n) for h, n, _ in registrations],
                                       [(h, n) for h, n, _ in replicas])


def _load_post_hook(module: nn.Module, incompatible_keys: Any) -> None:
    session = getattr(_load_local, "session", None)
    if session is None or session.owner is not module or session.missing_keys is not incompatible_keys.missing_keys:
        return
    _load_local.session = None
    # Per state: {id(old managed parameter): its replacement, or None}; the first registration that changed wins
    # (tied registrations were checked to hold the same data).
    replaced: dict[int, tuple[_FSDPState, dict[int, nn.Parameter | None]]] = {}
    for holder, name in session.registrations:
        state, slot = holder.__dict__[_OWNERS][name]
        current = holder._parameters.get(name)
        per_state = replaced.setdefault(id(state), (state, {}))[1]
        if per_state.get(id(slot.param)) is None:
            per_state[id(slot.param)] = current if current is not None and current is not slot.param else None
    for state, per_state in replaced.values():
        state.adopt(per_state)
    if session.replicas:
        import torch_xla

        for holder, name in session.replicas:  # assign=True put host tensors there
            p = holder._parameters.get(name)
            if p is not None and p.device.type == "cpu":
                _move_to(p, torch_xla.device())


# --------------------------------------------------------------------------- #
# Public API.
# --------------------------------------------------------------------------- #


def fully_shard(
    module: nn.Module,
    *,
    mesh: Any = None,
    reshard_after_forward: bool = True,
    shard_placement_fn: Callable[[nn.Parameter], int | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    ignored_params: Iterable[nn.Parameter] | None = None,
) -> FSDPModule:
    """Shard ``module``'s parameters over the mesh's ``fsdp`` axis, in place.

    Args:
      module: the module; its class becomes ``FSDP<Class>`` (a subclass of its
        class and :class:`FSDPModule`), its ``state_dict()`` keys are unchanged.
      mesh: a torch_xla ``Mesh`` with an ``fsdp`` axis, or a 1-D mesh; default
        the global mesh, or a 1-D ``('fsdp',)`` mesh over all devices.
      reshard_after_forward: do not keep gathered parameters alive from
        forward to backward: autograd saves the sharded parameter and the
        backward gathers it again behind an optimization barrier.
      shard_placement_fn: ``fn(param) -> dim | None`` choosing the sharded
        dimension (None: default). Default: dim 0 when it divides over the
        ``fsdp`` axis, else the largest dimension that does, else replicated
        (with a warning naming the parameter).
      mp_policy: :class:`MixedPrecisionPolicy`.
      ignored_params: parameters this state must not manage.

    Returns ``module`` itself, now also an :class:`FSDPModule`. Every check
    runs before any parameter is moved or sharded. ``load_state_dict`` keeps
    this sharding with ``assign=False`` and ``assign=True`` alike and moves
    nothing from the device to the host (see the module docstring).
    """
    import torch_xla
    import torch_xla.distributed.spmd as xs

    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if _is_fully_sharded(module):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; apply it once per module")
    if _is_replicated(module):
        raise ValueError(f"replicate was already applied to this {type(module).__name__}; "
                         f"a module is either replicated or fully sharded, not both")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}")
    if shard_placement_fn is not None and not callable(shard_placement_fn):
        raise TypeError("shard_placement_fn must be callable or None")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    ignored = list(ignored_params or ())
    for p in ignored:
        if not isinstance(p, nn.Parameter):
            raise TypeError(f"ignored_params must contain nn.Parameter objects, got {type(p).__name__}")
    mesh, axis = _resolve_mesh(mesh)
    size = _axis_size(mesh, axis)

    # Plan over the whole enclosing fully sharded tree, as if module were already sharded.
    top = _enclosing_top(module)
    tree_modules = module_tree(top, skip=_is_replicated).modules
    fsdp = [m for m in tree_modules if _is_fully_sharded(m) or m is module]
    all_ignored = list(ignored)
    for m in fsdp:
        if m is not module:
            all_ignored.extend(_state(m).ignored_params)
    plan = _plan(top, {id(m) for m in fsdp}, all_ignored)

    # Validate the parameters this module will newly shard.
    slots = plan[id(module)]
    for slot in slots:
        p = slot.param
        if p.device.type not in ("cpu", "xla"):
            raise ValueError(f"{slot.fqn} is on {p.device}; fully_shard moves parameters from the CPU to the XLA "
                             f"device, but not from {p.device.type}")
        applied = _applied_spec(p)
        if applied is not None:  # placed (and warned about) when it was first sharded
            slot.spec = applied
            continue
        dim = _placement(p, slot.fqn, size, shard_placement_fn)
        slot.spec = _spec(p, dim, axis)
        existing = _current_spec(p)
        if existing and existing != _spec_string(mesh, slot.spec, p):
            raise ValueError(f"{slot.fqn} already has the sharding {existing}, which conflicts with fully_shard's "
                             f"{slot.spec} over the '{axis}' axis; clear it or pass a matching shard_placement_fn")

    # Apply: move, shard, annotate gradients, attach the state.
    device = torch_xla.device()
    for slot in slots:
        p = slot.param
        if _applied_spec(p) is not None:
            continue
        if p.device.type != "xla":
            _move_to(p, device)
        if any(s is not None for s in slot.spec):
            xs.mark_sharding(p, mesh, slot.spec)
        _record_applied(p, slot.spec)
        p.register_hook(_grad_sharder(mesh, slot.spec))
    state = _FSDPState(mesh, axis, reshard_after_forward, shard_placement_fn, mp_policy, set(ignored))
    module.__dict__[_STATE] = state
    module.__class__ = _fsdp_class(type(module))
    _registry.add(module)
    states = {id(_state(m)) for m in fsdp}
    for m in tree_modules:  # ownership may have moved between states (shared parameters)
        owners = m.__dict__.get(_OWNERS)
        if owners:
            for name in [n for n, (st, _) in owners.items() if id(st) in states]:
                del owners[name]
    for m in fsdp:
        s = _state(m)
        s.slots = [sl for sl in plan[id(m)]]
        for sl in s.slots:
            sl.spec = _applied_spec(sl.param) or sl.spec
            sl.holder.__dict__.setdefault(_OWNERS, {})[sl.name] = (s, sl)
            _hook_loads(sl.holder)
        s.managed = _unique_managed(s.slots)
        _hook_loads(m)
    replicated = [sub for m in module_tree(module).modules if _is_replicated(m) for sub in module_tree(m).modules]
    annotate_modules_for_dynamo(module, replicated, True)
    return module  # type: ignore[return-value]


def _move_to(p: nn.Parameter, device: torch.device) -> None:
    """Move ``p`` to ``device`` in place: the same Parameter object, so ties survive."""
    with torch.no_grad():
        moved = nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
    torch.utils.swap_tensors(p, moved)


def _unique_managed(slots: list[_Slot]) -> list[tuple[str, nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for slot in slots:
        if id(slot.param) not in seen:
            seen.add(id(slot.param))
            out.append((slot.fqn, slot.param))
    return out


def _grad_sharder(mesh, spec: tuple) -> Callable[[torch.Tensor], torch.Tensor]:
    """A parameter hook giving the gradient the parameter's sharding."""

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if grad.device.type != "xla" or all(s is None for s in spec):
            return grad
        return annotate_sharding(grad, mesh, spec)

    return hook


def replicate(module: nn.Module, *, mesh: Any = None) -> nn.Module:
    """Keep ``module``'s parameters replicated across the mesh (data parallel).

    An enclosing :func:`fully_shard` neither traverses nor manages a
    replicated subtree, including ``fully_shard``-ed modules inside it (they
    keep their own sharding). Parameters still on the CPU are moved to the
    XLA device, and ``load_state_dict(assign=True)`` moves host tensors it
    assigns there too. Returns ``module``.
    """
    import torch_xla

    if not isinstance(module, nn.Module):
        raise TypeError(f"replicate expects an nn.Module, got {type(module).__name__}")
    if _is_fully_sharded(module):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; "
                         f"a module is either replicated or fully sharded, not both")
    if _is_replicated(module):
        raise ValueError(f"replicate was already applied to this {type(module).__name__}")
    mesh, _ = _resolve_mesh(mesh) if mesh is not None else (None, None)
    tree = module_tree(module, skip=lambda m: m is not module and _is_fully_sharded(m))
    params = [p for m in tree.modules for p in m._parameters.values() if p is not None]
    for p in params:
        if p.device.type not in ("cpu", "xla"):
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is on {p.device}; replicate moves parameters "
                             f"from the CPU to the XLA device only")
    device = torch_xla.device()
    for p in params:
        if p.device.type != "xla":
            _move_to(p, device)
    module.__dict__[_REPLICATE] = {"mesh": mesh}
    for m in tree.modules:  # load_state_dict(assign=True) with host tensors moves them to the device too
        names = [n for n, p in m._parameters.items() if p is not None]
        if names:
            m.__dict__.setdefault(_REPLICAS, {}).update(dict.fromkeys(names))
            _hook_loads(m)
    _hook_loads(module)
    return module
