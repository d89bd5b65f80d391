"""The token batches the Hugging Face tests train on: random ids, left padding that changes every step."""

from __future__ import annotations

from collections.abc import Iterator

import torch


def padded_batches(steps: int, batch: int, seq: int, vocab: int, seed: int = 1,
                   period: int = 5) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """``(ids, mask)`` per step; row r of step s has ``(s + r) % period`` padding tokens on the left."""
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        ids = torch.randint(0, vocab, (batch, seq), generator=g)
        mask = torch.ones(batch, seq, dtype=torch.long)
        for row in range(batch):
            mask[row, :(step + row) % period] = 0
        yield ids, mask
