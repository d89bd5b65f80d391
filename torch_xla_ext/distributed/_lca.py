"""Where shared parameters belong: lowest common ancestors in the module tree.

A parameter registered by several modules (tied embeddings, shared
projections) must be owned by one FSDP unit, and the only unit that sees every
use is one whose subtree holds all the modules that register it.  The lowest
such module is the lowest common ancestor (LCA) of those modules in the tree
spanned by a left-to-right DFS of the hierarchy (the tree of
``named_modules()``, a module's parent being the module it was first reached
from).

All queries are known before the walk starts, so Tarjan's offline LCA
algorithm answers them in one pass: a union-find structure (path compression
and union by rank) merges each finished subtree into its parent, and the set
of an already visited module then names the lowest module still open above
it, which is its LCA with the module being visited.  Total cost
O(modules + parameter registrations + queries * alpha), with no recursion.

Only Python objects are inspected; no tensor data is read, so nothing moves
between host and device.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import NamedTuple

import torch
import torch.nn as nn

from ._traversal import ModuleTree, SkipFn, module_tree

__all__ = ["SharedParamInfo", "get_shared_param_info_to_lca", "param_owners", "param_owners_in"]


class SharedParamInfo(NamedTuple):
    """One repeated registration of a parameter, with the one seen first.

    ``param_name`` and ``prim_param_name`` are local attribute names inside
    ``module`` and ``prim_module``; ``module_name`` and ``prim_module_name``
    are fully qualified module names relative to the root.  The ``prim_*``
    fields describe the primary (first) registration in left-to-right DFS
    order.  Hashable: modules hash by identity.
    """

    param_name: str
    module: nn.Module
    module_name: str
    prim_param_name: str
    prim_module: nn.Module
    prim_module_name: str


class _TarjanWalk:
    """Tarjan's offline LCA over a :class:`ModuleTree` in visiting order.

    Iterating yields each module index after it has been entered; while index
    ``i`` is current, :meth:`lca_with_current` gives the LCA of ``i`` and any
    index visited so far (``i`` included).  Union-find arrays are indexed by
    position in the tree.
    """

    __slots__ = ("_parents", "_uf", "_rank", "_ancestor")

    def __init__(self, tree: ModuleTree) -> None:
        n = len(tree)
        self._parents = tree.parents
        self._uf = list(range(n))
        self._rank = [0] * n
        # Meaningful for set representatives: the lowest open module above
        # (or equal to) every member of the set.
        self._ancestor = list(range(n))

    def _find(self, x: int) -> int:
        uf = self._uf
        root = x
        while uf[root] != root:
            root = uf[root]
        while uf[x] != root:  # path compression
            uf[x], x = root, uf[x]
        return root

    def _close_into_parent(self, child: int) -> None:
        parent = self._parents[child]
        a, b = self._find(child), self._find(parent)
        rank = self._rank
        if rank[a] < rank[b]:
            a, b = b, a
        self._uf[b] = a  # union by rank: the shallower tree goes under
        if rank[a] == rank[b]:
            rank[a] += 1
        self._ancestor[a] = parent

    def __iter__(self) -> Iterator[int]:
        parents = self._parents
        open_path: list[int] = []  # root-to-current chain of entered modules
        for i, parent in enumerate(parents):
            # Preorder numbering: everything on the path below the parent has
            # finished its subtree and is merged into its own parent's set.
            while open_path and open_path[-1] != parent:
                self._close_into_parent(open_path.pop())
            open_path.append(i)
            yield i

    def lca_with_current(self, visited: int) -> int:
        """LCA of the current module and ``visited`` (entered no later)."""
        return self._ancestor[self._find(visited)]


def _ignored_ids(ignored_params: Iterable[nn.Parameter] | None) -> dict[int, torch.Tensor]:
    # Keyed by id(); the values keep the objects alive so no id is reused.
    if ignored_params is None:
        return {}
    if isinstance(ignored_params, torch.Tensor):
        raise TypeError(
            "ignored_params must be a collection of parameters, not a single tensor; pass {param} instead"
        )
    ids: dict[int, torch.Tensor] = {}
    for p in ignored_params:
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"ignored_params must contain only parameters (tensors), got an element of type {type(p).__name__}"
            )
        ids[id(p)] = p
    return ids


def _registrations(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    # Every direct registration, duplicates within the module included, in
    # named_parameters(recurse=False) order. Module's own method: a stacked layer's refuses (stack_layers).
    return nn.Module.named_parameters(module, recurse=False, remove_duplicate=False)


def get_shared_param_info_to_lca(
    root: nn.Module,
    ignored_params: Iterable[nn.Parameter] | None = None,
    *,
    skip: SkipFn | None = None,
) -> dict[SharedParamInfo, nn.Module]:
    """Map each repeated registration of a parameter to the LCA of both registrants.

    Registrations are ordered by a left-to-right DFS of modules (see
    :func:`~._traversal.lr_dfs`) and, within a module, by
    ``named_parameters(recurse=False)``.  The first registration of a
    parameter is its primary one; every later registration yields a
    :class:`SharedParamInfo` that maps to the lowest common ancestor of
    ``module`` and ``prim_module`` in the DFS tree.  A parameter registered
    twice by the same module maps to that module.  Parameters in
    ``ignored_params`` (compared by identity) are left out, and so are
    modules pruned by ``skip`` (same meaning as in ``lr_dfs``).

    Dictionary order follows the registrations.  O(modules + registrations +
    queries * alpha) time, no recursion, no tensor data read.
    """
    ignored = _ignored_ids(ignored_params)
    tree = module_tree(root, skip=skip)
    modules = tree.modules
    walk = _TarjanWalk(tree)
    primary: dict[int, tuple[int, str]] = {}  # id(param) -> (module index, local name)
    result: dict[SharedParamInfo, nn.Module] = {}
    for i in walk:
        module = modules[i]
        for name, param in _registrations(module):
            key = id(param)
            if key in ignored:
                continue
            first = primary.get(key)
            if first is None:
                primary[key] = (i, name)
                continue
            j, prim_name = first
            info = SharedParamInfo(name, module, tree.fqn(i), prim_name, modules[j], tree.fqn(j))
            result[info] = modules[walk.lca_with_current(j)]
    return result


def param_owners(
    root: nn.Module,
    ignored_params: Iterable[nn.Parameter] | None = None,
    *,
    skip: SkipFn | None = None,
) -> dict[nn.Parameter, nn.Module]:
    """Map every parameter to the LCA of all modules that register it directly.

    This is the lowest module whose subtree contains every use of the
    parameter, i.e. where FSDP should assign it; an unshared parameter maps to
    its only registrant.  The LCA of a set is folded from pairwise LCAs in
    one Tarjan pass.  Modules pruned by ``skip`` (as in ``lr_dfs``) do not
    count as registrants, and parameters in ``ignored_params`` are left out.
    Keys are in first-registration order.  O(modules + registrations *
    alpha), no recursion, no tensor data read.
    """
    _ignored_ids(ignored_params)  # bad arguments are reported before the walk
    return param_owners_in(module_tree(root, skip=skip), ignored_params)


def param_owners_in(
    tree: ModuleTree,
    ignored_params: Iterable[nn.Parameter] | None = None,
) -> dict[nn.Parameter, nn.Module]:
    """:func:`param_owners` over a tree already walked (see :func:`~._traversal.module_tree`).

    For callers that need the tree for more than this query: the hierarchy
    is not walked again.
    """
    ignored = _ignored_ids(ignored_params)
    walk = _TarjanWalk(tree)
    owner: dict[int, int] = {}  # id(param) -> module index of the LCA so far
    params: dict[int, nn.Parameter] = {}
    for i in walk:
        for _, param in _registrations(tree.modules[i]):
            key = id(param)
            if key in ignored:
                continue
            current = owner.get(key)
            if current is None:
                owner[key] = i
                params[key] = param
            else:
                # The owner so far is an ancestor of an earlier registrant,
                # hence already entered: a valid query against module i.
                owner[key] = walk.lca_with_current(current)
    modules = tree.modules
    return {params[key]: modules[idx] for key, idx in owner.items()}
