"""Left-to-right depth-first traversal of a module hierarchy, without recursion.

Everything here is pure Python bookkeeping on ``nn.Module`` objects: nothing
reads tensor data, so nothing moves between host and device.

The order is the one of ``nn.Module.named_modules()``: a module is listed
before its children, children in registration order, each module once under
the first path that reaches it.  ``named_modules()`` recurses once per level
and therefore fails on very deep hierarchies (a few thousand nested modules);
the functions here keep their own stack and have no depth limit.

A ``skip`` predicate prunes the walk: a module for which it returns true is
not listed and its children are not entered from it.  A descendant of a
skipped module that is also reachable along a path avoiding every skipped
module is still listed, under that path, exactly as ``named_modules()`` would
list it if the edges into the skipped modules were removed.  This is what
composable FSDP needs to step around subtrees owned by another API (for
example a module given to ``replicate``).
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

__all__ = ["ModuleTree", "lr_dfs", "lr_dfs_modules", "module_tree"]

SkipFn = Callable[[nn.Module], bool]


class ModuleTree:
    """The depth-first tree that a left-to-right walk of a hierarchy spans.

    Modules are numbered in visiting order, so index 0 is the root (when the
    tree is not empty) and every parent has a smaller index than its children.

    Attributes:
        modules: the modules in left-to-right DFS order.
        parents: ``parents[i]`` is the index of the module from which
            ``modules[i]`` was first reached; ``-1`` for the root.
        local_names: ``local_names[i]`` is the attribute name of
            ``modules[i]`` in its tree parent; ``""`` for the root.
    """

    __slots__ = ("modules", "parents", "local_names", "_fqns")

    def __init__(self, modules: list[nn.Module], parents: list[int], local_names: list[str]) -> None:
        self.modules = modules
        self.parents = parents
        self.local_names = local_names
        self._fqns: list[str | None] = [None] * len(modules)

    def __len__(self) -> int:
        return len(self.modules)

    def fqn(self, index: int) -> str:
        """Fully qualified name of ``modules[index]`` relative to the root.

        Names are built on demand and cached, so asking for a few names in a
        very deep tree does not cost the quadratic memory of all of them.
        """
        fqns = self._fqns
        cached = fqns[index]
        if cached is not None:
            return cached
        # Climb to the nearest ancestor whose name is known, then fill down.
        chain = []
        i = index
        while i >= 0 and fqns[i] is None:
            chain.append(i)
            i = self.parents[i]
        prefix = fqns[i] if i >= 0 else ""
        for j in reversed(chain):
            local = self.local_names[j]
            if self.parents[j] < 0:
                prefix = local
            else:
                # Same joining rule as named_modules(): no dot after an empty prefix.
                prefix = prefix + "." + local if prefix else local
            fqns[j] = prefix
        return prefix  # type: ignore[return-value]

    def fqns(self) -> list[str]:
        """Fully qualified names of all modules, in visiting order."""
        fqns = self._fqns
        parents = self.parents
        local_names = self.local_names
        for i in range(len(fqns)):
            if fqns[i] is None:
                p = parents[i]
                if p < 0:
                    fqns[i] = local_names[i]
                else:
                    # Parents precede children, so fqns[p] is already set.
                    prefix = fqns[p]
                    fqns[i] = prefix + "." + local_names[i] if prefix else local_names[i]
        return list(fqns)  # type: ignore[arg-type]


def _check_args(root: object, skip: object) -> None:
    if not isinstance(root, nn.Module):
        raise TypeError(f"expected the root to be an nn.Module, got {type(root).__name__}; pass the model itself")
    if skip is not None and not callable(skip):
        raise TypeError(
            f"skip must be a callable taking an nn.Module and returning a bool, or None; got {type(skip).__name__}"
        )


def module_tree(root: nn.Module, *, skip: SkipFn | None = None) -> ModuleTree:
    """Walk ``root`` left to right, depth first, and return the tree it spans.

    The walk visits the modules of ``root.named_modules()`` in the same order,
    minus those pruned by ``skip`` (see the module docstring), and uses an
    explicit stack, so hierarchy depth is unbounded.  ``skip`` is called at
    most once per module; if it is true for ``root`` the tree is empty.

    Runs in O(modules + child edges) time and touches no tensor data.
    """
    _check_args(root, skip)
    modules: list[nn.Module] = []
    parents: list[int] = []
    local_names: list[str] = []
    # id() is stable here: every module stays referenced by the hierarchy.
    seen: set[int] = set()
    # Entries are (module, name in its parent, parent index).  Children are
    # pushed right to left so the leftmost child is popped first; a module is
    # claimed when popped, which reproduces the first-path-wins rule of the
    # recursive named_modules().
    stack: list[tuple[nn.Module, str, int]] = [(root, "", -1)]
    while stack:
        module, name, parent = stack.pop()
        key = id(module)
        if key in seen:
            continue
        seen.add(key)
        if skip is not None and skip(module):
            # Marked as seen: every later path to it would be pruned too.
            continue
        index = len(modules)
        modules.append(module)
        parents.append(parent)
        local_names.append(name)
        children = module._modules
        if children:
            for child_name, child in reversed(children.items()):
                if child is not None and id(child) not in seen:
                    stack.append((child, child_name, index))
    return ModuleTree(modules, parents, local_names)


def lr_dfs(root: nn.Module, *, skip: SkipFn | None = None) -> list[tuple[str, nn.Module]]:
    """``(fully qualified name, module)`` pairs of ``root`` in left-to-right DFS order.

    Without ``skip`` the result equals ``list(root.named_modules())``: the
    root first under the name ``""``, then each module once, under the first
    path that reaches it.  With ``skip``, a module for which ``skip(module)``
    is true is neither returned nor entered; its descendants appear only if
    another path that avoids skipped modules reaches them.

    Unlike ``named_modules()`` this does not recurse, so hierarchies thousands
    of levels deep are fine.  Pure bookkeeping: no tensor data is read.
    """
    tree = module_tree(root, skip=skip)
    return list(zip(tree.fqns(), tree.modules))


def lr_dfs_modules(root: nn.Module, *, skip: SkipFn | None = None) -> list[nn.Module]:
    """The modules of :func:`lr_dfs` without their names.

    Cheaper when names are not needed: a chain of depth ``d`` has names of
    total length O(d^2), which this never builds.
    """
    return module_tree(root, skip=skip).modules
