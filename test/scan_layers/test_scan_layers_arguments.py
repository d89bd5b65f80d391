"""scan_layers with what real layers take: keyword arguments, tuple inputs, per-layer attributes, torch_xla's API.

Every result is compared with the Python loop ``h = layer(h, **kwargs)`` on the
CPU, values and gradients (also the gradients of keyword tensors).
"""

from __future__ import annotations

import copy

import pytest
import torch
from functorch.compile import min_cut_rematerialization_partition

import torch_xla_ext as txe
from torch_xla_ext.scan import scan_cache_info

from scan_reference import assert_close_derived

DIM = 8


class Attention(torch.nn.Module):
    """A layer shaped like a decoder layer: h, an additive mask, rotary (cos, sin), a flag, a per-layer index."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.q = torch.nn.Linear(DIM, DIM)
        self.o = torch.nn.Linear(DIM, DIM)
        self.layer_idx = index  # differs per layer; read only by a cache this test never passes
        self.scale = DIM ** -0.5

    def forward(self, h, attention_mask=None, position_embeddings=None, cache=None, gate=True):
        q = self.q(h)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            q = q * cos + q.flip(-1) * sin
        if cache is not None:
            cache[self.layer_idx] = q
        scores = q @ h.transpose(-1, -2) * self.scale
        if attention_mask is not None:
            scores = scores + attention_mask
        out = self.o(scores.softmax(-1) @ h)
        return h + (out if gate else 0.5 * out)


def _layers(n: int = 3) -> torch.nn.ModuleList:
    torch.manual_seed(0)
    return torch.nn.ModuleList(Attention(i) for i in range(n))


def _loop(layers, h, **kwargs):
    for layer in layers:
        h = layer(h, **kwargs)
    return h


def _inputs(seq: int = 5):
    torch.manual_seed(1)
    h = torch.randn(2, seq, DIM)
    mask = torch.zeros(seq, seq).masked_fill(torch.ones(seq, seq).triu(1).bool(), -1e4)
    angles = torch.randn(seq, DIM)
    return h, mask, (angles.cos(), angles.sin())


def test_keyword_tensors_in_a_pytree_are_loop_operands_with_gradients(device):
    cpu = _layers()
    xla = copy.deepcopy(cpu).to(device)
    h, mask, (cos, sin) = _inputs()
    cos.requires_grad_()
    cos_d = cos.detach().to(device).requires_grad_()
    out = txe.scan_layers(xla, h.to(device), attention_mask=mask.to(device),
                          position_embeddings=(cos_d, sin.to(device)))
    ref = _loop(cpu, h, attention_mask=mask, position_embeddings=(cos, sin))
    out.square().sum().backward()
    ref.square().sum().backward()
    size = 3 * 2 * DIM * 5
    assert_close_derived(out, ref, size)
    assert_close_derived(cos_d.grad, cos.grad, size, msg="grad of a keyword tensor")
    for (name, p), (_, p_ref) in zip(xla.named_parameters(), cpu.named_parameters()):
        assert_close_derived(p.grad, p_ref.grad, size, msg=name)


def test_new_keyword_values_reuse_the_loop_and_are_never_baked_in(device):
    cpu = _layers()
    xla = copy.deepcopy(cpu).to(device)
    h, mask, rope = _inputs()
    with torch.no_grad():
        txe.scan_layers(xla, h.to(device), attention_mask=mask.to(device), position_embeddings=tuple(
            t.to(device) for t in rope))
        before = scan_cache_info()
        for step in range(2):
            mask_k = mask - float(step + 1)  # another value each call, same signature
            out = txe.scan_layers(xla, h.to(device), attention_mask=mask_k.to(device),
                                  position_embeddings=tuple(t.to(device) for t in rope))
            ref = _loop(cpu, h, attention_mask=mask_k, position_embeddings=rope)
            assert_close_derived(out, ref, 3 * DIM * 5)
        after = scan_cache_info()
    assert after.traces == before.traces and after.hits == before.hits + 2


def test_non_tensor_keywords_are_part_of_the_cache_key(device):
    cpu = _layers()
    xla = copy.deepcopy(cpu).to(device)
    h = _inputs()[0]
    with torch.no_grad():
        for gate in (True, False, True):
            out = txe.scan_layers(xla, h.to(device), gate=gate)
            assert_close_derived(out, _loop(cpu, h, gate=gate), 3 * DIM * 5)


class Pair(torch.nn.Module):
    """torch_xla's tuple convention: layer(a, b) -> (a', b')."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)

    def forward(self, a, b, scale=1.0):
        return torch.tanh(self.lin(a) + b) * scale, a - b


