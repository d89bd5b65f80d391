"""Composable FSDP for XLA SPMD: ``fully_shard``, ``replicate`` and their building blocks."""

from __future__ import annotations

from ._dynamo import annotate_modules_for_dynamo
from ._lca import SharedParamInfo, get_shared_param_info_to_lca
from .fully_shard import FSDPModule, MixedPrecisionPolicy, fully_shard, get_fully_sharded_modules, replicate

__all__ = [
    "FSDPModule",
    "MixedPrecisionPolicy",
    "SharedParamInfo",
    "annotate_modules_for_dynamo",
    "fully_shard",
    "get_fully_sharded_modules",
    "get_shared_param_info_to_lca",
    "replicate",
]
