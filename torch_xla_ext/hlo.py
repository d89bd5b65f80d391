"""Python view of a serialized ``xla.HloModuleProto``.

:func:`read_hlo` hands the bytes to the C++ reader in ``torch_xla_ext._C``
(a hand-written protobuf decoder, no protobuf dependency) and converts its
result once into frozen dataclasses (defined, with how they are built from
the reader's records, in ``_hlo_records``). Everything here works on host
memory only: reading a module never touches a device and never transfers
data between host and device. The analyses (collectives, host transfers,
while loops, constant bytes) are computed by the C++ reader; this module only
wraps, sorts and formats them.

Importing this module imports torch but not torch_xla.
"""

from __future__ import annotations

import functools
from typing import Iterable, Sequence

from . import _C
from ._format import clip, format_bytes
from ._hlo_records import (
    Collective,
    HloComputation,
    HloInstruction,
    HloParameter,
    HostTransfer,
    Shape,
    Sharding,
    WhileLoop,
    computations_from_records,
    sharding_from_record,
)

__all__ = [
    "Collective",
    "HloComputation",
    "HloInstruction",
    "HloModule",
    "HloParameter",
    "HloParseError",
    "HostTransfer",
    "Shape",
    "Sharding",
    "WhileLoop",
    "read_hlo",
    "read_sharding",
]

#: Raised for bytes that are not a well-formed HloModuleProto; a ValueError
#: whose message names the byte offset of the problem.
HloParseError = _C.HloParseError


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    rows = [[clip(c) for c in r] for r in rows]  # a module from elsewhere may carry megabyte-long names
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths)]
        lines.append((indent + "  ".join(cells)).rstrip())
    return lines


def _groups_text(groups: Iterable[Iterable[int]], limit: int = 4) -> str:
    groups = list(groups)
    if not groups:
        return "-"
    shown = ",".join("{" + ",".join(str(d) for d in g) + "}" for g in groups[:limit])
    if len(groups) > limit:
        shown += f",... ({len(groups)} groups)"
    return "{" + shown + "}"


