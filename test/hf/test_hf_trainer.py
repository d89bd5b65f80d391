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
from hf_trainer_helpers import Counts, StepCounts, cpu_reference, losses, programs_run

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


@pytest.mark.parametrize("name,value", [("torch_compile", True), ("deepspeed", "ds_config.json"), ("use_cpu", True),
                                        ("fsdp", "full_shard")])
def test_arguments_that_cannot_work_are_refused_naming_them(tmp_path, mesh, name, value):
    # torch_compile=True used to die inside accelerate (KeyError: 'model.embed_tokens.weight').
    args = arguments(tmp_path)
    object.__setattr__(args, name, value)  # set after construction: deepspeed's would import deepspeed
    model = prepare(tiny("llama"), mesh)
    with pytest.raises(ValueError, match=rf"TrainingArguments\({name}="):
        SPMDTrainer(model=model, args=args)


def test_model_init_gives_the_trainer_its_model_and_is_checked(tmp_path, mesh):
    made = []

    def model_init():
        made.append(prepare(tiny("llama"), mesh))
        return made[-1]

    trainer = SPMDTrainer(model_init=model_init, args=arguments(tmp_path, max_steps=2, save_strategy="no"),
                          train_dataset=token_rows(16, 16))
    trainer.train()  # Trainer calls model_init again here, for a fresh model
    assert len(made) == 2 and trainer.model is made[-1] and trainer.state.global_step == 2
    with pytest.raises(TypeError, match="model_init returned a LlamaForCausalLM that is not fully sharded"):
        SPMDTrainer(model_init=lambda: tiny("llama"), args=arguments(tmp_path))
    with pytest.raises(TypeError, match="pass model=.*or model_init="):
        SPMDTrainer(args=arguments(tmp_path))


class _LoggedStepCounts(SPMDTrainer):
    """Counts what each of Trainer's log / save / evaluate points moved, compiled and executed."""

    windows: list

    def _maybe_log_save_evaluate(self, *args, **kwargs):
        runs, before = programs_run(), Counts.now()
        super()._maybe_log_save_evaluate(*args, **kwargs)
        self.windows.append((Counts.now() - before, programs_run() - runs))


def test_a_logged_step_reads_the_loss_and_the_gradient_norm_and_nothing_else(tmp_path, mesh):
    # Trainer averaged the logged loss over processes with xm.mesh_reduce: 8 reads, 2 uploads and 4 compiles
    # at the first logged step, 8 reads at each later one. Under SPMD the loss is the global one already.
    trainer = _LoggedStepCounts(model=prepare(tiny("llama"), mesh), train_dataset=token_rows(48, 16),
                                args=arguments(tmp_path, max_steps=6, logging_steps=2, save_strategy="no"))
    trainer.windows = []
    trainer.train()
    logged = [trainer.windows[i] for i in (1, 3, 5)]  # steps 2, 4, 6
    assert [(c.d2h, c.d2h_bytes) for c, _ in logged] == [(2, 8)] * 3, logged  # two float32 scalars
    # Each read is of a replicated scalar: torch_xla counts a ReplicateShardedData for it and hands over one
    # device's copy; a gather would run a program of its own. The one program run is Trainer's sync.
    assert [runs for _, runs in logged] == [1] * 3, logged
    assert logged[0][0].compiles <= 1 and [c.compiles for c, _ in logged[1:]] == [0, 0], logged
    assert [c.d2h for c, _ in (trainer.windows[i] for i in (0, 2, 4))] == [0] * 3  # steps not logged read nothing
    assert len(losses(trainer)) == 3
