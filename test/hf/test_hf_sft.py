"""TRL's supervised fine-tuning through ``SPMDSFTTrainer``, against TRL's ``SFTTrainer`` on the CPU.

Each run trains a prepared tiny Llama for six steps on texts of the
in-memory tokenizer and compares every logged metric TRL writes (loss,
entropy, token accuracy, token count; eval's too) with plain TRL on the CPU,
in a process without torch_xla. Steps move nothing to the host: TRL's
metrics are read only when a step logs.
"""

from __future__ import annotations

import datasets
import pytest
import torch
import torch_xla
from accelerate.state import AcceleratorState

from torch_xla_ext.hf import SPMDSFTTrainer, prepare
from torch_xla_ext.testing.tolerances import tolerance

from hf_tiny import VOCAB, lora_config, sft_arguments, texts, tiny, tokenizer
from hf_trainer_helpers import Counts, StepCounts, cpu_sft_reference, programs_run

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Trainer's and accelerate's xm.mark_step
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*TypedStorage is deprecated"),
    pytest.mark.filterwarnings("ignore:.*pin_memory"),
    pytest.mark.filterwarnings("ignore:SPMDTrainer. a new batch shape"),  # packing's two buckets
]

STEPS = 6
TRAIN, EVAL = texts(64), texts(13, seed=1)
#: Per step, in float32: the loss and entropy reduce over the step's tokens (at most 8 x 64) and the vocabulary,
#: through three layers' projections; Adam carries each step's rounding into the next.
F32 = tolerance(torch.float32, STEPS * (8 * 64 + VOCAB + 3 * 4 * 128))["rtol"]
#: With TRL's default bf16 the runs round differently in bfloat16 (as in test_hf_trainer_bf16).
BF16 = tolerance(torch.bfloat16)["rtol"]


