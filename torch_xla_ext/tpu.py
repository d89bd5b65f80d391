"""Compile a lazy program for a TPU topology here, with no TPU: does it fit, and what it holds per chip.

``tpu.compile(outputs, topology="v5p:2x2x2")`` lowers the pending graph of
``outputs`` through :class:`~torch_xla_ext.LoweringContext` (hoisted tensors
become arguments with their shardings; nothing moves to the host, checked),
compiles it with libtpu's compile-only client for the topology's chips, and
reports the TPU compiler's own per-chip figures. Nothing is executed, on the
TPU or here; the lazy graph stays pending. The program must be partitioned
over as many devices as the topology has chips (an SPMD mesh of that size:
``CPU_NUM_DEVICES`` on this machine).

What the figures are: the compiled program's memory statistics (arguments,
outputs, temporaries, generated code, and the peak the compiler's buffer
assignment reaches), per chip; ``fits`` compares that peak with the chip's
HBM. A program whose temporaries exceed HBM fails to compile
(``RESOURCE_EXHAUSTED``); that is reported as ``fits=False`` with the
compiler's message, not raised. What they are not: no step time (nothing
runs), no host memory of the real job, no data loading.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Sequence

import torch

from ._format import format_bytes
from ._tpu_client import TpuUnavailable, compile_hlo, topology_devices
from .hlo import read_hlo
from .lowering import LoweringContext
from .transfer_guard import no_host_transfers

__all__ = ["CompiledForTpu", "TpuUnavailable", "compile", "HBM_BYTES"]

_GIB = 1 << 30

#: HBM per chip by libtpu's device kind (public specifications).
HBM_BYTES = {"TPU v5 lite": 16 * _GIB, "TPU v5": 95 * _GIB, "TPU v6 lite": 32 * _GIB, "TPU v4": 32 * _GIB}


@dataclasses.dataclass(frozen=True)
class CompiledForTpu:
    """The TPU compiler's figures for one program on one topology; every byte count is per chip."""

    topology: str
    chips: int
    device_kind: str
    hbm_bytes: int
    fits: bool
    peak_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    #: XLA's cost analysis per chip; None when the program has a while loop (XLA counts a loop's body
    #: once whatever its trip count, so the figure would be too low).
    flops: float | None
    bytes_accessed: float | None
    while_loops: int
    compile_seconds: float
    #: The partitioned program's collectives: kind -> (count, operand bytes), per chip, loops counted once.
    collectives: dict[str, tuple[int, int]]
    #: The compiler's refusal when the program's temporaries exceed HBM (then the byte counts are 0).
    error: str | None = None

    @property
    def headroom_bytes(self) -> int:
        """HBM left at the peak (negative: over by that much)."""
        return self.hbm_bytes - self.peak_bytes

    def __str__(self) -> str:
        rows = [("topology", f"{self.topology} ({self.chips} x {self.device_kind}, "
                             f"{format_bytes(self.hbm_bytes)} HBM each)"),
                ("fits", "yes" if self.fits else "NO")]
        if self.error is not None:
            rows.append(("compiler", self.error))
        else:
            rows += [("peak per chip", f"{format_bytes(self.peak_bytes)} "
                                       f"({100 * self.peak_bytes / self.hbm_bytes:.1f}% of HBM, headroom "
                                       f"{format_bytes(self.headroom_bytes)})"),
                     ("arguments", format_bytes(self.argument_bytes)),
                     ("outputs", f"{format_bytes(self.output_bytes)} ({format_bytes(self.alias_bytes)} aliased)"),
                     ("temporaries", format_bytes(self.temp_bytes)),
                     ("generated code", format_bytes(self.generated_code_bytes))]
            if self.flops is None:
                rows.append(("flops", f"not given: {self.while_loops} while loop(s), whose bodies XLA counts once"))
            else:
                rows += [("flops", f"{self.flops:.4g}"), ("bytes accessed", f"{self.bytes_accessed:.4g}")]
            for kind, (count, size) in sorted(self.collectives.items()):
                rows.append((kind, f"{count} x, {format_bytes(size)}"))
        rows.append(("TPU compile", f"{self.compile_seconds:.2f} s"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def compile(outputs: torch.Tensor | Sequence[torch.Tensor], topology: str) -> CompiledForTpu:  # noqa: A001
    """Compile the pending graph of ``outputs`` for ``topology`` with libtpu's compile-only client.

    Raises ValueError for an unknown topology or a program partitioned over
    another number of devices than the topology's chips, and
    :class:`TpuUnavailable` (an ImportError) without jax and libtpu
    (``pip install -e '.[tpu]'``), each before anything is lowered.
    """
    tensors = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    if not tensors or not all(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in tensors):
        raise TypeError("tpu.compile: outputs must be an XLA tensor or a non-empty sequence of XLA tensors")
    if not isinstance(topology, str) or not re.fullmatch(r"v\d+[a-z]*:\d+(x\d+)*", topology):
        raise ValueError(f"tpu.compile: topology must name a TPU slice like 'v5p:2x2x2' or 'v5e:2x4', "
                         f"got {topology!r}")
    devices = topology_devices(topology)
    import torch_xla.runtime as xr

    partitions = xr.global_runtime_device_count()
    if partitions != len(devices):
        raise ValueError(
            f"tpu.compile: the program is partitioned over {partitions} devices but {topology} has "
            f"{len(devices)} chips; build it on a mesh of {len(devices)} devices (on this machine: "
            f"CPU_NUM_DEVICES={len(devices)} before torch_xla is imported)"
        )
    kind = devices[0].device_kind
    hbm = HBM_BYTES.get(kind)
    if hbm is None:
        raise ValueError(f"tpu.compile: no HBM capacity known for {kind!r} ({topology}); known: {sorted(HBM_BYTES)}")
    with no_host_transfers():
        ctx = LoweringContext("tpu_compile")
        ctx.build(tensors)
        hlo = ctx.hlo()
    start = time.perf_counter()
    try:
        executable = compile_hlo(hlo, devices)
    except Exception as error:  # noqa: BLE001 - XlaRuntimeError; only HBM exhaustion is an answer
        message = str(error)
        if "RESOURCE_EXHAUSTED" not in message:
            raise
        return CompiledForTpu(topology, len(devices), kind, hbm, False, 0, 0, 0, 0, 0, 0, None, None, 0,
                              time.perf_counter() - start, {}, error=message.splitlines()[0][:400])
    seconds = time.perf_counter() - start
    stats = executable.get_compiled_memory_stats()
    optimized = read_hlo(executable.hlo_modules()[0].as_serialized_hlo_module_proto())
    loops = len(optimized.while_loops())
    cost = executable.cost_analysis() if loops == 0 else {}
    collectives: dict[str, tuple[int, int]] = {}
    for c in optimized.collectives():
        count, size = collectives.get(c.kind, (0, 0))
        collectives[c.kind] = (count + 1, size + c.operand_bytes)
    peak = int(stats.peak_memory_in_bytes)
    return CompiledForTpu(
        topology=topology, chips=len(devices), device_kind=kind, hbm_bytes=hbm, fits=peak <= hbm,
        peak_bytes=peak, argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes), alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes), generated_code_bytes=int(stats.generated_code_size_in_bytes),
        flops=cost.get("flops") if loops == 0 else None,
        bytes_accessed=cost.get("bytes accessed") if loops == 0 else None,
        while_loops=loops, compile_seconds=seconds, collectives=collectives,
    )
