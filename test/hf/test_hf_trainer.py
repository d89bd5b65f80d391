"""transformers' Trainer beyond the Llama run: an interleaved Gemma 2 as on the CPU, a model not sharded refused.

The interleaved Gemma 2's losses equal plain ``transformers.Trainer`` on the
CPU (``use_cpu=True``, ``optim="adamw_torch"``, the unfused AdamW our run's
default ``adamw_torch_fused`` becomes) within rel 1e-5 (float32, a few steps
of a tiny model), with nothing read or gathered inside a step after the
first. A model that is not fully sharded is refused. The Llama run with
Trainer's defaults, its checkpoints and its resume: ``test_hf_trainer_run.py``.
"""

from __future__ import annotations

import pytest

from torch_xla_ext.hf import SPMDTrainer, prepare

from hf_tiny import arguments, tiny, token_rows
from hf_trainer_helpers import StepCounts, cpu_reference, losses

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Trainer's and accelerate's xm.mark_step
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*TypedStorage is deprecated"),
]


def test_trainer_trains_an_interleaved_gemma2_as_on_the_cpu(tmp_path, mesh):
    train = token_rows(32, 16)
    steps = StepCounts()
    trainer = SPMDTrainer(model=prepare(tiny("gemma2"), mesh),
                          args=arguments(tmp_path / "xla", max_steps=3, logging_steps=1, save_strategy="no"),
                          train_dataset=train, callbacks=[steps])
    trainer.train()
    reference = cpu_reference("gemma2", tmp_path / "cpu", train, max_steps=3, logging_steps=1, save_strategy="no")
    assert losses(trainer) == pytest.approx(reference.losses, rel=1e-5)
    assert [(m.d2h, m.gathers) for m in steps.inside[1:]] == [(0, 0)] * 2


def test_spmd_trainer_refuses_a_model_that_is_not_fully_sharded(tmp_path):
    with pytest.raises(TypeError, match="fully sharded"):
        SPMDTrainer(model=tiny("llama"), args=arguments(tmp_path))
