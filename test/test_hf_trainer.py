"""transformers' Trainer on prepared models beyond the shared run: an interleaved Gemma 2, the best checkpoint.

The interleaved Gemma 2's losses equal plain ``transformers.Trainer`` on the
CPU (``use_cpu=True``, ``optim="adamw_torch"``, the unfused AdamW our run's
default ``adamw_torch_fused`` becomes) within rel 1e-5 (float32, a few steps
of a tiny model), with nothing read or gathered inside a step after the
first. ``load_best_model_at_end`` loads the best checkpoint's shards, not the
last state. A model that is not fully sharded is refused. The Llama run with
Trainer's defaults, its checkpoints and its resume: ``test_hf_trainer_run.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch_xla.distributed.spmd as xs

from torch_xla_ext.distributed.checkpoint import load_sharded
from torch_xla_ext.hf import SPMDTrainer, prepare
from torch_xla_ext.hf.trainer import SHARDED_CHECKPOINT_DIR

from hf_trainer_helpers import (CountedTrainer, StepCounts, arguments, cpu_reference, host_state, losses, tiny,
                                token_rows)

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Trainer's and accelerate's xm.mark_step
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*TypedStorage is deprecated"),
]


@pytest.fixture(scope="module")
def mesh(num_devices):
    return xs.Mesh(np.arange(num_devices), (num_devices,), ("fsdp",))


def test_trainer_trains_an_interleaved_gemma2_as_on_the_cpu(tmp_path, mesh):
    train = token_rows(32, 16)
    steps = StepCounts()
    trainer = SPMDTrainer(model=prepare(tiny("gemma2"), mesh),
                          args=arguments(tmp_path / "xla", max_steps=3, logging_steps=1, save_strategy="no"),
                          train_dataset=train, callbacks=[steps])
    trainer.train()
    reference = cpu_reference("gemma2", tmp_path / "cpu", train, max_steps=3, logging_steps=1, save_strategy="no")
    assert losses(trainer) == pytest.approx(losses(reference), rel=1e-5)
    assert [(m.d2h, m.gathers) for m in steps.inside[1:]] == [(0, 0)] * 2


def test_spmd_trainer_refuses_a_model_that_is_not_fully_sharded(tmp_path):
    with pytest.raises(TypeError, match="fully sharded"):
        SPMDTrainer(model=tiny("llama"), args=arguments(tmp_path))


def test_load_best_model_at_end_reads_the_best_checkpoints_shards(tmp_path, mesh):
    rows = token_rows(32, 12)
    args = arguments(tmp_path, max_steps=2, logging_steps=1, save_steps=1, eval_strategy="steps", eval_steps=1,
                     load_best_model_at_end=True, metric_for_best_model="loss", greater_is_better=True)
    # greater_is_better=True on a falling loss: the best is the first evaluation, not the last state.
    trainer = CountedTrainer(model=prepare(tiny("llama"), mesh), args=args, train_dataset=rows,
                             eval_dataset=rows[:8])
    trainer.train()
    assert trainer.state.best_model_checkpoint == str(tmp_path / "checkpoint-1")
    expected = prepare(tiny("llama"), mesh)
    load_sharded(tmp_path / "checkpoint-1" / SHARDED_CHECKPOINT_DIR, expected)
    got, best = host_state(trainer.model), host_state(expected)
    assert got.keys() == best.keys()
    for key, value in best.items():
        assert torch.equal(got[key], value), key
    last = prepare(tiny("llama"), mesh)
    load_sharded(tmp_path / "checkpoint-2" / SHARDED_CHECKPOINT_DIR, last)
    assert not all(torch.equal(a, b) for a, b in zip(host_state(last).values(), best.values()))
