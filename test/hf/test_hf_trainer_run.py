"""One SPMDTrainer run of a prepared tiny Llama with Trainer's default arguments, checked from every side.

The run (6 steps, a checkpoint every 3) is built once for this file. Its
losses and ``eval_loss`` (a short last batch too) equal plain
``transformers.Trainer`` on the CPU (in a child process without torch_xla,
same model, data and arguments, ``optim="adamw_torch"``:
our run keeps Trainer's default ``adamw_torch_fused``, which ``SPMDTrainer``
runs unfused, the same update); rel 1e-5, float32 over a few AdamW steps of a
tiny model (the recipe's own tests measured at most 4e-7 relative on losses).
Inside every step after the first nothing is read on the host or gathered;
evaluation keeps the logits on the device.

Its checkpoints hold shards: the saves and loads gather nothing
(``ReplicateShardedData``). A new process builds and prepares the model again
and resumes from step 3: its losses for steps 4-6 and its final parameters
equal the uninterrupted run's exactly. The step-6 checkpoint loads into a
model prepared on a 4 x 2 mesh: equal values, the new mesh's sharding, the
optimizer's moments sharded like their parameters. Last, a second short run
with ``load_best_model_at_end`` ends holding its best checkpoint's shards
(placed here, after the first run: it reuses most of its compiled programs).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs
import transformers

from torch_xla_ext.distributed.checkpoint import load_sharded
from torch_xla_ext.hf import prepare
from torch_xla_ext.hf.trainer import SHARDED_CHECKPOINT_DIR

from child_process import SPMD_CHILD, TEST_DIR, run_surviving
from hf_tiny import arguments, tiny, token_rows
from hf_trainer_helpers import (RUN_STEPS, SAVE_EVERY, Counts, CountedTrainer, StepCounts, TrainedRun, cpu_reference,
                                host_state, losses, run_arguments)

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:.*TypedStorage is deprecated"),
]

_RESUME = '''
import json, sys
import torch
sys.path.insert(0, sys.argv[3])
from torch_xla_ext.hf import prepare
from hf_tiny import tiny, token_rows
from hf_trainer_helpers import CountedTrainer, losses, run_arguments
trainer = CountedTrainer(model=prepare(tiny("llama"), mesh), args=run_arguments(sys.argv[1]),
                         train_dataset=token_rows(64, 12))
trainer.train(resume_from_checkpoint=sys.argv[2])
torch.save({k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}, sys.argv[1] + "/final.pt")
print(json.dumps({"losses": losses(trainer),
                  "gathers": {k: [c.gathers for c in v] for k, v in trainer.windows.items()}}))
'''


@pytest.fixture(scope="module")
def trained_llama(tmp_path_factory, mesh) -> TrainedRun:
    """The run every test of this file reads: a prepared tiny Llama, Trainer's defaults, 6 steps, one compile."""
    out = tmp_path_factory.mktemp("trainer")
    rows = token_rows(64, 12)
    steps = StepCounts()
    trainer = CountedTrainer(model=prepare(tiny("llama"), mesh), args=run_arguments(out), train_dataset=rows,
                             callbacks=[steps])
    assert trainer.args.optim == "adamw_torch_fused"  # Trainer's default, left as the user gave it
    trainer.train()
    return TrainedRun(trainer, steps, host_state(trainer.model), out, rows)


def _eval_rows() -> list[dict[str, torch.Tensor]]:
    """Four evaluation batches of 8 rows, of 16, 12, 8 and 16 tokens (one program per length)."""
    rows = []
    for k, seq in enumerate((16, 12, 8, 16)):
        rows += token_rows(8, seq, seed=10 + k)
    return rows


