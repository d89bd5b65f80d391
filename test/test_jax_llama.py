"""scripts/jax_llama.py, the JAX reference tpu-fit is sized against, computes what the torch model computes.

On the CPU, in float32: the loss and every gradient of ``LlamaForCausalLM``
(``labels=input_ids``) and two ``torch.optim.AdamW`` steps, against the
reference's, for an untied model and for a tied one with Llama 3's rotary
scaling. Then the reference compiles for a TPU topology and is read as
tpu-fit reads its own step.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

jax = pytest.importorskip("jax")
jax_llama = pytest.importorskip("jax_llama")

from torch_xla_ext.testing.tolerances import tolerance  # noqa: E402

CONFIGS = {
    "untied": dict(tie_word_embeddings=False),
    "tied_llama3_rope": dict(tie_word_embeddings=True, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8}),
}


def _config(**extra):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       rope_theta=10000.0, attn_implementation="eager", **extra)


def _torch_model(config, params: dict[str, np.ndarray]):
    """The torch model holding the reference's parameters (its stacked layers split per layer)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(config).float()
    state = {}
    for name, value in params.items():
        if name.startswith("layers."):
            for i in range(config.num_hidden_layers):
                state[f"model.layers.{i}.{name[len('layers.'):]}"] = torch.from_numpy(value[i].copy())
        elif name == "lm_head.weight":
            state[name] = torch.from_numpy(value.copy())
        else:
            state[f"model.{name}"] = torch.from_numpy(value.copy())
    if config.tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    missing = set(model.state_dict()) - set(state)
    assert not missing, missing
    model.load_state_dict(state, strict=True)
    return model


def _torch_grad(model, name: str, config) -> np.ndarray:
    """The torch gradient of the reference's parameter ``name`` (stacked like it for a layer's)."""
    if name.startswith("layers."):
        local = name[len("layers."):]
        return np.stack([model.get_parameter(f"model.layers.{i}.{local}").grad.numpy()
                         for i in range(config.num_hidden_layers)])
    return model.get_parameter(name if name == "lm_head.weight" else f"model.{name}").grad.numpy()


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_loss_and_gradients_equal_the_torch_model(case):
    config = _config(**CONFIGS[case])
    shapes = jax_llama.shapes_of(config)
    params = jax_llama.init_params(shapes, seed=1)
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, config.vocab_size, size=(2, 16)).astype(np.int32)

    model = _torch_model(config, params)
    out = model(input_ids=torch.from_numpy(tokens).long(), labels=torch.from_numpy(tokens).long())
    out.loss.backward()
    loss, grads = jax_llama.loss_and_grads(shapes, params, tokens)

    # The longest accumulation feeding one value: the layers' matmuls chained (hidden + intermediate each),
    # then the vocabulary's log-sum-exp and the mean over the predicted tokens.
    depth = config.num_hidden_layers * (config.hidden_size + config.intermediate_size) + config.vocab_size + 32
    torch.testing.assert_close(float(loss), out.loss.item(), **tolerance(torch.float32, depth))
    assert set(grads) == set(params)
    for name in params:
        expected = torch.from_numpy(_torch_grad(model, name, config))
        scale = float(expected.square().mean().sqrt()) or 1.0
        torch.testing.assert_close(torch.from_numpy(np.array(grads[name])), expected,
                                   **tolerance(torch.float32, depth, scale=scale), msg=name)


