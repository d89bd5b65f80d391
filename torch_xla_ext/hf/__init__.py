"""Hugging Face ``transformers`` models on XLA SPMD: the recipe in one call, scanned decoder stacks, Trainer.

* :func:`prepare` fully shards a decoder model, scans its layers and builds
  its attention mask on the device: the one call a Trainer or accelerate user
  needs.
* :func:`scan_decoder_layers` runs a model's decoder layers through
  :func:`torch_xla_ext.scan_layers` without copying its forward.
* :func:`causal_mask` builds the 4-D mask, in the form the model's attention
  implementation uses, that lets attention run with padding without a
  device->host read (Hugging Face's mask code reads a 2-D mask's values on the
  host to decide whether it may skip it).
* :class:`SPMDTrainer` (``torch_xla_ext.hf.trainer``) is transformers'
  ``Trainer`` with checkpoints that gather nothing.
* :class:`SPMDSFTTrainer` (``torch_xla_ext.hf.sft_trainer``) is the same for
  TRL's ``SFTTrainer``, its per-step metrics kept on the device until a step
  logs.

``transformers`` and ``trl`` are imported only by what needs them
(``SPMDTrainer``, ``SPMDSFTTrainer`` on first use).
"""

from __future__ import annotations

from typing import Any

from ._masks import causal_mask
from ._prepare import PreparedOptions, prepare, prepared_options
from ._scan_stack import ScannedLayers, scan_decoder_layers

__all__ = ["PreparedOptions", "SPMDSFTTrainer", "SPMDTrainer", "ScannedLayers", "causal_mask", "prepare",
           "prepared_options", "scan_decoder_layers"]


def __getattr__(name: str) -> Any:
    if name == "SPMDTrainer":  # imports transformers' Trainer (seconds): only when asked for
        from .trainer import SPMDTrainer

        return SPMDTrainer
    if name == "SPMDSFTTrainer":  # imports TRL (seconds)
        from .sft_trainer import SPMDSFTTrainer

        return SPMDSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
