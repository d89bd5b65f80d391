"""transformers' Trainer on a prepared model: the same losses as on the CPU, nothing read per step, no logits copied.

The CPU reference is plain ``transformers.Trainer`` with ``use_cpu=True`` on
the same model, data and arguments, with ``optim="adamw_torch"``: our run
keeps Trainer's default ``adamw_torch_fused`` and ``SPMDTrainer`` runs it
unfused (no fused kernel exists for XLA), which is the same update.
Tolerances: float32 over a few steps of AdamW on a tiny model (the recipe's
own tests measured at most 4e-7 relative on losses); rel 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch_xla.distributed.spmd as xs
import transformers

from torch_xla_ext.hf import SPMDTrainer, prepare

from hf_trainer_helpers import RUN_STEPS, Counts, StepCounts, arguments, cpu_reference, losses, tiny, token_rows

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Trainer's and accelerate's xm.mark_step
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*TypedStorage is deprecated"),
]


def _eval_rows() -> list[dict[str, torch.Tensor]]:
    """Four evaluation batches of 8 rows, of 16, 12, 8 and 16 tokens (one program per length)."""
    rows = []
    for k, seq in enumerate((16, 12, 8, 16)):
        rows += token_rows(8, seq, seed=10 + k)
    return rows


@pytest.fixture(scope="module")
def mesh(num_devices):
    return xs.Mesh(np.arange(num_devices), (num_devices,), ("fsdp",))


def test_trainer_with_default_arguments_matches_cpu_and_reads_nothing_per_step(tmp_path, trained_llama):
    trainer, steps = trained_llama.trainer, trained_llama.steps
    reference = cpu_reference("llama", tmp_path / "cpu", trained_llama.rows, max_steps=RUN_STEPS, logging_steps=1,
                              save_strategy="no")
    assert len(losses(trainer)) == RUN_STEPS
    assert losses(trainer) == pytest.approx(losses(reference), rel=1e-5)
    # Inside every step after the first: nothing read on the host, nothing gathered.
    for step, moved in enumerate(steps.inside[1:], start=2):
        assert (moved.d2h, moved.gathers) == (0, 0), (step, moved)
    # Steps 4 on compile nothing (a step's program compiles when the next batch is fetched).
    assert len({c.compiles for c in steps.at_begin[3:]}) == 1, [c.compiles for c in steps.at_begin]

    # Evaluation: eval_loss as on the CPU, a program per sequence length the first time and none after,
    # and the logits stay on the device (only the per-row losses come to the host).
    rows = _eval_rows()
    expected = reference.evaluate(rows)["eval_loss"]
    first = trainer.evaluate(rows)
    middle = Counts.now()
    second = trainer.evaluate(rows)
    after = Counts.now()
    assert first["eval_loss"] == pytest.approx(expected, rel=1e-5)
    assert second["eval_loss"] == first["eval_loss"]
    assert (after - middle).compiles == 0  # (the first compiles unless this process compiled the same programs)
    logits_bytes = 8 * 8 * 128 * 4  # the smallest evaluation batch's float32 logits
    assert (after - middle).gathers <= 1 and (after - middle).d2h_bytes < logits_bytes, after - middle

    # save_model() after training writes Hugging Face's format, which from_pretrained reads on the CPU.
    trainer.save_model(str(tmp_path / "final"))
    saved = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "final"))
    for key, value in saved.state_dict().items():
        assert torch.equal(value, trainer.model.state_dict()[key].cpu()), key

    # predict() returns the logits, as asked.
    predicted = trainer.predict(rows[:8])
    cpu_predicted = reference.predict(rows[:8])
    np.testing.assert_allclose(predicted.predictions, cpu_predicted.predictions, rtol=1e-4, atol=1e-5)


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