def test_attention_equals_torch_causal_grouped_sdpa():
    """``jax_llama.attention`` (what ``attention_hbm.py`` sizes beside HF's sdpa) against
    ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``: output and the three input gradients."""
    batch, seq, kv_heads, group, head_dim = 2, 9, 2, 3, 8
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in
               ((batch, seq, kv_heads, group, head_dim), (batch, seq, kv_heads, head_dim),
                (batch, seq, kv_heads, head_dim)))
    grad_out = rng.standard_normal(q.shape).astype(np.float32)

    def torch_layout(x) -> torch.Tensor:  # [b, s, kv, group, d] or [b, s, kv, d] -> [b, heads, s, d]
        x = torch.from_numpy(np.array(x))  # query head kv * group + g in KV head kv, as enable_gqa groups them
        return (x.flatten(2, -2) if x.ndim == 5 else x).transpose(1, 2)

    out, pullback = jax.vjp(jax_llama.attention, q, k, v)
    grads = pullback(grad_out)

    tq, tk, tv = (torch_layout(x).requires_grad_() for x in (q, k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
    expected_grads = torch.autograd.grad(expected, (tq, tk, tv), torch_layout(grad_out))

    # the longest accumulation: a score (head_dim terms), the softmax's row (seq), the weighted sum (seq)
    tol = tolerance(torch.float32, head_dim + 2 * seq)
    torch.testing.assert_close(torch_layout(out), expected, **tol)
    for name, got, want in zip("qkv", grads, expected_grads):
        torch.testing.assert_close(torch_layout(got), want, **tol, msg=name)
    # the causal mask is there: the first position attends to itself only
    torch.testing.assert_close(torch_layout(out)[:, :, 0], tv[:, :, 0].detach().repeat_interleave(group, dim=1), **tol)


def test_adamw_equals_torch_adamw_over_two_steps():
    rng = np.random.default_rng(3)
    shapes = {"a": (5, 7), "b": (11,)}
    params = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    grads = [{k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()} for _ in range(2)]

    tensors = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in params.items()}
    lr, decay = 0.1, 0.2  # large enough that the decay and every step are far above float32's rounding
    optimizer = torch.optim.AdamW(tensors.values(), lr=lr, weight_decay=decay, foreach=False)
    p, m, v = params, {k: np.zeros_like(x) for k, x in params.items()}, {k: np.zeros_like(x) for k, x in params.items()}
    for step, g in enumerate(grads, start=1):
        for k, t in tensors.items():
            t.grad = torch.from_numpy(g[k].copy())
        optimizer.step()
        p, m, v = jax_llama.adamw(p, g, m, v, step, lr=lr, weight_decay=decay)
        for k, t in tensors.items():
            state = optimizer.state[t]
            torch.testing.assert_close(torch.from_numpy(np.array(p[k])), t.detach(), **tolerance(torch.float32, 4))
            torch.testing.assert_close(torch.from_numpy(np.array(m[k])), state["exp_avg"],
                                       **tolerance(torch.float32, 4))
            torch.testing.assert_close(torch.from_numpy(np.array(v[k])), state["exp_avg_sq"],
                                       **tolerance(torch.float32, 4))


def test_the_reference_refuses_what_it_does_not_write():
    from transformers import MistralConfig

    with pytest.raises(ValueError, match="reference is Llama's"):
        jax_llama.shapes_of(MistralConfig())
    with pytest.raises(ValueError, match="attention_bias=False"):
        jax_llama.shapes_of(_config(attention_bias=True))


def test_the_reference_compiles_for_a_tpu_slice_with_its_state_donated():
    pytest.importorskip("libtpu")
    config = _config(tie_word_embeddings=False)
    shapes = jax_llama.shapes_of(config)
    n = sum(int(np.prod(v)) for v in jax_llama.param_shapes(shapes).values())
    compiled = jax_llama.compile_for(config, "v5e:2x4", batch=8, seq=32, path="scan+nothing_saveable")
    # Parameters and both AdamW moments, fp32 and sharded over the 8 chips, are arguments and reuse their
    # buffers (the TPU's tiled layouts may pad a small shard, never shrink one); the int32 tokens are not donated.
    assert compiled.alias_bytes >= 3 * 4 * n // 8
    assert compiled.argument_bytes >= compiled.alias_bytes + 8 * 32 * 4 // 8
    assert config.num_hidden_layers in compiled.trip_counts  # one loop over the stacked layers
    assert compiled.fits and compiled.hbm_used_bytes > compiled.argument_bytes
    with pytest.raises(ValueError, match="not a scan path"):
        jax_llama.compile_for(config, "v5e:2x4", batch=8, seq=32, path="loop")
