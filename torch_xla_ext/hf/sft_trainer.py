"""``SPMDSFTTrainer``: TRL's ``SFTTrainer`` for a fully sharded model on XLA SPMD.

It is :class:`~torch_xla_ext.hf.trainer.SPMDTrainer` and ``trl.SFTTrainer``
in one class (``SFTTrainer``'s dataset preparation, packing, PEFT and fused
loss; ``SPMDTrainer``'s checkpoints, optimizer, logging and batch buckets),
with one change of its own: **TRL's per-step metrics stay on the device until
a step logs.**

``SFTTrainer.compute_loss`` turns its metrics into Python floats inside
every step: the mean entropy, the token accuracy (each ``.item()`` after a
``num_valid > 0`` test), the number of tokens and, for MoE models, the
router's auxiliary loss. On XLA each read runs the step's graph so far and
copies a value to the host, five times a step. Here TRL computes the loss
as it does; its metric reads are taken from it while it runs (its
``accelerator.gather_for_metrics`` hands TRL a host zero and keeps the device
value), and the same metrics are formed on the device from the values it
asked to gather. They are read once, all together, when the step logs. The
token count comes from the collator on the host (before the batch is padded
to its bucket), as TRL would count the batch unpadded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import trl

from .trainer import SPMDTrainer

__all__ = ["SPMDSFTTrainer"]

#: The batch entry carrying the collator's token count to ``compute_loss`` (taken out before the model sees it).
_TOKENS_KEY = "_spmd_sft_tokens"


def _tokens(batch: Mapping[str, Any]) -> int:
    """How many tokens TRL counts in ``batch``: the attention mask's ones, or a padding-free row's width."""
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    positions = batch.get("position_ids")
    if isinstance(positions, torch.Tensor):
        return int(positions.size(1))
    raise ValueError("SPMDSFTTrainer: a training batch has neither attention_mask nor position_ids; TRL counts the "
                     "tokens of a batch from one of them")


class _CountTokens:
    """``collator``'s batches with their token count (TRL's rule, before any padding) under :data:`_TOKENS_KEY`."""

    def __init__(self, collator: Callable[[list], Any]) -> None:
        self.collator = collator

    def __call__(self, rows: list) -> Any:
        batch = self.collator(rows)
        if isinstance(batch, Mapping):
            batch = {**batch, _TOKENS_KEY: _tokens(batch)}
        return batch


@contextmanager
def _gathers_kept(accelerator: Any) -> Iterator[list[torch.Tensor]]:
    """While open, ``accelerator.gather_for_metrics`` keeps each tensor it is given and returns a host zero of its
    dtype (TRL then reads nothing from the device); yields the kept tensors, in order."""
    kept: list[torch.Tensor] = []

    def keep(value: Any, use_gather_object: bool = False) -> Any:
        if not isinstance(value, torch.Tensor) or use_gather_object:
            raise RuntimeError("SPMDSFTTrainer: TRL's compute_loss gathered something other than a tensor; this "
                               "version of TRL is not one SPMDSFTTrainer knows")
        kept.append(value)
        return torch.zeros(value.shape, dtype=value.dtype)

    own = vars(accelerator)
    had, previous = "gather_for_metrics" in own, own.get("gather_for_metrics")
    accelerator.gather_for_metrics = keep
    try:
        yield kept
    finally:
        if had:  # someone's own replacement on this accelerator, put back
            accelerator.gather_for_metrics = previous
        else:
            del accelerator.gather_for_metrics  # the class's method again


def _mean_or_zero(total: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """TRL's ``total / count if count > 0 else 0.0``, on the device."""
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros((), dtype=torch.float32,
                                                                           device=total.device))


class SPMDSFTTrainer(SPMDTrainer, trl.SFTTrainer):
    """``trl.SFTTrainer`` whose checkpoints gather nothing and whose steps read nothing, for a fully sharded model.

    Takes what ``SFTTrainer`` takes, plus ``SPMDTrainer``'s
    ``pad_to_multiple_of``. ``model`` must be fully sharded
    (:func:`torch_xla_ext.hf.prepare`); ``peft_config=`` adds its adapters
    to it. TRL's logged metrics (``entropy``, ``mean_token_accuracy``,
    ``num_tokens``, ``aux_loss``) are TRL's own, read from the device only at
    logging steps (see the module docstring).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._expected_gathers = {"train": 4, "eval": 3}
        if self.aux_loss_enabled:
            self._expected_gathers = {mode: count + 1 for mode, count in self._expected_gathers.items()}

    def _training_collator(self, collator: Any) -> Any:
        """``SPMDTrainer``'s training collator, each batch carrying TRL's token count taken before padding."""
        return super()._training_collator(_CountTokens(collator))

    def compute_loss(self, model: torch.nn.Module, inputs: dict, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        """TRL's loss; its metrics formed on the device and kept until the step logs."""
        mode = "train" if self.model.training else "eval"
        tokens = inputs.pop(_TOKENS_KEY, None)
        if mode == "train" and tokens is None:
            raise RuntimeError("SPMDSFTTrainer: a training batch came without its token count; train through "
                               "SPMDSFTTrainer.train(), whose loader counts each batch's tokens")
        metrics = self._metrics[mode]
        sizes = {key: len(values) for key, values in metrics.items()}
        with _gathers_kept(self.accelerator) as kept:
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if len(kept) != self._expected_gathers[mode]:
            raise RuntimeError(f"SPMDSFTTrainer: TRL's compute_loss gathered {len(kept)} values in {mode} mode where "
                               f"{self._expected_gathers[mode]} were expected; this version of TRL is not one "
                               f"SPMDSFTTrainer knows")
        valid, entropy_sum, correct = kept[:3]
        self._replace_last(metrics, sizes, "entropy", _mean_or_zero(entropy_sum.float(), valid))
        self._replace_last(metrics, sizes, "mean_token_accuracy", _mean_or_zero(correct.float(), valid))
        if mode == "train":
            self._total_train_tokens += tokens // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]
        if self.aux_loss_enabled:
            self._replace_last(metrics, sizes, "aux_loss", kept[-1].detach().float().mean())
        return result

    @staticmethod
    def _replace_last(metrics: dict[str, list], sizes: dict[str, int], key: str, value: torch.Tensor) -> None:
        """Put ``value`` in place of the host zero TRL just appended under ``key``."""
        values = metrics.get(key)
        if values is None or len(values) != sizes.get(key, 0) + 1:
            raise RuntimeError(f"SPMDSFTTrainer: TRL's compute_loss did not append one {key!r} metric; this version "
                               f"of TRL is not one SPMDSFTTrainer knows")
        values[-1] = value.detach()

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """TRL's log, its device metrics read first, all in one transfer."""
        metrics = self._metrics["train" if self.model.training else "eval"]
        places = [(key, i) for key, values in metrics.items() for i, value in enumerate(values)
                  if isinstance(value, torch.Tensor)]
        if places:
            read = torch.stack([metrics[key][i].reshape(()) for key, i in places]).cpu().tolist()
            for (key, i), value in zip(places, read):
                metrics[key][i] = value
        super().log(logs, start_time)