@pytest.fixture(autouse=True)
def _accelerate_state_reset():
    """accelerate's state is one per process: a bf16 run's must not stay for the tests after it."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


class _SavesCounted(SPMDSFTTrainer):
    """Records what each checkpoint save moved, and how many programs ran during it (the step's pending work is
    run first: the save would run it too, as one program of the step's own)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.saves: list[tuple[Counts, int]] = []

    def _save_checkpoint(self, *args, **kwargs):
        torch_xla.sync()
        runs, before = programs_run(), Counts.now()
        result = super()._save_checkpoint(*args, **kwargs)
        self.saves.append((Counts.now() - before, programs_run() - runs))
        return result


def _train(mesh, out, *, kind: str = "llama", scan: bool = True, train: list[str] = TRAIN, lora: bool = False,
           evaluate: bool = False, **overrides):
    model = prepare(tiny(kind), mesh, scan=scan)
    before = [(p, p.detach().cpu()) for p in model.parameters()]  # the model's own parameters, as prepared
    steps = StepCounts()
    trainer = _SavesCounted(model=model, args=sft_arguments(out, max_steps=STEPS, **overrides),
                            train_dataset=datasets.Dataset.from_dict({"text": train}),
                            eval_dataset=datasets.Dataset.from_dict({"text": EVAL}) if evaluate else None,
                            processing_class=tokenizer(), callbacks=[steps],
                            peft_config=lora_config() if lora else None)
    trainer.train()
    return trainer, steps, before


def _entries(history: list[dict], key: str) -> list[dict]:
    return [entry for entry in history if key in entry]


def _assert_logs_match(got: list[dict], want: list[dict], rel: float, keys: tuple[str, ...], count_key: str) -> None:
    got, want = _entries(got, keys[0]), _entries(want, keys[0])
    assert len(got) == len(want) > 0
    for mine, theirs in zip(got, want):
        assert mine["step"] == theirs["step"] and mine[count_key] == theirs[count_key]
        for key in keys:
            assert mine[key] == pytest.approx(theirs[key], rel=rel, abs=rel), (key, mine["step"], mine, theirs)


def test_trl_metrics_eval_and_saves_equal_cpu_trl_and_steps_read_nothing(tmp_path, mesh):
    settings = dict(bf16=False, eval_strategy="steps", eval_steps=3, save_strategy="steps", save_steps=3)
    trainer, steps, _ = _train(mesh, tmp_path / "xla", evaluate=True, **settings)
    reference = cpu_sft_reference("llama", tmp_path / "cpu", TRAIN, max_steps=STEPS, evaluate=EVAL, **settings)
    _assert_logs_match(trainer.state.log_history, reference, F32, ("loss", "entropy", "mean_token_accuracy"),
                       "num_tokens")
    _assert_logs_match(trainer.state.log_history, reference, F32,
                       ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"), "eval_num_tokens")
    assert [(m.d2h, m.gathers) for m in steps.inside[1:]] == [(0, 0)] * (STEPS - 1)
    assert [m.compiles for m in steps.at_begin[4:]] == [steps.at_begin[3].compiles] * (STEPS - 4)  # after eval
    assert [(c.gathers, runs) for c, runs in trainer.saves] == [(0, 0), (0, 0)]


def test_trl_defaults_bf16_and_gradient_checkpointing_train_as_on_the_cpu(tmp_path, mesh):
    """One repeated text: the loss falls by a quarter in six steps, far more than bfloat16's rounding apart."""
    repeated = [TRAIN[0]] * len(TRAIN)
    trainer, steps, _ = _train(mesh, tmp_path / "xla", train=repeated)
    assert trainer.args.bf16 and trainer.args.gradient_checkpointing  # TRL's defaults
    reference = cpu_sft_reference("llama", tmp_path / "cpu", repeated, max_steps=STEPS)
    assert _entries(reference, "loss")[-1]["loss"] < 0.75 * _entries(reference, "loss")[0]["loss"]
    _assert_logs_match(trainer.state.log_history, reference, BF16, ("loss", "entropy"), "num_tokens")
    assert [(m.d2h, m.gathers) for m in steps.inside[1:]] == [(0, 0)] * (STEPS - 1)


def test_packing_trains_as_on_the_cpu_in_two_buckets(tmp_path, mesh):
    settings = dict(bf16=False, packing=True)
    trainer, steps, _ = _train(mesh, tmp_path / "xla", **settings)
    reference = cpu_sft_reference("llama", tmp_path / "cpu", TRAIN, max_steps=STEPS, **settings)
    _assert_logs_match(trainer.state.log_history, reference, F32, ("loss", "entropy", "mean_token_accuracy"),
                       "num_tokens")
    assert [(m.d2h, m.gathers) for m in steps.inside[1:]] == [(0, 0)] * (STEPS - 1)


def test_lora_through_peft_config_with_accumulation_trains_the_adapters_as_on_the_cpu(tmp_path, mesh):
    settings = dict(bf16=False, save_strategy="steps", save_steps=3, gradient_accumulation_steps=2,
                    per_device_train_batch_size=4)
    trainer, steps, before = _train(mesh, tmp_path / "xla", lora=True, **settings)
    reference = cpu_sft_reference("llama", tmp_path / "cpu", TRAIN, max_steps=STEPS, lora=True, **settings)
    _assert_logs_match(trainer.state.log_history, reference, F32, ("loss", "entropy", "mean_token_accuracy"),
                       "num_tokens")
    assert [(m.d2h, m.gathers) for m in steps.inside[1:]] == [(0, 0)] * (STEPS - 1)
    # The adapters TRL adds after prepare are replicated: torch_xla counts each read of one (its parameter and
    # two Adam moments) as a ReplicateShardedData, handing over a copy it holds. Exactly those, and no read of
    # a sharded tensor, so nothing is gathered.
    adapters = sum(1 for name, _ in trainer.model.named_parameters() if "lora_" in name)
    assert adapters == 3 * 2 * 2  # layers x (q_proj, v_proj) x (A, B)
    assert [c.gathers for c, _ in trainer.saves] == [3 * adapters] * 2
    assert all(torch.equal(p.detach().cpu(), value) for p, value in before)  # the base model is frozen


def test_a_mixture_of_experts_logs_trls_load_balancing_loss_as_on_the_cpu(tmp_path, mesh):
    """TRL turns the router's load-balancing loss on for MoE models (every layer's router logits): a scanned
    stack refuses to hand those out, so the model is prepared unscanned, and without gradient checkpointing
    (torch.utils.checkpoint cannot run on XLA, docs/hf.md). TRL's aux_loss metric stays on the device too."""
    settings = dict(bf16=False, gradient_checkpointing=False)
    trainer, steps, _ = _train(mesh, tmp_path / "xla", kind="mixtral", scan=False, **settings)
    assert trainer.aux_loss_enabled
    reference = cpu_sft_reference("mixtral", tmp_path / "cpu", TRAIN, max_steps=STEPS, **settings)
    _assert_logs_match(trainer.state.log_history, reference, F32,
                       ("loss", "aux_loss", "entropy", "mean_token_accuracy"), "num_tokens")
    assert [(m.d2h, m.gathers) for m in steps.inside[1:]] == [(0, 0)] * (STEPS - 1)


def test_an_accelerators_own_gather_for_metrics_is_put_back_after_each_loss(tmp_path, mesh):
    """The loss swaps the accelerator's gather_for_metrics only while TRL's compute_loss runs."""
    model = prepare(tiny("llama"), mesh, scan=True)
    trainer = SPMDSFTTrainer(model=model, args=sft_arguments(tmp_path, max_steps=1, bf16=False),
                             train_dataset=datasets.Dataset.from_dict({"text": TRAIN[:8]}),
                             processing_class=tokenizer())
    mine = trainer.accelerator.gather_for_metrics  # the class's method, bound
    trainer.train()
    assert "gather_for_metrics" not in vars(trainer.accelerator)
    assert trainer.accelerator.gather_for_metrics == mine
    trainer.accelerator.gather_for_metrics = own = lambda value, use_gather_object=False: value
    trainer.evaluate(datasets.Dataset.from_dict({"text": TRAIN[:8]}))
    assert trainer.accelerator.gather_for_metrics is own  # the user's own replacement, put back
