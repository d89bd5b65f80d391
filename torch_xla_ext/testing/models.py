"""The small decoder used by the tests, the benchmarks and the demo.

Two residual blocks and one decoder whose token embedding is tied to its LM
head, parameterized by sizes so that each user builds the model it needs:

- :class:`MLPBlock`: ``x + down(act(up(norm(x))))``;
- :class:`CausalBlock`: a pre-norm block with causal self-attention and an
  MLP, each residual;
- :class:`Decoder`: embedding -> blocks (``scan_layers`` or a Python loop) ->
  optional final LayerNorm -> LM head sharing the embedding's weight.

Everything here is plain ``torch.nn`` and runs on any device; building a model
moves nothing between host and device (the parameters are created on the CPU).
Parameters are created in a fixed order (embedding, blocks, head), so under
one ``torch.manual_seed`` the same sizes give the same weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..scan import scan_layers

__all__ = ["MLPBlock", "CausalBlock", "Decoder"]


class MLPBlock(nn.Module):
    """Residual MLP block: ``x + down(activation(up(norm(x))))``.

    Args:
        width: the model width (input and output features).
        hidden: features of the hidden layer.
        activation: the nonlinearity between ``up`` and ``down`` (default GELU).
    """

    def __init__(self, width: int, hidden: int,
                 activation: Callable[[torch.Tensor], torch.Tensor] = F.gelu) -> None:
        super().__init__()
        self.activation = activation
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(..., width)`` -> the same shape."""
        return x + self.down(self.activation(self.up(self.norm(x))))


class CausalBlock(nn.Module):
    """Pre-norm decoder block: ``x + attn(attn_norm(x))`` (causal), then ``x + mlp(mlp_norm(x))``.

    The causal mask is an additive float bias (``-inf`` strictly above the
    diagonal), so nothing but the scores flows into the softmax's backward and
    no boolean activation is saved. Parameter names (``attn_norm``, ``qkv``,
    ``proj``, ``mlp_norm``, ``up``, ``down``) are the state-dict keys a
    reimplementation (the JAX twin in ``scripts/bench_scan.py``) reads.

    Args:
        width: the model width; must divide by ``heads``.
        heads: attention heads.
        mlp: MLP hidden size as a multiple of ``width``.
    """

    def __init__(self, width: int, heads: int, mlp: int = 4) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"CausalBlock: width {width} does not divide into {heads} heads; "
                             f"pick a width that is a multiple of heads")
        self.heads = heads
        self.attn_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp_norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, mlp * width)
        self.down = nn.Linear(mlp * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(batch, seq, width)`` -> the same shape."""
        b, s, d = x.shape
        h, hd = self.heads, d // self.heads
        qkv = self.qkv(self.attn_norm(x)).reshape(b, s, 3, h, hd).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # (b, heads, s, hd)
        att = torch.matmul(q, k.transpose(-2, -1)) * (hd ** -0.5)
        pos = torch.arange(s, device=x.device)
        bias = torch.zeros(s, s, device=x.device, dtype=x.dtype).masked_fill(
            pos[:, None] < pos[None, :], float("-inf"))
        att = (att + bias).softmax(dim=-1)
        o = torch.matmul(att, v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(o)
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class Decoder(nn.Module):
    """A decoder whose token embedding is tied to the LM head.

    ``tokens (batch, seq)`` -> ``embed`` -> the blocks -> ``norm`` (when
    ``final_norm``) -> ``head`` -> logits ``(batch, seq, vocab)``. The blocks
    run through :func:`torch_xla_ext.scan_layers` when ``use_scan`` (an
    attribute, so a copy of one model can run either way), else in a Python
    loop. ``head.weight is embed.weight``: ``parameters()`` yields it once.

    Args:
        vocab: vocabulary size.
        width: model width.
        num_layers: how many blocks.
        make_block: builds one block (called ``num_layers`` times, after the
            embedding is created); default ``MLPBlock(width, 4 * width)``.
        final_norm: a LayerNorm between the blocks and the head.
        embed_std: when given, the tied weight is re-drawn from
            ``N(0, embed_std**2)`` after every module is built.
        use_scan: run the blocks with ``scan_layers`` (True) or a loop.

    ``partition_fn`` (an attribute, default None) is passed to ``scan_layers``:
    a remat policy of :mod:`torch_xla_ext.remat`.
    """

    partition_fn: Callable | None = None

    def __init__(self, vocab: int, width: int, num_layers: int,
                 make_block: Callable[[], nn.Module] | None = None, *,
                 final_norm: bool = False, embed_std: float | None = None, use_scan: bool = True) -> None:
        super().__init__()
        self.use_scan = use_scan
        self.embed = nn.Embedding(vocab, width)
        make = make_block or (lambda: MLPBlock(width, 4 * width))
        self.layers = nn.ModuleList(make() for _ in range(num_layers))
        self.norm = nn.LayerNorm(width) if final_norm else None
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        if embed_std is not None:
            nn.init.normal_(self.embed.weight, std=embed_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Integer ``tokens (batch, seq)`` -> logits ``(batch, seq, vocab)``."""
        h = self.embed(tokens)
        if self.use_scan:
            h = scan_layers(self.layers, h, self.partition_fn)
        else:
            for layer in self.layers:
                h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h)
