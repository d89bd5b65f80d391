"""A program lowered for a 1-D mesh of N devices, annotated for M: how a slice of 128 or more chips is lowered.

PyTorch's autograd engine counts a backend's devices in an 8-bit index
(``c10::DeviceIndex``): with 128 or more XLA devices in one process the
count wraps and every backward fails an internal assert (torch 2.9, measured
here at 128 and 256 devices; 127 work). A TPU job never meets this, each
host seeing only its own chips, but a virtual mesh of a 256-chip slice in
one process does.

The step is therefore lowered on a smaller virtual mesh and re-annotated.
GSPMD's input is the unpartitioned program: global shapes, with shardings
that name devices. On a 1-D mesh every sharding is either replicated or
splits one dimension over all N devices, so the program for M devices is
the same text with each such sharding splitting that dimension over M
devices instead, provided every sharded dimension divides by M (checked by
the compiler: GSPMD would pad an uneven one, which a program lowered for M
would not). Anything else (a 2-D tiling, partial replication, manual
sharding, a collective written into the program) is refused, never
rewritten: the widened program is then not known to be the one M devices
would lower. ``test_tpu_fit.py`` checks that a program lowered for 8 and
widened to 16 compiles to the figures of the one lowered for 16.
"""

from __future__ import annotations

import re

__all__ = ["widen_shardings"]

_TILED = re.compile(r"devices=\[(?P<dims>[\d,]+)\](?P<devices><=\[[\d,]+\](?:T\([\d,]+\))?|[\d,]+)(?P<rest>[^,}{]*)")
# What the text holds where a sharding is not a 1-D mesh's (matched where the printer writes it, so a
# name in the metadata does not count): the word each refusal names.
_REFUSED = {"{maximal": "maximal", "{manual": "manual", "last_tile_dim": "last_tile_dim",
            "replica_groups=": "replica_groups", '"SPMDFullToShardShape"': "SPMDFullToShardShape",
            '"SPMDShardToFullShape"': "SPMDShardToFullShape"}


def widen_shardings(text: str, devices: int, to: int) -> str:
    """``text`` (an HLO module) with every sharding over ``devices`` devices of a 1-D mesh made one over ``to``.

    ValueError naming what it found for anything but replicated shardings
    and shardings that split one dimension over all ``devices`` in order.
    """
    for mark, word in _REFUSED.items():
        if mark in text:
            raise ValueError(f"widen_shardings: the program holds {word!r}; only a 1-D mesh's shardings "
                             f"(one dimension over all {devices} devices, or replicated) can be widened")
    in_order = ",".join(str(d) for d in range(devices))

    def widen(found: re.Match) -> str:
        dims = [int(d) for d in found.group("dims").split(",")]
        listed = found.group("devices")
        ordered = listed == in_order or listed == f"<=[{devices}]"
        if not ordered or sorted(dims)[-1] != devices or any(d != 1 for d in sorted(dims)[:-1]):
            raise ValueError(f"widen_shardings: {found.group(0)!r} does not split one dimension over all "
                             f"{devices} devices in order; only a 1-D mesh's shardings can be widened")
        rest = found.group("rest")
        if rest.strip() and not rest.strip().startswith("metadata="):
            raise ValueError(f"widen_shardings: {found.group(0)!r} carries more than a tiling")
        wide = ",".join(str(to if d == devices else d) for d in dims)
        return f"devices=[{wide}]<=[{to}]{rest}"

    return _TILED.sub(widen, text)
