"""The machinery of test/tpu/test_tpu_paths*.py: each path's program registered by name, compiled once for
the topology with the checks every path passes, and the hand counts its figures are checked against
(see test_tpu_paths.py's docstring)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch_xla
import torch_xla.distributed.spmd as xs

import torch_xla_ext as txe
from torch_xla_ext import tpu
from torch_xla_ext.testing import measure_transfers


TOPOLOGY = "v5e:2x4"
FSDP = 8  # devices on the mesh's one axis, chips of the topology
TUPLE = 512  # the tuple a program of several outputs returns them in
L, B, D = 4, 64, 256  # the programs' layers, batch and width


@pytest.fixture(scope="module", autouse=True)
def report_compiles(num_devices):
    """Every compile's figures, printed after the module (shown with -s)."""
    assert num_devices == FSDP
    yield
    print(f"\n{'program':<28} {'peak':>9} {'arguments':>9} {'outputs':>9} {'temp':>6} {'flops':>9} {'loops':>8} "
          f"{'compile':>7}  collectives (count, bytes per chip)")
    for name, c in COMPILED.items():
        r = c.r
        flops = "-" if r.flops is None else f"{r.flops:.3g}"
        loops = ",".join(map(str, r.trip_counts)) or "-"
        print(f"{name:<28} {r.peak_bytes:>9} {r.argument_bytes:>9} {r.output_bytes:>9} {r.temp_bytes:>6} "
              f"{flops:>9} {loops:>8} {r.compile_seconds:>6.2f}s  {dict(sorted(r.collectives.items()))}")


def fsdp_mesh():
    return xs.Mesh(np.arange(FSDP), (FSDP,), ("fsdp",))


def seed() -> None:
    torch.manual_seed(0)
    torch_xla.manual_seed(0)


# --------------------------------------------------------------------------- #
# Hand counts
# --------------------------------------------------------------------------- #

def tpu_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """The bytes a TPU buffer of per-chip ``shape`` takes (layouts seen in v5e compiles).

    The last dim is laid out in rows of 128 elements; 1, 2, 4 or a multiple
    of 8 rows are not padded. A 1-D buffer of up to 128 elements takes one
    row (512 bytes in float32); a scalar takes 512 bytes (a 64-bit one, two
    32-bit words: 1024). Shards that other layouts would pad differently are
    refused, so that a count never guesses.
    """
    if not shape:
        return 512 * max(1, itemsize // 4)
    if len(shape) == 1:
        (n,) = shape
        assert n <= 128 or (n % 128 == 0 and n & (n - 1) == 0), f"a 1-D shard of {n} elements: pick another size"
        return max(n, 128) * itemsize
    assert shape[-1] % 128 == 0 and (shape[-2] in (1, 2, 4) or shape[-2] % 8 == 0), \
        f"shard {shape} is not laid out in whole rows of 128: pick another size"
    return math.prod(shape) * itemsize


def fsdp_spec(shape: tuple[int, ...]) -> tuple:
    """fully_shard's placement of the shapes used here: dim 0 over 'fsdp' (each divides by 8)."""
    assert shape[0] % FSDP == 0, shape
    return ("fsdp",) + (None,) * (len(shape) - 1)


@dataclasses.dataclass(frozen=True)
class Arg:
    """An array the program reads or returns: global shape, dtype, partition spec (None: replicated)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: tuple | None

    @classmethod
    def of(cls, t: torch.Tensor, spec: tuple | None) -> Arg:
        return cls(tuple(t.shape), t.dtype, spec)

    @property
    def chip_bytes(self) -> int:
        shard = self.shape
        if self.spec is not None:
            assert all(a is None or n % FSDP == 0 for n, a in zip(self.shape, self.spec)), self
            shard = tuple(n // FSDP if a == "fsdp" else n for n, a in zip(self.shape, self.spec))
        return tpu_bytes(shard, self.dtype.itemsize)


def param_args(module: nn.Module, sharded: Callable[[nn.Parameter], bool] = lambda p: True) -> list[Arg]:
    return [Arg.of(p, fsdp_spec(tuple(p.shape)) if sharded(p) else None) for p in module.parameters()]


def layer_offsets(n: int) -> list[Arg]:
    """scan_layers' offsets of the n stacked layers (groups): one int64 [1] device tensor each."""
    return [Arg((1,), torch.int64, None)] * n


def outputs_bytes(loss: bool, values: list[Arg]) -> int:
    return (tpu_bytes((), 4) if loss else 0) + sum(a.chip_bytes for a in values) + TUPLE


@dataclasses.dataclass
class Compiled:
    r: tpu.CompiledForTpu
    moved: str | None  # the report of a device-to-host transfer around tpu.compile, None when nothing moved
    lowered: txe.HloModule  # the program tpu.compile lowered
    arguments: int  # the hand counts
    outputs: int | None


def hand_counted_arguments(lowered: txe.HloModule, args: list[Arg]) -> int:
    """``args`` per chip, plus the program's scalar arguments.

    The lowered program's parameters of rank 1 and more must be exactly
    ``args`` (the same global shapes); its rank-0 parameters are numbers
    torch_xla uploads as device data, one TPU scalar each.
    """
    params = lowered.entry_parameters
    scalars = [p for p in params if not tuple(p.shape)]
    arrays = Counter(tuple(p.shape) for p in params if tuple(p.shape))
    assert arrays == Counter(a.shape for a in args), (arrays, Counter(a.shape for a in args))
    assert len(scalars) <= 16, f"{len(scalars)} scalar arguments"
    return sum(a.chip_bytes for a in args) + sum(tpu_bytes((), p.dtype.itemsize) for p in scalars)


BUILDERS: dict[str, Callable[[], tuple[list[torch.Tensor], list[Arg], int | None]]] = {}
COMPILED: dict[str, Compiled] = {}


def path(name: str):
    """Register a builder: ``() -> (outputs, arguments, hand-counted output bytes or None)``."""
    def register(build):
        BUILDERS[name] = build
        return build
    return register


def compiled(name: str, loops: tuple[int, ...] = ()) -> Compiled:
    """The path's program compiled for the topology (once per module), with the checks every path passes."""
    if name not in COMPILED:
        seed()
        outputs, args, out_bytes = BUILDERS[name]()
        ctx = txe.LoweringContext("hand_count")
        ctx.build(outputs)
        lowered = ctx.module
        with measure_transfers() as moved:
            r = tpu.compile(outputs, topology=TOPOLOGY)
        COMPILED[name] = Compiled(r, moved.report() if moved.device_to_host else None, lowered,
                                   hand_counted_arguments(lowered, args), out_bytes)
    c = COMPILED[name]
    r = c.r
    assert c.moved is None, c.moved
    assert r.error is None and r.fits, str(r)
    assert r.chips == FSDP and r.topology == TOPOLOGY and r.device_kind == "TPU v5 lite"
    assert r.argument_bytes <= r.peak_bytes <= r.hbm_bytes
    assert None not in r.trip_counts and r.flops is not None and r.flops > 0 and r.bytes_accessed > 0, str(r)
    assert sorted(r.trip_counts) == sorted(loops), (r.trip_counts, loops)
    assert r.while_loops == len(loops)
    return c


def matmul_flops(m: int, k: int, n: int) -> int:
    return 2 * m * k * n


def opcodes(module: txe.HloModule) -> set[str]:
    return {ins.opcode for c in module.computations for ins in c.instructions}
