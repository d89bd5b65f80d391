"""Composable FSDP on XLA SPMD: ``fully_shard`` and ``replicate``.

``fully_shard(module)`` keeps the module (its class is swapped to a subclass of
both its class and :class:`FSDPModule`, so ``isinstance`` checks and
``state_dict()`` keys are unchanged) and shards the parameters its state
manages over the mesh's ``fsdp`` axis with GSPMD sharding annotations. Each
managed parameter's gradient is annotated with the parameter's sharding (a
reduce-scatter), so ``.grad`` is sharded exactly like the parameter. In the
module's forward each managed parameter is optionally cast for mixed precision
and then:

- with ``reshard_after_forward=True`` (the default), used sharded: autograd
  saves the sharded parameter, and the SPMD partitioner gathers it at each
  use, in the forward and again in the backward, as torch_xla's FSDPv2 does.
  The step's graph holds no gathered copy from the forward to the backward
  (when a backend runs each gather is its scheduler's choice), and a step
  records no per-parameter operation but the gradient annotation;
- with ``reshard_after_forward=False``, gathered once (annotated replicated)
  and kept by autograd for the backward.

Inside ``scan_layers`` and under ``torch.compile`` the parameters are gathered
in both modes; scan's backward recomputes a resharded gather from the sharded
layer parameter instead of stacking it across layers.

Ownership: every parameter is managed by exactly one state. A parameter used by
several modules (a tied embedding and LM head) belongs to the lowest fully
sharded module containing all the modules that register it, found with an
offline lowest-common-ancestor pass over the module tree. Ownership is
recomputed over the whole enclosing fully sharded tree whenever ``fully_shard``
is applied, so it does not depend on the order of application.

``replicate(module)`` marks a subtree whose parameters stay replicated; an
enclosing ``fully_shard`` neither traverses nor manages it, including any
``fully_shard``-ed modules inside it.

Buffers: the buffers of the modules a state manages (not those of nested fully
sharded or replicated modules) are moved to the XLA device, replicated, as in
FSDP2; XLA buffers keep their sharding. The tensor objects are swapped, so the
module attributes, ``named_buffers()`` and other references see the moved
tensor, and persistence and state dict keys are unchanged (:mod:`._buffers`).

Data movement: sharding parameters that are still on the host uploads them
once, at ``fully_shard`` time, and so is each host buffer. Forward and backward
move nothing to the host, and nothing to the device but the inputs.

``torch.compile(model, backend="openxla")`` traces a fully sharded forward
without graph breaks (``fullgraph=True`` works): the gathers and gradient
shardings are recorded as the ``txe::annotate_sharding`` op, which the backend
applies to its lazy tensors. The partitioner decides what the compiled forward
saves, so ``reshard_after_forward=True`` keeps the gathered parameters for the
backward there (a ``UserWarning`` says so when dynamo traces the forward).

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

State: ``fully_shard.state(module)`` and ``replicate.state(module)`` return the
state object each API attached (None where it was not applied). States live in
a registry keyed by module identity and held weakly (:mod:`._state`); nothing is
written into the module's ``__dict__``. The implementation: :mod:`._state`
(state objects, registry, forward), :mod:`._param` (one parameter's placement,
gather and gradient sharding), :mod:`._ownership` (who manages what, one module tree per
call), :mod:`._load` (``load_state_dict``).

Problems (a tensor on another device, tied keys holding different data) raise
before anything changes under the outermost fully sharded module the call
reaches: called on the fully sharded root, the check covers every managed
parameter before any is replaced.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch.nn as nn

from ._buffers import check_buffers, managed_buffers, move_buffers
from ._dynamo import mark_managed
from ._load import hook_loads
from ._ownership import fully_sharded_in, plan, survey
from ._param import (
    axis_size,
    current_spec,
    default_placement,
    move_to,
    resolve_mesh,
    shard_new,
    spec_for,
    spec_string,
)
from ._registry import (
    ReplicateState,
    assign_ownership,
    copy_records,
    fsdp_state,
    holder_record,
    is_fully_sharded,
    is_replicated,
    register_fsdp,
    register_replicate,
    replicate_state,
)
from ._state import FSDPState, MixedPrecisionPolicy, Slot
from .._partitionable import partition_layer_norms
from .._contract import applied_spec, is_stacked
from . import _traversal
from ._traversal import lr_dfs

__all__ = [
    "FSDPModule",
    "MixedPrecisionPolicy",
    "fully_shard",
    "get_fully_sharded_modules",
    "replicate",
]


def _state(module: nn.Module) -> FSDPState:
    state = fsdp_state(module)
    if state is None:
        raise RuntimeError(
            f"this {type(module).__name__} has a fully sharded class but no fully_shard state (was it built "
            f"with object.__new__ or copied without copy.deepcopy?); apply fully_shard to a module of the "
            f"original class instead")
    return state


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

    def __deepcopy__(self, memo: dict[int, Any]) -> FSDPModule:
        """A deep copy that is fully sharded like this module (its registry records copied too)."""
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
        copy_records(memo)
        return new


def get_fully_sharded_modules(root: nn.Module) -> list[nn.Module]:
    """The fully sharded modules under ``root`` (itself included) in left-to-right DFS order.

    The order of ``root.modules()``, each module once, never entering a
    ``replicate``-d subtree, whatever order ``fully_shard`` was applied in.
    """
    if not isinstance(root, nn.Module):
        raise TypeError(f"root must be an nn.Module, got {type(root).__name__}")
    return [m for _, m in lr_dfs(root, skip=is_replicated) if is_fully_sharded(m)]


_fsdp_classes: dict[type, type] = {}


def _fsdp_class(cls: type) -> type:
    """A subclass of ``cls`` and :class:`FSDPModule` whose ``forward`` runs through its state's :meth:`FSDPState.forward`.

    It keeps ``cls``'s ``__name__`` and ``__qualname__``: tools look layers up
    by class name (transformers' ``_no_split_modules``, accelerate's
    ``get_module_class_from_name``, Trainer's ``fsdp_config`` layer classes),
    and a sharded layer must still answer to its own. ``isinstance(m,
    FSDPModule)`` tells a fully sharded module apart.

    The wrapper keeps ``cls.forward``'s signature, name, docstring and
    annotations for introspection (``inspect.signature(module.forward)``).
    A wrapping ``forward`` rather than FSDP2's forward pre/post hook pair: where
    the state swaps gathered (or cast) parameters in for the forward, it must
    put the sharded ones back when the forward raises, and a post hook does not
    run then (the next optimizer step would update the swapped-in copies); the
    wrapper's ``finally`` does. Hooks users register on the module still run
    around it, as ``nn.Module.__call__`` runs them around ``forward``.
    """
    if cls not in _fsdp_classes:
        def forward(self, *args, **kwargs):
            return _state(self).forward(cls.forward, self, args, kwargs)

        # The wrapper looks like cls.forward to introspection (name, docstring, annotations, and through
        # __wrapped__ its signature): tools bind inputs by it (transformers' Trainer keeps only the columns
        # the signature names, and finds the label arguments by it).
        functools.update_wrapper(forward, cls.forward)
        _fsdp_classes[cls] = type(cls.__name__, (FSDPModule, cls),
                                  {"forward": forward, "__module__": cls.__module__,
                                   "__qualname__": cls.__qualname__})
    return _fsdp_classes[cls]


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
      module: the module; its class becomes a subclass of its class and of
        :class:`FSDPModule` with the same name; its ``state_dict()`` keys are unchanged.
      mesh: a torch_xla ``Mesh`` with an ``fsdp`` axis, or a 1-D mesh; default
        the global mesh, or a 1-D ``('fsdp',)`` mesh over all devices.
      reshard_after_forward: do not keep gathered parameters alive from
        forward to backward: the forward runs on the sharded parameters,
        autograd saves them, and the partitioner gathers each where it is
        used (see the module docstring). A backward after an in-place write
        to a parameter its forward used (an optimizer step in between)
        raises autograd's ``RuntimeError``, as in eager.
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
    ignored = _checked_arguments(module, reshard_after_forward, shard_placement_fn, mp_policy, ignored_params)
    mesh, axis = resolve_mesh(mesh)
    found, fsdp, slots_of = _plan(module, mesh, axis, ignored, shard_placement_fn)
    buffers = managed_buffers(found.own, module)
    check_buffers(buffers)
    # Every check passed: from here on the module and its parameters change.
    _apply(module, mesh, slots_of[id(module)], buffers,
           FSDPState(mesh, axis, reshard_after_forward, shard_placement_fn, mp_policy, set(ignored)))
    assign_ownership(found.tree.modules, [_state(m) for m in fsdp], [slots_of[id(m)] for m in fsdp])
    for m in fsdp:
        for sl in slots_of[id(m)]:
            hook_loads(sl.holder)
        hook_loads(m)
    # Dynamo's marks: module's tree, minus everything a replicated module reaches.
    inside_replicated = {id(sub) for r in found.replicated for sub in _traversal.module_tree(r).modules}
    managed = [m for m in found.own.modules if id(m) not in inside_replicated]
    mark_managed(managed, True)
    # LayerNorm without PyTorch's batch-norm fallback, which GSPMD replicates.
    partition_layer_norms(managed)
    return module  # type: ignore[return-value]


def _checked_arguments(module: nn.Module, reshard_after_forward: bool, shard_placement_fn: Callable | None,
                       mp_policy: MixedPrecisionPolicy, ignored_params: Iterable[nn.Parameter] | None
                       ) -> list[nn.Parameter]:
    """``fully_shard``'s arguments checked (nothing changes yet): the ignored parameters as a list."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
    if is_fully_sharded(module):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; apply it once per module")
    if is_replicated(module):
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
    return ignored


def _plan(module: nn.Module, mesh: Any, axis: str | int, ignored: list[nn.Parameter],
          shard_placement_fn: Callable | None) -> tuple[Any, list[nn.Module], dict[int, list[Slot]]]:
    """Ownership over the whole enclosing fully sharded tree, as if ``module`` were already sharded (one walk).

    Returns the survey, the fully sharded modules of the tree (``module``
    among them) and each one's slots, keyed by ``id``. The slots ``module``
    newly shards get their partition spec; a conflict with a sharding a
    parameter already has raises. Nothing changes yet.
    """
    found = survey(module)
    fsdp = fully_sharded_in(found.tree, module)
    all_ignored = list(ignored)
    for m in fsdp:
        if m is not module:
            all_ignored.extend(_state(m).ignored_params)
    slots_of = plan(found.tree, {id(m) for m in fsdp}, all_ignored)
    size = axis_size(mesh, axis)
    for slot in slots_of[id(module)]:
        p = slot.param
        if p.device.type not in ("cpu", "xla"):
            raise ValueError(f"{slot.fqn} is on {p.device}; fully_shard moves parameters from the CPU to the XLA "
                             f"device, but not from {p.device.type}")
        applied = applied_spec(p)
        if applied is not None:  # placed (and warned about) when it was first sharded
            slot.spec = applied
            continue
        holder = slot.holder
        dim = default_placement(p, slot.fqn, size, shard_placement_fn,
                                stacked=holder is not None and is_stacked(holder, slot.name))
        slot.spec = spec_for(p, dim, axis)
        existing = current_spec(p)
        if existing and existing != spec_string(mesh, slot.spec, p):
            raise ValueError(f"{slot.fqn} already has the sharding {existing}, which conflicts with fully_shard's "
                             f"{slot.spec} over the '{axis}' axis; clear it or pass a matching shard_placement_fn")
    return found, fsdp, slots_of


def _apply(module: nn.Module, mesh: Any, slots: list[Slot], buffers: Any, state: FSDPState) -> None:
    """Move and shard ``module``'s new parameters and its buffers, attach ``state``, swap the class."""
    import torch_xla

    device = torch_xla.device()
    for slot in slots:
        if applied_spec(slot.param) is None:
            shard_new(slot.param, mesh, slot.spec, device)
    move_buffers(buffers, device)
    register_fsdp(module, state)
    module.__class__ = _fsdp_class(type(module))


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
    if is_fully_sharded(module):
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}; "
                         f"a module is either replicated or fully sharded, not both")
    if is_replicated(module):
        raise ValueError(f"replicate was already applied to this {type(module).__name__}")
    mesh, _ = resolve_mesh(mesh) if mesh is not None else (None, None)
    tree = _traversal.module_tree(module, skip=lambda m: m is not module and is_fully_sharded(m))
    params = [p for m in tree.modules for p in m._parameters.values() if p is not None]
    for p in params:
        if p.device.type not in ("cpu", "xla"):
            raise ValueError(f"a parameter of shape {tuple(p.shape)} is on {p.device}; replicate moves parameters "
                             f"from the CPU to the XLA device only")
    device = torch_xla.device()
    for p in params:
        if p.device.type != "xla":
            move_to(p, device)
    register_replicate(module, ReplicateState(mesh))
    for m in tree.modules:  # load_state_dict(assign=True) with host tensors moves them to the device too
        names = [n for n, p in m._parameters.items() if p is not None]
        if names:
            holder_record(m, create=True).replicas.update(dict.fromkeys(names))
            hook_loads(m)
    hook_loads(module)
    return module


fully_shard.state = fsdp_state  # type: ignore[attr-defined]
replicate.state = replicate_state  # type: ignore[attr-defined]