def test_tuple_input_calls_each_layer_with_its_elements(device):
    torch.manual_seed(0)
    cpu = torch.nn.ModuleList(Pair() for _ in range(4))
    xla = copy.deepcopy(cpu).to(device)
    a, b = torch.randn(3, DIM), torch.randn(3, DIM)
    out = txe.scan_layers(xla, (a.to(device), b.to(device)), scale=0.5)
    ref = (a, b)
    for layer in cpu:
        ref = layer(*ref, scale=0.5)
    assert isinstance(out, tuple) and len(out) == 2
    (out[0].sum() + out[1].square().sum()).backward()
    (ref[0].sum() + ref[1].square().sum()).backward()
    for got, want in zip(out, ref):
        assert_close_derived(got, want, 4 * DIM)
    for p, p_ref in zip(xla.parameters(), cpu.parameters()):
        assert_close_derived(p.grad, p_ref.grad, 4 * DIM * 3)


def test_partition_fn_and_is_layer_pure_by_position_as_in_torch_xla(device):
    cpu = _layers()
    xla = copy.deepcopy(cpu).to(device)
    h = _inputs()[0]
    out = txe.scan_layers(xla, h.to(device), min_cut_rematerialization_partition, False)
    ref = _loop(cpu, h)
    out.sum().backward()
    ref.sum().backward()
    assert_close_derived(out, ref, 3 * DIM * 5)
    for p, p_ref in zip(xla.parameters(), cpu.parameters()):
        assert_close_derived(p.grad, p_ref.grad, 3 * DIM * 5 * 2)


class Wrong(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(DIM, DIM)

    def forward(self, h):
        return self.lin(h), None


class Boxed(Wrong):
    def forward(self, h):
        return (self.lin(h),)


def test_a_layer_returning_something_else_is_named_with_what_came_back(device):
    layers = torch.nn.ModuleList(Wrong() for _ in range(2)).to(device)
    with pytest.raises(ValueError, match=r"Wrong.forward returned tuple of 2 \(Tensor\(2, 8\) float32, "
                                         r"NoneType\) for the input Tensor\(2, 8\) float32"):
        txe.scan_layers(layers, torch.zeros(2, DIM, device=device))
    boxed = torch.nn.ModuleList(Boxed() for _ in range(2)).to(device)  # (h,) for h: the loop would pass a tuple on
    with pytest.raises(txe.ScanInputError, match=r"Boxed.forward returned tuple of 1 \(Tensor\(2, 8\) float32\)"):
        txe.scan_layers(boxed, torch.zeros(2, DIM, device=device))
    pairs = torch.nn.ModuleList(Pair() for _ in range(2)).to(device)
    with pytest.raises(txe.ScanInputError, match=r"Pair.forward returned tuple of 2 .* for the input tuple of 3"):
        txe.scan_layers(pairs, tuple(torch.zeros(2, DIM, device=device) for _ in range(3)))


def test_bad_arguments_raise_before_anything_runs(device):
    layers = _layers().to(device)
    h = torch.zeros(2, 5, DIM, device=device)
    with pytest.raises(txe.ScanInputError, match=r"attention_mask'\] is a tensor on cpu"):
        txe.scan_layers(layers, h, attention_mask=torch.zeros(5, 5))
    with pytest.raises(txe.ScanInputError, match="input_data must be an XLA tensor or a non-empty tuple"):
        txe.scan_layers(layers, [h])
    with pytest.raises(txe.ScanInputError, match="partition_fn must be callable"):
        txe.scan_layers(layers, h, 3)


def test_per_layer_attributes_are_accepted_only_when_they_trace_the_same(device):
    cpu = _layers()
    xla = copy.deepcopy(cpu).to(device)
    h = _inputs()[0]
    # layer_idx differs per layer but is read only with a cache: the same trace.
    with torch.no_grad():
        assert_close_derived(txe.scan_layers(xla, h.to(device)), _loop(cpu, h), 3 * DIM * 5)
    # A per-layer scale changes the computation: scanning layers[0]'s would be wrong.
    xla[2].scale = 0.25
    with pytest.raises(ValueError, match=r"layers\[2\] differs in layer_idx = 2 \(layers\[0\]: 0\); scale = 0.25"):
        txe.scan_layers(xla, h.to(device))
    xla[2].scale = xla[0].scale
    # A layer in another mode (dropout on in one layer only) is refused too.
    drop = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(DIM, DIM), torch.nn.Dropout(0.5))
                               for _ in range(3)).to(device)
    drop[1].eval()
    with pytest.raises(ValueError, match=r"layers\[1\] differs in training = False"):
        txe.scan_layers(drop, h.to(device))


