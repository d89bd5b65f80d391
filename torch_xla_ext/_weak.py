"""An identity-keyed map that holds its keys weakly.

Modules may define ``__eq__``/``__hash__`` and tensors compare elementwise, so
neither makes a safe key of a ``weakref.WeakKeyDictionary``. This map keys by
``id()`` and keeps a weak reference next to each value: an entry is removed by
the reference's callback when its key is freed (so the map never outgrows the
live keys), and a lookup checks the reference, so a reused id never matches.
A lookup costs one dict access and one dereference.

The map holds values strongly: a value must not reference its key, or the
key is never freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

__all__ = ["WeakIdMap"]

K = TypeVar("K")
V = TypeVar("V")


class WeakIdMap(Generic[K, V]):
    """``key -> value`` by key identity, for as long as the key lives; insertion ordered."""

    __slots__ = ("_data", "__weakref__")

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref, V]] = {}

    def get(self, key: K, default: Any = None) -> V | Any:
        """The value of ``key``, or ``default``."""
        entry = self._data.get(id(key))
        if entry is None or entry[0]() is not key:
            return default
        return entry[1]

    def __contains__(self, key: K) -> bool:
        entry = self._data.get(id(key))
        return entry is not None and entry[0]() is key

    def __setitem__(self, key: K, value: V) -> None:
        entry = self._data.get(id(key))
        if entry is not None and entry[0]() is key:
            self._data[id(key)] = (entry[0], value)
            return
        self_ref = weakref.ref(self)
        k = id(key)

        def forget(ref: weakref.ref, k: int = k) -> None:
            owner = self_ref()
            if owner is not None:
                current = owner._data.get(k)
                if current is not None and current[0] is ref:
                    del owner._data[k]

        self._data[k] = (weakref.ref(key, forget), value)

    def __len__(self) -> int:
        return len(self._data)

    def items(self) -> Iterator[tuple[K, V]]:
        """Live ``(key, value)`` pairs, in insertion order (a snapshot: safe to modify the map meanwhile)."""
        for ref, value in list(self._data.values()):
            key = ref()
            if key is not None:
                yield key, value

    def keys(self) -> Iterator[K]:
        """Live keys, in insertion order (a snapshot)."""
        for key, _ in self.items():
            yield key
