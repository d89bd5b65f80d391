"""The autocast rule torch_xla 2.9 lacks: ``scaled_dot_product_attention`` under ``torch.autocast("xla")``.

CUDA's autocast casts the query, key and value of
``F.scaled_dot_product_attention`` to the autocast dtype; torch_xla registers
no such rule for the XLA device, so the op falls through autocast with its
inputs as they come. A rotary model's attention then fails in its first
step: the query and key leave the rotary embedding in float32 (its cos/sin
are float32), the value leaves an autocast ``Linear`` in bfloat16, and
PyTorch refuses ``Expected query, key, and value to have the same dtype``.
That is Hugging Face's default (``sdpa``) attention for Llama, Qwen2,
Mistral and most decoders, under Trainer's ``bf16=True``.

The rule: cast each floating-point query, key and value to the autocast
dtype, then run the op's own decomposition with autocast still on, which
is what eager XLA runs for inputs of one dtype: the matmuls in the autocast
dtype, the softmax in float32 (XLA's autocast casts it up). The attention
mask is not cast (a float mask's large negative values would overflow
bfloat16 to ``-inf``; the decomposition adds it in float32). A scan traces
its step through the same rule, so its captured graphs hold the same casts
and a float32 softmax, and compute what the Python loop computes.

Registered once, when ``torch_xla_ext`` is imported, for the
``AutocastXLA`` dispatch key and this one op only, and only where no rule
is registered already (a later torch_xla that ships its own keeps it).
"""

from __future__ import annotations

import torch

__all__ = ["register_sdpa_autocast"]

_OP = "aten::scaled_dot_product_attention"
_KEY = "AutocastXLA"
_library: torch.library.Library | None = None


def _sdpa_under_autocast(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                         scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    dtype = torch.get_autocast_dtype("xla")

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return torch.ops.aten.scaled_dot_product_attention.default.decompose(
        cast(query), cast(key), cast(value), attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def register_sdpa_autocast() -> bool:
    """Register the rule (see the module docstring) unless some rule is there; whether this call registered it."""
    global _library
    if _library is not None or torch._C._dispatch_has_kernel_for_dispatch_key(_OP, _KEY):
        return False
    library = torch.library.Library("aten", "IMPL")
    library.impl("scaled_dot_product_attention", _sdpa_under_autocast, _KEY)
    _library = library  # the registration lives as long as the library object
    return True
