"""What scan and fully_shard tell each other, in one room neither of them owns.

``fully_shard`` places parameters and ``stack_layers`` stores a stack's
parameters as rows of one ``[L, ...]`` parameter; each must know what the
other did, and neither imports the other:

- :func:`record_applied` / :func:`applied_spec`: the partition spec
  ``fully_shard`` gave a parameter (``stack_layers`` refuses placed ones;
  loading and ``tpu_fit`` read it back);
- :func:`is_stacked`: whether a holder's parameter is one ``stack_layers``
  made (``fully_shard`` then shards it on a layer's dimension, never over the
  layers), and the marks stacking leaves on layers (:data:`RECORDS`, which
  scan's keys skip);
- :func:`as_whole`: within it, a stacked layer's modules answer
  ``named_parameters`` and ``_apply`` as PyTorch's own (for this package's
  walks over them, and PyTorch's it calls: ``functional_call``'s tie check,
  DCP's state dicts), where a user's call is refused.

The scan-trace flag both read lives with the annotations
(:func:`torch_xla_ext._annotate.in_scan_step_trace`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

from ._weak import WeakIdMap

__all__ = ["applied_spec", "record_applied", "applied_count", "is_stacked", "as_whole", "whole", "STACKED_NAMES",
           "LAYER", "SLOTS", "MEMBER", "RECORDS"]

# Parameters fully_shard placed -> the partition spec applied. Keyed by identity and held weakly: an entry
# goes when its parameter is freed.
_applied: WeakIdMap = WeakIdMap()


def applied_spec(p: torch.Tensor) -> tuple | None:
    """The partition spec fully_shard gave ``p``, or None when it never placed ``p``."""
    return _applied.get(p)


def record_applied(p: torch.Tensor, spec: tuple) -> None:
    """Remember that ``p`` was placed with ``spec`` (for as long as ``p`` lives)."""
    _applied[p] = spec


def applied_count() -> int:
    """How many live parameters fully_shard has placed (diagnostics and tests)."""
    return len(_applied)


#: On a stacked ModuleList: {qualified per-layer name: the stacked parameter's key}.
STACKED_NAMES = "_txe_stacked_names"
LAYER = "_txe_stacked_layer"    # on each stacked layer: (its ModuleList, index)
SLOTS = "_txe_stacked_slots"    # on each holder: {local name: (ModuleList, key, index)}
MEMBER = "_txe_stacked_member"  # on each module inside a stacked layer: (ModuleList, index, path in the layer)

#: The attributes stacking keeps on layers and their modules: bookkeeping, not what a forward computes
#: (``scan_layers`` does not compare them between layers, nor does scan's state key; the index in them
#: differs by design).
RECORDS = frozenset({LAYER, SLOTS, MEMBER})


def is_stacked(holder: nn.Module, name: str) -> bool:
    """Whether ``holder``'s parameter ``name`` is one ``stack_layers`` made (its dim 0 indexes the layers).

    Read from the holder (the ModuleList), so a ``copy.deepcopy`` of the model answers like the original.
    """
    return name in holder.__dict__.get(STACKED_NAMES, {}).values()


_whole = threading.local()


@contextlib.contextmanager
def as_whole() -> Iterator[None]:
    """Within: a stacked layer's modules answer ``named_parameters`` and ``_apply`` as PyTorch's (this thread)."""
    _whole.depth = getattr(_whole, "depth", 0) + 1
    try:
        yield
    finally:
        _whole.depth -= 1


def whole() -> bool:
    """Whether this thread is inside :func:`as_whole`."""
    return bool(getattr(_whole, "depth", 0))
