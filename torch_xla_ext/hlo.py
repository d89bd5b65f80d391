"""Python view of a serialized ``xla.HloModuleProto``.

:func:`read_hlo` hands the bytes to the C++ reader in ``torch_xla_ext._C``
(a hand-written protobuf decoder, no protobuf dependency) and converts its
result once into frozen dataclasses. Everything here works on host memory
only: reading a module never touches a device and never transfers data
between host and device. The analyses (collectives, host transfers, while
loops, constant bytes) are computed by the C++ reader; this module only
wraps, sorts and formats them.

Importing this module imports torch but not torch_xla.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

import torch

from . import _C
from ._format import format_bytes

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

# Bits per element of XLA's array types.
_BITS: dict[str, int] = {
    "pred": 8,
    "s1": 1, "u1": 1, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "f4e2m1fn": 4,
    "s8": 8, "u8": 8,
    "f8e5m2": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e3m4": 8,
    "f8e5m2fnuz": 8, "f8e4m3fnuz": 8, "f8e8m0fnu": 8,
    "s16": 16, "u16": 16, "f16": 16, "bf16": 16,
    "s32": 32, "u32": 32, "f32": 32,
    "s64": 64, "u64": 64, "f64": 64, "c64": 64,
    "c128": 128,
}  # fmt: skip

_TORCH_DTYPE_NAMES: dict[str, str] = {
    "pred": "bool",
    "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64",
    "u8": "uint8", "u16": "uint16", "u32": "uint32", "u64": "uint64",
    "f16": "float16", "bf16": "bfloat16", "f32": "float32", "f64": "float64",
    "c64": "complex64", "c128": "complex128",
    "f8e5m2": "float8_e5m2", "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2fnuz": "float8_e5m2fnuz", "f8e4m3fnuz": "float8_e4m3fnuz",
    "f8e8m0fnu": "float8_e8m0fnu",
}  # fmt: skip

_TORCH_DTYPES: dict[str, torch.dtype] = {
    xla: getattr(torch, name) for xla, name in _TORCH_DTYPE_NAMES.items() if hasattr(torch, name)
}

_UNBOUNDED = -(2**63)  # XLA's size of an unbounded dynamic dimension

_SHARDING_TYPE_VALUES: dict[str, int] = {
    "replicated": 0,
    "maximal": 1,
    "tuple": 2,
    "other": 3,
    "manual": 4,
    "unknown": 5,
    "unreduced": 6,
}


@dataclass(frozen=True)
class Shape:
    """An HLO shape: an array, a tuple of shapes, a token or an opaque value.

    ``element_type`` is XLA's lowercase type name ("f32", "bf16", "pred",
    "s32", "tuple", "token", ...); ``dimensions`` is empty for tuples and
    scalars. ``is_dynamic_dimension`` marks bounded dynamic dimensions (empty
    when all are static).
    """

    element_type: str
    dimensions: tuple[int, ...] = ()
    tuple_shapes: tuple[Shape, ...] = ()
    is_dynamic_dimension: tuple[bool, ...] = ()

    @property
    def is_tuple(self) -> bool:
        """Whether this is a tuple shape."""
        return self.element_type == "tuple"

    @property
    def num_elements(self) -> int:
        """Elements of an array; for a tuple, the sum over its leaves; 0 for tokens."""
        if self.is_tuple:
            return sum(s.num_elements for s in self.tuple_shapes)
        if self.element_type not in _BITS:
            return 0
        return math.prod(max(d, 0) for d in self.dimensions)

    @property
    def byte_size(self) -> int:
        """Bytes of the data: sub-byte types are rounded up per array, tuples sum their leaves."""
        if self.is_tuple:
            return sum(s.byte_size for s in self.tuple_shapes)
        bits = _BITS.get(self.element_type, 0)
        return (self.num_elements * bits + 7) // 8

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype of an array shape, or None (tuples, tokens, types torch lacks)."""
        return _TORCH_DTYPES.get(self.element_type)

    def __str__(self) -> str:
        if self.is_tuple:
            return "(" + ", ".join(str(s) for s in self.tuple_shapes) + ")"
        if self.element_type in ("token", "opaque"):
            return self.element_type
        dims = []
        for i, d in enumerate(self.dimensions):
            if d == _UNBOUNDED:
                dims.append("?")
            elif i < len(self.is_dynamic_dimension) and self.is_dynamic_dimension[i]:
                dims.append(f"<={d}")
            else:
                dims.append(str(d))
        return f"{self.element_type}[{','.join(dims)}]"


