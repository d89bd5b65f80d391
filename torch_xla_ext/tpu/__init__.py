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
assignment reaches), per chip; ``fits`` compares what the program needs
(:attr:`CompiledForTpu.required_bytes`: its buffers in HBM as the
compiler's buffer assignment places them, and its code) with the chip's
HBM. A program whose temporaries exceed HBM fails to compile
(``RESOURCE_EXHAUSTED``); that is reported as ``fits=False`` with the
compiler's message, not raised. What they are not: no step time (nothing
runs), no host memory of the real job, no data loading.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator, Sequence

import torch

from .._format import format_bytes
from .._scan.backend import CPU_CODEGEN_ENV, CPU_CODEGEN_MARK, forced_cpu_codegen
from .._placeholders import parameter_shardings
from ._client import (CompiledProgram, SizedCompile, TpuUnavailable, compile_sized, computation_cost, required_bytes,
                      rewrite_entry, topology_devices)
from ..hlo import HloModule, read_hlo
from ..lowering import LoweringContext
from ..transfer_guard import no_host_transfers

__all__ = ["CompiledForTpu", "TpuUnavailable", "compile", "lowering", "HBM_BYTES"]

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
    #: The compiler's own temporaries figure: on v5e often 0 while ``peak_bytes`` is well above arguments +
    #: outputs, on v5p possibly above ``peak_bytes`` (see :attr:`required_bytes`).
    temp_bytes: int
    generated_code_bytes: int
    #: XLA's cost analysis per chip, each while body counted as many times as its loop runs; None when
    #: a loop's trip count is unknown (XLA itself counts a body once, which would be too low).
    flops: float | None
    bytes_accessed: float | None
    while_loops: int
    compile_seconds: float
    #: The partitioned program's collectives: kind -> (count, operand bytes) per chip, those in a loop
    #: body counted once per trip (once when its trip count is unknown: see ``trip_counts``). One
    #: collective is one channel, however the compiler splits it (asynchronous start / done pieces).
    collectives: dict[str, tuple[int, int]]
    #: The compiler's refusal when the program's temporaries exceed HBM (then the byte counts are 0).
    error: str | None = None
    #: Each while loop's trip count in the compiled program (None: unknown), in the program's order.
    trip_counts: tuple[int | None, ...] = ()
    #: The program's buffers in HBM (memory space 0 of the compiler's buffer assignment: arguments,
    #: outputs, constants, temporaries), without the on-chip memory ``peak_bytes`` may include
    #: (:func:`~torch_xla_ext.tpu._client.hbm_buffer_bytes`); None when the compiler wrote none.
    hbm_buffer_bytes: int | None = None

    @property
    def hbm_used_bytes(self) -> int | None:
        """What the program holds in HBM per chip: its HBM buffers and its generated code (None: unknown).

        The figure to compare programs by: ``peak_bytes`` can include the
        chip's on-chip vector memory, which at small sizes is most of it.
        """
        if self.hbm_buffer_bytes is None:
            return None
        return self.hbm_buffer_bytes + self.generated_code_bytes

    @property
    def required_bytes(self) -> int:
        """What ``fits`` compares with HBM (:func:`~torch_xla_ext.tpu._client.required_bytes`)."""
        return required_bytes(self.peak_bytes, self.argument_bytes, self.output_bytes, self.alias_bytes,
                              self.temp_bytes, self.generated_code_bytes, self.hbm_buffer_bytes)

    @property
    def headroom_bytes(self) -> int:
        """HBM left over what the program needs (:attr:`required_bytes`; negative: over by that much)."""
        return self.hbm_bytes - self.required_bytes

    def __str__(self) -> str:
        rows = [("topology", f"{self.topology} ({self.chips} x {self.device_kind}, "
                             f"{format_bytes(self.hbm_bytes)} HBM each)"),
                ("fits", "yes" if self.fits else "NO")]
        if self.error is not None:
            rows.append(("compiler", self.error))
        else:
            rows += [("needs per chip", f"{format_bytes(self.required_bytes)} "
                                        f"({100 * self.required_bytes / self.hbm_bytes:.1f}% of HBM, headroom "
                                        f"{format_bytes(self.headroom_bytes)})"),
                     ("peak per chip", format_bytes(self.peak_bytes)),
                     ("HBM used", "unknown" if self.hbm_used_bytes is None
                      else f"{format_bytes(self.hbm_used_bytes)} (buffers and code, no on-chip memory)"),
                     ("arguments", format_bytes(self.argument_bytes)),
                     ("outputs", f"{format_bytes(self.output_bytes)} ({format_bytes(self.alias_bytes)} aliased)"),
                     ("temporaries", format_bytes(self.temp_bytes)),
                     ("generated code", format_bytes(self.generated_code_bytes))]
            if self.trip_counts:
                rows.append(("while loops", ", ".join("trip count unknown" if n is None else f"{n} trips"
                                                      for n in self.trip_counts)))
            if self.flops is None:
                rows.append(("flops", "not given: a while loop's trip count is unknown"))
            else:
                rows += [("flops", f"{self.flops:.4g}"), ("bytes accessed", f"{self.bytes_accessed:.4g}")]
            for kind, (count, size) in sorted(self.collectives.items()):
                rows.append((kind, f"{count} x, {format_bytes(size)}"))
        rows.append(("TPU compile", f"{self.compile_seconds:.2f} s"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


@contextlib.contextmanager
def lowering() -> Iterator[None]:
    """Build the program for :func:`compile` in here: scans lower as they would on a TPU.

    On this machine's CPU device, scans lower with choices that only help
    XLA:CPU's code generation (a guard on each sliced layer, stacked layers
    merged to one dimension); a TPU job's program has neither, and
    :func:`compile` refuses a program that has them. The same as
    ``TORCH_XLA_EXT_CPU_CODEGEN=0`` for the block.
    """
    with forced_cpu_codegen(False):
        yield


def compile(outputs: torch.Tensor | Sequence[torch.Tensor], topology: str, *,  # noqa: A001
            donated: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> CompiledForTpu:
    """Compile the pending graph of ``outputs`` for ``topology`` with libtpu's compile-only client.

    ``donated``: ``(before, after)`` pairs of a tensor the step updates in
    place: ``before`` a tensor over its old device data (``t.clone()`` taken
    before the step shares it), ``after`` the tensor itself. ``after``'s
    result may reuse ``before``'s buffer, as torch_xla's ``sync`` donates the
    buffer of a tensor updated in place; ``after`` is added to the outputs.
    Without it a step's parameters and optimizer state count twice, as
    arguments and as outputs. Parameters over placeholders (tensors with a
    shape and no data, :mod:`torch_xla_ext.tpu.fit`) get the sharding they
    were marked with.

    Raises ValueError for an unknown topology, a program partitioned over
    another number of devices than the topology's chips, one built with
    the XLA:CPU lowering choices (build it inside :func:`lowering`), or a
    donated pair whose shapes or dtypes differ or whose ``before`` the
    program does not read, and :class:`TpuUnavailable` (an ImportError)
    without jax and libtpu (``pip install -e '.[tpu]'``), each before
    anything is compiled.
    """
    return _compile(outputs, topology, donated, widen=False)


def _compile(outputs: torch.Tensor | Sequence[torch.Tensor], topology: str,
             donated: Sequence[tuple[torch.Tensor, torch.Tensor]], widen: bool) -> CompiledForTpu:
    """:func:`compile`. ``widen``: a program lowered on a 1-D mesh of a divisor of the topology's chips is
    annotated for all of them (:mod:`torch_xla_ext.tpu._widen`: how ``tpu_fit`` lowers a slice of 128 chips
    or more)."""
    return _compile_lowered(_lower(outputs, topology, donated, widen), topology)


def _compile_lowered(hlo: bytes, topology: str) -> CompiledForTpu:
    """Compile :func:`_lower`'s program ``hlo`` for ``topology`` and describe it."""
    return _described(compile_sized(hlo, topology_devices(topology)), hlo, topology)


def _lower(outputs: torch.Tensor | Sequence[torch.Tensor], topology: str,
           donated: Sequence[tuple[torch.Tensor, torch.Tensor]], widen: bool) -> bytes:
    """:func:`compile`'s checks and its program, as a serialized HloModuleProto ready for the TPU compiler:
    entry parameters sharded, donated buffers aliased, widened to the topology's chips where asked."""
    tensors = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
    if not tensors or not all(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in tensors):
        raise TypeError("tpu.compile: outputs must be an XLA tensor or a non-empty sequence of XLA tensors")
    pairs = list(donated)
    for k, pair in enumerate(pairs):
        if not (isinstance(pair, tuple) and len(pair) == 2
                and all(isinstance(t, torch.Tensor) and t.device.type == "xla" for t in pair)):
            raise TypeError(f"tpu.compile: donated[{k}] must be a (before, after) pair of XLA tensors")
        before, after = pair
        if before.shape != after.shape or before.dtype != after.dtype:
            raise ValueError(f"tpu.compile: donated[{k}] pairs {tuple(before.shape)} {before.dtype} with "
                             f"{tuple(after.shape)} {after.dtype}; a buffer is reused only by its own shape")
    if not isinstance(topology, str) or not re.fullmatch(r"v\d+[a-z]*:\d+(x\d+)*", topology):
        raise ValueError(f"tpu.compile: topology must name a TPU slice like 'v5p:2x2x2' or 'v5e:2x4', "
                         f"got {topology!r}")
    devices = topology_devices(topology)
    import torch_xla.runtime as xr

    partitions = xr.global_runtime_device_count()
    widened = (partitions, len(devices)) if widen and partitions < len(devices) else None
    if widened is not None and len(devices) % partitions:
        raise ValueError(f"tpu.compile: a program lowered for {partitions} devices cannot be widened to "
                         f"{topology}'s {len(devices)} chips: {partitions} does not divide {len(devices)}")
    if partitions != len(devices) and widened is None:
        raise ValueError(
            f"tpu.compile: the program is partitioned over {partitions} devices but {topology} has "
            f"{len(devices)} chips; build it on a mesh of {len(devices)} devices (on this machine: "
            f"CPU_NUM_DEVICES={len(devices)} before torch_xla is imported)"
        )
    kind = devices[0].device_kind
    hbm = HBM_BYTES.get(kind)
    if hbm is None:
        raise ValueError(f"tpu.compile: no HBM capacity known for {kind!r} ({topology}); known: {sorted(HBM_BYTES)}")
    positions = {id(t): n for n, t in enumerate(tensors)}
    for _, after in pairs:
        if id(after) not in positions:
            positions[id(after)] = len(tensors)
            tensors.append(after)
    with no_host_transfers():
        ctx = LoweringContext("tpu_compile")
        ctx.build(tensors)
        hlo = ctx.hlo()
    lowered = ctx.module  # the reader's view of the same bytes, parsed once
    shardings = parameter_shardings(ctx)
    aliases: dict[int, int] = {}
    if pairs:
        numbers = ctx.tensor_parameter_ids([before for before, _ in pairs])
        for k, ((_, after), number) in enumerate(zip(pairs, numbers)):
            if number < 0:
                raise ValueError(f"tpu.compile: donated[{k}]'s before tensor is not device data the program "
                                 f"reads (take it with t.clone() before the step updates t)")
            if number in aliases.values() or positions[id(after)] in aliases:
                raise ValueError(f"tpu.compile: donated[{k}] gives a buffer or a result a second time; each "
                                 f"buffer is reused by one result")
            aliases[positions[id(after)]] = number
    if shardings or aliases or widened:
        hlo = rewrite_entry(hlo, shardings, aliases, widened)
        lowered = read_hlo(hlo)
    cpu_only = sorted({c.name for c in lowered.computations if CPU_CODEGEN_MARK in c.name})
    if cpu_only:
        raise ValueError(
            f"tpu.compile: the program holds {len(cpu_only)} computation(s) lowered with XLA:CPU-only choices "
            f"({', '.join(cpu_only[:3])}{', ...' if len(cpu_only) > 3 else ''}), which a TPU job's program does "
            f"not have; build the program inside `with tpu.lowering():` (or with {CPU_CODEGEN_ENV}=0)"
        )
    return hlo


def _described(compiled: SizedCompile, hlo: bytes, topology: str) -> CompiledForTpu:
    """The figures of ``compiled``, a :func:`~torch_xla_ext.tpu._client.compile_sized` of ``hlo`` for
    ``topology`` (``tpu_fit`` compiles in a process of its own and describes the program it hands back)."""
    devices = topology_devices(topology)
    if compiled.program is None:
        kind = devices[0].device_kind
        return CompiledForTpu(topology, len(devices), kind, HBM_BYTES[kind], False, 0, 0, 0, 0, 0, 0, None, None,
                              0, compiled.seconds, {}, error=compiled.refusal)
    return _describe(compiled.program, read_hlo(hlo), topology, devices, compiled.seconds,
                     compiled.hbm_buffer_bytes)


def _describe(program: CompiledProgram, lowered: HloModule, topology: str, devices: tuple, seconds: float,
              hbm_buffers: int | None = None) -> CompiledForTpu:
    """The figures of ``program``, compiled for ``devices`` from the program ``lowered``.

    Also what the benchmarks use for a program another front end (JAX) compiled for the same devices
    (``CompiledProgram.of(executable)``). ``hbm_buffers``: :func:`~torch_xla_ext.tpu._client.hbm_buffer_bytes`
    of its compile.
    """
    kind = devices[0].device_kind
    hbm = HBM_BYTES[kind]
    stats = program.memory
    optimized = read_hlo(program.optimized)
    trips = _trip_counts(optimized, lowered)
    flops, bytes_accessed = _trip_counted_cost(optimized, trips, program.optimized_text)
    runs = _runs_per_computation(optimized, trips)
    collectives: dict[str, tuple[int, int]] = {}
    channels: set[int] = set()
    for c in optimized.collectives():
        # The TPU compiler splits an asynchronous collective into start, continuation and done fusions,
        # each holding a copy of the instruction with the collective's channel: count the channel once.
        if c.channel_id is not None:
            if c.channel_id in channels:
                continue
            channels.add(c.channel_id)
        # It emits a reduce-scatter as an all-reduce inside an "all-reduce-scatter" fusion (the operand
        # is the whole gradient, as a reduce-scatter's is).
        what = "reduce-scatter" if c.kind == "all-reduce" and c.computation.startswith("all-reduce-scatter") else c.kind
        times = runs.get(c.computation)
        times = 1 if times is None else times
        count, size = collectives.get(what, (0, 0))
        collectives[what] = (count + times, size + times * c.operand_bytes)
    result = CompiledForTpu(
        topology=topology, chips=len(devices), device_kind=kind, hbm_bytes=hbm, fits=False,
        peak_bytes=stats["peak_memory_in_bytes"], argument_bytes=stats["argument_size_in_bytes"],
        output_bytes=stats["output_size_in_bytes"], alias_bytes=stats["alias_size_in_bytes"],
        temp_bytes=stats["temp_size_in_bytes"], generated_code_bytes=stats["generated_code_size_in_bytes"],
        flops=flops, bytes_accessed=bytes_accessed, while_loops=len(trips), compile_seconds=seconds,
        collectives=collectives, trip_counts=tuple(trips.values()), hbm_buffer_bytes=hbm_buffers,
    )
    return dataclasses.replace(result, fits=result.required_bytes <= hbm)


def _trip_counts(optimized: HloModule, lowered: HloModule) -> dict[str, int | None]:
    """Each loop of the compiled program (by instruction name) -> its trip count, None when unknown.

    The compiler rewrites a loop's counter (on TPU into a pair of 32-bit
    words), so the count is read from the loop it came from in the lowered
    program (the one with the compiled loop's op name, or named by the last
    part of it: a torch_xla loop carries no op name of its own) and
    accepted only when the compiled condition still compares with that
    count: a loop the compiler unrolled or otherwise re-counted is unknown.
    """
    by_name = {w.instruction.name: w.trip_count for w in lowered.while_loops()}
    by_op_name: dict[str, int | None] = {}
    for w in lowered.while_loops():
        if w.op_name:  # a front end's own op name (JAX's "jit(f)/while"): only a unique one identifies a loop
            by_op_name[w.op_name] = None if w.op_name in by_op_name else w.trip_count
    trips: dict[str, int | None] = {}
    for w in optimized.while_loops():
        n = w.trip_count
        if n is None and w.op_name:
            source = by_op_name.get(w.op_name, by_name.get(w.op_name.rsplit("/", 1)[-1]))
            n = source if source is not None and source in w.condition_constants else None
        trips[w.instruction.name] = n
    return trips


def _trip_counted_cost(optimized: HloModule, trips: dict[str, int | None],
                       text: str) -> tuple[float | None, float | None]:
    """(flops, bytes accessed) of the compiled program with each loop body counted once per trip."""
    entry = optimized.entry.name
    loops_in: dict[str, list] = {}
    for w in optimized.while_loops():
        loops_in.setdefault(w.computation, []).append(w)
    bodies = {w.body for w in optimized.while_loops()}
    if any(trips[w.instruction.name] is None or w.body is None for w in optimized.while_loops()):
        return None, None
    if any(holder != entry and holder not in bodies for holder in loops_in):
        return None, None  # a loop inside a called computation: not read here

    once_cache: dict[str, tuple[float, float]] = {}

    def once(computation: str) -> tuple[float, float]:
        """XLA's figures for ``computation`` with each loop inside it counted once (one parse each)."""
        if computation not in once_cache:
            cost = computation_cost(text, None if computation == entry else computation)
            once_cache[computation] = (float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0)))
        return once_cache[computation]

    def counted(computation: str) -> tuple[float, float]:
        flops, accessed = once(computation)
        for w in loops_in.get(computation, ()):
            body_once_flops, body_once_accessed = once(w.body)
            body_flops, body_accessed = counted(w.body)
            n = trips[w.instruction.name]
            flops += n * body_flops - body_once_flops
            accessed += n * body_accessed - body_once_accessed
        return flops, accessed

    return counted(entry)


def _runs_per_computation(optimized: HloModule, trips: dict[str, int | None]) -> dict[str, int | None]:
    """How many times each computation runs per execution of the program (None: a loop's count unknown)."""
    by_id = {c.id: c for c in optimized.computations}
    callers: dict[str, list[tuple[str, int | None]]] = {}
    for comp in optimized.computations:
        for ins in comp.instructions:
            for k, callee_id in enumerate(ins.called_computation_ids):
                callee = by_id.get(callee_id)
                if callee is None:
                    continue
                factor: int | None = 1
                if ins.opcode == "while":
                    n = trips.get(ins.name)
                    factor = None if n is None else (n if k == 0 else n + 1)  # body, then condition
                callers.setdefault(callee.name, []).append((comp.name, factor))
    runs: dict[str, int | None] = {optimized.entry.name: 1}

    def count(name: str, seen: frozenset = frozenset()) -> int | None:
        if name in runs:
            return runs[name]
        if name in seen:  # a cycle: not valid HLO
            return None
        total: int | None = 0
        for caller, factor in callers.get(name, ()):
            caller_runs = count(caller, seen | {name})
            total = None if total is None or caller_runs is None or factor is None else total + caller_runs * factor
        runs[name] = total
        return total

    for comp in optimized.computations:
        count(comp.name)
    return runs
