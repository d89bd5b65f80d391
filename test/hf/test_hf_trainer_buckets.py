"""SPMDTrainer pads training batches to a multiple of the sequence length: dynamic padding compiles one program.

Rows of 8 lengths, batched in order 8 at a time by a collator that pads
each batch to its longest row (as transformers' and TRL's do): 6 batch
lengths between 9 and 60. Padded to 64 they are one shape, and the losses
are plain Trainer's on the CPU with the same collator (the padding's labels
are -100).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from torch_xla_ext.hf import SPMDTrainer, prepare
from torch_xla_ext.hf._buckets import BucketPadding

from hf_tiny import InOrder, arguments, pad_batch, ragged_rows, tiny
from hf_trainer_helpers import StepCounts, cpu_reference, losses

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Trainer's and accelerate's xm.mark_step
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled"),
]

STEPS = 6
#: Each batch of 8 rows has one length: 9, 23, 37, 60, 17, 29 tokens.
LENGTHS = tuple(n for n in (9, 23, 37, 60, 17, 29) for _ in range(8))


def _rows():
    return ragged_rows(8 * STEPS, LENGTHS)


def _trainer(tmp_path, mesh, **kwargs):
    steps = StepCounts()
    trainer = SPMDTrainer(model=prepare(tiny("llama"), mesh), train_dataset=InOrder(_rows()), data_collator=pad_batch,
                          args=arguments(tmp_path, max_steps=STEPS, logging_steps=1, save_strategy="no"),
                          callbacks=[steps], **kwargs)
    return trainer, steps


def test_dynamic_padding_compiles_one_step_program_and_trains_as_on_the_cpu(tmp_path, mesh):
    trainer, steps = _trainer(tmp_path / "xla", mesh)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*new batch shape")  # none: every batch is [8, 64]
        trainer.train()
    compiles = [b.compiles - a.compiles for a, b in zip(steps.at_begin, steps.at_begin[1:])]
    assert compiles[2:] == [0] * (STEPS - 3), compiles  # the step's programs compiled by step 3, never again
    assert trainer._shapes.seen == {(8, 64)}
    reference = cpu_reference("llama", tmp_path / "cpu", InOrder(_rows()), collator="pad_batch", max_steps=STEPS,
                              logging_steps=1, save_strategy="no")
    assert losses(trainer) == pytest.approx(reference.losses, rel=1e-5)


def test_without_buckets_a_new_shape_after_warm_up_warns_once_naming_it(tmp_path, mesh):
    trainer, _ = _trainer(tmp_path, mesh, pad_to_multiple_of=None)
    with pytest.warns(UserWarning, match=r"new batch shape \(8, 37\) at training step 3") as caught:
        trainer.train()
    assert len([w for w in caught if "new batch shape" in str(w.message)]) == 1
    assert trainer._shapes.seen == {(8, n) for n in (9, 23, 37, 60, 17, 29)}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loader's thread
def test_a_column_along_the_sequence_with_no_known_padding_is_refused(tmp_path, mesh):
    def with_extra(rows):
        batch = pad_batch(rows)
        return {**batch, "loss_weights": batch["attention_mask"].float()}

    trainer = SPMDTrainer(model=prepare(tiny("llama"), mesh), train_dataset=InOrder(_rows()), data_collator=with_extra,
                          args=arguments(tmp_path, max_steps=1, save_strategy="no"))
    with pytest.raises(ValueError, match=r"column 'loss_weights' \(8, 9\).*pad_to_multiple_of=None"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the loader's thread
def test_a_collators_error_on_the_loaders_thread_reaches_train(tmp_path, mesh):
    # torch_xla's prefetching loader thread died with it, and train() returned after 0 steps with no error.
    def broken(rows):
        raise KeyError("the collator's own bug")

    trainer = SPMDTrainer(model=prepare(tiny("llama"), mesh), train_dataset=InOrder(_rows()), data_collator=broken,
                          args=arguments(tmp_path, max_steps=2, save_strategy="no"), pad_to_multiple_of=None)
    with pytest.raises(KeyError, match="the collator's own bug"):
        trainer.train()


@pytest.mark.parametrize("value", [0, -64, 8.0, True])
def test_a_bad_multiple_is_refused(tmp_path, mesh, value):
    with pytest.raises(ValueError, match="pad_to_multiple_of must be a positive int or None"):
        SPMDTrainer(model=prepare(tiny("llama"), mesh), args=arguments(tmp_path), pad_to_multiple_of=value)


def _batch(**columns):
    return lambda rows: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in columns.items()}


def test_the_padding_values_keep_the_loss_and_the_positions():
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    pad = BucketPadding(_batch(input_ids=ids, attention_mask=torch.ones(2, 3, dtype=torch.long), labels=ids,
                               position_ids=torch.tensor([[0, 1, 0], [0, 1, 2]])), 4, pad_token_id=3, causal=False)
    out = pad([])
    assert out["input_ids"].tolist() == [[5, 6, 7, 3], [8, 9, 10, 3]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 0]]
    assert out["labels"].tolist() == [[5, 6, 7, -100], [8, 9, 10, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 2, 3]]


def test_a_batch_whose_padding_something_would_read_is_left_as_it_is_with_one_warning():
    ids = torch.tensor([[5, 6, 7]])
    masked_label = BucketPadding(_batch(input_ids=ids, attention_mask=torch.tensor([[0, 1, 1]]), labels=ids), 4,
                                 None, causal=True)
    with pytest.warns(UserWarning, match="labels at positions the attention_mask excludes"):
        assert masked_label([])["input_ids"].shape == (1, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert masked_label([])["input_ids"].shape == (1, 3)  # warned once
    no_mask = _batch(input_ids=ids, labels=ids)
    with pytest.warns(UserWarning, match="no attention_mask and the model is not a causal LM"):
        assert BucketPadding(no_mask, 4, None, causal=False)([])["input_ids"].shape == (1, 3)
    assert BucketPadding(no_mask, 4, None, causal=True)([])["input_ids"].shape == (1, 4)  # attends backwards only


def test_no_batch_is_padded_past_the_models_positions():
    ids = torch.arange(70).reshape(1, 70)
    batch = _batch(input_ids=ids, attention_mask=torch.ones(1, 70, dtype=torch.long), labels=ids)
    assert BucketPadding(batch, 64, None, causal=True, max_length=100)([])["input_ids"].shape == (1, 100)
    assert BucketPadding(batch, 64, None, causal=True, max_length=None)([])["input_ids"].shape == (1, 128)



def test_a_padding_free_row_has_its_last_sequence_run_on_into_the_padding():
    """TRL's packing: sequences of 2 and 3 tokens in one row, their boundaries for varlen kernels beside it."""
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    bounds = torch.tensor([0, 2, 5], dtype=torch.int32)
    batch = dict(input_ids=ids, labels=torch.tensor([[-100, 6, -100, 8, 9]]),
                 position_ids=torch.tensor([[0, 1, 0, 1, 2]]), seq_idx=torch.tensor([[0, 0, 1, 1, 1]]),
                 cu_seq_lens_q=bounds, cu_seq_lens_k=bounds, max_length_q=3, max_length_k=3)
    out = BucketPadding(lambda rows: batch, 8, pad_token_id=3, causal=True)([])
    assert out["input_ids"].tolist() == [[5, 6, 7, 8, 9, 3, 3, 3]]
    assert out["labels"].tolist() == [[-100, 6, -100, 8, 9, -100, -100, -100]]
    assert out["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3, 4, 5]]
    assert out["seq_idx"].tolist() == [[0, 0, 1, 1, 1, 1, 1, 1]]
    for side in ("q", "k"):
        assert out[f"cu_seq_lens_{side}"].tolist() == [0, 2, 8] and out[f"max_length_{side}"] == 6
    assert bounds.tolist() == [0, 2, 5]  # the collator's own tensor is left as it was
