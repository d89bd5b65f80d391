"""Trainer's ``bf16=True`` (autocast) on rotary models with ``sdpa`` attention, scanned and unscanned, as on the CPU.

torch_xla 2.9 alone fails in the first step (``Expected query, key, and
value to have the same dtype``: the rotary embedding hands float32 queries
and keys beside a bfloat16 value); the package's XLA autocast rule for the
attention (``torch_xla_ext._sdpa_autocast``) casts them as CUDA's and the
CPU's autocast do. Every run learns one repeated row (the loss falls from
ln(128) to about 3 in six steps), so a run that does not train, or trains
something else, misses the CPU's losses by far more than bfloat16 rounds.
"""

from __future__ import annotations

import pytest
import torch
from accelerate.state import AcceleratorState

from torch_xla_ext.hf import SPMDTrainer, prepare
from torch_xla_ext.testing.tolerances import tolerance

from hf_tiny import arguments, tiny, token_rows
from hf_trainer_helpers import StepCounts, cpu_reference, losses

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Trainer's and accelerate's xm.mark_step
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*TypedStorage is deprecated"),
]

STEPS = 6
#: Each step's loss within 8 eps of bfloat16 (relative) of the CPU's: the runs round differently in bfloat16
#: and Adam carries that into the next steps (measured: at most 0.6% apart over the six steps).
BF16 = tolerance(torch.bfloat16)


@pytest.fixture(autouse=True)
def _accelerate_state_reset():
    """accelerate's state is one per process: a bf16 run's must not stay for the tests after it."""
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_bf16_autocast_with_sdpa_trains_scanned_and_unscanned_as_on_the_cpu(tmp_path, mesh, kind):
    train = [token_rows(1, 16)[0]] * 32
    settings = dict(bf16=True, max_steps=STEPS, logging_steps=1, save_strategy="no")
    runs = {}
    for scan in (True, False):
        model = prepare(tiny(kind), mesh, scan=scan)
        assert model.config._attn_implementation == "sdpa"
        steps = StepCounts()
        trainer = SPMDTrainer(model=model, args=arguments(tmp_path / f"scan_{scan}", **settings), train_dataset=train,
                              callbacks=[steps])
        trainer.train()
        runs[scan] = losses(trainer)
        assert [(m.d2h, m.gathers) for m in steps.inside[1:]] == [(0, 0)] * (STEPS - 1)
    reference = cpu_reference(kind, tmp_path / "cpu", train, **settings).losses
    assert reference[-1] < 0.75 * reference[0]  # the model learns the row
    for scan, got in runs.items():
        assert got == pytest.approx(reference, rel=BF16["rtol"]), f"scan={scan}: {got} against the CPU's {reference}"
    assert runs[True] == pytest.approx(runs[False], rel=BF16["rtol"])
