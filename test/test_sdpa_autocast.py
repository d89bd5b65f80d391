"""The package's XLA autocast rule for scaled_dot_product_attention (torch_xla_ext._sdpa_autocast)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
import torch_xla

from torch_xla_ext._sdpa_autocast import register_sdpa_autocast
from torch_xla_ext.testing.tolerances import tolerance

B, H, S, D = 2, 4, 8, 16


def _qkv(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, S, D, generator=g) for _ in range(3))


def _reference(q, k, v, **kwargs) -> torch.Tensor:
    """The rule's math on the CPU: inputs rounded to bfloat16, the attention in float32."""
    return F.scaled_dot_product_attention(*(t.bfloat16().float() for t in (q, k, v)), **kwargs)


def test_a_rotary_models_mixed_dtypes_attend_in_bfloat16(device):
    # A rotary embedding hands float32 queries and keys beside a bfloat16 value: torch_xla alone refuses
    # "Expected query, key, and value to have the same dtype".
    q, k, v = _qkv()
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device).bfloat16(), is_causal=True)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float().cpu(), _reference(q, k, v, is_causal=True), **tolerance(torch.bfloat16, S))


def test_the_softmax_runs_in_float32(device):
    q, k, v = (t.to(device) for t in _qkv())
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v.bfloat16())
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([out])
    assert set(re.findall(r"= (\w+)\[[^\]]*\][^ ]* exponential\(", hlo)) == {"f32"}, hlo
    assert re.search(r"bf16\[[^\]]*\][^ ]* dot\(", hlo), hlo  # the matmuls in bfloat16


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_a_mask_is_applied_in_float32(device, mask):
    # A float mask's large negative values are not cast: in bfloat16 finfo(float32).min overflows to -inf, and
    # a row with every key masked would turn from uniform weights into NaN.
    q, k, v = _qkv(1)
    allowed = torch.ones(S, S, dtype=torch.bool).tril()
    allowed[0] = False  # the first query sees no key
    attn_mask = allowed if mask == "bool" else torch.zeros(S, S).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device).bfloat16(),
                                             attn_mask=attn_mask.to(device))
    want = _reference(q, k, v, attn_mask=attn_mask)
    got = out.float().cpu()
    assert torch.isnan(got[:, :, 0]).all() == torch.isnan(want[:, :, 0]).all()  # as PyTorch does on the CPU
    torch.testing.assert_close(got[:, :, 1:], want[:, :, 1:], **tolerance(torch.bfloat16, S))


def test_without_autocast_nothing_is_cast(device):
    q, k, v = _qkv()
    out = F.scaled_dot_product_attention(q.to(device), k.to(device), v.to(device))
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v), **tolerance(torch.float32, S))
    with torch.autocast("xla", dtype=torch.bfloat16), pytest.raises(RuntimeError, match="same dtype"):
        F.scaled_dot_product_attention(q, k, v.bfloat16())  # CPU tensors: the XLA rule does not apply


def test_gradients_flow_through_the_casts(device):
    q, k, v = _qkv(2)
    qx, kx, vx = (t.to(device).requires_grad_() for t in (q, k, v))
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(qx, kx, vx.bfloat16(), is_causal=True)
    out.float().square().sum().backward()
    qc, kc, vc = (t.clone().requires_grad_() for t in (q, k, v))
    _reference(qc, kc, vc, is_causal=True).square().sum().backward()
    for got, want in ((qx, qc), (kx, kc), (vx, vc)):
        assert got.grad.dtype == torch.float32
        scale = float(want.grad.square().mean().sqrt())
        torch.testing.assert_close(got.grad.cpu(), want.grad, **tolerance(torch.bfloat16, S * D, scale=scale))


def test_registering_again_changes_nothing():
    assert register_sdpa_autocast() is False  # importing torch_xla_ext registered it
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::scaled_dot_product_attention", "AutocastXLA")
