"""The only door to jax and libtpu: libtpu's compile-only client, reached through ``jax.experimental.topologies``.

It compiles a serialized HloModuleProto for a TPU topology on a machine
with no TPU attached (nothing is executed, no TPU is opened) and reads the
compiled program's memory statistics, cost analysis and optimized HLO.
Build options are torch_xla's: SPMD partitioning on, the Shardy partitioner
off (torch_xla emits GSPMD annotations), sharding propagation to the outputs
allowed (without it the gradients come out replicated).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

__all__ = ["TpuUnavailable", "KNOWN_TOPOLOGIES", "topology_devices", "compile_hlo", "computation_cost"]

#: Topologies the compile-only client was seen to compile for here (the refusal lists them).
KNOWN_TOPOLOGIES = ("v5e:2x2", "v5e:2x4", "v5p:2x2x1", "v5p:2x2x2", "v6e:2x4")


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


@functools.cache
def topology_devices(name: str) -> tuple:
    """The compile-only devices of topology ``name`` (``"v5p:2x2x2"``); ValueError for an unknown one."""
    topologies, _, _ = _jax()
    with _quiet_stderr():  # libtpu warns that it finds no TPU host: there is none, by design
        try:
            return tuple(topologies.get_topology_desc(topology_name=name, platform="tpu").devices)
        except Exception as error:  # noqa: BLE001 - libtpu's own error type varies by version
            raise ValueError(
                f"tpu.compile: libtpu does not know the topology {name!r} ({str(error).splitlines()[0][:200]}); "
                f"seen to work here: {', '.join(KNOWN_TOPOLOGIES)}"
            ) from None


def compile_hlo(hlo: bytes, devices: tuple) -> Any:
    """Compile ``hlo`` (a serialized HloModuleProto, SPMD-partitioned over ``len(devices)``) for ``devices``."""
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
    module = jaxlib_ext.mlir.hlo_to_stablehlo(hlo)
    return devices[0].client.compile(module, jaxlib_ext.DeviceList(devices), options)


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
                # The entry's layout no longer describes the entry.
                lines[n] = re.sub(r", entry_computation_layout=\{.*?\}(?=, [a-z_]+=|$)", "", line)
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
