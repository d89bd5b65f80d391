"""The only door to jax and libtpu: libtpu's compile-only client, reached through ``jax.experimental.topologies``.

It compiles a serialized HloModuleProto for a TPU topology on a machine
with no TPU attached (nothing is executed, no TPU is opened) and reads the
compiled program's memory statistics, cost analysis and optimized HLO.
Build options are torch_xla's: SPMD partitioning on, the Shardy partitioner
off (torch_xla emits GSPMD annotations), sharding propagation to the outputs
allowed (without it the gradients come out replicated).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import re
import sys
import tempfile
import time
from typing import Any

__all__ = ["TpuUnavailable", "KNOWN_TOPOLOGIES", "wraparound", "links", "topology_devices", "compile_hlo",
           "compile_sized", "SizedCompile", "CompiledProgram", "MEMORY_FIELDS", "computation_cost", "rewrite_entry",
           "required_bytes", "hbm_buffer_bytes"]

#: Topologies the compile-only client was seen to compile for here (the refusal lists them).
KNOWN_TOPOLOGIES = ("v5e:2x2", "v5e:2x4", "v5p:2x2x1", "v5p:2x2x2", "v6e:2x4")


def required_bytes(peak: int, argument: int, output: int, alias: int, temp: int, generated_code: int,
                   hbm_buffers: int | None = None) -> int:
    """What a compiled program needs in HBM per chip: its HBM buffers and its code.

    ``hbm_buffers`` (:func:`hbm_buffer_bytes`, the compiler's own buffer
    assignment) is what the program allocates in HBM: with the generated
    code, the program's HBM. Without it, the compile-only client's memory
    statistics only bound it from above, and their two accounts differ by
    chip (on v5e the peak is the larger, temporaries often 0; on v5p the
    temporaries figure is well above the buffer assignment's own temporary
    buffer: 1.43x the HBM used for Llama-3-8B's step): the larger of the peak
    and arguments + outputs - aliased + temporaries + generated code.
    """
    if hbm_buffers is not None:
        return hbm_buffers + generated_code
    return max(peak, argument + output - alias + temp + generated_code)


class TpuUnavailable(ImportError):
    """jax or libtpu is not installed."""


def _jax() -> tuple[Any, Any, Any]:
    # libtpu takes a machine-wide lock file when it starts, so a second process (a benchmark beside a test
    # run) fails with "Internal error when accessing libtpu multi-process lockfile". The compile-only client
    # opens no chip; libtpu's own switch lets each process load it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies
        from jax._src.lib import _jax as jaxlib_ext
        from jax._src.lib import xla_client
        import libtpu  # noqa: F401  (the compiler itself)
    except ImportError as error:
        raise TpuUnavailable(
            f"torch_xla_ext.tpu needs jax and libtpu ({error.name} is missing): pip install -e '.[tpu]' "
            f"(jax==0.7.1 and libtpu==0.0.21, as torch_xla 2.9's own extras pin them)"
        ) from error
    return topologies, jaxlib_ext, xla_client


def _shape(name: str) -> tuple[str, tuple[int, ...]]:
    """A topology name's generation and axis extents (``"v5p:4x4x4"``: ``("v5p", (4, 4, 4))``); no extents for a
    malformed one (libtpu names it in its refusal)."""
    generation, _, shape = name.partition(":")
    try:
        return generation, tuple(int(extent) for extent in shape.split("x"))
    except ValueError:
        return generation, ()


def wraparound(name: str) -> tuple[bool, bool, bool]:
    """Which axes of a slice of topology ``name`` close into rings, as the real slice's links do.

    The compiler plans collectives over the links it is told of, and libtpu's
    default for a named topology is a mesh, rings closed on no axis. A real
    slice is a torus where its shape allows: on v4 and v5p (libtpu also names
    it ``v5``) every slice built of whole 4x4x4 cubes (each axis a multiple
    of 4) closes all three axes; on v5e and v6e an axis as long as the pod's,
    16 chips, closes. Measured on Llama-3 8B's step for ``v5p:4x4x4``, the
    mesh plan differed from the torus plan by up to 0.9 GiB of HBM per chip,
    so sizing for a mesh would size another machine.
    """
    generation, dims = _shape(name)
    if generation in ("v4", "v5p", "v5") and len(dims) == 3 and all(extent % 4 == 0 for extent in dims):
        return (True, True, True)
    if generation in ("v5e", "v6e") and len(dims) == 2:
        return (dims[0] == 16, dims[1] == 16, False)
    return (False, False, False)


def links(name: str) -> str:
    """The links :func:`wraparound` gives a slice of topology ``name``, in words: "a 3-D torus", "a mesh"."""
    axes = len(_shape(name)[1])
    closed = [axis + 1 for axis, ring in enumerate(wraparound(name)[:axes]) if ring]
    if not closed:
        return "a mesh"
    if len(closed) == axes:
        return f"a {axes}-D torus"
    return f"a ring on axis {', '.join(map(str, closed))}, a mesh otherwise"


@functools.cache
def topology_devices(name: str) -> tuple:
    """The compile-only devices of a slice of topology ``name`` (``"v5p:2x2x2"``); ValueError for an unknown one.

    The slice has the torus links a real one of that shape has (:func:`wraparound`).
    """
    topologies, _, _ = _jax()
    wrap = wraparound(name)
    closed = {"wrap": wrap} if any(wrap) else {}
    with _quiet_stderr():  # libtpu warns that it finds no TPU host: there is none, by design
        try:
            return tuple(topologies.get_topology_desc(topology_name=name, platform="tpu", **closed).devices)
        except Exception as error:  # noqa: BLE001 - libtpu's own error type varies by version
            raise ValueError(
                f"tpu.compile: libtpu does not know the topology {name!r} ({str(error).splitlines()[0][:200]}); "
                f"seen to work here: {', '.join(KNOWN_TOPOLOGIES)}"
            ) from None


def compile_hlo(hlo: bytes, devices: tuple, dump_to: str | None = None) -> Any:
    """Compile ``hlo`` (a serialized HloModuleProto, SPMD-partitioned over ``len(devices)``) for ``devices``.

    ``dump_to``: a directory where the compiler writes its programs and buffer assignment
    (:func:`hbm_buffer_bytes` reads it).
    """
    _, jaxlib_ext, xla_client = _jax()
    import numpy as np

    options = xla_client.CompileOptions()
    build = options.executable_build_options
    build.num_replicas = 1
    build.num_partitions = len(devices)
    build.use_spmd_partitioning = True
    build.use_shardy_partitioner = False
    build.allow_spmd_sharding_propagation_to_output = [True]
    build.device_assignment = xla_client.DeviceAssignment.create(np.arange(len(devices)).reshape(1, len(devices)))
    if dump_to is not None:
        build.debug_options.xla_dump_to = dump_to
    module = jaxlib_ext.mlir.hlo_to_stablehlo(hlo)
    return devices[0].client.compile(module, jaxlib_ext.DeviceList(devices), options)


#: The compiler's memory statistics a description reads (``CompiledMemoryStats``' field names).
MEMORY_FIELDS = ("peak_memory_in_bytes", "argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
                 "temp_size_in_bytes", "generated_code_size_in_bytes")


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    """What describing a compiled program reads, without its executable: plain data a process can hand on."""

    #: The compiler's memory statistics, by :data:`MEMORY_FIELDS` name.
    memory: dict[str, int]
    #: The optimized program, a serialized HloModuleProto, and its text (XLA's cost analysis reads the text).
    optimized: bytes
    optimized_text: str

    @classmethod
    def of(cls, executable: Any) -> CompiledProgram:
        stats = executable.get_compiled_memory_stats()
        module = executable.hlo_modules()[0]
        return cls({name: int(getattr(stats, name)) for name in MEMORY_FIELDS},
                   module.as_serialized_hlo_module_proto(), module.to_string())


@dataclasses.dataclass(frozen=True)
class SizedCompile:
    """One compile of :func:`compile_sized`: the compiled program, or the compiler's refusal for HBM."""

    program: CompiledProgram | None
    seconds: float
    #: :func:`hbm_buffer_bytes` of the compile (None: refused, or no buffer assignment written).
    hbm_buffer_bytes: int | None
    #: The first line of the compiler's ``RESOURCE_EXHAUSTED`` error when the program's temporaries exceed HBM.
    refusal: str | None = None


def compile_sized(hlo: bytes, devices: tuple) -> SizedCompile:
    """:func:`compile_hlo` with the compiler's buffer assignment read, timed; running out of HBM is an answer.

    Any other compile error is raised. The executable is not kept: nothing
    can run it here, and the program it was compiled to says all there is.
    """
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="txe_tpu_") as dump:
        try:
            executable = compile_hlo(hlo, devices, dump_to=dump)
        except Exception as error:  # noqa: BLE001 - XlaRuntimeError; only HBM exhaustion is an answer
            message = str(error)
            if "RESOURCE_EXHAUSTED" not in message:
                raise
            return SizedCompile(None, time.perf_counter() - start, None, message.splitlines()[0][:400])
        seconds = time.perf_counter() - start
        return SizedCompile(CompiledProgram.of(executable), seconds, hbm_buffer_bytes(dump))


