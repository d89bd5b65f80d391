"""Hugging Face causal LMs trained with fully_shard, with and without scan_decoder_layers, against CPU eager.

Tiny random configs (no download). Every layer and the root are fully
sharded over 8 devices; AdamW runs 5 steps on batches whose left padding
(the attention mask) changes every step. The losses must match the same model
trained on the CPU, no step after the first may move data device->host, and
no step after the second may compile.
"""

from __future__ import annotations

import contextlib
import copy
import inspect

import pytest
import torch
import torch_xla
import transformers

import torch_xla_ext as txe
from torch_xla_ext.distributed import fully_shard
from torch_xla_ext.hf import ScannedLayers, causal_mask, scan_decoder_layers
from torch_xla_ext.scan import scan_cache_info
from torch_xla_ext.testing import measure_transfers

from hf_batches import padded_batches

STEPS, BATCH, SEQ, VOCAB = 5, 8, 12, 128


def _model(kind: str, attention: str = "eager") -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation=attention)
        return transformers.LlamaForCausalLM(config)
    config = transformers.GPT2Config(
        n_embd=64, n_layer=3, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, attn_implementation=attention)
    return transformers.GPT2LMHeadModel(config)


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.model.layers if hasattr(model, "model") else model.transformer.h


def _batches():
    return padded_batches(STEPS, BATCH, SEQ, VOCAB)


def _train_step(model, optimizer, ids, mask):
    loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


@pytest.mark.parametrize("scanned", [False, True], ids=["loop", "scan"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_fully_sharded_training_matches_cpu_eager(kind, scanned, mesh):
    cpu = _model(kind)
    model = copy.deepcopy(cpu)
    keys = list(model.state_dict())
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if scanned:
        assert isinstance(scan_decoder_layers(model), ScannedLayers)
    assert list(model.state_dict()) == keys
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cpu_optimizer = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    device = torch_xla.device()
    scans = scan_cache_info()
    for step, (ids, mask) in enumerate(_batches()):
        expected = _train_step(cpu, cpu_optimizer, ids, mask).item()
        ids_d, mask_d = ids.to(device), mask.to(device)
        torch_xla.sync()
        # From step 2 on nothing may compile: the recompile guard names what changed if something does.
        with measure_transfers() as moved, (txe.no_recompiles() if step >= 2 else contextlib.nullcontext()):
            loss = _train_step(model, optimizer, ids_d, mask_d)
            torch_xla.sync()
        if step >= 1:
            assert not moved.device_to_host, (step, moved.report())
        assert loss.item() == pytest.approx(expected, rel=1e-5), step
    after = scan_cache_info()
    assert (after.traces + after.hits) - (scans.traces + scans.hits) == (STEPS if scanned else 0)
    if kind == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight


def test_a_fully_sharded_model_shows_transformers_its_own_forward(mesh):
    # Trainer keeps only the batch columns that inspect.signature(model.forward) names, and finds
    # the label arguments with find_labels: a (*args, **kwargs) forward made it drop every input.
    from transformers.utils import find_labels

    cpu = _model("llama")
    model = copy.deepcopy(cpu)
    for layer in _layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert inspect.signature(model.forward) == inspect.signature(cpu.forward)
    assert {"input_ids", "attention_mask", "labels"} <= set(inspect.signature(model.forward).parameters)
    assert find_labels(type(model)) == find_labels(type(cpu)) == ["labels"]
    assert inspect.signature(_layers(model)[0].forward) == inspect.signature(_layers(cpu)[0].forward)


def test_scan_decoder_layers_refuses_what_a_scan_cannot_keep(device):
    model = _model("llama").to(device)
    stack = scan_decoder_layers(model)
    ids = torch.randint(0, VOCAB, (2, 6)).to(device)
    with pytest.raises(txe.ScanInputError, match="KV cache"):
        model(input_ids=ids, use_cache=True)
    with pytest.raises(txe.ScanInputError, match="every layer's output"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, output_hidden_states=True)
    with pytest.raises(txe.ScanInputError, match="already scanned"):
        scan_decoder_layers(model)
    # Outside the model's forward the stack is a plain list of the layers.
    assert len(list(stack)) == 3 and stack[1] is model.model.layers[1]
    with torch.no_grad():
        mask = torch.ones_like(ids)
        scanned = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert type(stack.unscan()) is torch.nn.ModuleList
        looped = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(scanned.cpu(), looped.cpu(), rtol=1e-5, atol=1e-5)


def test_scan_decoder_layers_refuses_mixed_layer_kinds_and_unclear_stacks(device):
    config = transformers.Qwen2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=VOCAB, use_sliding_window=True, sliding_window=4, max_window_layers=1,
        layer_types=["full_attention", "sliding_attention"])  # no period shorter than the stack
    with pytest.raises(txe.ScanInputError, match="mixes layer kinds"):
        scan_decoder_layers(transformers.Qwen2ForCausalLM(config))
    two = torch.nn.Module()
    two.a = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))
    two.b = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(2))
    with pytest.raises(txe.ScanInputError, match=r"candidates: \['a', 'b'\]"):
        scan_decoder_layers(two)
    assert isinstance(scan_decoder_layers(two, two.b), ScannedLayers)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_causal_mask_gives_the_models_own_attention_and_moves_nothing_to_the_host(device, attention):
    # With a 2-D mask, HF's sdpa mask code reads it on the host; the 4-D mask is used as given. The
    # reference is the model's own mask, built from the 2-D one on the CPU: every logit, padded rows
    # included (left padding with labels=input_ids puts the last padded row's prediction in the loss).
    cpu = _model("llama", attention)
    model = copy.deepcopy(cpu).to(device)
    scan_decoder_layers(model)
    ids, mask = next(_batches())
    own = cpu(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
    ids_d, mask_d = ids.to(device), mask.to(device)
    torch_xla.sync()
    with txe.no_host_transfers():
        out = model(input_ids=ids_d, attention_mask=causal_mask(mask_d, model=model), labels=ids_d, use_cache=False)
        torch_xla.sync()
    torch.testing.assert_close(out.logits.cpu(), own.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss.cpu(), own.loss, rtol=1e-5, atol=1e-5)
    with pytest.raises(txe.ScanInputError, match=r"\[batch, seq\]"):
        causal_mask(mask_d[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_causal_mask_for_a_model_gives_exactly_its_own_loss_with_left_padding(attention, dtype):
    # Before, causal_mask was additive for every model: under sdpa a padded row then attended uniformly
    # to every key instead of giving zeros, and the loss moved (tiny Llama: 4.8834 against its own 4.8697).
    model = _model("llama", attention).to(dtype)
    ids, mask = next(_batches())
    mask[0, :5] = 0  # left padding: rows with nothing to attend to
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False)
        ours = model(input_ids=ids, attention_mask=causal_mask(mask, model=model), labels=ids, use_cache=False)
    assert torch.equal(ours.loss, own.loss) and torch.equal(ours.logits, own.logits)
    built = causal_mask(mask, model=model)
    assert built.dtype == (torch.bool if attention == "sdpa" else dtype)


def test_causal_mask_refuses_an_attention_it_does_not_build():
    model = _model("llama")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(txe.ScanInputError, match="'flash_attention_2'.*2-D padding mask"):
        causal_mask(torch.ones(1, 4, dtype=torch.long), model=model)


def _mistral(window: int) -> torch.nn.Module:
    config = transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, sliding_window=window, attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.MistralForCausalLM(config).eval()


def test_causal_mask_keeps_a_sliding_window_past_its_length(device):
    """A tiny Mistral (window 4) at 16 tokens with left padding: the 4-D mask gives the model's own result."""
    model = _mistral(4)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 16), generator=g)
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, use_cache=False).logits  # HF builds the windowed mask
        windowed = model(input_ids=ids, attention_mask=causal_mask(mask, sliding_window=4), use_cache=False).logits
        full = model(input_ids=ids, attention_mask=causal_mask(mask), use_cache=False).logits
    rows = mask.bool()  # padded positions' logits are not meaningful
    torch.testing.assert_close(windowed[rows], own[rows], rtol=1e-5, atol=1e-5)
    assert (full[rows] - own[rows]).abs().max() > 1e-2  # without the window: another model

    xla_model = copy.deepcopy(model).to(device)
    scan_decoder_layers(xla_model)
    with torch.no_grad():
        scanned = xla_model(input_ids=ids.to(device), attention_mask=causal_mask(mask.to(device), sliding_window=4),
                            use_cache=False).logits.cpu()
        with pytest.raises(txe.ScanInputError, match=r"sliding_window = 4.*causal_mask\(mask, sliding_window=4\)"):
            xla_model(input_ids=ids.to(device), attention_mask=causal_mask(mask.to(device)), use_cache=False)
        with pytest.raises(txe.ScanInputError, match="was not built by causal_mask"):
            xla_model(input_ids=ids.to(device), attention_mask=causal_mask(mask.to(device), 4) * True,
                      use_cache=False)
    torch.testing.assert_close(scanned[rows], own[rows], rtol=1e-4, atol=1e-4)


