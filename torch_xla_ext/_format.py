"""Small text helpers shared by reports (no torch, no torch_xla)."""

from __future__ import annotations

import re

__all__ = ["clip", "format_bytes", "parse_tiled_spec"]


def format_bytes(n: float) -> str:
    """``520.0 KiB``; whole bytes below 1 KiB (``0 B``)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def clip(text: str, limit: int = 120) -> str:
    """``text``, or its head and tail around ``... (N chars) ...`` when longer than ``limit`` (names in reports)."""
    if len(text) <= limit:
        return text
    keep = max(limit - 30, 10)
    head, tail = keep * 2 // 3, keep - keep * 2 // 3
    return f"{text[:head]}...({len(text)} chars)...{text[len(text) - tail:]}"


_TILED = re.compile(r"\{devices=\[([\d,]+)\]([^ }]*)( last_tile_dim_replicate)?\}")


def parse_tiled_spec(spec: str) -> tuple[tuple[int, ...], str, bool] | None:
    """``(tile dims, device list text, last dim replicates)`` of a tiled sharding string.

    ``"{devices=[4,1,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"`` gives
    ``((4, 1, 2), "0,1,2,3,4,5,6,7", True)``; None for any other form.
    """
    m = _TILED.fullmatch(spec)
    if m is None:
        return None
    return tuple(int(v) for v in m.group(1).split(",")), m.group(2), bool(m.group(3))
