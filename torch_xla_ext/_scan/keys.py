"""Values keyed by what they hold: comparable and hashable, for scan's cache keys and its state checks.

:func:`value_key` keys any Python value by contents (numbers by their bits,
containers and plain objects by their items, host tensors and numpy values
by a hash of their bytes, host random generators by their state; the rest by
identity); :func:`attribute_key` keys a module's Python attributes (those of
its submodules too) that way; :func:`bits_key` and :func:`content_digest` are
the number and tensor keys the lifter's fingerprint uses as well.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import pickle
import random
import struct
import types
from typing import Any

import numpy as np
import torch

from .._contract import RECORDS

__all__ = ["value_key", "by_contents", "attribute_key", "attribute_values", "readable_attributes", "bits_key",
           "content_digest"]

_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, enum.Enum)


_pack_double = struct.Struct("<d").pack
_pack_complex = struct.Struct("<dd").pack


def bits_key(value: Any) -> tuple | None:
    """A number or numpy value keyed by what it holds, bit for bit; None for any other value.

    Floats and complex numbers by their bits (``-0.0`` is not ``0.0``, NaN
    payloads differ), numpy scalars by dtype and bits (``np.float32(-0.0)``),
    numpy arrays by dtype, shape and a hash of their bytes (a table passed to
    ``torch.tensor(table)`` and rewritten in place between calls).
    """
    if isinstance(value, float):
        return ("f", _pack_double(value))
    if isinstance(value, complex):
        return ("c", _pack_complex(value.real, value.imag))
    if isinstance(value, np.generic) and value.dtype != object:
        return ("np", value.dtype.str, value.tobytes())
    if isinstance(value, np.ndarray) and value.dtype != object:
        return ("nd", value.shape, value.dtype.str,
                hashlib.blake2b(np.ascontiguousarray(value).view(np.uint8), digest_size=16).digest())
    return None


def content_digest(t: torch.Tensor) -> bytes | None:
    """A 128-bit hash of a host tensor's bytes (None for layouts without plain bytes: sparse, meta, ...)."""
    try:
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError):
        return None
    return hashlib.blake2b(data, digest_size=16).digest()


#: How much of a value :func:`value_key` describes by contents before it names the rest by identity.
_KEY_NODES = 4096
_KEY_DEPTH = 8


def value_key(value: object, memo: dict[int, object] | None = None) -> object:
    """What ``value`` holds, comparable and hashable: two values with equal keys compute alike when read.

    Numbers by their bits (``-0.0`` is not ``0.0``; NaN payloads differ),
    strings, dtypes and enums by value; classes, functions and modules as
    themselves (code); tuples, lists, sets, dicts, ``SimpleNamespace``,
    dataclass instances, ``functools.partial`` and other objects with a
    ``__dict__`` (a model's config) by their items; host tensors, numpy arrays
    and numpy scalars by dtype, shape and a hash of their bytes; host random
    generators (``random.Random``, numpy's ``Generator``, ``BitGenerator`` and
    ``RandomState``, a CPU ``torch.Generator``) by a hash of their state, which
    every draw changes. Anything else
    (an XLA tensor, an object without a ``__dict__``), and what lies past
    :data:`_KEY_NODES` items or :data:`_KEY_DEPTH` levels, is named by identity
    (:func:`by_contents` tells whether a key has such a part). ``memo`` keys
    an object reached twice (a config every layer shares) once.
    """
    return _key(value, [_KEY_NODES], 0, {} if memo is None else memo)


#: Types keyed as they are, looked up by exact type first (most attributes are one of these).
_EXACT = frozenset({type(None), bool, int, str, bytes, torch.dtype, torch.device})
#: Objects that are code, keyed as themselves (compared by identity, yet no state a call changes).
_CODE = (type, types.FunctionType, types.BuiltinFunctionType, types.ModuleType, types.MethodWrapperType,
         types.WrapperDescriptorType, types.MethodDescriptorType)


