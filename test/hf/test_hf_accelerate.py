"""A prepared model in a hand-written accelerate loop: the CPU loop's losses, nothing read or compiled per step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch_xla
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from torch.utils.data import DataLoader
from transformers import default_data_collator

from torch_xla_ext.hf import prepare

from hf_tiny import tiny, token_rows
from hf_trainer_helpers import Counts

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]

STEPS = 6


def test_accelerate_loop_matches_the_cpu_loop_and_moves_nothing_per_step(mesh):
    cpu = tiny("llama")
    model = prepare(copy.deepcopy(cpu), mesh)
    rows = token_rows(8 * STEPS, 12)

    cpu_optimizer = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    expected = []
    for batch in DataLoader(rows, batch_size=8, collate_fn=default_data_collator):
        loss = cpu(**batch, use_cache=False).loss
        loss.backward()
        cpu_optimizer.step()
        cpu_optimizer.zero_grad()
        expected.append(loss.item())

    # accelerate's state is one per process and outlives Accelerators: a Trainer with bf16=True earlier in this
    # process would leave its autocast on for this one.
    AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = Accelerator()
    assert accelerator.mixed_precision == "no"
    assert accelerator.device.type == "xla"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(rows, batch_size=8, collate_fn=default_data_collator)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    got, per_step = [], []
    begin = Counts.now()
    for batch in loader:  # accelerate's XLA loader puts each batch on the device and syncs per batch
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        got.append(loss)
        now = Counts.now()
        per_step.append(now - begin)
        begin = now
    torch_xla.sync()
    assert [t.item() for t in got] == pytest.approx(expected, rel=1e-5)
    # The losses were read after the loop. Inside it nothing was read on the host or gathered after the
    # first step; a step's program compiles when the loader syncs, at the next batch: the first step's and
    # the second's (with AdamW's state; unless this process compiled the same program before, the
    # compile cache being process-wide), none from the fourth batch on.
    assert [(c.d2h, c.gathers) for c in per_step[1:]] == [(0, 0)] * (STEPS - 1), per_step
    assert sum(c.compiles for c in per_step) <= 2 and not any(c.compiles for c in per_step[3:]), per_step