_ALLOCATION = re.compile(r"allocation \d+: size (\d+), (?:color (\d+), )?")


def hbm_buffer_bytes(dump_dir: str) -> int | None:
    """Bytes of the compiled program's buffers in HBM, per chip, from the buffer assignment in ``dump_dir``.

    The compiler assigns each buffer a memory space (its "color"): 0 is HBM;
    the others are on-chip memories (on TPU the largest, color 1, is the
    vector memory its memory-space assignment prefetches into; programs on
    v5e were measured using up to 112 MiB of it). The compile-only client's
    ``peak_memory_in_bytes`` adds color 1 to HBM for some programs and not
    for others (measured on v5e: a program whose HBM buffers are 160 MiB
    reports a 272 MiB peak, 112 MiB of it color 1), so a small program's
    peak can be mostly on-chip memory.
    The sum of the color-0 allocations is what the program holds in HBM
    while it runs: arguments, outputs (an output that reuses an argument's
    buffer counted once), constants, and the preallocated temporary buffer
    (sized by the compiler's peak of live temporaries). None when the dump
    holds no buffer assignment.
    """
    found = glob.glob(os.path.join(dump_dir, "*after_optimizations-buffer-assignment.txt"))
    totals = []
    for path in found:
        total = 0
        with open(path) as f:
            for line in f:
                m = _ALLOCATION.match(line)
                if m is not None and int(m.group(2) or 0) == 0:
                    total += int(m.group(1))
        totals.append(total)
    # One module per compile here; were the compiler to emit helper modules too, the program is the largest.
    return max(totals) if totals else None