@dataclass(frozen=True)
class Sharding:
    """An ``xla.OpSharding`` as the reader decoded it.

    The fields mirror the proto (``type`` is the lowercase enum name:
    "replicated", "maximal", "tuple", "other", "manual", "unknown",
    "unreduced"), except that ``tile_assignment_devices`` is always the
    explicit device list: an iota description (``iota_reshape_dims`` /
    ``iota_transpose_perm``) is expanded, within the reader's size limits.
    ``str(sharding)`` is XLA's ``HloSharding::ToString()`` of the proto, the
    same string ``torch_xla._XLAC._get_xla_sharding_spec`` returns and the
    HLO text shows (after XLA's normalization, e.g. sorted replica groups).
    ``valid`` is False when XLA would reject the proto.
    """

    type: str
    tile_assignment_dimensions: tuple[int, ...] = ()
    tile_assignment_devices: tuple[int, ...] = ()
    replicate_on_last_tile_dim: bool = False
    last_tile_dims: tuple[str, ...] = ()
    tuple_shardings: tuple[Sharding, ...] = ()
    iota_reshape_dims: tuple[int, ...] = ()
    iota_transpose_perm: tuple[int, ...] = ()
    valid: bool = True
    text: str = field(default="", repr=False)

    def __str__(self) -> str:
        if self.text:
            return self.text
        return _C.format_sharding(self._as_plain())

    def _as_plain(self) -> tuple:
        def type_value(name: str) -> int:
            if name in _SHARDING_TYPE_VALUES:
                return _SHARDING_TYPE_VALUES[name]
            if name.startswith("type_"):
                return int(name[5:])
            raise ValueError(f"unknown sharding type {name!r}")

        return (
            type_value(self.type),
            list(self.tile_assignment_dimensions),
            [] if self.iota_reshape_dims else list(self.tile_assignment_devices),
            self.replicate_on_last_tile_dim,
            [type_value(t) for t in self.last_tile_dims],
            list(self.iota_reshape_dims),
            list(self.iota_transpose_perm),
            [s._as_plain() for s in self.tuple_shardings],
        )

    @property
    def _subgroup_rank(self) -> int:
        if self.replicate_on_last_tile_dim:
            return 1
        return len(self.last_tile_dims)

    @property
    def data_tile_dimensions(self) -> tuple[int, ...]:
        """Tile counts of the data dimensions (subgroup dimensions removed)."""
        if self.type != "other":
            return ()
        n = len(self.tile_assignment_dimensions) - self._subgroup_rank
        return self.tile_assignment_dimensions[: max(n, 0)]

    @property
    def is_replicated(self) -> bool:
        """Replicated, or tiled with every data dimension in one piece and the rest replicated."""
        if self.type == "replicated":
            return True
        if self.type == "tuple":
            return bool(self.tuple_shardings) and all(s.is_replicated for s in self.tuple_shardings)
        if self.type != "other" or not self.valid:
            return False
        if not self.replicate_on_last_tile_dim and any(t != "replicated" for t in self.last_tile_dims):
            return False
        return all(d == 1 for d in self.data_tile_dimensions)

    @property
    def num_shards(self) -> int:
        """How many distinct pieces the data is cut into (1 unless tiled)."""
        if self.type != "other" or not self.valid:
            return 1
        return math.prod(self.data_tile_dimensions)


@dataclass(frozen=True)
class HloInstruction:
    """One HLO instruction. ``computation`` is the name of the computation holding it.

    ``parameter_number`` is None unless the opcode is "parameter";
    ``channel_id`` is None when unset (XLA treats non-positive ids as unset).
    ``replica_groups`` comes from ``collective_device_list`` when present
    (iota lists expanded), otherwise from the deprecated ``replica_groups``.
    """

    id: int
    name: str
    opcode: str
    shape: Shape
    operand_ids: tuple[int, ...] = ()
    called_computation_ids: tuple[int, ...] = ()
    parameter_number: int | None = None
    custom_call_target: str = ""
    is_host_transfer: bool = False
    channel_id: int | None = None
    replica_groups: tuple[tuple[int, ...], ...] = ()
    sharding: Sharding | None = None
    frontend_attributes: Mapping[str, str] = field(default_factory=dict, hash=False)
    computation: str = ""
    source_target_pairs: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class HloComputation:
    """An HLO computation: its instructions in the order of the proto."""

    id: int
    name: str
    root_id: int
    instructions: tuple[HloInstruction, ...]

    @functools.cached_property
    def _by_id(self) -> dict[int, HloInstruction]:
        index: dict[int, HloInstruction] = {}
        for ins in self.instructions:
            index.setdefault(ins.id, ins)
        return index

    def instruction(self, id: int) -> HloInstruction:
        """The instruction with this id; KeyError if the computation has none."""
        try:
            return self._by_id[id]
        except KeyError:
            raise KeyError(f"computation {self.name!r} has no instruction with id {id}") from None

    @property
    def root(self) -> HloInstruction | None:
        """The root instruction, or None when root_id names no instruction."""
        return self._by_id.get(self.root_id)

    @property
    def parameters(self) -> list[HloInstruction]:
        """Parameter instructions ordered by parameter number."""
        params = [i for i in self.instructions if i.opcode == "parameter"]
        return sorted(params, key=lambda i: i.parameter_number or 0)


