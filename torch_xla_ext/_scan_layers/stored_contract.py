"""What a layer stored stacked answers per parameter: PyTorch's numbers, or a :class:`StackedLayerError` at that line.

After :func:`~torch_xla_ext.stack_layers`, a layer's parameters are rows of
one ``[L, ...]`` parameter per name on the ``nn.ModuleList``. Code written
for per-layer parameter objects must never compute something else silently,
so each per-layer surface either keeps the unstacked model's meaning or
refuses where the user wrote it:

- ``layers[i].up.weight`` is a :class:`_Row`: a differentiable view of the
  stacked parameter's row (reads and in-place writes under ``no_grad``
  reach the stacked parameter, as ``nn.init`` and ``.data.normal_()`` do);
  its ``.grad`` is the row of the stacked gradient (a view: ``zero_()``
  reaches it). Assigning ``.data`` or ``.grad``, ``requires_grad_``,
  ``register_hook`` and ``retain_grad`` are refused: a row has no
  per-layer flag, storage or hook of its own.
- Every module inside a stacked layer gets a subclass of its class (same
  name) whose ``parameters()``/``named_parameters()`` refuse when the
  module holds stacked rows (so ``requires_grad_``, ``zero_grad``, optimizer
  groups, ``clip_grad_norm_`` and no-decay rules over a layer cannot see
  nothing), and which refuses ``.to()``/``.half()``/``.cpu()`` of a layer
  alone, a ``copy.deepcopy`` of a layer alone, assigning a parameter over a
  stacked name, and replacing or wrapping a submodule that holds stacked
  rows (LoRA adapters would read layer 0's weight in every scanned layer).
  The same operations on the model or the ``ModuleList`` work.
- Pickling (``torch.save(model)``) rebuilds these subclasses by their base
  class.
- Refused when ``stack_layers`` is called (nothing changed yet): an
  optimizer that already holds a layer's parameter, and a parameter tied
  between a layer and a module outside the list.
- At an optimizer step (a process-wide step pre-hook, installed by the first
  ``stack_layers``): a per-layer parameter that stacking replaced, and
  weight-decay groups that put a stacked parameter where the per-layer
  ``p.dim() < 2`` rule would not (a rule by name, module type or ``dim``
  cannot see stacked per-layer parameters).
"""

from __future__ import annotations

import copy
import gc
import threading
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._contract import MEMBER, SLOTS, STACKED_NAMES, as_whole, whole
from .._weak import WeakIdMap
from .._scan.errors import ScanInputError, StackedLayerError

__all__ = ["member_class", "container_class", "row", "refuse_outside_holders", "register_stacked", "mark_replaced"]


_member_classes: dict[type, type] = {}
_container_classes: dict[type, type] = {}

# Stacked parameter -> its qualified per-layer name; per-layer parameter stacking replaced -> where its values
# went; optimizer -> the groups' signature last checked. Weak: a dropped model or optimizer leaves no entry.
_STACKED: WeakIdMap[torch.Tensor, str] = WeakIdMap()
_REPLACED: WeakIdMap[torch.Tensor, str] = WeakIdMap()
_checked: WeakIdMap[Any, tuple] = WeakIdMap()
_hook_lock = threading.Lock()
_hook_handle: Any = None


def _where(module: nn.Module, name: str | None = None) -> str:
    """``layers[3].mlp.up_proj`` (``.weight``) for a module inside a stacked layer."""
    record = module.__dict__.get(MEMBER)
    if record is None:
        return type(module).__name__
    _, index, path = record
    text = f"layers[{index}]" + (f".{path}" if path else "")
    return text + (f".{name}" if name else "")


def _holds_rows(module: nn.Module, recurse: bool = True) -> bool:
    if not recurse:
        return bool(module.__dict__.get(SLOTS))
    return any(m.__dict__.get(SLOTS) for m in nn.Module.modules(module))


def _first_key(module: nn.Module) -> str:
    """One stacked parameter's key under ``module`` (``'mlp/up_proj/weight'``), for messages."""
    for m in nn.Module.modules(module):
        for _, (_, key, _) in m.__dict__.get(SLOTS, {}).items():
            return key
    return "<name>"


