"""LoRA fine-tuning of a tiny Hugging Face Llama through the README recipe: base frozen, adapters trained.

Hand-made adapters (``peft`` is not a dependency) on every layer's ``q_proj``
and ``v_proj``; everything else frozen. The model is fully sharded per layer
and at the root, its decoder layers scanned, trained with AdamW on batches
whose left padding changes; it must match the same model trained on the CPU
(losses, the adapters' gradients and values), the base weights must not move,
and no step may move data to the host.
"""

from __future__ import annotations

import copy

import torch
import torch_xla
import transformers
from torch import nn

import torch_xla_ext as txe
from torch_xla_ext.distributed import fully_shard
from torch_xla_ext.hf import causal_mask, scan_decoder_layers
from torch_xla_ext.testing.tolerances import tolerance

from hf_batches import padded_batches

STEPS, BATCH, SEQ, VOCAB, HIDDEN, RANK = 3, 8, 12, 128, 64, 4
# Longest accumulation per step (projections, attention over the sequence, MLP, head, softmax, token mean).
TOL = tolerance(torch.float32, STEPS * (2 * (4 * HIDDEN + SEQ + 128) + HIDDEN + VOCAB + BATCH * SEQ))


class LoRALinear(nn.Module):
    """``base(x) + scale * x A^T B^T`` with ``base`` frozen."""

    def __init__(self, base: nn.Linear, rank: int = RANK, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


def _lora_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return model


def test_lora_fine_tune_through_the_recipe_matches_cpu_eager(mesh):
    cpu = _lora_llama()
    model = copy.deepcopy(cpu)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    scan_decoder_layers(model)
    adapters = [n for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    base = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if not p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    cpu_optimizer = torch.optim.AdamW([p for p in cpu.parameters() if p.requires_grad], lr=1e-2)
    device = torch_xla.device()
    for step, (ids, mask) in enumerate(padded_batches(STEPS, BATCH, SEQ, VOCAB)):
        expected = cpu(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
        expected.backward()
        ids_d, mask_d = ids.to(device), mask.to(device)
        torch_xla.sync()
        with txe.no_host_transfers() if step >= 1 else txe.transfer_guard("allow"):
            loss = model(input_ids=ids_d, attention_mask=causal_mask(mask_d, model=model), labels=ids_d,
                         use_cache=False).loss
            loss.backward()
            torch_xla.sync()
        torch.testing.assert_close(loss.cpu(), expected.detach(), **TOL)
        if step == 0:  # the adapters' gradients, before any update
            for name in adapters:
                torch.testing.assert_close(model.get_parameter(name).grad.cpu(), cpu.get_parameter(name).grad,
                                           **TOL, msg=lambda m, name=name: f"{name}: {m}")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cpu_optimizer.step()
        cpu_optimizer.zero_grad(set_to_none=True)
        torch_xla.sync()
    for name, p in model.named_parameters():
        if name in base:
            torch.testing.assert_close(p.detach().cpu(), base[name], rtol=0, atol=0, msg=name)  # did not move
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.detach().cpu(), cpu.get_parameter(name).detach(), **TOL, msg=name)
