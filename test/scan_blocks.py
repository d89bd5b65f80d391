"""The stack of layers the scan_layers tests scan over: pre-norm GELU MLP blocks with residuals."""

from __future__ import annotations

import torch


class Block(torch.nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def make_blocks(n: int, dim: int = 16, hidden: int = 32, seed: int = 0) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block(dim, hidden) for _ in range(n))