class _Row(torch.Tensor):
    """A stacked layer's parameter: a differentiable view of its row of the stacked parameter.

    Ops see a plain tensor (``__torch_function__`` is disabled). What a row
    cannot be (a leaf with its own flag, storage, gradient slot or hooks)
    raises :class:`StackedLayerError`.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    def _refuse(self, what: str, instead: str) -> StackedLayerError:
        container, key, index, where = self.__dict__["_txe_row"]
        return StackedLayerError(
            f"{where}.{what}: this layer is stored stacked (stack_layers), and {where} is row {index} of the "
            f"stacked parameter '{key}' of its ModuleList, not a parameter of its own; {instead}"
        )

    @property
    def grad(self) -> torch.Tensor | None:  # type: ignore[override]
        container, key, index, _ = self.__dict__["_txe_row"]
        g = container._parameters[key].grad
        return None if g is None else g[index]

    @grad.setter
    def grad(self, value: Any) -> None:
        _, key, index, _ = self.__dict__["_txe_row"]
        raise self._refuse("grad = ...", f"write into the stacked gradient instead "
                                         f"(layers.get_parameter('{key}').grad[{index}].copy_(...))")

    @property
    def data(self) -> torch.Tensor:  # type: ignore[override]
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: Any) -> None:
        _, key, index, _ = self.__dict__["_txe_row"]
        raise self._refuse("data = ...", f"copy into the row instead (with torch.no_grad(): "
                                         f"layers.get_parameter('{key}')[{index}].copy_(value))")

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        return torch._C.TensorBase.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        raise self._refuse("requires_grad = ...", _FREEZE)

    def requires_grad_(self, requires_grad: bool = True) -> torch.Tensor:
        raise self._refuse("requires_grad_()", _FREEZE)

    def register_hook(self, hook: Any) -> Any:
        _, key, _, _ = self.__dict__["_txe_row"]
        raise self._refuse("register_hook()", f"register the hook on the stacked parameter "
                                              f"(layers.get_parameter('{key}')), whose gradient holds every row")

    def register_post_accumulate_grad_hook(self, hook: Any) -> Any:
        _, key, _, _ = self.__dict__["_txe_row"]
        raise self._refuse("register_post_accumulate_grad_hook()",
                           f"register it on the stacked parameter (layers.get_parameter('{key}'))")

    def retain_grad(self) -> None:
        raise self._refuse("retain_grad()", "its .grad already reads the row of the stacked gradient")


_FREEZE = ("a row has no requires_grad of its own. Freeze whole stacked parameters (layers.get_parameter(key)"
           ".requires_grad_(False)), or do not stack layers that are frozen one by one")


def row(container: nn.Module, key: str, index: int, holder: nn.Module, name: str) -> torch.Tensor:
    """Row ``index`` of ``container``'s stacked parameter ``key``, as ``holder.name`` answers it."""
    out = container._parameters[key][index].as_subclass(_Row)
    out.__dict__["_txe_row"] = (container, key, index, _where(holder, name))
    return out


