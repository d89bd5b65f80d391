"""Mixture-of-experts models (Mixtral, Qwen3-MoE) through ``prepare``: scanned, on the device, as on the CPU.

transformers' default experts implementation counts each expert's tokens
with ``torch.histc`` (a host read; a scanned stack refuses it, and
torch_xla has no integer ``histc``). ``prepare`` selects the package's
device-side one (``xla_dense``: every expert on every token, combined by the
router's weights), whose result is the routed sum the model's own forward
computes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch_xla
import transformers

import torch_xla_ext as txe
from torch_xla_ext.hf import SPMDTrainer, prepare
from torch_xla_ext.hf._moe import DENSE, dense_experts_forward, expert_modules
from torch_xla_ext.testing.tolerances import tolerance

from hf_tiny import arguments, tiny, token_rows
from hf_trainer_helpers import StepCounts, cpu_reference, losses

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Trainer's and accelerate's xm.mark_step
    pytest.mark.filterwarnings("ignore:.*torch.distributed is disabled"),
]

STEPS = 6


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe"])
def test_moe_trains_scanned_through_prepare_as_on_the_cpu_reading_nothing(tmp_path, mesh, kind):
    model = prepare(tiny(kind), mesh, scan=True)
    assert {m.config._experts_implementation for _, m in expert_modules(model)} == {DENSE}
    train = token_rows(32, 16)
    steps = StepCounts()
    trainer = SPMDTrainer(model=model, args=arguments(tmp_path / "xla", max_steps=STEPS, logging_steps=1,
                                                      save_strategy="no"), train_dataset=train, callbacks=[steps])
    trainer.train()
    reference = cpu_reference(kind, tmp_path / "cpu", train, max_steps=STEPS, logging_steps=1, save_strategy="no")
    assert reference.losses[-1] < reference.losses[0] - 0.1  # it trains
    assert losses(trainer) == pytest.approx(reference.losses, rel=1e-5)
    assert [(m.d2h, m.gathers) for m in steps.inside[1:]] == [(0, 0)] * (STEPS - 1)


def _experts(kind: str) -> torch.nn.Module:
    if kind != "gpt_oss":
        return next(m for _, m in expert_modules(tiny(kind)))
    # GPT-OSS's experts: biases, transposed weights, gate and up interleaved, a clamped gate of its own
    config = transformers.GptOssConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=128,
                                       num_local_experts=4, num_experts_per_tok=2)
    experts = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts(config)
    assert experts.has_bias and experts.is_transposed and not experts.is_concatenated
    return experts


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_the_dense_experts_give_the_routed_sum_and_its_gradients(kind):
    """On the CPU, against the model's own eager experts: values and every gradient (router weights included)."""
    experts = _experts(kind)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.2)
    mine = copy.deepcopy(experts)
    experts.config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(1)
    # down_proj is [experts, hidden, intermediate] ([experts, intermediate, hidden] transposed)
    width, inner = experts.down_proj.shape[1:][::-1] if experts.is_transposed else experts.down_proj.shape[1:]
    hidden = torch.randn(24, width, generator=g, requires_grad=True)
    index = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(24)])
    weights = torch.rand(24, 2, generator=g).softmax(-1).requires_grad_()
    want = experts(hidden, index, weights)
    got = dense_experts_forward(mine, hidden, index, weights)
    # each output sums 2 experts' down projections of the intermediate width
    tol = tolerance(torch.float32, 2 * inner, scale=float(want.abs().mean()))
    torch.testing.assert_close(got, want, **tol)
    cotangent = torch.randn(want.shape, generator=g)
    want_grads = torch.autograd.grad(want, [hidden, weights, *experts.parameters()], cotangent)
    got_grads = torch.autograd.grad(got, [hidden, weights, *mine.parameters()], cotangent)
    for w, m in zip(want_grads, got_grads):
        torch.testing.assert_close(m, w, **tolerance(torch.float32, 24 * inner,
                                                     scale=float(w.abs().mean())))


def test_experts_that_cannot_run_on_the_device_are_refused_before_anything_changes(mesh):
    split = tiny("mixtral")
    next(m for _, m in expert_modules(split))._is_expert_parallel = True
    with pytest.raises(ValueError, match="expert parallelism"):
        prepare(split, mesh)
    kernels = tiny("mixtral")
    next(m for _, m in expert_modules(kernels)).config._experts_implementation = "sonicmoe"
    with pytest.raises(ValueError, match="sonicmoe"):
        prepare(kernels, mesh)
    assert next(kernels.parameters()).device.type == "cpu"  # nothing moved
    assert isinstance(kernels, transformers.MixtralForCausalLM) and not hasattr(kernels, "_txe_prepared")


def test_every_layers_router_logits_are_refused_by_a_scanned_stack(mesh):
    """The load-balancing loss reads every layer's router logits, which one scan cannot hand out."""
    model = prepare(tiny("mixtral"), mesh, scan=True)
    ids = torch.randint(0, 128, (8, 16)).to(torch_xla.device())
    with pytest.raises(txe.ScanInputError, match="output_router_logits"):
        model(input_ids=ids, labels=ids, output_router_logits=True)
