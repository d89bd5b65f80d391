"""scan and scan_layers inside torch.compile(backend="openxla"): refused at trace time, with the reason."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
import torch_xla

import torch_xla_ext as txe
from torch_xla_ext._scan.dynamo import ScanUnderCompileError

from scan_blocks import make_blocks


class Scanned(torch.nn.Module):
    def __init__(self, layers: torch.nn.ModuleList, use_scan_layers: bool) -> None:
        super().__init__()
        self.layers = layers
        self.use_scan_layers = use_scan_layers

    def forward(self, x):
        h = x * 2.0
        if self.use_scan_layers:
            return txe.scan_layers(self.layers, h)
        return txe.scan(lambda c, row: (torch.tanh(c + row), None), h[0], h)[0]


@pytest.mark.parametrize("fullgraph", [False, True])
@pytest.mark.parametrize("use_scan_layers", [True, False], ids=["scan_layers", "scan"])
def test_scans_inside_torch_compile_raise_naming_the_reason(device, use_scan_layers, fullgraph):
    torch._dynamo.reset()  # dynamo caches compiled frames per code object, across torch.compile calls
    model = Scanned(make_blocks(2), use_scan_layers).to(device)
    x = torch.randn(4, 16).to(device)
    model(x)  # the model runs without torch.compile
    torch_xla.sync()
    compiled = torch.compile(model, backend="openxla", fullgraph=fullgraph)
    # fullgraph: dynamo reports the refusal while tracing (quoting it); otherwise
    # it compiles what comes before the scan and the scan raises when called.
    error = torch._dynamo.exc.Unsupported if fullgraph else ScanUnderCompileError
    with pytest.raises(error, match="cannot run inside torch.compile.*wrong gradients after a graph"):
        compiled(x)