def test_causal_mask_refuses_a_bad_window():
    with pytest.raises(txe.ScanInputError, match="sliding_window must be a positive int"):
        causal_mask(torch.ones(1, 4), sliding_window=0)


def _stacked_per_layer(model: torch.nn.Module) -> int:
    """How many activations the forward loop of the model's (one) scanned plan stacks for the backward."""
    from torch_xla_ext._scan import cache

    (plan,) = [p for p in cache._cache[model.model.layers[0]].values() if p.grad is not None]
    return plan.grad.num_stacked


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
@pytest.mark.parametrize("switch", ["activation_checkpointing_enable", "gradient_checkpointing_enable"])
def test_activation_checkpointing_recomputes_the_scanned_layers(device, switch):
    cpu = _model("llama").train()
    plain, checkpointed = (copy.deepcopy(cpu).to(device) for _ in range(2))
    for model in (plain, checkpointed):
        scan_decoder_layers(model)
    # transformers 5 names the switch activation_checkpointing_enable (gradient_checkpointing_enable: its alias)
    getattr(checkpointed, switch)()
    ids, mask = next(_batches())
    ids_d, mask_d = ids.to(device), causal_mask(mask.to(device))
    losses, grads = [], []
    for model in (plain, checkpointed):
        loss = model(input_ids=ids_d, attention_mask=mask_d, labels=ids_d, use_cache=False).loss
        loss.backward()
        torch_xla.sync()  # one program for the loss and every gradient
        losses.append(loss.detach().cpu())
        grads.append([p.grad.cpu() for p in model.parameters()])
    ref = cpu(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
    ref.backward()
    torch.testing.assert_close(losses[0], ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for (name, _), a, b, c in zip(cpu.named_parameters(), grads[0], grads[1], cpu.parameters()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")
        torch.testing.assert_close(a, c.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    # Checkpointing stacks only each layer's input; the plain scan keeps the activations.
    assert _stacked_per_layer(checkpointed) < _stacked_per_layer(plain)
    assert all(layer.gradient_checkpointing for layer in checkpointed.model.layers)  # the switch is left on