def _traces_held(error: BaseException) -> list[str]:
    """Frames of ``error``'s traceback whose locals still hold a trace (lazy tensors over placeholders)."""
    from torch_xla_ext._scan.trace import _Traced

    held, tb = [], error.__traceback__
    while tb is not None:
        for name, value in tb.tb_frame.f_locals.items():
            if isinstance(value, _Traced):
                held.append(f"{tb.tb_frame.f_code.co_name}: {name}")
        tb = tb.tb_next
    return held


def test_a_refusal_keeps_no_trace_alive(device):
    # A kept exception (pytest.raises, sys.last_traceback) must not keep lazy
    # tensors over placeholders alive: the next torch_xla.sync() would run them.
    layers = _layers().to(device)
    layers[1].scale = 0.25
    with pytest.raises(ValueError, match="differs in") as info:
        txe.scan_layers(layers, torch.zeros(2, 5, DIM, device=device))
    assert _traces_held(info.value) == []


def test_heterogeneous_layers_raise_valueerror_worded_as_torch_xla(device):
    layers = _layers().to(device)
    h = torch.zeros(2, 5, DIM, device=device)
    wide = copy.deepcopy(layers[0])
    wide.q = torch.nn.Linear(DIM, 2 * DIM).to(device)
    with pytest.raises(ValueError, match=r"Shape mismatch for 'q.weight' in layer 1: expected \(8, 8\), got \(16, 8\)"):
        txe.scan_layers([layers[0], wide], h)
    extra = copy.deepcopy(layers[0])
    extra.register_buffer("step", torch.zeros((), device=device))
    with pytest.raises(ValueError, match=r"Layer 1 has mismatched keys. Extra keys: \['step'\]"):
        txe.scan_layers([layers[0], extra], h)
    other = type("OtherAttention", (Attention,), {})(1).to(device)  # the same keys, another class
    with pytest.raises(ValueError, match=r"layers\[1\] is a OtherAttention but layers\[0\] is a Attention"):
        txe.scan_layers([layers[0], other], h)
    # Another class with other keys: the keys are named first, as torch_xla does.
    linear = torch.nn.Linear(DIM, DIM).to(device)
    with pytest.raises(ValueError, match=r"Layer 1 has mismatched keys. Missing keys: \['bias', 'weight'\]"):
        txe.scan_layers([linear, torch.nn.Sequential(copy.deepcopy(linear))], torch.zeros(DIM, device=device))
