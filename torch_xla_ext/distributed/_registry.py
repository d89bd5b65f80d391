"""The registry of ``fully_shard`` and ``replicate``: which module has which state, and per-holder records.

Nothing is written into a module's ``__dict__``: every per-module fact lives in
one of three maps keyed by module identity and held weakly (an entry goes when
its module is freed), read through the lookup functions below:

- ``fully_shard``-ed module -> :class:`~._state.FSDPState` (:func:`fsdp_state`);
- ``replicate``-d module -> :class:`ReplicateState` (:func:`replicate_state`);
- module holding a managed or replicated parameter registration ->
  :class:`HolderRecord` (:func:`holder_record`), which ``load_state_dict``
  reads to keep the sharding.

States never hold their modules strongly (a registration's holder is a weak
reference), so the weak maps do free them. Only Python objects are kept here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch.nn as nn

from .._contract import applied_spec
from .._weak import WeakIdMap
from ._state import FSDPState, Slot

__all__ = [
    "HolderRecord",
    "ReplicateState",
    "assign_ownership",
    "copy_records",
    "fsdp_state",
    "fully_sharded_modules",
    "holder_record",
    "is_fully_sharded",
    "is_replicated",
    "register_fsdp",
    "register_replicate",
    "registry_size",
    "replicate_state",
]


@dataclasses.dataclass
class ReplicateState:
    """What ``replicate(module, mesh=...)`` recorded: the mesh given (None: not given)."""

    mesh: Any = None


@dataclasses.dataclass
class HolderRecord:
    """Per module holding registrations fully_shard or replicate manage (for ``load_state_dict``).

    Attributes:
      owned: local parameter name -> (managing state, its slot).
      replicas: local names of parameters of a replicated subtree.
      load_hooks: whether the load_state_dict hooks are registered on the module.
    """

    owned: dict[str, tuple[FSDPState, Slot]] = dataclasses.field(default_factory=dict)
    replicas: dict[str, None] = dataclasses.field(default_factory=dict)
    load_hooks: bool = False


# --------------------------------------------------------------------------- #
# The registry: weak, identity-keyed (modules may define __eq__/__hash__).
# --------------------------------------------------------------------------- #

_fsdp: WeakIdMap = WeakIdMap()       # module -> FSDPState
_replicate: WeakIdMap = WeakIdMap()  # module -> ReplicateState
_holders: WeakIdMap = WeakIdMap()    # module -> HolderRecord


def fsdp_state(module: nn.Module) -> FSDPState | None:
    """The state ``fully_shard`` attached to ``module``, or None when it was not applied."""
    return _fsdp.get(module)


def replicate_state(module: nn.Module) -> ReplicateState | None:
    """The state ``replicate`` attached to ``module``, or None when it was not applied."""
    return _replicate.get(module)


def is_fully_sharded(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module``."""
    return module in _fsdp


def is_replicated(module: nn.Module) -> bool:
    """Whether ``replicate`` was applied to ``module``."""
    return module in _replicate


def register_fsdp(module: nn.Module, state: FSDPState) -> None:
    """Attach ``state`` to ``module`` (for as long as the module lives)."""
    _fsdp[module] = state


def register_replicate(module: nn.Module, state: ReplicateState) -> None:
    """Attach ``state`` to ``module`` (for as long as the module lives)."""
    _replicate[module] = state


def fully_sharded_modules() -> list[nn.Module]:
    """Every live fully sharded module, in the order ``fully_shard`` was applied."""
    return list(_fsdp.keys())


def holder_record(module: nn.Module, create: bool = False) -> HolderRecord | None:
    """``module``'s :class:`HolderRecord`; with ``create``, a new empty one when it has none."""
    record = _holders.get(module)
    if record is None and create:
        record = _holders[module] = HolderRecord()
    return record


def assign_ownership(modules: Iterable[nn.Module], states: list[FSDPState], slots: list[list[Slot]]) -> None:
    """Record that each of ``states`` manages its ``slots`` (one list per state), in the holders' records.

    Ownership may have moved between these states (a shared parameter's
    lowest common ancestor changes when a module above it is fully sharded):
    the old entries of these states in ``modules``' records are dropped first.
    A slot's spec is the one its parameter was sharded with, if it was.
    """
    ids = {id(st) for st in states}
    for m in modules:
        record = holder_record(m)
        if record is not None and record.owned:
            for name in [n for n, (st, _) in record.owned.items() if id(st) in ids]:
                del record.owned[name]
    for st, own in zip(states, slots):
        for sl in own:
            sl.spec = applied_spec(sl.param) or sl.spec
            holder_record(sl.holder, create=True).owned[sl.name] = (st, sl)
        st.set_slots(own)


def registry_size() -> int:
    """Entries in the registry (it shrinks as modules are freed); for diagnostics and tests."""
    return len(_fsdp) + len(_replicate) + len(_holders)


def copy_records(memo: dict[int, Any]) -> None:
    """Give the modules a ``copy.deepcopy`` made (``memo``: id(original) -> copy) their originals' records.

    Called at the end of each fully sharded module's ``__deepcopy__``; a
    record whose modules are not all copied yet waits for an enclosing one.
    Copied parameters are not placed again: they keep the sharding the copy gave them.
    """
    copied: dict[int, FSDPState] = {}  # id(original state) -> state of the copy
    for original, state in list(_fsdp.items()):
        new_module = memo.get(id(original))
        if new_module is None:
            continue
        existing = _fsdp.get(new_module)
        if existing is not None:
            copied[id(state)] = existing
            continue
        holders = [slot.holder for slot in state.slots]
        if any(h is None or id(h) not in memo for h in holders):
            continue
        new = FSDPState(state.mesh, state.axis, state.reshard_after_forward, state.shard_placement_fn,
                        state.mp_policy, {memo.get(id(p), p) for p in state.ignored_params})
        new._spec_texts = dict(state._spec_texts)
        new.set_slots([Slot(memo[id(h)], s.name, memo.get(id(s.param), s.param), s.spec, s.fqn)
                       for s, h in zip(state.slots, holders)])
        _fsdp[new_module] = new
        copied[id(state)] = new
    for original, state in list(_replicate.items()):
        new_module = memo.get(id(original))
        if new_module is not None and new_module not in _replicate:
            _replicate[new_module] = ReplicateState(state.mesh)
    for original, record in list(_holders.items()):
        new_module = memo.get(id(original))
        if new_module is None or new_module in _holders:
            continue
        if any(id(st) not in copied for st, _ in record.owned.values()):
            continue
        owned = {}
        for name, (st, slot) in record.owned.items():
            new_state = copied[id(st)]
            owned[name] = (new_state, next(s for s in new_state.slots
                                           if s.name == name and s.holder is new_module))
        _holders[new_module] = HolderRecord(owned, dict(record.replicas), record.load_hooks)