class _Member:
    """The methods a module inside a stacked layer gets (a subclass of its class, same name, puts them first)."""

    def __getattr__(self, name: str) -> Any:
        slots = self.__dict__.get(SLOTS)
        if slots is not None and name in slots and self.__dict__["_parameters"].get(name) is None:
            container, key, index = slots[name]
            return row(container, key, index, self, name)  # type: ignore[arg-type]
        return super().__getattr__(name)  # type: ignore[misc]

    def _refuse(self, what: str, instead: str) -> StackedLayerError:
        return StackedLayerError(
            f"{_where(self)}.{what}: this layer is stored stacked (stack_layers); its parameters are rows of "  # type: ignore[arg-type]
            f"one [L, ...] parameter per name on its ModuleList (e.g. '{_first_key(self)}'), not tensors of "  # type: ignore[arg-type]
            f"its own. {instead}"
        )

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True) -> Any:
        if not whole() and _holds_rows(self, recurse):  # type: ignore[arg-type]
            raise self._refuse(
                "named_parameters()/parameters()",
                "Take the model's or the ModuleList's parameters (each stacked parameter once), and build "
                "optimizer groups, freezing and clipping over those; layers frozen or optimized one by one "
                "cannot be stored stacked.")
        return super().named_parameters(prefix, recurse, remove_duplicate)  # type: ignore[misc]

    def parameters(self, recurse: bool = True) -> Any:
        self.named_parameters(recurse=recurse)  # raises here, not at the first iteration
        return super().parameters(recurse)  # type: ignore[misc]

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        if not whole() and _holds_rows(self):  # type: ignore[arg-type]
            raise self._refuse("to()/half()/float()/cpu()",
                               "Convert the model or the ModuleList: one layer's rows cannot change dtype or "
                               "device alone.")
        return super()._apply(fn, recurse)  # type: ignore[misc]

    def __deepcopy__(self, memo: dict) -> Any:
        record = self.__dict__.get(MEMBER)
        if record is not None and id(record[0]) not in memo and _holds_rows(self):  # type: ignore[arg-type]
            raise self._refuse("copy.deepcopy", "Its copy would hold no parameters (and train nothing); deep-copy "
                                                "the whole model or ModuleList, or copy a layer before stacking.")
        return copy._reconstruct(self, memo, *self.__reduce_ex__(4))  # type: ignore[attr-defined]

    def __reduce_ex__(self, protocol: int) -> Any:
        return (_rebuild_member, (type(self).__bases__[1],), self.__dict__)

    def _refuse_replacing(self, name: str, value: Any) -> None:
        slots = self.__dict__.get(SLOTS)
        if slots is not None and name in slots:
            raise self._refuse(f"{name} = ... / register_parameter / del",
                               f"Write into its row instead (with torch.no_grad(): "
                               f"layers.get_parameter('{slots[name][1]}')[{slots[name][2]}].copy_(value)).")
        modules = self.__dict__.get("_modules")
        if modules is not None and name in modules:
            old = modules[name]
            if old is not None and old is not value and _holds_rows(old):
                raise self._refuse(f"{name} = ... / del",
                                   f"{name} holds stacked rows, and a module put in its place (a wrapper, a LoRA "
                                   f"adapter) would not be read by scan_layers as the loop reads it. Replace or "
                                   f"wrap submodules before stack_layers.")

    def __setattr__(self, name: str, value: Any) -> None:
        self._refuse_replacing(name, value)
        super().__setattr__(name, value)  # type: ignore[misc]

    def __delattr__(self, name: str) -> None:
        self._refuse_replacing(name, None)
        super().__delattr__(name)  # type: ignore[misc]

    def add_module(self, name: str, module: nn.Module | None) -> None:
        self._refuse_replacing(name, module)
        super().add_module(name, module)  # type: ignore[misc]

    def register_parameter(self, name: str, param: nn.Parameter | None) -> None:
        self._refuse_replacing(name, param)
        super().register_parameter(name, param)  # type: ignore[misc]


class _Container:
    """The methods the ``nn.ModuleList`` of stacked layers gets."""

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        with as_whole():
            return super()._apply(fn, recurse)  # type: ignore[misc]

    def __reduce_ex__(self, protocol: int) -> Any:
        return (_rebuild_container, (type(self).__bases__[1],), self.__dict__)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)  # type: ignore[misc]
        register_stacked(self)  # type: ignore[arg-type]