def rewrite_entry(hlo: bytes, shardings: dict[int, str], aliases: dict[int, int],
                  widen: tuple[int, int] | None = None) -> bytes:
    """``hlo`` (a serialized HloModuleProto) with entry parameters sharded and outputs aliased to parameters.

    ``shardings``: parameter number -> HLO sharding text, for parameters
    that have none (a placeholder's: see ``_placeholders``). ``aliases``:
    index in the entry's result tuple -> parameter number whose buffer that
    result may reuse (torch_xla donates the buffer of a tensor a step
    updates in place). Done on the module's text and parsed back by XLA's
    own parser, which checks the result. ``widen=(n, m)``: the program was
    lowered for a 1-D mesh of ``n`` devices and is annotated for ``m``
    (``_widen.widen_shardings``).
    """
    import re

    _, jaxlib_ext, xla_client = _jax()
    options = jaxlib_ext.HloPrintOptions()
    options.print_large_constants = True  # by default XLA prints a constant of more than a few elements as
    # "{...}", which its parser reads back as another value: the program would not be the one lowered
    text = xla_client.XlaComputation(hlo).get_hlo_module().to_string(options)
    if "{...}" in text:
        raise ValueError("rewrite_entry: the module's text elides a constant; it cannot be rewritten")
    lines = text.splitlines()
    entry = next(n for n, line in enumerate(lines) if line.startswith("ENTRY "))
    pending = dict(shardings)
    for n in range(entry + 1, len(lines)):
        if lines[n].startswith("}"):
            break
        found = re.search(r" parameter\((\d+)\)", lines[n])
        if found is None or int(found.group(1)) not in pending:
            continue
        if "sharding=" in lines[n]:
            raise ValueError(f"rewrite_entry: parameter {found.group(1)} already has a sharding")
        spec = pending.pop(int(found.group(1)))
        lines[n] = lines[n][:found.end()] + f", sharding={spec}" + lines[n][found.end():]
    if pending:
        raise ValueError(f"rewrite_entry: no entry parameter numbered {sorted(pending)}")
    if aliases:
        if "input_output_alias=" in lines[0]:
            raise ValueError("rewrite_entry: the module aliases outputs already")
        pairs = ", ".join(f"{{{out}}}: ({param}, {{}}, may-alias)" for out, param in sorted(aliases.items()))
        head = re.match(r"HloModule [^ ,]+", lines[0])
        lines[0] = lines[0][:head.end()] + f", input_output_alias={{ {pairs} }}" + lines[0][head.end():]
    text = "\n".join(lines)
    if widen is not None:
        from ._widen import widen_shardings

        text = widen_shardings(text, *widen)
    return jaxlib_ext.hlo_module_from_text(text).as_serialized_hlo_module_proto()


