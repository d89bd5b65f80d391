"""Lifting what a traced step function reads, and recording it so a cached loop never goes stale.

While ``scan`` traces ``fn`` lazily on placeholders, :class:`Lifter` (a
``TorchFunctionMode``) sees every torch call ``fn`` makes. It does three jobs:

* **Lift**: an XLA tensor that is neither an input nor made by ``fn`` is an
  *outside* tensor. It is replaced by a stand-in placeholder, recorded in order
  of first use, and becomes an explicit loop operand. The tensor objects are
  re-resolved on every call, so a dict entry or attribute that now holds a
  different tensor is read as it is now.
* **Record** a fingerprint of the trace: each torch call's function, its
  Python numbers and other non-tensor arguments *by value*, which input /
  outside tensor / earlier result each tensor argument was, and the contents
  (a 128-bit hash of the bytes) of host tensors it reads. Two traces with equal
  fingerprints lower to the same loop with the same constants; a cached loop is
  reused only then. Calls into torch_xla's own ops that bypass torch functions
  (``xm.*``, ``xs.mark_sharding``) are not recorded: their non-tensor
  arguments must not change between calls of one cached fn.
* **Refuse host reads** of XLA tensors (``.item()``, ``print``, ``if t:``; see
  :mod:`~torch_xla_ext._scan.guard`) before torch_xla would run a graph over
  placeholders.
* **Refuse host random draws** (``torch.rand`` without an XLA device,
  ``F.dropout`` on a host tensor; :mod:`~torch_xla_ext._scan.draws`) before
  they draw.
* **Refuse writes** to outside tensors by any route: an in-place op or ``out=``
  on one fails at once; a write through an alias (``.data``, a view) shows up
  as a changed stand-in after the trace (:meth:`Lifter.check_outside_unchanged`).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from .._xla import xlac
from .aot import note_backward_python
from .draws import TORCH_CPU, torch_host_draw
from .errors import ScanUnsupportedError
from .guard import describe_callable, host_read, refusing_draw, user_frame
from .keys import bits_key, content_digest

__all__ = ["Lifter", "is_inplace_call", "ValueIdentity"]

_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__", "__set__"})


def is_inplace_call(func: Any) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``__setitem__``, ``__iadd__``, ...)."""
    name = getattr(func, "__name__", "")
    if name in _INPLACE_DUNDERS:
        return True
    # OpOverloads are named like ``add_.Tensor``; methods like ``add_``.
    base = name.split(".", 1)[0]
    return base.endswith("_") and not base.endswith("__")


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors a call writes into: its first argument if in place, and every ``out=`` tensor."""
    targets = [args[0]] if args and isinstance(args[0], torch.Tensor) and is_inplace_call(func) else []
    out = kwargs.get("out")
    if out is not None:
        targets += [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return targets


_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format,
          torch.Size, slice, type(Ellipsis))


def _map_tensors(f: Callable[[torch.Tensor], Any], value: Any) -> Any:
    """``pytree.tree_map(f, value)`` for tensor leaves: the same result, without pytree's cost for plain tuples.

    Torch calls pass flat tuples, lists and dicts of tensors and numbers; other
    containers (namedtuples, registered pytree nodes) go through pytree.
    """
    kind = type(value)
    if kind is tuple or kind is list:
        mapped = [_map_tensors(f, v) for v in value]
        return value if all(m is v for m, v in zip(mapped, value)) else kind(mapped)
    if kind is dict:
        mapped = {k: _map_tensors(f, v) for k, v in value.items()}
        return value if all(mapped[k] is v for k, v in value.items()) else mapped
    if isinstance(value, torch.Tensor):
        return f(value)
    if isinstance(value, _PLAIN):
        return value
    return pytree.tree_map(lambda v: f(v) if isinstance(v, torch.Tensor) else v, value)


def _tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``value`` in pytree order (see :func:`_map_tensors`)."""
    if isinstance(value, torch.Tensor):
        return [value]
    kind = type(value)
    if kind is tuple or kind is list:
        return [t for v in value for t in _tensor_leaves(v)]
    if isinstance(value, _PLAIN):
        return []
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


class ValueIdentity:
    """Tells whether a lazy tensor still holds the value it held when this was made (about 1 us a tensor).

    A write replaces a tensor's IR value: through Python ops it also bumps
    the version counter, from C++ (batch_norm's running statistics) or by a
    sharding annotation only the value. While an identity lives it keeps the
    original values alive, so no new value can take a freed one's address.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        X = xlac()
        self._before = [(t._version, X._unique_id_for_ir_and_data(t)) for t in tensors]
        self._held = [t * 1 if t.dtype != torch.bool else t ^ False for t in tensors]

    def changed(self, tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Per tensor (the same ones, in order): whether its value was replaced."""
        X = xlac()
        return [t._version != v or X._unique_id_for_ir_and_data(t) != uid
                for t, (v, uid) in zip(tensors, self._before)]

    def written(self, tensors: Sequence[torch.Tensor]) -> list[bool]:
        """Per tensor: whether a Python in-place op wrote it (its version counter moved)."""
        return [t._version != v for t, (v, _) in zip(tensors, self._before)]


