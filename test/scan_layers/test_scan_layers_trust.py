"""scan_layers gives the loop's values or refuses: hooks, private attributes, submodule classes, autocast.

Every way a layer can differ from ``layers[0]`` that a scan of ``layers[0]``'s
forward would miss is either proven irrelevant (the layer traces the same) or
refused, naming the layer and what differs. Each accepted case is compared
with the plain loop ``for layer in layers: h = layer(h)`` on the device.
"""

from __future__ import annotations

import copy
import textwrap
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torch_xla_ext as txe
from torch_xla_ext.scan import scan_cache_info
from torch_xla_ext.testing.tolerances import tolerance

from child_process import SPMD_CHILD, run_surviving


class Block(nn.Module):
    def __init__(self, width: int = 8, act: type[nn.Module] = nn.Tanh, residual: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.act = act()
        self._scale = 1.0
        self.residual = residual

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # Without the residual, autocast makes the output bfloat16 for a float32 input.
        out = self.act(self.lin(h)) * self._scale
        return out + h if self.residual else out


def _layers(device, n: int = 3, **kw) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block(**kw) for _ in range(n)).to(device)


def _loop(layers, h):
    for layer in layers:
        h = layer(h)
    return h


@pytest.mark.parametrize("where", ["forward hook on layers[1]", "pre-hook on layers[2]",
                                   "hook on layers[1].lin", "hook on layers[0]", "backward hook on layers[1]"])
def test_module_hooks_are_refused_naming_the_layer_and_the_hook(device, where):
    layers = _layers(device)

    def double(module, inputs, output):
        return output * 2

    if where == "forward hook on layers[1]":
        layers[1].register_forward_hook(double)
        name = r"layers\[1\] has a forward hook \(.*double"
    elif where == "pre-hook on layers[2]":
        layers[2].register_forward_pre_hook(lambda m, args: (args[0] * 3,))
        name = r"layers\[2\] has a forward pre-hook \(.*lambda"
    elif where == "hook on layers[1].lin":
        layers[1].lin.register_forward_hook(double)
        name = r"layers\[1\]\.lin has a forward hook"
    elif where == "hook on layers[0]":
        layers[0].register_forward_hook(double)
        name = r"layers\[0\] has a forward hook"
    else:
        layers[1].register_full_backward_hook(lambda m, gi, go: None)
        name = r"layers\[1\] has a backward hook"
    h = torch.randn(4, 8, device=device)
    before = scan_cache_info()
    with pytest.raises(txe.ScanInputError, match=name):
        txe.scan_layers(layers, h)
    assert scan_cache_info() == before  # refused before anything was traced


def test_a_global_module_hook_is_refused(device):
    layers = _layers(device)
    handle = nn.modules.module.register_module_forward_hook(lambda m, i, o: o)
    try:
        with pytest.raises(txe.ScanInputError, match="global module forward hook"):
            txe.scan_layers(layers, torch.randn(4, 8, device=device))
    finally:
        handle.remove()


def test_hooks_removed_again_scan_like_the_loop(device):
    layers = _layers(device)
    handle = layers[1].register_forward_hook(lambda m, i, o: o * 2)
    with pytest.raises(txe.ScanInputError):
        txe.scan_layers(layers, torch.randn(4, 8, device=device))
    handle.remove()
    h = torch.randn(4, 8, device=device)
    torch.testing.assert_close(txe.scan_layers(layers, h).cpu(), _loop(layers, h).cpu(),
                               **tolerance(torch.float32, 8 * 3))


_HF_HOOK = SPMD_CHILD + textwrap.dedent('''
    import torch_xla_ext as txe
    from transformers.utils import output_capturing

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Linear(8, 8) for _ in range(3)]).to(dev)
    for layer in layers:  # as transformers installs it on every decoder layer at a model's first forward
        output_capturing.install_output_capuring_hook(layer, "hidden_states", 0)
    h = torch.randn(4, 8).to(dev)
    want = h
    for layer in layers:
        want = layer(want)
    got = txe.scan_layers(layers, h)
    close = torch.allclose(got.cpu(), want.cpu(), rtol=1e-5, atol=1e-5)
    token = output_capturing._active_collector.set({"hidden_states": []})
    try:
        txe.scan_layers(layers, h)
        capturing = "accepted"
    except txe.ScanInputError as error:
        capturing = "refused" if "forward hook" in str(error) else str(error)
    finally:
        output_capturing._active_collector.reset(token)
    print("hf imported", "torch_xla_ext.hf" in sys.modules, "close", close, "capturing", capturing)
''')