def computation_cost(module_text: str, computation: str | None = None) -> dict[str, float]:
    """XLA's cost analysis (flops, bytes accessed, ...) of one computation of an optimized module's text.

    ``computation`` None analyses the entry. Another computation (a loop
    body) is analysed as if it were the entry: each loop inside it counted
    once, as XLA counts them. The compile-only client has no cost model, so
    the host's CPU client runs the analysis; it reads the TPU program as
    written (flops do not depend on the device; bytes use the shapes' sizes).
    """
    import re

    _, jaxlib_ext, xla_client = _jax()
    if computation is not None:
        lines = module_text.splitlines()
        found = False
        for n, line in enumerate(lines):
            if line.startswith("HloModule "):
                # The entry's layout and aliases no longer describe the entry.
                lines[n] = re.sub(r", (entry_computation_layout|input_output_alias)=\{.*?\}(?=, [a-z_]+=|$)", "",
                                  line)
            elif line.startswith("ENTRY "):
                lines[n] = line[len("ENTRY "):]
            elif line.startswith(f"%{computation} ("):
                lines[n] = "ENTRY " + line
                found = True
        if not found:
            raise ValueError(f"computation_cost: no computation {computation!r} in the module")
        module_text = "\n".join(lines)
    module = jaxlib_ext.hlo_module_from_text(module_text)
    return dict(jaxlib_ext.hlo_module_cost_analysis(_cpu_client(), module))


@functools.cache
def _cpu_client() -> Any:
    """A CPU client of our own for the cost analysis: ``jax.devices("cpu")`` would start every backend
    JAX finds, a TPU host's chips included."""
    _, _, xla_client = _jax()
    return xla_client.make_cpu_client()


class _quiet_stderr:
    """Silence file descriptor 2 (libtpu's C++ logging) while libtpu starts; Python's own stderr is left alone."""

    def __enter__(self) -> None:
        sys.stderr.flush()
        self._saved = os.dup(2)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.close(devnull)

    def __exit__(self, *exc: object) -> None:
        os.dup2(self._saved, 2)
        os.close(self._saved)
