"""A fully sharded module's state (:class:`FSDPState`): its slots, mixed precision, and the per-step forward.

The forward's gather is the one place in ``fully_shard`` that builds XLA
operations, and it moves nothing to the host. Which module has which state
is the registry's (:mod:`._registry`); a state never holds its module
strongly (a registration's holder is a weak reference).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from .._annotate import annotate_sharding, in_scan_step_trace, mesh_text, shard_activation
from ._param import Gather, axis_size, hook_gradient, place, spec_string

__all__ = [
    "FSDPState",
    "MixedPrecisionPolicy",
    "Slot",
    "unique_managed",
]


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


class Slot:
    """One registration (holder module, local name) of a managed parameter.

    The holder is referenced weakly, so a state never keeps its modules alive.
    """

    __slots__ = ("_holder", "name", "param", "spec", "fqn")

    def __init__(self, holder: nn.Module, name: str, param: nn.Parameter, spec: tuple, fqn: str) -> None:
        self._holder = weakref.ref(holder)
        self.name = name
        self.param = param
        self.spec = spec  # partition spec of the parameter over the mesh
        self.fqn = fqn    # relative to the managing module

    @property
    def holder(self) -> nn.Module | None:
        """The module registering the parameter (None once it was freed)."""
        return self._holder()


def unique_managed(slots: list[Slot]) -> list[tuple[str, nn.Parameter]]:
    """``(fqn, parameter)`` of each distinct parameter of ``slots``, first registration first."""
    seen: set[int] = set()
    out = []
    for slot in slots:
        if id(slot.param) not in seen:
            seen.add(id(slot.param))
            out.append((slot.fqn, slot.param))
    return out


class FSDPState:
    """What ``fully_shard(module, ...)`` decided for one module, and its forward."""

    def __init__(self, mesh: Any, axis: str | int, reshard_after_forward: bool,
                 shard_placement_fn: Callable | None, mp_policy: MixedPrecisionPolicy,
                 ignored_params: set[nn.Parameter]) -> None:
        self.mesh, self.axis = mesh, axis
        # What the forward passes instead of the mesh: constants torch.compile can trace.
        self.mesh_text = mesh_text(mesh)
        self.axis_size = axis_size(mesh, axis)
        self.reshard_after_forward = reshard_after_forward
        self.shard_placement_fn = shard_placement_fn
        self.mp_policy = mp_policy
        self.ignored_params = ignored_params
        self.managed: list[tuple[str, nn.Parameter]] = []
        self.slots: list[Slot] = []
        # Managed parameters without their gradient hook yet (frozen ones).
        self.unhooked: list[tuple[nn.Parameter, tuple]] = []
        self._spec_texts: dict[tuple[tuple, int], str] = {}

    def spec_text(self, spec: tuple, param: torch.Tensor) -> str:
        """The sharding string ``param`` carries once placed with ``spec`` ('' when replicated)."""
        key = (spec, param.dim())
        text = self._spec_texts.get(key)
        if text is None:
            text = self._spec_texts[key] = spec_string(self.mesh, spec, param)
        return text

    def set_slots(self, slots: list[Slot]) -> None:
        """Manage exactly the registrations ``slots``."""
        self.slots = slots
        self.managed = unique_managed(slots)
        specs = {id(slot.param): slot.spec for slot in slots}
        self.unhooked = [(p, specs[id(p)]) for _, p in self.managed]
        self.hook_unfrozen()

    def hook_unfrozen(self) -> None:
        """Hook the gradient of each managed parameter unfrozen since it was placed."""
        self.unhooked = [(p, spec) for p, spec in self.unhooked if not hook_gradient(p, self.mesh, spec)]

    def adopt(self, replaced: dict[int, nn.Parameter | None]) -> None:
        """After ``load_state_dict``: make each registration's current parameter the managed one.

        ``replaced`` maps ``id(old managed parameter)`` to the parameter that
        replaces it (None: kept). Every registration of a tied parameter is
        pointed at its replacement, which is placed on the device with the
        slot's sharding (see :func:`._param.place`).
        """
        groups: dict[int, list[Slot]] = {}
        for slot in self.slots:
            if id(slot.param) in replaced:
                groups.setdefault(id(slot.param), []).append(slot)
        changed = False
        for key, slots in groups.items():
            new = replaced[key]
            if new is None:
                new = slots[0].param
            for slot in slots:
                holder = slot.holder
                if holder is not None and holder._parameters.get(slot.name) is not new:
                    holder._parameters[slot.name] = new
                changed |= slot.param is not new
                slot.param = new
            spec = slots[0].spec
            place(new, self.mesh, spec, self.spec_text(spec, new))
        if changed:
            self.set_slots(self.slots)

    def forward(self, forward: Callable, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Run ``forward(module, *args, **kwargs)`` on the managed parameters, gathered or sharded.

        Gathered (one replicated annotation each, kept by autograd for the
        backward) with ``reshard_after_forward=False``, inside scan's trace
        (scan's backward recomputes each gather) and under ``torch.compile``.
        Otherwise the module runs on its sharded parameters, autograd saves
        them as they are, and the SPMD partitioner gathers each where it is
        used, in the forward and again in the backward (FSDPv2's way): the
        graph holds nothing gathered from the forward to the backward, and the
        step records no per-parameter work but the gradient's annotation
        (:func:`grad_sharder`).
        """
        mp = self.mp_policy
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(mp.param_dtype) if t.is_floating_point() else t, (args, kwargs))
        # Under torch.compile the parameters are gathered too: the tests' compiled decoder
        # on sharded parameters leaves the eager losses at step 3 (not isolated further);
        # gathered, it trains like the eager one.
        compiling = torch.compiler.is_compiling()
        if compiling:
            # torch_xla 2.9's openxla backend differentiates an input of the compiled graph
            # that autograd saves as it is (token ids an embedding reads, features a Linear
            # reads) at its first call's value on every later call; a view made inside the
            # graph is saved instead. A view, not a copy: an in-place write reaches the caller.
            args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.view_as(t), (args, kwargs))
            if self.reshard_after_forward and self.managed and torch.is_grad_enabled():
                _warn_compiled_reshard()
        in_scan = in_scan_step_trace()
        gather = not self.reshard_after_forward or compiling or in_scan
        if not compiling and not in_scan and torch.is_grad_enabled():
            args = self._barrier_in_backward(args)
        if gather or mp.param_dtype is not None or mp.reduce_dtype is not None:
            out = self._swapped_forward(forward, module, args, kwargs, gather)
        else:
            if self.unhooked:  # without a Gather node, only the hook shards their gradients
                self.hook_unfrozen()
            out = forward(module, *args, **kwargs)
        if mp.output_dtype is not None:
            out = pytree.tree_map_only(
                torch.Tensor, lambda t: t.to(mp.output_dtype) if t.is_floating_point() else t, out)
        # Keep activations sharded over the fsdp axis on their leading (batch)
        # dimension, so the compiler gathers weights rather than activations.
        return pytree.tree_map_only(torch.Tensor, self._shard_batch, out)

    def _barrier_in_backward(self, args: tuple) -> tuple:
        """``args``, through a node whose backward ties the module's parameter gradients to its input gradients.

        Without it XLA's combiner merges every module's gradient
        reduce-scatter into one at the end of the backward, and each module's
        full, unreduced gradient stays live until then (measured on the TPU
        compiler: ``scripts/bench_fsdp.py --tpu``, ``test/fsdp/test_fsdp_tpu.py``). With the barrier each module's
        gradients are reduced and sharded before the backward goes on to the
        modules before it (FSDPv2 places the same barrier with a full backward
        hook). Only positional tensor arguments that need a gradient carry it;
        a module with none (the root reading token ids) needs no barrier.
        """
        params = [p for _, p in self.managed if p.requires_grad]
        if not params:  # nothing's gradient to tie (frozen or no managed parameters)
            return args
        flat, spec = pytree.tree_flatten(args)
        positions = [k for k, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad
                     and t.device.type == "xla"]
        if not positions:
            return args
        tied = _BackwardBarrier.apply(params, *(flat[k] for k in positions))
        for k, t in zip(positions, tied):
            flat[k] = t
        return pytree.tree_unflatten(flat, spec)

    def _swapped_forward(self, forward: Callable, module: nn.Module, args: tuple, kwargs: dict,
                         gather: bool) -> Any:
        """``forward`` with each managed registration swapped for its parameter gathered and/or cast."""
        param_dtype = self.mp_policy.param_dtype
        swapped: list[tuple[nn.Module, str, Any]] = []
        try:
            uses: list[tuple[nn.Module, str, int]] = []
            index: dict[int, int] = {}
            sources: list[torch.Tensor] = []
            specs: list[tuple] = []
            for slot in self.slots:
                holder = slot.holder
                if holder is None:
                    continue
                current = holder._parameters[slot.name]
                k = index.get(id(current))
                if k is None:
                    k = index[id(current)] = len(sources)
                    source = current
                    if param_dtype is not None and source.is_floating_point():
                        source = source.to(param_dtype)
                    sources.append(source)
                    specs.append(slot.spec)
                uses.append((holder, slot.name, k))
            fulls = self._gather(sources, specs, gather)
            for holder, name, k in uses:
                swapped.append((holder, name, holder._parameters[name]))
                holder._parameters[name] = fulls[k]
            return forward(module, *args, **kwargs)
        finally:
            for holder, name, current in reversed(swapped):
                holder._parameters[name] = current

    def _gather(self, sources: list[torch.Tensor], specs: list[tuple], gather: bool) -> list[torch.Tensor]:
        """Each source, gathered when ``gather``: one :class:`Gather` node for those that need a gradient."""
        reshard = self.reshard_after_forward
        if gather:
            fulls = [annotate_sharding(t, self.mesh_text, (None,) * t.dim(), recompute_in_backward=reshard)
                     if not t.requires_grad else None for t in sources]
        else:
            fulls = [None if t.requires_grad else t for t in sources]
        needs = [k for k, full in enumerate(fulls) if full is None]
        if needs:
            gathered = Gather.apply(self.mesh_text, tuple(specs[k] for k in needs), self.mp_policy.reduce_dtype,
                                    gather, reshard, *(sources[k] for k in needs))
            for k, full in zip(needs, gathered):
                fulls[k] = full
        return fulls

    def _shard_batch(self, t: torch.Tensor) -> torch.Tensor:
        if (t.device.type != "xla" or not t.is_floating_point() or t.dim() == 0
                or t.shape[0] % self.axis_size):
            return t
        spec = (self.axis,) + (None,) * (t.dim() - 1)
        if t.requires_grad:
            return shard_activation(t, self.mesh_text, spec)
        return annotate_sharding(t, self.mesh_text, spec)


