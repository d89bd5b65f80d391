"""Training batches padded to a multiple of the sequence length, so dynamic padding compiles a few programs.

XLA compiles the training step once per batch shape. transformers' and
TRL's collators pad each batch to its own longest row, and packing gives a
new length nearly every step: each new length compiles the step again (2 to
5 programs; 8 packed steps took 120 s against 38 s padded to 64).
:class:`BucketPadding` wraps the collator ``SPMDTrainer`` trains with and
pads every ``[batch, seq]`` column on the right to the next multiple of
``multiple``: ``input_ids`` with the pad token, ``attention_mask`` with 0,
``labels`` with -100 (ignored by the loss, so the loss and its gradients
are the unpadded batch's), ``position_ids`` counting on, ``token_type_ids``
with 0; a padding-free batch (TRL's packing) has its last sequence run on
into the padding (``seq_idx``, ``cu_seq_lens_*``, ``max_length_*``). A
batch with another ``[batch, seq]`` column is refused (its pad value is
unknown) naming it and ``pad_to_multiple_of=None``.

:class:`ShapeWatch` warns once when a training batch has a shape not seen
before after the first steps (each such shape compiles the step again),
naming the shape and the fix.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["DEFAULT_MULTIPLE", "BucketPadding", "ShapeWatch"]

#: ``SPMDTrainer``'s default ``pad_to_multiple_of``.
DEFAULT_MULTIPLE = 64

_IGNORE_INDEX = -100  # what transformers' losses skip


class BucketPadding:
    """``collator``'s batches with every ``[batch, seq]`` column padded on the right to a multiple of ``multiple``.

    Exact only where nothing reads the padding: real positions never attend
    to it (an ``attention_mask`` excludes it, or ``causal``: a decoder's
    positions attend to earlier ones only), and no position the mask
    excludes has a label (such a position attends to nothing, and what it
    computes then depends on the sequence length: a fully masked eager row
    attends uniformly over every key). A batch that fails either is left as
    it is, with one warning saying why. ``max_length`` (the model's
    ``max_position_embeddings``): no batch is padded past it.
    """

    def __init__(self, collator: Callable[[list], Any], multiple: int, pad_token_id: int | None,
                 causal: bool, max_length: int | None = None) -> None:
        self.collator, self.multiple, self.causal, self.max_length = collator, multiple, causal, max_length
        self.pad_token_id = 0 if pad_token_id is None else int(pad_token_id)
        self.warned = False

    def _unpadded_because(self, batch: Mapping[str, Any]) -> str | None:
        mask, labels = batch.get("attention_mask"), batch.get("labels")
        if not isinstance(mask, torch.Tensor):
            return None if self.causal else "the batch has no attention_mask and the model is not a causal LM"
        if isinstance(labels, torch.Tensor) and labels.shape == mask.shape and bool(
                ((mask == 0) & (labels != _IGNORE_INDEX)).any()):
            return ("labels at positions the attention_mask excludes count in the loss, and what those positions "
                    "compute depends on the sequence length; give them the label -100, as transformers' collators do")
        return None

    def __call__(self, rows: list) -> Any:
        batch = self.collator(rows)
        if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
            return batch
        ids = batch["input_ids"]
        if ids.dim() != 2:
            return batch
        rows_n, seq = ids.shape
        target = -(-seq // self.multiple) * self.multiple
        if self.max_length is not None and seq <= self.max_length < target:
            target = self.max_length  # the model's positions end there (absolute position embeddings)
        if target == seq:
            return batch
        why = self._unpadded_because(batch)
        if why is not None:
            if not self.warned:
                self.warned = True
                warnings.warn(f"SPMDTrainer: a batch of length {seq} is not padded to a multiple of {self.multiple}: "
                              f"{why}. Such batches compile a step program per length.", stacklevel=2)
            return batch
        fills = {"input_ids": self.pad_token_id, "attention_mask": 0, "labels": _IGNORE_INDEX, "token_type_ids": 0}
        extra = target - seq
        padded = dict(batch)
        for key, value in batch.items():
            if not (isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows_n, seq)):
                continue
            if key == "position_ids":
                steps = torch.arange(1, extra + 1, dtype=value.dtype).expand(rows_n, extra)
                padded[key] = torch.cat([value, value[:, -1:] + steps], dim=1)
            elif key == "seq_idx":  # a padding-free row's sequence index per token: the last sequence goes on
                padded[key] = torch.cat([value, value[:, -1:].expand(rows_n, extra)], dim=1)
            elif key in fills and value.dim() == 2:
                padded[key] = torch.nn.functional.pad(value, (0, extra), value=fills[key])
            else:
                raise ValueError(
                    f"SPMDTrainer: the batch's column {key!r} {tuple(value.shape)} runs along the sequence, and its "
                    f"padding value is unknown; pad it to a multiple of {self.multiple} in your collator, or turn "
                    f"the padding off with SPMDTrainer(..., pad_to_multiple_of=None)")
        _lengthen_last_sequence(padded, target)
        return type(batch)(padded) if not isinstance(batch, dict) else padded


def _lengthen_last_sequence(batch: dict[str, Any], length: int) -> None:
    """A padding-free batch's sequence boundaries (TRL's ``cu_seq_lens_*``, ``max_length_*``) with its last
    sequence running on to ``length``, as its ``position_ids`` and ``seq_idx`` now do."""
    for side in ("q", "k"):
        bounds = batch.get(f"cu_seq_lens_{side}")
        if not isinstance(bounds, torch.Tensor) or bounds.dim() != 1 or bounds.numel() < 2:
            continue
        bounds = bounds.clone()
        bounds[-1] = length
        batch[f"cu_seq_lens_{side}"] = bounds
        if f"max_length_{side}" in batch:
            batch[f"max_length_{side}"] = int(bounds.diff().max())


class ShapeWatch:
    """One warning when a training batch's shape is new after ``warm_up`` steps."""

    def __init__(self, warm_up: int, multiple: int | None) -> None:
        self.warm_up, self.multiple = warm_up, multiple
        self.seen: set[tuple[int, ...]] = set()
        self.steps = 0
        self.warned = False

    def step(self, inputs: Mapping[str, Any]) -> None:
        ids = inputs.get("input_ids") if isinstance(inputs, Mapping) else None
        if not isinstance(ids, torch.Tensor):
            return
        shape = tuple(ids.shape)
        self.steps += 1
        if shape not in self.seen and self.steps > self.warm_up and not self.warned:
            self.warned = True
            fix = ("pad to fewer lengths: SPMDTrainer(..., pad_to_multiple_of=64) (the default)"
                   if self.multiple is None
                   else f"raise SPMDTrainer(..., pad_to_multiple_of=) above {self.multiple}, or pad every batch to "
                        f"one length in the collator (padding='max_length')")
            warnings.warn(f"SPMDTrainer: a new batch shape {shape} at training step {self.steps}; XLA compiles the "
                          f"step again for each shape ({len(self.seen)} before this one). To compile fewer "
                          f"programs, {fix}.", stacklevel=3)
        self.seen.add(shape)