class Lifter(TorchFunctionMode):
    """Substitutes outside XLA tensors read by a traced function with stand-ins, and fingerprints the trace.

    Args:
      inputs: the tensors passed to the traced function (carry and x leaves, and
        for the autograd traces the outside arguments too). They are known.
      standin_for: makes the stand-in of a newly seen outside XLA tensor; None
        forbids reading any outside XLA tensor other than those in ``fixed``.
      fixed: ``(outside tensor, stand-in)`` pairs known in advance (the autograd
        traces map the outside tensors of the first trace to their arguments).
      record: build :attr:`fingerprint` (the first, lifting trace of a call).
    """

    def __init__(self, inputs: Sequence[torch.Tensor],
                 standin_for: Callable[[torch.Tensor], torch.Tensor] | None,
                 fixed: Sequence[tuple[torch.Tensor, torch.Tensor]] = (), record: bool = False) -> None:
        super().__init__()
        self._known: dict[int, torch.Tensor] = {id(t): t for t in inputs}
        self._standin_for = standin_for
        self.outside: list[torch.Tensor] = []
        self.standins: list[torch.Tensor] = []
        self._standin_ids: list[ValueIdentity] = []
        self._index: dict[int, int] = {}
        self._alias: dict[int, torch.Tensor] = {}
        self._record = record
        # Role of each tensor the fingerprint can name: ("i", k) input k, ("o", k)
        # outside tensor k's stand-in, ("t", n) the n-th tensor made by fn.
        self._roles: dict[int, tuple] = {id(t): ("i", k) for k, t in enumerate(inputs)}
        self._made = 0
        #: Weak references to the XLA tensors fn made (outputs of its torch calls; lifting traces only).
        self.made: list[weakref.ref] = []
        self._calls: list[tuple] = []
        #: Host tensors and unhashable objects the fingerprint names by identity:
        #: held so that no other object can take their id while a plan lives.
        self.held: list[Any] = []
        #: Whether fn passed a host tensor from outside to a torch call (recorded traces).
        self.reads_host = False
        #: The first call this mode refused (a host read or draw): raised again after the trace if fn
        #: caught it and went on without the value.
        self.refusal: ScanUnsupportedError | None = None
        for original, standin in fixed:
            self._add(original, standin)

    # ----------------------------------------------------------------- aliases
    def alias(self, tensor: torch.Tensor, value: torch.Tensor) -> None:
        """From now on, uses of ``tensor`` read ``value`` (a functional in-place update)."""
        self._alias[id(tensor)] = value
        self._known[id(value)] = value

    def resolve(self, value: Any) -> Any:
        return self._alias.get(id(value), value) if isinstance(value, torch.Tensor) else value

    # ----------------------------------------------------------------- lifting
    def _add(self, original: torch.Tensor, standin: torch.Tensor) -> torch.Tensor:
        k = len(self.outside)
        self._index[id(original)] = k
        self.outside.append(original)
        self.standins.append(standin)
        if self._record:
            self._standin_ids.append(ValueIdentity([standin]))
        self._known[id(standin)] = standin
        self._roles[id(standin)] = ("o", k)
        return standin

    def _swap(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        alias = self._alias.get(id(value))
        if alias is not None:
            return alias
        if id(value) in self._known:
            return value
        index = self._index.get(id(value))
        if index is not None:
            return self.standins[index]
        if type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter):
            # A wrapper subclass (torch_xla's XLAShardedTensor from mark_sharding):
            # look through it, or leave it alone while it is being built.
            inner = getattr(value, "global_tensor", None)
            return self._swap(inner) if isinstance(inner, torch.Tensor) else value
        if value.device.type != "xla":
            return value
        if torch._is_functional_tensor(value) and isinstance(torch._from_functional_tensor(value), FakeTensor):
            # A value of AOTAutograd's own trace (its fake tensor, behind the functionalization wrapper), handed
            # unwrapped to the ops it runs for a custom op inside an autograd.Function: never one from outside
            # fn, which holds device data.
            return value
        if self._standin_for is None:
            raise RuntimeError(
                f"scan: fn read an outside tensor of shape {tuple(value.shape)} that it did not read "
                f"when first traced; fn must read the same tensors on every call"
            )
        return self._add(value, self._standin_for(value))

    def _register_hook(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """A tensor hook ``fn`` registers: the backward runs it (noted for AOTAutograd's split, see
        :func:`~torch_xla_ext._scan.aot.split`); the lifting trace, which runs without autograd, skips it."""
        tensor, hook = (list(args) + [kwargs.get("hook")])[:2]
        note_backward_python(f"a tensor hook ({describe_callable(hook)}) registered at {user_frame()}")
        if not tensor.requires_grad:
            return RemovableHandle(OrderedDict())
        return func(*args, **kwargs)

    # ------------------------------------------------------------- fingerprint
    def _describe(self, value: Any) -> Any:
        """A hashable description of an argument: by value, by role, or (host tensors) by identity and version."""
        if isinstance(value, torch.Tensor):
            role = self._roles.get(id(value))
            if role is not None:
                return role
            if value.device.type == "xla":
                # An XLA wrapper left alone while it is being built (mark_sharding).
                # Never held: a live lazy tensor over placeholders would be
                # materialized by the next sync.
                return ("xla", type(value).__name__, tuple(value.shape), value.dtype)
            # A host tensor: its values are baked into the trace (uploaded as a
            # constant), so the plan is keyed by its contents. A write through
            # .data or a numpy view moves no version counter; contents catch it.
            self.reads_host = True
            digest = content_digest(value)
            if digest is not None:
                return ("h", tuple(value.shape), value.dtype, value.device.type, digest)
            self.held.append(value)
            return ("h", id(value), value._version, value.device.type)
        bits = bits_key(value)  # numbers and numpy values (torch.tensor(table) bakes a table in)
        if bits is not None:
            return bits
        if isinstance(value, (bool, int, str, type(None), torch.dtype, torch.device, torch.layout,
                              torch.memory_format, type(Ellipsis))):
            return (type(value).__name__, value)
        if isinstance(value, (list, tuple)):
            return (type(value).__name__, tuple(self._describe(v) for v in value))
        if isinstance(value, dict):
            return ("dict", tuple((self._describe(k), self._describe(v)) for k, v in value.items()))
        if isinstance(value, slice):
            return ("slice", self._describe(value.start), self._describe(value.stop), self._describe(value.step))
        try:
            hash(value)
        except TypeError:
            self.held.append(value)
            return ("id", type(value).__name__, id(value))
        return (type(value).__qualname__, value)

    def fingerprint(self) -> tuple:
        """What a cached loop must match to be reused: every torch call with its arguments, in order.

        Each tensor argument is named by its role (input k, outside tensor k,
        the n-th tensor made by fn), so the record fixes the dataflow too. (No
        graph hash: torch_xla computes one only after the previous step's
        execution finished, which would make tracing wait on the device.)
        """
        return tuple(self._calls)

    def check_outside_unchanged(self) -> None:
        """Raise if fn wrote into an outside tensor through an alias (``.data``, a view, ``copy_`` on a view)."""
        for k, (standin, identity) in enumerate(zip(self.standins, self._standin_ids)):
            if identity.changed([standin])[0]:
                t = self.outside[k]
                raise RuntimeError(
                    f"scan: fn writes into a tensor defined outside it (shape {tuple(t.shape)}, dtype "
                    f"{t.dtype}), through an alias such as .data or a view. The write would be lost: fn must "
                    f"be functional for tensors it does not receive; return the new value through the carry "
                    f"or ys instead."
                )

    # -------------------------------------------------------------------- mode
    def _refuse(self, error: ScanUnsupportedError) -> ScanUnsupportedError:
        if self.refusal is None:
            self.refusal = error
        return error

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.register_hook:
            return self._register_hook(func, args, kwargs)
        read = host_read(func, args, kwargs)
        if read is not None:
            raise self._refuse(ScanUnsupportedError(
                f"scan: fn reads a tensor's value on the host ({read}) at {user_frame()}. scan traces fn once "
                f"on placeholders without running it, so it cannot read values each iteration as the Python "
                f"loop would (print, .item(), .tolist(), .cpu(), `if t > 0:` and ops whose result shape depends "
                f"on values all do). Compute with tensors instead (torch.where for an if, a fixed-size mask for "
                f"a data-dependent selection), or do the read outside fn."
            ))
        if torch_host_draw(func, args, kwargs, _tensor_leaves):
            raise self._refuse(refusing_draw("scan", [TORCH_CPU], user_frame()))
        for target in _written(func, args, kwargs):
            if (id(target) not in self._known and id(target) not in self._alias
                    and (target.device.type == "xla" or id(target) in self._index)):
                how = "out=" if target is not (args[0] if args else None) else getattr(func, "__name__", func)
                raise RuntimeError(
                    f"scan: fn writes into a tensor defined outside it ({how} on a tensor of shape "
                    f"{tuple(target.shape)}, dtype {target.dtype}). The write would be lost: fn must be "
                    f"functional for tensors it does not receive; return the new value through the carry "
                    f"or ys instead."
                )
        args = _map_tensors(self._swap, args)
        kwargs = _map_tensors(self._swap, kwargs)
        if self._record:
            self._calls.append((func, self._describe(args), self._describe(kwargs)))
        out = func(*args, **kwargs)
        for leaf in _tensor_leaves(out):
            self._known[id(leaf)] = leaf
            if self._record and id(leaf) not in self._roles:
                self._roles[id(leaf)] = ("t", self._made)
                self._made += 1
                if leaf.device.type == "xla":
                    self.made.append(weakref.ref(leaf))
        return out
