"""Marks that tell ``torch.compile`` which modules FSDP manages."""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn

from ._traversal import lr_dfs_modules

__all__ = ["annotate_modules_for_dynamo"]


def annotate_modules_for_dynamo(
    module: nn.Module,
    ignored_modules: Iterable[nn.Module],
    use_orig_params: bool,
) -> None:
    """Flag every module under ``module`` except ``ignored_modules`` as FSDP-managed.

    Sets ``_is_fsdp_managed_module = True`` and
    ``_fsdp_use_orig_params = use_orig_params`` on each module of
    ``module.modules()`` (``module`` included) that is not one of
    ``ignored_modules``.  Membership is by identity, and only the listed
    modules are exempt: pass their submodules too if those should stay
    unmarked.  The hierarchy is walked with an explicit stack, so any depth
    works.

    Why dynamo needs the marks: dynamo does not trace the FSDP machinery
    itself, so it cannot tell from the frames it sees that a module's
    parameters are swapped by FSDP hooks around every forward (unsharded
    before use, resharded after).  By default dynamo specializes on an
    ``nn.Module``: it assumes the module is well behaved, guards little, and
    captures the parameter tensors it saw while tracing as fixed attributes
    of the graph.  For an FSDP-managed module that is harmful: the
    tensors change from step to step, and the order in which the captured
    ones were created would dictate the backward order.  A module carrying
    ``_is_fsdp_managed_module`` is traced as an unspecialized module
    instead, its parameters read at call time and passed to the graph as
    inputs, so each step uses the tensors FSDP has just put in place.
    ``_fsdp_use_orig_params`` records the FSDP setting for dynamo to check,
    since it cannot inspect the FSDP state directly.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``ignored_modules`` is
            not an iterable of ``nn.Module`` (a single module is rejected,
            as its own iteration would be ambiguous), or ``use_orig_params``
            is not a ``bool``.  Checked before any module is changed.

    Only Python attributes are set; no tensor is read or moved.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"module must be an nn.Module, got {type(module).__name__}; pass the model whose modules FSDP manages"
        )
    if isinstance(ignored_modules, nn.Module):
        raise TypeError(
            f"ignored_modules must be a collection of modules, not a single {type(ignored_modules).__name__}; "
            "pass [module] instead"
        )
    if not isinstance(use_orig_params, bool):
        raise TypeError(f"use_orig_params must be True or False, got {use_orig_params!r}")
    try:
        ignored_list = list(ignored_modules)
    except TypeError:
        raise TypeError(
            f"ignored_modules must be an iterable of nn.Module, got {type(ignored_modules).__name__}; "
            "pass an empty list to ignore nothing"
        ) from None
    for m in ignored_list:
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"ignored_modules must contain only nn.Module objects, got an element of type {type(m).__name__}"
            )
    ignored = {id(m) for m in ignored_list}  # identity, immune to custom __eq__/__hash__

    # Collect first, so a failure in the walk leaves every module untouched.
    mark_managed([m for m in lr_dfs_modules(module) if id(m) not in ignored], use_orig_params)


def mark_managed(modules: Iterable[nn.Module], use_orig_params: bool) -> None:
    """Set dynamo's two FSDP marks on exactly ``modules`` (already walked and filtered by the caller)."""
    for m in modules:
        m._is_fsdp_managed_module = True  # type: ignore[assignment]
        m._fsdp_use_orig_params = use_orig_params  # type: ignore[assignment]
