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
import tempfile
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

    from torch_xla_ext.tpu import _client as _tpu_client
    from torch_xla_ext.hlo import read_hlo
    from torch_xla_ext.tpu import _describe

    devices = _tpu_client.topology_devices(topology)
    lowered = jitted.lower(*specs)
    with tempfile.TemporaryDirectory(prefix="txe_jax_") as dump:
        start = time.perf_counter()
        compiled = lowered.compile(compiler_options={"xla_dump_to": dump})
        seconds = time.perf_counter() - start
        buffers = _tpu_client.hbm_buffer_bytes(dump)
    module = read_hlo(lowered.compiler_ir("hlo").as_serialized_hlo_module_proto())
    return _describe(_tpu_client.CompiledProgram.of(compiled.runtime_executable()), module, topology, devices,
                     seconds, buffers)


def collective_bytes(r: tpu.CompiledForTpu) -> int:
    return sum(size for _, size in r.collectives.values())


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def hbm_mib(r: tpu.CompiledForTpu) -> float | None:
    return None if r.hbm_used_bytes is None else r.hbm_used_bytes / MIB


def print_table(rows: dict[tuple[str, int], TpuRow], layer_counts: Sequence[int], methods: Sequence[str],
                baseline: str) -> None:
    """Per (L, method): HBM used (buffers + code, MiB per chip) and vs ``baseline``, the HBM buffers alone
    and vs ``baseline``, the compiler's peak
    (which may include on-chip memory), arguments, code, compile s, GFLOP and GB accessed per chip,
    collectives (count, MiB per chip)."""
    head = (f"{'L':>3} {'method':<13} {'HBM MiB':>8} {'x ' + baseline:>10} {'buffers':>8} {'x':>5} "
            f"{'peak MiB':>9} {'args':>6} "
            f"{'code':>6} {'compile s':>9} {'GFLOP':>8} {'GB acc':>7} {'colls':>6} {'coll MiB':>9}  trips")
    print(head)
    print("-" * len(head))
    for n in layer_counts:
        base = rows.get((baseline, n))
        base_hbm = hbm_mib(base.result) if base and base.result else None
        base_buf = base.result.hbm_buffer_bytes if base and base.result else None
        for m in methods:
            row = rows.get((m, n))
            if row is None:
                continue
            r = row.result
            if r is None:
                print(f"{n:>3} {m:<13} {row.note}")
                continue
            used = hbm_mib(r)
            ratio = used / base_hbm if used is not None and base_hbm else None
            trips = ",".join("?" if t is None else str(t) for t in r.trip_counts) or "-"
            buf = r.hbm_buffer_bytes
            buf_ratio = buf / base_buf if buf is not None and base_buf else None
            print(f"{n:>3} {m:<13} {_fmt(used, 2):>8} {_fmt(ratio, 2):>10} "
                  f"{_fmt(None if buf is None else buf / MIB, 2):>8} {_fmt(buf_ratio, 2):>5} {r.peak_bytes / MIB:>9.2f} "
                  f"{r.argument_bytes / MIB:>6.2f} {r.generated_code_bytes / MIB:>6.2f} {r.compile_seconds:>9.2f} "
                  f"{_fmt(None if r.flops is None else r.flops / 1e9, 3):>8} "
                  f"{_fmt(None if r.bytes_accessed is None else r.bytes_accessed / 1e9, 3):>7} "
                  f"{sum(c for c, _ in r.collectives.values()):>6} {collective_bytes(r) / MIB:>9.2f}  {trips}"
                  + (f"  {row.note}" if row.note else ""))


def plot(rows: dict[tuple[str, int], TpuRow], layer_counts: Sequence[int], methods: Sequence[str], out: str,
         title: str) -> None:
    """HBM used per chip (buffers + code) and TPU compile seconds against L, one line per method."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for m in methods:
        points = [(n, rows[(m, n)].result) for n in layer_counts
                  if (m, n) in rows and rows[(m, n)].result and rows[(m, n)].result.hbm_used_bytes is not None]
        if not points:
            continue
        axes[0].plot([n for n, _ in points], [hbm_mib(r) for _, r in points], marker="o", label=m)
        axes[1].plot([n for n, _ in points], [r.compile_seconds for _, r in points], marker="o", label=m)
    axes[0].set(xlabel="layers L", ylabel="HBM used per chip (MiB)", title=f"{title}: HBM used per chip")
    axes[1].set(xlabel="layers L", ylabel="TPU compile (s, this host)", title=f"{title}: TPU compile time")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