def _subclass(cls: type, mixin: type, cache: dict[type, type]) -> type:
    sub = cache.get(cls)
    if sub is None:
        sub = type(cls.__name__, (mixin, cls), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
        cache[cls] = sub
    return sub


def member_class(cls: type) -> type:
    """``cls`` (a module class inside stacked layers) with :class:`_Member`'s methods first."""
    return cls if issubclass(cls, _Member) else _subclass(cls, _Member, _member_classes)


def container_class(cls: type) -> type:
    """``cls`` (the stacked layers' ``ModuleList`` class) with :class:`_Container`'s methods first."""
    return cls if issubclass(cls, _Container) else _subclass(cls, _Container, _container_classes)


def container_base(cls: type) -> type:
    """The class :func:`container_class` made ``cls`` from (``cls`` itself for a list that is not stacked)."""
    return cls.__bases__[1] if issubclass(cls, _Container) else cls


def rebased(cls: type, base: type) -> type:
    """The class a list of class ``cls`` takes to become a ``base``: stacked lists stay stacked."""
    return container_class(base) if issubclass(cls, _Container) else base


def _rebuild_member(base: type) -> nn.Module:
    return object.__new__(member_class(base))


def _rebuild_container(base: type) -> nn.Module:
    return object.__new__(container_class(base))


def refuse_outside_holders(layers: nn.ModuleList, params: dict[int, str]) -> None:
    """Refuse an optimizer or a module outside ``layers`` that holds one of the layers' parameters.

    ``params``: ``id(parameter) -> 'layers[i].name'``. One pass over the
    objects the garbage collector tracks (after a collection, so a dropped
    optimizer does not count); run once, before ``stack_layers`` changes
    anything.
    """
    gc.collect()
    inside = {id(m) for layer in layers for m in nn.Module.modules(layer)}
    for obj in gc.get_objects():
        kind = type(obj)  # (not isinstance: it reads __class__, which some objects answer with a warning)
        if issubclass(kind, torch.optim.Optimizer):
            for group in obj.param_groups:
                for p in group["params"]:
                    if id(p) in params:
                        raise ScanInputError(
                            f"stack_layers: an optimizer ({kind.__name__}) already holds {params[id(p)]}; "
                            f"stacking replaces that parameter, so the optimizer would update a tensor nothing "
                            f"reads. Create the optimizer after stack_layers")
        elif issubclass(kind, nn.Module) and id(obj) not in inside and obj is not layers:
            for name, p in obj.__dict__.get("_parameters", {}).items():
                if p is not None and id(p) in params:
                    raise ScanInputError(
                        f"stack_layers: {params[id(p)]} is also the parameter '{name}' of a "
                        f"{kind.__name__} outside these layers (tied); a stacked row cannot stay tied to "
                        f"it. Untie them, or leave these layers unstacked")


def register_stacked(container: nn.Module) -> None:
    """Record ``container``'s stacked parameters for the optimizer-step check (and install that check)."""
    global _hook_handle
    for name, key in container.__dict__.get(STACKED_NAMES, {}).items():
        p = container._parameters.get(key)
        if p is not None:
            _STACKED[p] = name
    with _hook_lock:
        if _hook_handle is None:
            _hook_handle = register_optimizer_step_pre_hook(_check_step)


def mark_replaced(p: torch.Tensor, where: str, key: str) -> None:
    """Remember that stacking replaced the per-layer parameter ``p`` (``where``) by a row of ``key``."""
    _REPLACED[p] = f"{where} (now a row of the stacked parameter '{key}')"


def _check_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Optimizer step pre-hook: refuse replaced per-layer parameters and decay groups that miss stacking.

    Runs again only when the groups change (their lists, lengths or decay).
    """
    groups = optimizer.param_groups
    signature = tuple((id(g["params"]), len(g["params"]), g.get("weight_decay", 0)) for g in groups)
    if _checked.get(optimizer) == signature:
        return
    decays = {bool(g.get("weight_decay", 0)) for g in groups}
    for g in groups:
        decayed = bool(g.get("weight_decay", 0))
        for p in g["params"]:
            replaced = _REPLACED.get(p)
            if replaced is not None:
                raise StackedLayerError(
                    f"{type(optimizer).__name__}.step: it holds {replaced}, which stack_layers replaced; "
                    f"nothing reads it any more. Create the optimizer from the model's parameters after "
                    f"stack_layers")
            name = _STACKED.get(p) if len(decays) == 2 else None
            if name is not None and decayed != (p.dim() - 1 >= 2):
                raise StackedLayerError(
                    f"{type(optimizer).__name__}.step: the stacked parameter of the layers' '{name}' "
                    f"(per layer {tuple(p.shape[1:])}) is in a group with weight_decay="
                    f"{g.get('weight_decay', 0)}, but the usual rule decays only parameters of 2 or more dims; "
                    f"a rule by name, module type or p.dim() cannot see stacked per-layer parameters (stack_layers). "
                    f"Put each stacked parameter in the group its per-layer shape calls for (p.dim() - 1 < 2: no "
                    f"decay), or leave the layers unstacked")
    _checked[optimizer] = signature
