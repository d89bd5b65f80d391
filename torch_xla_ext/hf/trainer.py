"""``SPMDTrainer``: transformers' ``Trainer`` for a fully sharded model on XLA SPMD.

Everything a user sets through ``TrainingArguments`` works as in
``Trainer``. What the subclass changes, and only for what Trainer cannot be
told through its arguments:

* **Checkpoints gather nothing.** Trainer's checkpoints during training
  (``save_steps``, ``save_strategy``) write the model and optimizer through
  :func:`torch_xla_ext.distributed.checkpoint.save_sharded`: every device's
  shard as it is, into ``checkpoint-N/sharded/``, beside the scheduler,
  RNG and trainer state Trainer writes as usual. ``Trainer.train
  (resume_from_checkpoint=...)`` and ``load_best_model_at_end`` read them
  back into the sharded model (resharding when the model was prepared on
  another mesh). Trainer's own XLA checkpoint gathers every parameter and
  every optimizer moment to one device and the host. ``trainer.save_model()``
  (the user's call, after training) still writes Hugging Face's format
  (``from_pretrained`` reads it): that has to gather.
* **The default optimizer runs on XLA.** Trainer's default ``optim`` is
  ``adamw_torch_fused``, whose kernels exist for CUDA and the CPU, not XLA
  (``RuntimeError: fused=True requires ... devices``); the same AdamW runs
  unfused here (the same update, rounded as XLA rounds).

* **A logged step reads the loss and the gradient norm, nothing else.**
  Trainer averages the logged loss over processes through
  ``xm.mesh_reduce`` (a rendezvous: 7 reads and 2 uploads per logged step);
  under SPMD the loss is already the global one (``_logged_loss``).

* **Evaluation weighs each batch by its rows.** On XLA accelerate hands
  Trainer its loader inside torch_xla's ``MpDeviceLoader``, whose thread
  runs ahead of Trainer; the loader left accelerate's state before Trainer
  handled its last batch, so a short last batch counted as a full one
  (``eval_loss`` of 13 rows in batches of 8 was the plain mean of the two
  batch losses). Evaluation and prediction iterate accelerate's own loader
  on the calling thread; Trainer moves each batch to the device.

A model from :func:`torch_xla_ext.hf.prepare` needs nothing else: its mask is
built on the device (no host read per step), and Trainer evaluates without
copying logits to the host unless ``compute_metrics`` asks for them.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
import transformers

from ..distributed import FSDPModule
from ..distributed.checkpoint import load_sharded, save_sharded
from ._buckets import DEFAULT_MULTIPLE, BucketPadding, ShapeWatch
from ._loader_errors import CollatorErrors
from ._logged_loss import spmd_loss_gather

__all__ = ["SHARDED_CHECKPOINT_DIR", "SPMDTrainer"]

#: The folder of a Trainer checkpoint (``checkpoint-N/``) that holds the model's and optimizer's shards.
SHARDED_CHECKPOINT_DIR = "sharded"
_SCHEDULER_NAME = "scheduler.pt"  # Trainer's own file name for the scheduler state


def _on_this_thread(loader: Any) -> Any:
    """accelerate's loader out of torch_xla's prefetching ``MpDeviceLoader`` (see the module docstring)."""
    from accelerate.data_loader import MpDeviceLoaderWrapper

    if not isinstance(loader, MpDeviceLoaderWrapper):
        return loader
    inner = loader._loader
    inner.rng_types = loader._rng_types  # the wrapper took them away from its prefetch thread
    return inner


#: ``TrainingArguments`` that cannot work with a fully sharded model on XLA SPMD: (argument, is it set, why).
_UNSUPPORTED: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("fsdp", bool, "the model is fully sharded already; leave fsdp and fsdp_config unset"),
    ("torch_compile", bool, "the lazy graph already compiles each whole step into one XLA program, and "
                            "scan_layers does not run inside torch.compile; leave torch_compile=False"),
    ("deepspeed", lambda value: value is not None, "DeepSpeed shards for CUDA processes; the model is sharded "
                                                    "over the SPMD mesh already"),
    ("use_cpu", bool, "the model lives on the XLA device (prepare put it there); for a CPU run use plain "
                      "transformers.Trainer on an unprepared model"),
)


def _refuse_unsupported(args: transformers.TrainingArguments) -> None:
    """ValueError naming the first argument of :data:`_UNSUPPORTED` that ``args`` sets, before Trainer starts."""
    for name, is_set, why in _UNSUPPORTED:
        if is_set(getattr(args, name, None)):
            raise ValueError(f"SPMDTrainer: TrainingArguments({name}={getattr(args, name)!r}) is not supported: {why}")


class SPMDTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose checkpoints neither gather nor copy whole tensors, for a fully sharded model.

    Takes the arguments ``Trainer`` takes. ``model`` (or what ``model_init``
    returns) must be fully sharded (:func:`torch_xla_ext.hf.prepare`, or
    ``fully_shard`` applied to it). Arguments that cannot work here raise
    ``ValueError`` naming them before Trainer starts: Trainer's own FSDP
    (``fsdp=``, ``fsdp_config=``; the model already is), ``torch_compile``,
    ``deepspeed`` and ``use_cpu``.

    ``pad_to_multiple_of`` (default 64; None: off): each training batch's
    ``[batch, seq]`` columns padded on the right to a multiple of it (labels
    with -100, so the loss is the unpadded batch's), so dynamic padding and
    packing compile one step program per bucket, not per length; a new
    shape after the first two steps warns once, naming it.

    Under single-process SPMD one process drives every device:
    ``per_device_train_batch_size`` is the batch of the whole mesh (sharded
    over it), not of one chip.
    """

    def __init__(self, model: torch.nn.Module | None = None, args: transformers.TrainingArguments | None = None,
                 *rest: Any, pad_to_multiple_of: int | None = DEFAULT_MULTIPLE, **kwargs: Any) -> None:
        if pad_to_multiple_of is not None and (not isinstance(pad_to_multiple_of, int)
                                               or isinstance(pad_to_multiple_of, bool) or pad_to_multiple_of < 1):
            raise ValueError(f"SPMDTrainer: pad_to_multiple_of must be a positive int or None, got "
                             f"{pad_to_multiple_of!r}")
        given = inspect.signature(super().__init__).bind(model, args, *rest, **kwargs).arguments  # the next class's
        if model is None and given.get("model_init") is None:
            raise TypeError("SPMDTrainer trains a fully sharded model: pass model=torch_xla_ext.hf.prepare(model, "
                            "mesh), or model_init= a function that returns one")
        if model is not None and not isinstance(model, FSDPModule):
            raise TypeError(f"SPMDTrainer trains a fully sharded model (torch_xla_ext.hf.prepare(model, mesh)); got "
                            f"{type(model).__name__}")
        if args is not None:
            _refuse_unsupported(args)
        super().__init__(model, args, *rest, **kwargs)
        self.pad_to_multiple_of = pad_to_multiple_of
        self._shapes = ShapeWatch(warm_up=2, multiple=pad_to_multiple_of)
        self._collator_errors = CollatorErrors(None)

    def call_model_init(self, trial: Any = None) -> torch.nn.Module:
        """Trainer's ``model_init`` call (at construction and again at ``train()``), its model checked."""
        model = super().call_model_init(trial)
        if not isinstance(model, FSDPModule):
            raise TypeError(f"SPMDTrainer: model_init returned a {type(model).__name__} that is not fully sharded; "
                            f"return torch_xla_ext.hf.prepare(model, mesh) from it")
        return model

    @staticmethod
    def get_optimizer_cls_and_kwargs(args: transformers.TrainingArguments,
                                     model: torch.nn.Module | None = None) -> tuple[Any, Any]:
        """Trainer's choice, with fused kernels (CUDA and CPU only) switched off: the same update on XLA."""
        cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(args, model)
        if kwargs.get("fused"):
            kwargs = {**kwargs, "fused": False}
        return cls, kwargs

    # ---- training batches ----

    def _training_collator(self, collator: Any) -> Any:
        """``collator`` as training batches go through it: padded to a multiple of ``pad_to_multiple_of``
        (``_buckets``). A subclass wraps it further by extending this."""
        if self.pad_to_multiple_of is None:
            return collator
        config = getattr(self.model, "config", None)
        causal = type(self.model).__name__.endswith("ForCausalLM") or bool(getattr(config, "is_decoder", False))
        positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        return BucketPadding(collator, self.pad_to_multiple_of, getattr(config, "pad_token_id", None), causal,
                             positions if isinstance(positions, int) else None)

    def get_train_dataloader(self) -> Any:
        """Trainer's loader over :meth:`_training_collator`, the collator's errors kept for this thread
        (:class:`~._loader_errors.CollatorErrors`)."""
        self._collator_errors = CollatorErrors(self._training_collator(self.data_collator))
        original, self.data_collator = self.data_collator, self._collator_errors
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator = original

    def training_step(self, model: torch.nn.Module, inputs: dict, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._collator_errors.raise_if_any()
        self._shapes.step(inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer's ``train``; a collator error on the loader's thread is raised here, not lost with it."""
        result = super().train(*args, **kwargs)
        self._collator_errors.raise_if_any()
        return result

    def _maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """Trainer's logging, saving and evaluation; the logged loss read without a gather (``_logged_loss``)."""
        with spmd_loss_gather():
            super()._maybe_log_save_evaluate(*args, **kwargs)

    # ---- evaluation ----

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        return _on_this_thread(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        return _on_this_thread(super().get_test_dataloader(test_dataset))

    # ---- saving ----

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """At a checkpoint: the config and the model's shards; called by the user: Hugging Face's format."""
        if not _internal_call:
            super().save_model(output_dir, _internal_call)
            return
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        os.makedirs(output_dir, exist_ok=True)
        config = getattr(self.model, "config", None)
        if self.args.should_save:  # host files: one process writes them; every process writes its shards
            if config is not None:
                config.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))
        if self.args.save_only_model:  # otherwise the model's shards go with the optimizer's
            save_sharded(os.path.join(output_dir, SHARDED_CHECKPOINT_DIR), self.model)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_sharded(os.path.join(output_dir, SHARDED_CHECKPOINT_DIR), self.model, self.optimizer)
        if self.lr_scheduler is not None and self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    # ---- loading ----

    @staticmethod
    def _sharded(checkpoint: str | None) -> str | None:
        path = None if checkpoint is None else os.path.join(checkpoint, SHARDED_CHECKPOINT_DIR)
        return path if path is not None and os.path.isdir(path) else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        sharded = self._sharded(resume_from_checkpoint)
        if sharded is None:  # a checkpoint in Hugging Face's format: Trainer reads it
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        load_sharded(sharded, self.model if model is None else model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        sharded = self._sharded(checkpoint)
        if sharded is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        load_sharded(sharded, self.model, self.optimizer, load_model=False)
        scheduler = os.path.join(checkpoint, _SCHEDULER_NAME)
        if self.lr_scheduler is not None and os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        sharded = self._sharded(self.state.best_model_checkpoint)
        if sharded is None:
            super()._load_best_model()
            return
        load_sharded(sharded, self.model)
