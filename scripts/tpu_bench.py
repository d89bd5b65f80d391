"""The ``--tpu TOPOLOGY`` mode of the benchmarks: each method's training step compiled for a TPU topology.

No TPU is needed and nothing runs: libtpu's compile-only client compiles
each method's step (``torch_xla_ext.tpu.compile``; JAX's own step through
``jax.jit(...).lower(...).compile()`` for the same devices) and the TPU
compiler's figures are read the same way for both: per-chip peak HBM,
arguments, temporaries, flops and bytes accessed with every ``while`` body
counted once per trip, collectives (count and operand bytes per chip, loop
bodies once per trip), and TPU compile seconds. The compiler is
deterministic, so one run gives the figures (compile seconds are wall time
on this host, the one noisy column).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torch_xla_ext import tpu
from torch_xla_ext.testing import measure_transfers

MIB = 1 << 20


@dataclass
class TpuRow:
    method: str
    layers: int
    result: tpu.CompiledForTpu | None = None
    note: str = ""


def compile_torch(build: Callable[[], Sequence[torch.Tensor]], topology: str) -> tpu.CompiledForTpu:
    """Build a torch step's lazy outputs (lowered for TPU) and compile them; nothing may move to the host."""
    with tpu.lowering():
        outputs = list(build())
    with measure_transfers() as moved:
        result = tpu.compile(outputs, topology=topology)
    if moved.device_to_host:
        raise RuntimeError(f"tpu.compile moved data to the host: {moved.report()}")
    return result


def compile_jax(jitted, specs: Sequence, topology: str) -> tpu.CompiledForTpu:
    """JAX's own step ``jitted`` (in/out shardings over the topology's devices) compiled for ``topology``."""
    import time

    from torch_xla_ext import _tpu_client
    from torch_xla_ext.hlo import read_hlo
    from torch_xla_ext.tpu import _describe

    devices = _tpu_client.topology_devices(topology)
    lowered = jitted.lower(*specs)
    start = time.perf_counter()
    compiled = lowered.compile()
    seconds = time.perf_counter() - start
    module = read_hlo(lowered.compiler_ir("hlo").as_serialized_hlo_module_proto())
    return _describe(compiled.runtime_executable(), module, topology, devices, seconds)


def collective_bytes(r: tpu.CompiledForTpu) -> int:
    return sum(size for _, size in r.collectives.values())


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def print_table(rows: dict[tuple[str, int], TpuRow], layer_counts: Sequence[int], methods: Sequence[str],
                baseline: str) -> None:
    """Per (L, method): peak / arguments / temporaries (MiB per chip), peak vs ``baseline``, compile s,
    GFLOP and GB accessed per chip, collectives (count, MiB per chip)."""
    head = (f"{'L':>3} {'method':<13} {'peak MiB':>9} {'x ' + baseline:>10} {'args':>8} {'temp':>8} "
            f"{'compile s':>9} {'GFLOP':>8} {'GB acc':>7} {'colls':>6} {'coll MiB':>9}  trips")
    print(head)
    print("-" * len(head))
    for n in layer_counts:
        base = rows.get((baseline, n))
        base_peak = base.result.peak_bytes if base and base.result else None
        for m in methods:
            row = rows.get((m, n))
            if row is None:
                continue
            r = row.result
            if r is None:
                print(f"{n:>3} {m:<13} {row.note}")
                continue
            ratio = r.peak_bytes / base_peak if base_peak else None
            trips = ",".join("?" if t is None else str(t) for t in r.trip_counts) or "-"
            print(f"{n:>3} {m:<13} {r.peak_bytes / MIB:>9.2f} {_fmt(ratio, 2):>10} {r.argument_bytes / MIB:>8.2f} "
                  f"{r.temp_bytes / MIB:>8.2f} {r.compile_seconds:>9.2f} "
                  f"{_fmt(None if r.flops is None else r.flops / 1e9, 3):>8} "
                  f"{_fmt(None if r.bytes_accessed is None else r.bytes_accessed / 1e9, 3):>7} "
                  f"{sum(c for c, _ in r.collectives.values()):>6} {collective_bytes(r) / MIB:>9.2f}  {trips}"
                  + (f"  {row.note}" if row.note else ""))


def plot(rows: dict[tuple[str, int], TpuRow], layer_counts: Sequence[int], methods: Sequence[str], out: str,
         title: str) -> None:
    """Peak HBM per chip and TPU compile seconds against L, one line per method."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for m in methods:
        points = [(n, rows[(m, n)].result) for n in layer_counts if (m, n) in rows and rows[(m, n)].result]
        if not points:
            continue
        axes[0].plot([n for n, _ in points], [r.peak_bytes / MIB for _, r in points], marker="o", label=m)
        axes[1].plot([n for n, _ in points], [r.compile_seconds for _, r in points], marker="o", label=m)
    axes[0].set(xlabel="layers L", ylabel="peak HBM per chip (MiB)", title=f"{title}: peak HBM per chip")
    axes[1].set(xlabel="layers L", ylabel="TPU compile (s, this host)", title=f"{title}: TPU compile time")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
