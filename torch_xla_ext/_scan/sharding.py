"""Reading, comparing and re-applying the shardings of scan's inputs and outputs (no data moves)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .._annotate import is_replicated_spec
from .._xla import xlac


def _sharding_of(t: torch.Tensor) -> Any:
    """``t``'s sharding annotation (an ``OpSharding``), or None when it has none or is replicated.

    Holding this rather than ``t`` matters: a tensor kept alive until the next
    sync becomes an output of the synced graph and is materialized.
    """
    X = xlac()
    return None if is_replicated_spec(X._get_xla_sharding_spec(t)) else X._get_xla_op_sharding(t)


def _canonical_specs(tensors: list[torch.Tensor]) -> list[str]:
    """Sharding strings with both spellings of "not sharded" (``''`` and ``'{replicated}'``) as ``'{replicated}'``.

    The spelling changes under the caller: after an execution, or once torch_xla
    has propagated shardings through a user computation the tensor feeds.
    """
    specs = xlac()._get_xla_sharding_specs(tensors) if tensors else []
    return ["{replicated}" if is_replicated_spec(spec) else spec for spec in specs]


def _apply_shardings(values: Sequence[torch.Tensor | None], shardings: Sequence[Any]) -> None:
    """Annotate each lazy value with its ``OpSharding`` (from :func:`_sharding_of`), where it has one."""
    for value, sharding in zip(values, shardings):
        if value is not None and sharding is not None:
            xlac()._xla_mark_sharding(value, sharding)


def _shard_like(values: Sequence[torch.Tensor | None], refs: Sequence[torch.Tensor | None]) -> None:
    """Annotate each lazy value with its reference tensor's sharding, if it has one."""
    _apply_shardings(values, [None if r is None else _sharding_of(r) for r in refs])