def test_trainer_with_default_arguments_matches_cpu_and_reads_nothing_per_step(tmp_path, trained_llama):
    trainer, steps = trained_llama.trainer, trained_llama.steps
    rows, short = _eval_rows(), token_rows(13, 16, seed=20)
    reference = cpu_reference("llama", tmp_path / "cpu", trained_llama.rows, evaluate=(rows, short), predict=rows[:8],
                              max_steps=RUN_STEPS, logging_steps=1, save_strategy="no")
    assert len(losses(trainer)) == RUN_STEPS
    assert losses(trainer) == pytest.approx(reference.losses, rel=1e-5)
    # Inside every step after the first: nothing read on the host, nothing gathered.
    for step, moved in enumerate(steps.inside[1:], start=2):
        assert (moved.d2h, moved.gathers) == (0, 0), (step, moved)
    # Steps 4 on compile nothing (a step's program compiles when the next batch is fetched).
    assert len({c.compiles for c in steps.at_begin[3:]}) == 1, [c.compiles for c in steps.at_begin]

    # Evaluation: eval_loss as on the CPU, a program per sequence length the first time and none after,
    # and the logits stay on the device (only the per-row losses come to the host).
    first = trainer.evaluate(rows)
    middle = Counts.now()
    second = trainer.evaluate(rows)
    after = Counts.now()
    assert first["eval_loss"] == pytest.approx(reference.eval_losses[0], rel=1e-5)
    assert second["eval_loss"] == first["eval_loss"]
    assert (after - middle).compiles == 0  # (the first compiles unless this process compiled the same programs)
    logits_bytes = 8 * 8 * 128 * 4  # the smallest evaluation batch's float32 logits
    assert (after - middle).gathers <= 1 and (after - middle).d2h_bytes < logits_bytes, after - middle
    # A short last batch weighs by its rows (13 rows: 8 + 5), as on the CPU; it counted as a full batch.
    assert trainer.evaluate(short)["eval_loss"] == pytest.approx(reference.eval_losses[1], rel=1e-5)

    # save_model() after training writes Hugging Face's format, which from_pretrained reads on the CPU.
    trainer.save_model(str(tmp_path / "final"))
    saved = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "final"))
    for key, value in saved.state_dict().items():
        assert torch.equal(value, trainer.model.state_dict()[key].cpu()), key

    # predict() returns the logits, as asked.
    predicted = trainer.predict(rows[:8])
    np.testing.assert_allclose(predicted.predictions, reference.predictions, rtol=1e-4, atol=1e-5)


def test_checkpoints_hold_shards_and_gather_nothing(trained_llama):
    trainer, out = trained_llama.trainer, trained_llama.out
    assert [c.gathers for c in trainer.windows["save"]] == [0, 0]
    checkpoint = out / f"checkpoint-{SAVE_EVERY}"
    files = set(os.listdir(checkpoint))
    assert {SHARDED_CHECKPOINT_DIR, "scheduler.pt", "trainer_state.json", "rng_state.pth", "config.json"} <= files
    # Neither Trainer's gathered model file nor its optimizer file.
    assert not files & {"model.safetensors", "pytorch_model.bin", "optimizer.pt"}, files


def test_resume_in_a_new_process_is_bit_identical(trained_llama, tmp_path):
    trainer, final, out = trained_llama.trainer, trained_llama.final, trained_llama.out
    child_out = tmp_path / "resumed"
    child_out.mkdir()
    stdout = run_surviving(tmp_path, SPMD_CHILD + _RESUME, str(child_out), str(out / f"checkpoint-{SAVE_EVERY}"),
                           str(TEST_DIR))
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["gathers"]["load_model"] == [0] and report["gathers"]["load_optimizer"] == [0]
    assert report["gathers"]["save"] == [0]  # the step-6 save of the resumed run
    assert report["losses"] == losses(trainer)  # steps 1-3 from the checkpoint's history, 4-6 recomputed
    resumed = torch.load(child_out / "final.pt")
    assert resumed.keys() == final.keys()
    for key, value in final.items():
        assert torch.equal(resumed[key], value), key


def test_a_checkpoint_loads_onto_another_mesh_sharded_again(trained_llama, num_devices):
    trainer, final, out = trained_llama.trainer, trained_llama.final, trained_llama.out
    mesh = xs.Mesh(np.arange(num_devices), (4, 2), ("fsdp", "tensor"))
    model = prepare(tiny("llama"), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = Counts.now()
    load_sharded(out / f"checkpoint-{RUN_STEPS}" / SHARDED_CHECKPOINT_DIR, model, optimizer)
    assert (Counts.now() - before).gathers == 0
    assert host_state(model).keys() == final.keys()
    for key, value in host_state(model).items():
        assert torch.equal(value, final[key]), key
    saved = trainer.optimizer.optimizer.state
    names = dict(trainer.model.named_parameters())
    tables = {"model.embed_tokens.weight", "lm_head.weight"}  # prepare shards them on the hidden dim
    for name, param in model.named_parameters():
        spec = torch_xla._XLAC._get_xla_sharding_spec(param)
        sharded_dim = ("{devices=[1,4,2]",) if name in tables else ("{devices=[4,1,2]", "{devices=[4,2]")
        assert spec.startswith(sharded_dim), (name, spec)
        moment = optimizer.state[param]["exp_avg"]
        assert torch_xla._XLAC._get_xla_sharding_spec(moment) == spec, name
        assert torch.equal(moment.cpu(), saved[names[name]]["exp_avg"].cpu()), name


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
