"""The Python state a step function can reach, and whether its trace changed it.

The Python loop runs ``fn`` once per iteration: a ``fn`` that changes Python
state (a counter in a closure, a dict entry, an attribute, a list it appends
to) runs each iteration with the state the previous one left. A traced loop
runs one trace for all iterations, which is the loop only if every
iteration's ``fn`` computes the same thing.

:class:`ReachableState` keys, by contents (:func:`~torch_xla_ext._scan.keys.value_key`),
what ``fn`` can reach directly: its closure cells, the globals its code
names, its defaults, ``self`` of a bound method, the arguments of a
``functools.partial``, and a module's attributes (those of its submodules
too). A trace that changed any of it is followed by one trace per remaining
iteration (:func:`~torch_xla_ext._scan.stages.capture`): the same state
sequence the loop would see, the same side effects, and a refusal at the
first iteration that traces differently, whatever the period of the change.
State reached only through other functions' globals, and containers past
the key's size budget, are not seen: for those the second trace of a call
that lowers a loop is the remaining check.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .keys import attribute_key, value_key

__all__ = ["ReachableState", "backward_state_key"]

#: Objects never keyed: they hold no per-call state a step computes with, or are themselves code.
_SKIPPED = (types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType, type,
            functools.partial)


def _key(value: Any) -> object:
    # A plain object (``self`` of a bound method, a callable object) is keyed by its attributes by value_key.
    return attribute_key(value) if isinstance(value, torch.nn.Module) else value_key(value)


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _reachable(fn: Any, found: dict[str, Any], seen: set[int], depth: int = 0) -> None:
    """Collect ``name -> object`` for the state ``fn`` reaches directly (see the module docstring)."""
    if id(fn) in seen or depth > 4:
        return
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        found[f"{getattr(fn.func, '__qualname__', 'partial')} arguments"] = (fn.args, fn.keywords)
        _reachable(fn.func, found, seen, depth + 1)
        return
    if isinstance(fn, types.MethodType):
        found["self"] = fn.__self__
        _reachable(fn.__func__, found, seen, depth + 1)
        return
    if isinstance(fn, torch.nn.Module):
        found[type(fn).__name__] = fn
        return
    code = getattr(fn, "__code__", None)
    if code is None:
        if callable(fn) and not isinstance(fn, _SKIPPED):  # a callable object: its attributes
            found[type(fn).__name__] = fn
            _reachable(type(fn).__call__, found, seen, depth + 1)
        return
    for name, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, torch.nn.Module) or not (callable(value) or isinstance(value, _SKIPPED)):
            found[name] = value
        elif callable(value):
            _reachable(value, found, seen, depth + 1)  # a nested helper: its own closure
    module_globals = getattr(fn, "__globals__", {})
    for name in _code_names(code):
        if name in module_globals:
            value = module_globals[name]
            if isinstance(value, torch.nn.Module) or not (callable(value) or isinstance(value, _SKIPPED)):
                found[name] = value
    if getattr(fn, "__defaults__", None):
        found["defaults"] = fn.__defaults__
    if getattr(fn, "__kwdefaults__", None):
        found["keyword defaults"] = fn.__kwdefaults__


class ReachableState:
    """A snapshot of the state ``fn`` reaches; :meth:`changed` names what differs now."""

    def __init__(self, fn: Callable) -> None:
        self._objects: dict[str, Any] = {}
        _reachable(fn, self._objects, set())
        self._before = {name: _key(value) for name, value in self._objects.items()}

    def changed(self) -> list[str]:
        """The names whose contents differ from the snapshot's."""
        return [name for name, value in self._objects.items() if _key(value) != self._before[name]]


def backward_state_key(fn: Callable, functions: Sequence[type]) -> tuple:
    """What Python that only a step's backward runs may read, keyed by contents (comparable across calls).

    ``fn``'s reachable state (a value it hands a custom Function, kept on
    ``ctx``; a hook's closure), the backward hooks of the modules it reaches,
    and each of ``functions``' backward's own reachable state (a module
    global such as a schedule's coefficient). A plan whose backward runs such
    code is reused only for a call whose key is equal.
    """
    found: dict[str, Any] = {}
    _reachable(fn, found, set())
    for cls in functions:
        of_backward: dict[str, Any] = {}
        _reachable(getattr(cls, "backward", None), of_backward, set())
        found.update({f"{cls.__qualname__}.backward: {name}": value for name, value in of_backward.items()})
    for name, value in list(found.items()):
        if isinstance(value, torch.nn.Module):
            for path, module in torch.nn.Module.named_modules(value):
                hooks = (*module._backward_pre_hooks.values(), *module._backward_hooks.values())
                for k, hook in enumerate(hooks):
                    of_hook: dict[str, Any] = {}
                    _reachable(hook, of_hook, set())
                    found.update({f"{name}.{path} hook {k}: {n}": v for n, v in of_hook.items()})
                    found[f"{name}.{path} hook {k}"] = getattr(hook, "__code__", hook)
    return tuple((name, _key(value)) for name, value in found.items())
