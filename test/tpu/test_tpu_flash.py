"""tpu-fit's flash attention: torch_xla's Pallas kernel lowered for the TPU, looped and scanned, and its glue.

The kernel itself runs only on a TPU. What is checked here: the steps that
use it lower on this machine (the kernel lowered for the TPU platform) and
compile for a TPU slice, and the attention function around it (grouped
query heads, layout, scale, refusals) computes the model's own attention,
with a causal softmax standing in for the kernel.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

from child_process import run_child

pytest.importorskip("libtpu")

# Head dim 128 and 512 tokens: the kernel's smallest blocks. Two query heads share one key/value head.
SMALL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 256, "max_position_embeddings": 1024}


def test_flash_steps_lower_the_kernel_for_the_tpu_and_compile_for_a_slice():
    source = textwrap.dedent(f"""
        import dataclasses, json, os
        import torch_xla
        from torch_xla_ext import tpu
        from torch_xla_ext.tpu._fit_step import compile_step

        lower_for_tpu, kernels = tpu._lower, []

        def counting(outputs, topology, donated, widen):  # the step's TPU kernels, as its HLO names them
            hlo = torch_xla._XLAC._get_xla_tensors_hlo(list(outputs) + [after for _, after in donated])
            kernels.append(hlo.count('custom_call_target="tpu_custom_call"'))
            return lower_for_tpu(outputs, topology, donated, widen)

        tpu._lower = counting
        for path in ("loop", "scan+nothing_saveable"):
            for attention in (None, "flash"):
                r = compile_step({SMALL!r}, "v5e:2x4", batch=16, seq=512, path=path, attention=attention)
                print(json.dumps({{**dataclasses.asdict(r), "kernels": kernels[-1]}}), flush=True)
        try:
            compile_step({SMALL!r}, "v5e:2x4", batch=16, seq=512, path="loop", attention="flash",
                         from_shapes=False)
        except ValueError as error:
            print("refused:", error, flush=True)
        os._exit(0)
    """)
    proc = run_child(["-c", source], devices=8, env={"TF_CPP_MIN_LOG_LEVEL": "2"})
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [(r["path"], r["attention"]) for r in reports] == [
        ("loop", None), ("loop", "flash"), ("scan+nothing_saveable", None), ("scan+nothing_saveable", "flash")]
    for r in reports:
        assert r["error"] is None and r["compiled"]["fits"], r
    # Per layer, the forward kernel and the backward's two (dq; dk and dv): two layers unrolled, and the
    # scanned layer once in each loop body (the forward, and the backward with the forward recomputed).
    assert [r["kernels"] for r in reports] == [0, 6, 0, 4]
    assert reports[3]["compiled"]["trip_counts"] == [2, 2]  # the scanned step kept its loops
    assert "refused: tpu_fit: attention='flash' is shape-only" in proc.stdout


def _causal_softmax_kernel(calls: list):
    """A stand-in for torch_xla's flash_attention: causal softmax attention, every head its own k and v."""
    def kernel(q, k, v, causal=False, q_segment_ids=None, kv_segment_ids=None, sm_scale=1.0, *, ab=None,
               partition_spec=None, mesh=None):
        calls.append((tuple(q.shape), tuple(k.shape), causal, sm_scale, partition_spec))
        scores = (q @ k.transpose(-1, -2)) * sm_scale
        s = q.shape[-2]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        return scores.softmax(-1) @ v

    return kernel


def _attention_module(heads: int, kv_heads: int, dim: int):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention

    config = LlamaConfig(hidden_size=heads * dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=dim, attn_implementation="eager")
    return LlamaAttention(config, layer_idx=0).eval()


def test_the_attention_function_computes_the_models_causal_attention(mesh, monkeypatch):
    from torch_xla.experimental import custom_kernel
    from transformers.models.llama.modeling_llama import eager_attention_forward

    from torch_xla_ext.tpu._flash import flash_attention_forward, flash_lowered_for_tpu

    calls: list = []
    gen = torch.Generator().manual_seed(0)
    b, heads, kv_heads, s, d = 2, 6, 2, 5, 8
    module = _attention_module(heads, kv_heads, d)
    q = torch.randn(b, heads, s, d, generator=gen)
    k, v = (torch.randn(b, kv_heads, s, d, generator=gen) for _ in range(2))
    causal = torch.full((s, s), torch.finfo(torch.float32).min).triu(1).expand(b, 1, s, s)
    want, _ = eager_attention_forward(module, q, k, v, causal, scaling=0.3)
    with flash_lowered_for_tpu(mesh, "fsdp"):
        monkeypatch.setattr(custom_kernel, "flash_attention", _causal_softmax_kernel(calls))
        got, weights = flash_attention_forward(module, q, k, v, None, scaling=0.3)
        default, _ = flash_attention_forward(module, q, k, v, None)
    assert weights is None and got.shape == want.shape == (b, s, heads, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert calls[0] == ((b, heads, s, d), (b, heads, s, d), True, 0.3, ("fsdp", None, None, None))
    assert calls[1][3] == d ** -0.5 and default.shape == want.shape


def test_what_the_kernel_would_not_compute_is_refused(mesh):
    from torch_xla_ext.tpu._flash import flash_attention_forward, flash_lowered_for_tpu

    module = _attention_module(2, 1, 8)
    q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="only for a step lowered inside"):
        flash_attention_forward(module, q, k, k, None)
    with pytest.raises(ValueError, match="the mesh has no axis 'data'"):
        with flash_lowered_for_tpu(mesh, "data"):
            pass
    with flash_lowered_for_tpu(mesh, "fsdp"):
        with pytest.raises(ValueError, match="has an attention mask"):
            flash_attention_forward(module, q, k, k, torch.zeros(1, 1, 4, 4))
        with pytest.raises(ValueError, match="has a sliding window"):
            flash_attention_forward(module, q, k, k, None, sliding_window=2)
        module.train()
        with pytest.raises(ValueError, match="has dropout"):
            flash_attention_forward(module, q, k, k, None, dropout=0.1)
        with pytest.raises(RuntimeError, match="already entered"):
            with flash_lowered_for_tpu(mesh, "fsdp"):
                pass
    from torch_xla.experimental import custom_kernel

    assert custom_kernel.trace_pallas.__module__ == "torch_xla.experimental.custom_kernel"  # restored


def test_fit_refuses_an_unknown_attention_before_any_child_starts():
    from torch_xla_ext.tpu.fit import fit

    with pytest.raises(ValueError, match="attention must be one of sdpa, eager, flash or None, got 'pallas'"):
        fit(SMALL, "v5e:2x4", batch=16, seq=512, paths=["loop"], attention="pallas")
    with pytest.raises(ValueError, match="attention='flash' needs a slice of fewer than 128 chips, got 256"):
        fit(SMALL, "v5p:8x8x4", batch=256, seq=512, paths=["loop"], attention="flash")
