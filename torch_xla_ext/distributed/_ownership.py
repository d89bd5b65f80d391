"""Which fully sharded module manages which parameter: one module tree per ``fully_shard`` call.

``fully_shard(module)`` plans ownership over the whole enclosing fully sharded
tree (the topmost fully sharded module whose non-replicated tree reaches
``module``), as if ``module`` were already sharded, so the result does not
depend on the order of application. :func:`survey` walks ``module``'s tree once
and, when another fully sharded module encloses it, that module's tree once;
:func:`plan` and the LCA pass (:func:`._lca.param_owners_in`) reuse that tree.

Only Python objects are inspected; no tensor data is read, so nothing moves
between host and device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch.nn as nn

from . import _traversal
from ._lca import param_owners_in
from ._registry import fully_sharded_modules, is_fully_sharded, is_replicated
from ._state import Slot

__all__ = ["Survey", "plan", "survey"]


@dataclasses.dataclass
class Survey:
    """What one ``fully_shard(module)`` call learns about the hierarchy.

    Attributes:
      top: the topmost fully sharded module whose tree reaches ``module``
        (``module`` itself when none does).
      tree: ``top``'s tree, replicated subtrees pruned.
      own: ``module``'s tree, replicated subtrees pruned (``tree`` when ``top is module``).
      replicated: the replicated modules ``own``'s walk stopped at.
    """

    top: nn.Module
    tree: _traversal.ModuleTree
    own: _traversal.ModuleTree
    replicated: list[nn.Module]


def _reaches(root: nn.Module, target: nn.Module, seen: set[int]) -> bool:
    """Whether ``root``'s non-replicated tree contains ``target``; adds every module visited to ``seen``.

    Stops as soon as ``target`` is found. Modules already in ``seen`` are still
    entered (being reachable from an earlier root says nothing about ``target``).
    """
    visited: set[int] = set()
    stack = [root]
    while stack:
        m = stack.pop()
        if id(m) in visited:
            continue
        visited.add(id(m))
        if is_replicated(m):
            continue
        seen.add(id(m))
        if m is target:
            return True
        stack.extend(c for c in m._modules.values() if c is not None)
    return False


def survey(module: nn.Module) -> Survey:
    """Find the enclosing fully sharded top of ``module`` and build the trees the call needs.

    Every live fully sharded module is a candidate, except those inside
    ``module``'s tree or inside a tree already searched (they cannot enclose
    more). Each remaining candidate's tree is searched once, stopping where
    the current top is found: containment is transitive, so one pass over the
    candidates ends at the topmost enclosing module.
    """
    replicated: list[nn.Module] = []

    def skip(m: nn.Module) -> bool:
        if is_replicated(m):
            replicated.append(m)
            return True
        return False

    own = _traversal.module_tree(module, skip=skip)
    searched = {id(m) for m in own.modules}
    top = module
    for candidate in fully_sharded_modules():
        if id(candidate) not in searched and _reaches(candidate, top, searched):
            top = candidate
    tree = own if top is module else _traversal.module_tree(top, skip=is_replicated)
    return Survey(top, tree, own, replicated)


def plan(tree: _traversal.ModuleTree, fsdp_ids: set[int],
         ignored: Iterable[nn.Parameter]) -> dict[int, list[Slot]]:
    """Which state manages which parameter, over ``tree`` (a top's tree, replicated subtrees pruned).

    Returns ``{id(fully sharded module): [slots]}``: one slot per registration
    (holder module, local name) of each parameter the module manages, the
    first registration first, with an empty spec the caller fills in. A
    parameter belongs to the nearest fully sharded ancestor-or-self of the LCA
    of all modules registering it.
    """
    nearest: list[int] = []
    for i, m in enumerate(tree.modules):  # parents precede children
        parent = tree.parents[i]
        nearest.append(i if id(m) in fsdp_ids else (nearest[parent] if parent >= 0 else -1))
    index = {id(m): i for i, m in enumerate(tree.modules)}
    owners = param_owners_in(tree, ignored)
    result: dict[int, list[Slot]] = {fid: [] for fid in fsdp_ids}
    for i, holder in enumerate(tree.modules):
        for local, param in holder._parameters.items():
            if param is None or param not in owners:
                continue
            owner = nearest[index[id(owners[param])]]
            if owner < 0:
                continue
            base = tree.fqn(owner)
            full = f"{tree.fqn(i)}.{local}" if tree.fqn(i) else local
            fqn = full[len(base) + 1:] if base else full
            result[id(tree.modules[owner])].append(Slot(holder, local, param, (), fqn))
    return result


def fully_sharded_in(tree: _traversal.ModuleTree, module: nn.Module) -> list[nn.Module]:
    """The fully sharded modules of ``tree``, and ``module`` (about to be), in tree order."""
    return [m for m in tree.modules if m is module or is_fully_sharded(m)]