@dataclass(frozen=True)
class HloParameter:
    """A parameter of the entry computation.

    ``shape`` and ``dtype`` describe an array parameter (``shape`` is empty
    and ``dtype`` None for tuples); ``sharding`` is XLA's sharding string, or
    None when the HLO parameter carries no sharding. ``tensor`` and ``kind``
    ("input", "seed" or "hoisted") are filled in by
    :class:`torch_xla_ext.LoweringContext`; the reader leaves them None.
    """

    number: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None
    sharding: str | None
    hlo_shape: Shape
    tensor: torch.Tensor | None = field(default=None, compare=False, hash=False, repr=False)
    kind: str | None = None


@dataclass(frozen=True)
class Collective:
    """A collective instruction (an async pair is reported once, at its -start).

    ``kind`` is the family ("all-gather", "all-reduce", "reduce-scatter",
    "all-to-all", "collective-permute", ...); ``opcode`` the instruction's own
    opcode; ``operand_bytes`` the summed byte size of its operands' shapes.
    """

    kind: str
    opcode: str
    instruction: HloInstruction
    computation: str
    operand_bytes: int
    replica_groups: tuple[tuple[int, ...], ...]
    channel_id: int | None


@dataclass(frozen=True)
class HostTransfer:
    """An instruction that moves data between host and device, and why it counts as one."""

    reason: str
    instruction: HloInstruction
    computation: str


@dataclass(frozen=True)
class WhileLoop:
    """A while loop, its computations, and what is known of its trip count.

    ``body_instruction_count`` counts the body's instructions plus those of
    every computation reachable from it (each computation once).
    """

    instruction: HloInstruction
    computation: str
    condition: str | None
    body: str | None
    known_trip_count: int | None
    body_instruction_count: int


# ---------------------------------------------------------------------------
# Conversion from the C++ objects.


def _shape_from_record(record: tuple, cache: dict[tuple, Shape]) -> Shape:
    shape = cache.get(record)
    if shape is None:
        element_type, dimensions, tuple_shapes, dynamic = record
        shape = Shape(
            element_type=element_type,
            dimensions=dimensions,
            tuple_shapes=tuple(_shape_from_record(t, cache) for t in tuple_shapes),
            is_dynamic_dimension=dynamic,
        )
        cache[record] = shape
    return shape


def _sharding(c: _C.Sharding) -> Sharding:
    return Sharding(
        type=_C.sharding_type_name(c.type),
        tile_assignment_dimensions=tuple(c.tile_assignment_dimensions),
        tile_assignment_devices=tuple(c.devices),
        replicate_on_last_tile_dim=c.replicate_on_last_tile_dim,
        last_tile_dims=tuple(_C.sharding_type_name(t) for t in c.last_tile_dims),
        tuple_shardings=tuple(_sharding(e) for e in c.tuple_elements),
        iota_reshape_dims=tuple(c.iota_reshape_dims),
        iota_transpose_perm=tuple(c.iota_transpose_perm),
        valid=c.valid,
        text=c.text,
    )


def _computation(c: _C.Computation, shapes: dict[tuple, Shape]) -> HloComputation:
    name = c.name
    records = c.instruction_records()
    with_sharding = [k for k, r in enumerate(records) if r[11]]
    shardings = {}
    if with_sharding:
        native = c.instructions  # only touched when some instruction is sharded
        shardings = {k: _sharding(native[k].sharding) for k in with_sharding}
    instructions = []
    for k, (iid, iname, opcode, shape, operands, called, param, target, host, channel, groups, _, attrs, pairs) in enumerate(records):
        instructions.append(
            HloInstruction(
                id=iid,
                name=iname,
                opcode=opcode,
                shape=_shape_from_record(shape, shapes),
                operand_ids=operands,
                called_computation_ids=called,
                parameter_number=param if opcode == "parameter" else None,
                custom_call_target=target,
                is_host_transfer=host,
                channel_id=channel if channel > 0 else None,
                replica_groups=groups,
                sharding=shardings.get(k),
                frontend_attributes=attrs,
                computation=name,
                source_target_pairs=pairs,
            )
        )
    return HloComputation(id=c.id, name=name, root_id=c.root_id, instructions=tuple(instructions))


def _table(rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
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
        shapes: dict[tuple, Shape] = {}
        self.computations: tuple[HloComputation, ...] = tuple(_computation(c, shapes) for c in module.computations)
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
            f"HloModule {self.name}: {len(self.computations)} computations, "
            f"{self.num_instructions} instructions, entry {entry}"
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
                        "unknown" if w.known_trip_count is None else str(w.known_trip_count),
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
    return _sharding(_C.read_sharding(_contiguous_bytes(data, "read_sharding")))
