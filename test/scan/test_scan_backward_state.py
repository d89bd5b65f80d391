"""Python state that only the backward reads: a scan's gradients are the Python loop's on every call.

A custom autograd.Function whose backward reads a coefficient (gradient reversal on a schedule), a tensor hook
registered inside fn, a module backward hook: none of them shows in the forward's trace, so a loop lowered
once would keep the first call's backward. Each case is called twice with the state changed in between, and its
gradients are compared with the Python loop's, through scan and scan_layers (stacked and not).
"""

from __future__ import annotations

import pytest
import torch

import torch_xla_ext as txe
from scan_reference import assert_close_derived

COEF = 1.0  # read by _Reverse.backward only


class _Reverse(torch.autograd.Function):
    """Gradient reversal scaled by the module-level COEF."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return -COEF * g


class _ReverseBy(torch.autograd.Function):
    """Gradient reversal scaled by a coefficient the forward keeps on ctx."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, coef: float) -> torch.Tensor:
        ctx.coef = coef
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return -ctx.coef * g, None


def _steps(device: torch.device, state: dict) -> dict:
    lin = torch.nn.Linear(4, 4).to(device)
    lin.register_full_backward_hook(lambda m, gin, gout: (gin[0] * state["coef"],))

    def with_hook(c, x):
        h = c * x
        h.register_hook(lambda g: g * state["coef"])
        return torch.tanh(h), None

    return {
        "function reading a global": lambda c, x: (torch.tanh(_Reverse.apply(c * x)), None),
        "function reading ctx": lambda c, x: (torch.tanh(_ReverseBy.apply(c * x, state["coef"])), None),
        "tensor hook": with_hook,
        "module backward hook": lambda c, x: (torch.tanh(lin(c) + x), None),
    }


@pytest.mark.parametrize("case", ["function reading a global", "function reading ctx", "tensor hook",
                                  "module backward hook"])
def test_backward_only_state_changed_between_calls_gives_the_loops_gradients(device, case):
    global COEF
    state = {"coef": 1.0}
    step = _steps(device, state)[case]
    xs = torch.linspace(0.1, 1.0, 12).reshape(3, 4).to(device)

    def grad(scanned: bool) -> torch.Tensor:
        w = torch.full((4,), 0.5, device=device, requires_grad=True)
        if scanned:
            c, _ = txe.scan(step, w * 1, xs)
        else:
            c = w * 1
            for x in xs:
                c, _ = step(c, x)
        c.sum().backward()
        return w.grad

    try:
        for coef in (1.0, 3.0, -0.5):
            COEF = state["coef"] = coef
            assert_close_derived(grad(True), grad(False), 3 * 4, msg=f"{case}, coef {coef}")
    finally:
        COEF = 1.0


class _ReversingLayer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(_Reverse.apply(h)))


@pytest.mark.parametrize("stacked", [False, True])
def test_scan_layers_whose_layers_run_such_a_backward_give_the_loops_gradients(device, stacked):
    global COEF
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(_ReversingLayer() for _ in range(3)).to(device)
    if stacked:
        txe.stack_layers(layers)
    x = torch.randn(2, 8).to(device)
    try:
        for coef in (1.0, 2.5):
            COEF = coef
            grads = []
            for scanned in (True, False):
                layers.zero_grad()
                inp = x.clone().requires_grad_()
                if scanned:
                    out = txe.scan_layers(layers, inp)
                else:
                    out = inp
                    for layer in layers:
                        out = layer(out)
                out.square().sum().backward()
                grads.append([inp.grad] + [p.grad for p in layers.parameters()])
            for got, want in zip(*grads):
                assert_close_derived(got, want, 3 * 8 * 2, msg=f"stacked={stacked}, coef {coef}")
    finally:
        COEF = 1.0


def test_an_unchanged_backward_state_reuses_the_lowered_loop(device):
    from torch_xla_ext.scan import scan_cache_info

    xs = torch.linspace(0.1, 1.0, 12).reshape(3, 4).to(device)
    w = torch.full((4,), 0.5, device=device, requires_grad=True)

    def step(c, x):
        return torch.tanh(_Reverse.apply(c * x)), None

    counts = []
    for _ in range(3):
        before = scan_cache_info()
        txe.scan(step, w * 1, xs)[0].sum().backward()
        after = scan_cache_info()
        counts.append((after.traces - before.traces, after.hits - before.hits))
    assert counts[1:] == [(0, 1), (0, 1)], counts