def test_hugging_faces_idle_output_hook_is_accepted_without_importing_hf_and_refused_while_capturing(tmp_path):
    # The hooks scan_layers accepts are a fixed set: importing torch_xla_ext.hf used to add this one.
    out = run_surviving(tmp_path, _HF_HOOK)
    assert out.splitlines()[-1] == "hf imported False close True capturing refused", out


def test_a_per_layer_private_attribute_that_changes_the_result_is_refused(device):
    layers = _layers(device)
    layers[1]._scale = 2.0
    with pytest.raises(txe.ScanInputError, match=r"layers\[1\] differs in _scale = 2.0 \(layers\[0\]: 1.0\)"):
        txe.scan_layers(layers, torch.randn(4, 8, device=device))


class Configured(nn.Module):
    """A layer holding its own settings object, read by its forward."""

    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.cfg = cfg

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        scale = cfg["scale"] if isinstance(cfg, dict) else cfg.scale if isinstance(cfg, types.SimpleNamespace) \
            else cfg
        return torch.tanh(self.lin(h)) * scale + h


_SETTINGS = {
    "dict": (lambda: {"scale": 2.0}, lambda cfg: cfg.update(scale=3.0)),
    "namespace": (lambda: types.SimpleNamespace(scale=2.0), lambda cfg: setattr(cfg, "scale", 3.0)),
    "host tensor": (lambda: torch.tensor(2.0), lambda cfg: cfg.fill_(3.0)),
}


@pytest.mark.parametrize("kind", list(_SETTINGS))
def test_a_layers_settings_changed_in_place_after_a_call_are_refused_as_on_a_fresh_stack(device, kind):
    # The first call verified the layers alike; reuse was then decided by the settings objects'
    # identities, and later calls ran layers[0]'s computation for every layer (0.48 off for a dict).
    make, change = _SETTINGS[kind]
    torch.manual_seed(0)
    layers = nn.ModuleList(Configured(make()) for _ in range(3)).to(device)
    h = torch.randn(4, 8, device=device)
    with torch.no_grad():  # a host tensor read by the forward cannot enter the autograd trace
        torch.testing.assert_close(txe.scan_layers(layers, h).cpu(), _loop(layers, h).cpu(),
                                   **tolerance(torch.float32, 8 * 3))
        change(layers[1].cfg)
        with pytest.raises(txe.ScanInputError, match=r"layers\[1\] differs in cfg"):
            txe.scan_layers(layers, h)
        change(layers[0].cfg)
        change(layers[2].cfg)  # alike again, all at 3.0
        torch.testing.assert_close(txe.scan_layers(layers, h).cpu(), _loop(layers, h).cpu(),
                                   **tolerance(torch.float32, 8 * 3))


def test_a_refusal_names_what_differs_not_settings_that_only_are_other_objects(device):
    torch.manual_seed(0)
    layers = nn.ModuleList(Configured({"scale": 2.0}) for _ in range(3)).to(device)
    for layer in layers:
        layer.lin.tag = object()  # another object in every layer, read by nothing
    layers[2].cfg["scale"] = 5.0
    with pytest.raises(txe.ScanInputError) as refused:
        txe.scan_layers(layers, torch.randn(4, 8, device=device))
    message = str(refused.value)
    assert "cfg = {'scale': 5.0} (layers[0]: {'scale': 2.0})" in message and "tag" not in message, message


def test_a_private_attribute_the_forward_does_not_read_is_accepted(device):
    layers = _layers(device)
    for i, layer in enumerate(layers):
        layer._note = f"layer {i}"  # read by nothing in the forward
    h = torch.randn(4, 8, device=device)
    torch.testing.assert_close(txe.scan_layers(layers, h).cpu(), _loop(layers, h).cpu(),
                               **tolerance(torch.float32, 8 * 3))


def test_children_of_another_class_are_refused(device):
    layers = _layers(device)
    layers[1].act = nn.Sigmoid().to(device)
    with pytest.raises(txe.ScanInputError, match=r"layers\[1\] differs in act.__class__"):
        txe.scan_layers(layers, torch.randn(4, 8, device=device))


