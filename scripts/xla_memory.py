"""Device memory of compiled XLA programs, read from XLA's own buffer assignment.

torch_xla 2.9 does not expose a compiled program's memory statistics, and
PJRT's CPU client has no allocator statistics (``xm.get_memory_info`` raises
UNIMPLEMENTED). XLA itself reports them: with ``--xla_dump_to`` every compiled
program leaves a ``*memory-usage-report.txt`` (and the buffer assignment it
summarizes) whose first line is ``Total bytes used: N``, the memory its buffer
assignment allocates on one device
(parameters, outputs and temporaries, after buffer reuse; under SPMD the
partitioned per-device program). torch_xla and JAX read the same
``XLA_FLAGS``, so both are measured the same way.

The same dump holds each program after XLA's optimizations (``*after_optimizations.hlo.pb``,
an ``xla.HloProto`` wrapping the ``HloModuleProto``), which :meth:`Programs.largest_module`
reads with torch_xla_ext's HLO reader (collectives, fusions, copies of the
partitioned per-device program).

``enable(directory)`` must run before torch_xla or JAX is imported. Dumping
writes the program's text and LLVM IR for every compile, so compile times
measured in the same run are slower than without it.
"""

from __future__ import annotations

import os
import pathlib
import re

from proto_wire import hlo_module_of

_TOTAL = re.compile(r"Total bytes used: (\d+)")


def enable(directory: str) -> pathlib.Path:
    """Make XLA dump every compiled program's buffer assignment under ``directory`` (before importing XLA)."""
    path = pathlib.Path(directory).resolve()
    path.mkdir(parents=True, exist_ok=True)
    for old in path.glob("*"):
        old.unlink()
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = f"{flags} --xla_dump_to={path} --xla_dump_hlo_as_text --xla_dump_hlo_as_proto".strip()
    return path


class Programs:
    """The programs compiled since this object was made (their memory-usage reports)."""

    def __init__(self, directory: pathlib.Path) -> None:
        self.directory = directory
        self.seen = set(directory.glob("*"))

    def bytes_per_program(self) -> dict[str, int]:
        out = {}
        for path in self._new("*memory-usage-report.txt"):
            match = _TOTAL.search(path.read_text(errors="replace")[:200])
            if match:
                out[path.name] = int(match.group(1))
        return out

    def largest(self) -> int | None:
        """Bytes of the largest program compiled since (the training step), or None if none was."""
        sizes = self.bytes_per_program().values()
        return max(sizes) if sizes else None

    def largest_module(self):
        """The optimized ``torch_xla_ext.HloModule`` of the largest program compiled since, or None."""
        import torch_xla_ext as txe

        dumps = self._new("*after_optimizations.hlo.pb")
        if not dumps:
            return None
        largest = max(dumps, key=lambda path: path.stat().st_size)
        return txe.read_hlo(hlo_module_of(largest.read_bytes()))

    def _new(self, pattern: str) -> list[pathlib.Path]:
        return sorted(set(self.directory.glob(pattern)) - self.seen)