class HloModule:
    """A decoded HloModuleProto (see :func:`read_hlo`).

    Holds every computation and instruction as frozen dataclasses. The
    analyses are computed by the C++ reader on first use and cached.
    """

    def __init__(self, module: _C.Module) -> None:
        """Wraps a ``torch_xla_ext._C.Module``; use :func:`read_hlo` instead."""
        self._c = module
        self.name: str = module.name
        self.entry_computation_name: str = module.entry_computation_name
        self.entry_computation_id: int = module.entry_computation_id
        self.computations: tuple[HloComputation, ...] = computations_from_records(module.records())
        self._entry_index: int = module.entry_index
        self._by_id: dict[int, HloComputation] = {}
        self._by_name: dict[str, HloComputation] = {}
        self._instructions: dict[int, HloInstruction] = {}
        for comp in self.computations:
            self._by_id.setdefault(comp.id, comp)
            self._by_name.setdefault(comp.name, comp)
            for ins in comp.instructions:
                self._instructions.setdefault(ins.id, ins)

    def __repr__(self) -> str:
        return (
            f"HloModule(name={self.name!r}, entry={self.entry_computation_name!r}, "
            f"computations={len(self.computations)}, instructions={self.num_instructions})"
        )

    @property
    def entry(self) -> HloComputation:
        """The entry computation (ValueError if the proto names none that exists)."""
        if self._entry_index < 0:
            raise ValueError(
                f"HLO module {self.name!r} has no entry computation: neither id "
                f"{self.entry_computation_id} nor name {self.entry_computation_name!r} "
                "matches one of its computations"
            )
        return self.computations[self._entry_index]

    def computation(self, name_or_id: str | int) -> HloComputation:
        """The computation with this name (str) or id (int); KeyError if absent."""
        if isinstance(name_or_id, str):
            found = self._by_name.get(name_or_id)
        elif isinstance(name_or_id, int) and not isinstance(name_or_id, bool):
            found = self._by_id.get(name_or_id)
        else:
            raise TypeError(f"computation() takes a name (str) or an id (int), got {type(name_or_id).__name__}")
        if found is None:
            raise KeyError(f"HLO module {self.name!r} has no computation {name_or_id!r}")
        return found

    def instruction(self, id: int) -> HloInstruction:
        """The instruction with this id, in any computation; KeyError if absent."""
        try:
            return self._instructions[id]
        except KeyError:
            raise KeyError(f"HLO module {self.name!r} has no instruction with id {id}") from None

    @property
    def num_instructions(self) -> int:
        """Instructions in all computations."""
        return self._c.num_instructions()

    @property
    def entry_parameters(self) -> list[HloParameter]:
        """Entry computation parameters ordered by parameter number."""
        params = []
        entry = self.entry
        for index in self._c.entry_parameter_indices():
            ins = entry.instructions[index]
            shape = ins.shape
            params.append(
                HloParameter(
                    number=ins.parameter_number if ins.parameter_number is not None else 0,
                    name=ins.name,
                    shape=() if shape.is_tuple else shape.dimensions,
                    dtype=shape.torch_dtype,
                    sharding=str(ins.sharding) if ins.sharding is not None else None,
                    hlo_shape=shape,
                )
            )
        return params

    @functools.cached_property
    def _collectives(self) -> tuple[Collective, ...]:
        out = []
        for rec in self._c.collectives():
            comp = self.computations[rec.computation]
            ins = comp.instructions[rec.instruction]
            out.append(
                Collective(
                    kind=rec.kind,
                    opcode=ins.opcode,
                    instruction=ins,
                    computation=comp.name,
                    operand_bytes=rec.operand_bytes,
                    replica_groups=ins.replica_groups,
                    channel_id=ins.channel_id,
                )
            )
        return tuple(out)

    def collectives(self) -> list[Collective]:
        """Collective instructions in all computations, in proto order."""
        return list(self._collectives)

    @functools.cached_property
    def _host_transfers(self) -> tuple[HostTransfer, ...]:
        out = []
        for rec in self._c.host_transfers():
            comp = self.computations[rec.computation]
            out.append(HostTransfer(reason=rec.reason, instruction=comp.instructions[rec.instruction], computation=comp.name))
        return tuple(out)

    def host_transfers(self) -> list[HostTransfer]:
        """Instructions that move data between host and device (infeed/outfeed,
        host send/recv, host-offload and host-callback custom calls, host compute)."""
        return list(self._host_transfers)

    @functools.cached_property
    def _while_loops(self) -> tuple[WhileLoop, ...]:
        out = []
        for rec in self._c.while_loops():
            comp = self.computations[rec.computation]
            cond = self._by_id.get(rec.condition_id)
            body = self._by_id.get(rec.body_id)
            out.append(
                WhileLoop(
                    instruction=comp.instructions[rec.instruction],
                    computation=comp.name,
                    condition=cond.name if cond is not None else None,
                    body=body.name if body is not None else None,
                    known_trip_count=rec.known_trip_count,
                    body_instruction_count=rec.body_instruction_count,
                    trip_count=rec.known_trip_count if rec.known_trip_count is not None else rec.inferred_trip_count,
                    op_name=rec.op_name,
                    condition_constants=tuple(rec.condition_constants),
                )
            )
        return tuple(out)

    def while_loops(self) -> list[WhileLoop]:
        """While loops in all computations, in proto order."""
        return list(self._while_loops)

    @functools.cached_property
    def constants_bytes(self) -> int:
        """Total bytes of constant instructions' shapes across all computations."""
        return self._c.constants_bytes()

    def summary(self) -> str:
        """A human-readable report: parameters, collectives, host transfers, loops, constants."""
        entry = self.computations[self._entry_index].name if self._entry_index >= 0 else "<missing>"
        lines = [
            f"HloModule {clip(self.name)}: {len(self.computations)} computations, "
            f"{self.num_instructions} instructions, entry {clip(entry)}"
        ]
        params = self.entry_parameters if self._entry_index >= 0 else []
        lines.append(f"Parameters ({len(params)}):")
        if params:
            rows = [["#", "name", "shape", "sharding"]]
            rows += [[str(p.number), p.name, str(p.hlo_shape), p.sharding or "-"] for p in params]
            lines += _table(rows)
        collectives = self.collectives()
        total = sum(c.operand_bytes for c in collectives)
        lines.append(f"Collectives ({len(collectives)}, {format_bytes(total)} of operands):")
        if collectives:
            rows = [["opcode", "instruction", "computation", "bytes", "replica groups", "channel"]]
            for c in collectives:
                rows.append(
                    [
                        c.opcode,
                        c.instruction.name,
                        c.computation,
                        format_bytes(c.operand_bytes),
                        _groups_text(c.replica_groups),
                        "-" if c.channel_id is None else str(c.channel_id),
                    ]
                )
            lines += _table(rows)
        transfers = self.host_transfers()
        lines.append(f"Host transfers ({len(transfers)}):")
        if transfers:
            rows = [["instruction", "computation", "shape", "reason"]]
            rows += [[t.instruction.name, t.computation, str(t.instruction.shape), t.reason] for t in transfers]
            lines += _table(rows)
        loops = self.while_loops()
        lines.append(f"While loops ({len(loops)}):")
        if loops:
            rows = [["instruction", "computation", "body", "condition", "trip count", "body instructions"]]
            for w in loops:
                rows.append(
                    [
                        w.instruction.name,
                        w.computation,
                        w.body or "-",
                        w.condition or "-",
                        "unknown" if w.trip_count is None else str(w.trip_count),
                        str(w.body_instruction_count),
                    ]
                )
            lines += _table(rows)
        lines.append(f"Constants: {format_bytes(self.constants_bytes)}")
        return "\n".join(lines)


def _contiguous_bytes(data: object, what: str) -> bytes | bytearray | memoryview:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(
            f"{what} expects the serialized proto as bytes, bytearray or memoryview, "
            f"got {type(data).__name__}; pass e.g. LoweringContext.hlo()"
        )
    if isinstance(data, memoryview) and not data.c_contiguous:
        return data.tobytes()
    return data


def read_hlo(data: bytes | bytearray | memoryview) -> HloModule:
    """Decodes serialized ``xla.HloModuleProto`` bytes into an :class:`HloModule`.

    Pure host-side parsing: no device, no transfer. Raises TypeError for
    anything but bytes-like input, and :data:`HloParseError` (a ValueError
    naming the byte offset) when the bytes are not a well-formed proto, or
    when they describe far more data than their size holds: the reader
    allocates at most ``_C.BUDGET_BYTES_PER_INPUT_BYTE`` (64) bytes per input
    byte plus ``_C.BUDGET_BASE_BYTES`` (1 MiB); lowered modules need 11-18.
    A non-contiguous memoryview is copied first.
    """
    return HloModule(_C.read_module(_contiguous_bytes(data, "read_hlo")))


def read_sharding(data: bytes | bytearray | memoryview) -> Sharding:
    """Decodes one serialized ``xla.OpSharding`` (e.g. from ``OpSharding.SerializeToString()``)."""
    return sharding_from_record(_C.read_sharding(_contiguous_bytes(data, "read_sharding")).record())