def test_layers_of_another_class_are_refused_naming_both_classes(device):
    class Other(Block):
        pass

    def init(self: nn.Module) -> None:
        nn.Module.__init__(self)
        self.lin, self.act, self._scale, self.residual = nn.Linear(8, 8), nn.Tanh(), 1.0, True

    # A class printed as Block that is not Block nor derived from it (a module reloaded, say).
    same_name = type("Block", (nn.Module,), {"__init__": init, "forward": Block.forward,
                                             "__qualname__": Block.__qualname__, "__module__": Block.__module__})
    h = torch.randn(4, 8, device=device)
    layers = _layers(device)
    layers[2] = Other().to(device)
    with pytest.raises(txe.ScanInputError, match=r"layers\[2\] is a Other but layers\[0\] is a Block; all layers "
                                                 r"must be of one class$"):
        txe.scan_layers(layers, h)
    layers = _layers(device)
    layers[1] = same_name().to(device)  # not a wrapper's subclass: no fully_shard advice
    with pytest.raises(txe.ScanInputError, match=r"layers\[1\] is a Block but layers\[0\] is a Block, two classes of one "
                                                 r"name defined twice .*; all layers must be of one class$"):
        txe.scan_layers(layers, h)


def test_a_child_of_a_subclass_that_computes_the_same_is_accepted(device):
    class MyTanh(nn.Tanh):
        pass

    layers = _layers(device)
    layers[2].act = MyTanh().to(device)
    h = torch.randn(4, 8, device=device)
    torch.testing.assert_close(txe.scan_layers(layers, h).cpu(), _loop(layers, h).cpu(),
                               **tolerance(torch.float32, 8 * 3))


def test_a_submodule_in_eval_mode_is_refused_when_it_changes_the_result(device):
    class Drop(Block):
        def __init__(self) -> None:
            super().__init__()
            self.drop = nn.Dropout(0.5)

        def forward(self, h):
            return self.drop(super().forward(h))

    torch.manual_seed(0)
    layers = nn.ModuleList(Drop() for _ in range(3)).to(device)
    layers[2].drop.eval()
    with pytest.raises(txe.ScanInputError, match=r"layers\[2\] differs in drop.training = False"):
        txe.scan_layers(layers, torch.randn(4, 8, device=device))


@pytest.mark.parametrize("first", ["autocast", "plain"])
def test_autocast_state_is_part_of_reuse(device, first):
    layers = _layers(device, residual=False)
    h = torch.randn(4, 8, device=device)
    order = [first, "plain" if first == "autocast" else "autocast"] * 2
    for mode in order:
        if mode == "autocast":
            with torch.autocast("xla", dtype=torch.bfloat16):
                got, want = txe.scan_layers(layers, h), _loop(layers, h)
            assert got.dtype == want.dtype == torch.bfloat16
        else:
            got, want = txe.scan_layers(layers, h), _loop(layers, h)
            assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got.float().cpu(), want.float().cpu(), **tolerance(want.dtype, 8 * 3))


def test_scan_layers_under_autocast_trains_like_the_loop(device):
    layers = _layers(device, n=4, residual=False)
    ref = copy.deepcopy(layers)
    h = torch.randn(4, 8, device=device)
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = txe.scan_layers(layers, h)
        want = _loop(ref, h)
    assert out.dtype == want.dtype == torch.bfloat16
    out.float().square().sum().backward()
    want.float().square().sum().backward()
    tol = tolerance(torch.bfloat16, 8 * 4)
    torch.testing.assert_close(out.float().cpu(), want.float().cpu(), **tol)
    for (name, p), q in zip(layers.named_parameters(), ref.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), **tolerance(torch.bfloat16, 4 * 8 * 4),
                                   msg=lambda m, name=name: f"{name}: {m}")


class _Attention(nn.Module):
    """Self-attention through ``F.scaled_dot_product_attention``; ``mixed``: the value left in the autocast dtype."""

    def __init__(self, mixed: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)
        self.mixed = mixed

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in self.qkv(h).view(2, 4, 3, 2, 8).unbind(2))
        q, k = q.float(), k.float()
        o = F.scaled_dot_product_attention(q, k, v if self.mixed else v.float())
        return h + self.out(o.transpose(1, 2).reshape(2, 4, 16)).float()


def _rms(t: torch.Tensor) -> float:
    return float(t.detach().float().square().mean().sqrt())


@pytest.mark.parametrize("mixed", [False, True], ids=["float32_qkv", "bfloat16_value"])
def test_attention_under_autocast_trains_like_the_loop(device, mixed):
    # Before the package's XLA autocast rule for scaled_dot_product_attention, scan refused this with
    # gradients: eager cast the softmax up to float32 op by op, and the trace that captures the backward
    # decomposed the attention below autocast, leaving it in bfloat16. ``mixed``: a bfloat16 value beside
    # float32 queries and keys, as a rotary model hands it (torch_xla alone fails on it, loop or scan).
    torch.manual_seed(0)
    layers = nn.ModuleList(_Attention(mixed) for _ in range(3)).to(device)
    ref = copy.deepcopy(layers)
    h = torch.randn(2, 4, 16, device=device)
    with torch.autocast("xla", dtype=torch.bfloat16):
        out, want = txe.scan_layers(layers, h), _loop(ref, h)
    out.square().sum().backward()
    want.square().sum().backward()
    # The same casts in the same places (the rule runs in the trace as in eager): XLA computes the same.
    torch.testing.assert_close(out.cpu(), want.cpu(), **tolerance(torch.bfloat16, 3 * 16, scale=_rms(want)))
    for (name, p), q in zip(layers.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), **tolerance(torch.bfloat16, 3 * 16 * 8, scale=_rms(q.grad)),
                                   msg=lambda m, name=name: f"{name}: {m}")