def _key(value: object, budget: list[int], depth: int, memo: dict[int, object]) -> object:
    kind = type(value)
    if kind in _EXACT:
        return (kind, value)
    if kind is float:
        return bits_key(value)
    budget[0] -= 1
    if budget[0] < 0 or depth > _KEY_DEPTH:
        return _Identity(id(value))
    bits = bits_key(value)  # numbers by their bits, numpy values by their bytes, as scan's fingerprint keys them
    if bits is not None:
        return bits
    if isinstance(value, _PLAIN):
        return (kind, value)
    if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.layout == torch.strided:
        digest = content_digest(value)
        if digest is not None:
            return ("t", tuple(value.shape), value.dtype, value.requires_grad, digest)
    if isinstance(value, _CODE):
        return ("code", value)
    if isinstance(value, (tuple, list)):
        return (kind, tuple(_key(v, budget, depth + 1, memo) for v in value))
    if isinstance(value, (set, frozenset)):
        keys = [_key(v, budget, depth + 1, memo) for v in value]
        return (kind, frozenset(keys)) if all(_hashable(k) for k in keys) else _Identity(id(value))
    if isinstance(value, dict):
        return (kind, tuple((_key(k, budget, depth + 1, memo), _key(v, budget, depth + 1, memo))
                            for k, v in value.items()))
    if isinstance(value, functools.partial):
        return (kind, _key((value.func, value.args, value.keywords), budget, depth + 1, memo))
    state = _generator_state(value)
    if state is not None:
        return ("generator", kind, state)
    if isinstance(value, torch.Tensor) or not hasattr(value, "__dict__"):
        return _Identity(id(value))
    if id(value) in memo:
        return memo[id(value)]
    memo[id(value)] = _Identity(id(value))  # while it is being keyed: a cycle back to it names it
    if dataclasses.is_dataclass(value):
        items = tuple((f.name, _key(getattr(value, f.name), budget, depth + 1, memo))
                      for f in dataclasses.fields(value))
    else:  # SimpleNamespace, a config object, any plain object: its attributes
        items = _key(vars(value), budget, depth + 1, memo)
    memo[id(value)] = key = (kind, items)
    return key


def _generator_state(value: object) -> bytes | None:
    """A host random generator's state, as a digest; None for anything else.

    A draw changes the generator's state but none of its Python attributes
    (numpy's generators have none), so keyed as an object a generator that
    ``fn`` drew from would look unchanged.
    """
    if isinstance(value, random.Random):
        state: object = value.getstate()
    elif isinstance(value, np.random.Generator):
        state = value.bit_generator.state
    elif isinstance(value, np.random.BitGenerator):
        state = value.state
    elif isinstance(value, np.random.RandomState):
        state = value.get_state(legacy=False)
    elif isinstance(value, torch.Generator) and value.device.type == "cpu":
        state = value.get_state().numpy().tobytes()
    else:
        return None
    return hashlib.blake2b(pickle.dumps(state, protocol=4), digest_size=16).digest()


class _Identity(int):
    """The part of a :func:`value_key` that names an object by identity."""


def _hashable(key: object) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def by_contents(key: object) -> bool:
    """Whether a :func:`value_key` describes its value wholly by contents (no part named by identity)."""
    if isinstance(key, _Identity):
        return False
    if isinstance(key, (tuple, frozenset)):
        return all(by_contents(k) for k in key)
    return True


def attribute_key(layer: torch.nn.Module, memo: dict[int, object] | None = None) -> tuple:
    """The Python attributes of ``layer`` and its submodules (not members, children or hooks), comparable."""
    memo = {} if memo is None else memo
    return tuple((path, name, value_key(value, memo)) for path, name, value in readable_attributes(layer))


def attribute_values(layer: torch.nn.Module) -> list[object]:
    """The attribute values :func:`attribute_key` reads (to keep the objects it names by identity alive)."""
    return [value for _, _, value in readable_attributes(layer)]


#: What ``nn.Module.__init__`` puts in every module's ``__dict__`` (members, children, hook tables) and
#: what ``nn.Module.compile`` adds: compared by ``scan_layers``' member and hook checks, not here.
_BOOKKEEPING = frozenset(vars(torch.nn.Module())) - {"training"} | {"_compiled_call_impl"} | RECORDS


def readable_attributes(layer: torch.nn.Module):
    """Every attribute of ``layer`` and its submodules that can change what its forward computes.

    Private attributes included (a ``self._scale``), and each submodule's
    class: a ``Tanh`` in one layer where another has a ``Sigmoid`` shows up
    here even though neither has an attribute.
    """
    for path, module in layer.named_modules():
        yield path, "__class__", type(module)
        for name, value in vars(module).items():
            if name not in _BOOKKEEPING:
                yield path, name, value