class _BackwardBarrier(torch.autograd.Function):
    """Identity on a module's inputs; its backward puts an optimization barrier over the gradients of the
    module's parameters accumulated so far and the gradients flowing on to the inputs.

    Autograd runs a parameter's gradient accumulation as soon as the gradient
    exists (before any other ready node), so when the inputs' gradients arrive
    here, the module's parameter gradients of this backward are in ``.grad``.
    """

    @staticmethod
    def forward(ctx, params: list, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.params = params
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        import torch_xla.core.xla_model as xm

        tied = [p.grad for p in ctx.params if p.grad is not None and p.grad.device.type == "xla"]
        tied += [g for g in grads if g is not None]
        if tied:
            xm.optimization_barrier_(tied)
        return (None, *grads)


_COMPILED_RESHARD = (
    "fully_shard(reshard_after_forward=True) under torch.compile: AOTAutograd's partitioner decides what the "
    "compiled forward saves for the backward, and it saves the gathered (unsharded) parameters instead of "
    "gathering them again in the backward. Values and gradients are the same; the memory is that of "
    "reshard_after_forward=False. Run the model without torch.compile (lazy tensors) to reshard after forward.")


@torch._dynamo.assume_constant_result
def _warn_compiled_reshard() -> bool:
    """Warn that a compiled forward keeps gathered parameters; dynamo runs it while tracing (a constant to it)."""
    warnings.warn(_COMPILED_RESHARD, UserWarning, stacklevel=2)
    return True