class _Float32Island(nn.Module):
    """A layer that runs its second matmul in float32 with autocast switched off, as a router or a head does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.lin2 = nn.Linear(64, 64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(self.lin(h)).float()
        with torch.autocast("xla", enabled=False):
            return h + self.lin2(a)


def test_a_float32_island_under_autocast_gets_the_loops_gradients(device):
    # backward() after the autocast block, as PyTorch advises: eager runs the gradients of the float32
    # matmul in float32. The scan's backward was captured under the forward's autocast, and computed
    # them in bfloat16 (3e-3 to 1e-2 of the largest gradient away from the loop's).
    torch.manual_seed(0)
    layers = nn.ModuleList(_Float32Island() for _ in range(3)).to(device)
    ref = copy.deepcopy(layers)
    h = torch.randn(16, 64, device=device)
    with torch.autocast("xla", dtype=torch.bfloat16):
        out, want = txe.scan_layers(layers, h), _loop(ref, h)
    out.square().sum().backward()
    want.square().sum().backward()
    torch.testing.assert_close(out.cpu(), want.cpu(), **tolerance(torch.float32, 3 * 64, scale=_rms(want)))
    for (name, p), q in zip(layers.named_parameters(), ref.parameters()):
        dtype = torch.float32 if ".lin2." in f".{name}" else torch.bfloat16
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), **tolerance(dtype, 2 * 3 * 64, scale=_rms(q.grad)),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_backward_under_autocast_is_refused(device):
    layers = _layers(device, residual=False)
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = txe.scan_layers(layers, torch.randn(4, 8, device=device))
        with pytest.raises(txe.ScanUnsupportedError, match=r"backward\(\) ran under torch.autocast"):
            out.float().sum().backward()
    assert all(p.grad is None for p in layers.parameters())


def test_scan_under_autocast_and_without_uses_its_own_loop(device):
    w = torch.randn(8, 8, device=device)

    def step(c, x):
        return c, (x @ w).float()

    xs_ = torch.randn(3, 4, 8, device=device)
    init = torch.zeros(4, device=device)
    _, plain = txe.scan(step, init, xs_)
    with torch.autocast("xla", dtype=torch.bfloat16):
        _, mixed = txe.scan(step, init, xs_)
        want = torch.stack([(x @ w).float() for x in xs_])
    _, plain_again = txe.scan(step, init, xs_)
    torch.testing.assert_close(mixed.cpu(), want.cpu(), rtol=0, atol=0)
    torch.testing.assert_close(plain_again.cpu(), plain.cpu(), rtol=0, atol=0)
    assert not torch.equal(mixed.cpu(), plain.cpu())  # bfloat16 matmuls round differently


def test_groups_of_alternating_layers_scan_like_the_loop(device):
    class Gated(Block):
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Parameter(torch.ones(8))

        def forward(self, h):
            return torch.sigmoid(self.lin(h)) * self.gate

    torch.manual_seed(0)
    layers = nn.ModuleList([Block(), Gated(), Block(), Gated(), Block(), Gated()]).to(device)
    ref = copy.deepcopy(layers)
    h = torch.randn(4, 8, device=device)
    with pytest.raises(txe.ScanInputError, match="mismatched keys"):
        txe.scan_layers(layers, h)  # layer by layer they differ
    out = txe.scan_layers(layers, h, group_size=2)
    want = _loop(ref, h)
    out.square().sum().backward()
    want.square().sum().backward()
    tol = tolerance(torch.float32, 8 * 6)
    torch.testing.assert_close(out.cpu(), want.cpu(), **tol)
    for p, q in zip(layers.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), **tol)
    before = scan_cache_info()
    txe.scan_layers(layers, h, group_size=2)
    assert scan_cache_info().hits == before.hits + 1  # the groups are kept: the loop is reused
    with pytest.raises(txe.ScanInputError, match="do not split into groups of 4"):
        txe.scan_layers(layers, h, group_size=4)
    with pytest.raises(txe.ScanInputError, match="nn.ModuleList"):
        txe.scan_layers(list(layers), h, group_size=2)
