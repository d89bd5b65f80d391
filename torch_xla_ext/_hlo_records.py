"""The frozen records of :mod:`torch_xla_ext.hlo` and how they are built.

The C++ reader hands over plain dicts keyed by the field names of these
dataclasses (``_C.Module.records()``, ``_C.Sharding.record()``), so building a
record is a keyword call. Tables the records need (bits per element type,
XLA's size of an unbounded dimension) come from ``_C`` as well; only the
mapping to torch dtypes, which C++ does not know, lives here. Host memory
only: nothing here touches a device.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Mapping

import torch

from . import _C

# Bits per element of XLA's array types, from the C++ reader's table.
_BITS: Mapping[str, int] = _C.PRIMITIVE_TYPE_BITS

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
            if d == _C.UNBOUNDED_SIZE:
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
    "unreduced"; ``_C.SHARDING_TYPES`` maps them to the proto's values),
    except that ``tile_assignment_devices`` is always the explicit device
    list: an iota description (``iota_reshape_dims`` /
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
        # A sharding made in Python: the C++ printer reads its fields by name.
        return _C.format_sharding(self)

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
    ``integer_value`` is the value of an integer scalar constant (None for
    any other instruction); ``comparison_direction`` that of a compare.
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
    integer_value: int | None = None
    comparison_direction: str = ""


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

    ``known_trip_count`` is what the loop's backend_config states;
    ``trip_count`` is that, else the count read from the loop itself when it
    has the counted form (a state element starting at a constant, stepped by
    a positive constant in the body, compared with a constant bound by
    ``<``, ``<=`` or ``!=`` in the condition), else None.
    ``body_instruction_count`` counts the body's instructions plus those of
    every computation reachable from it (each computation once).
    ``op_name`` is the while instruction's metadata op name and
    ``condition_constants`` the integer scalar constants of its condition:
    what ties a loop a compiler rewrote to the loop it came from.
    """

    instruction: HloInstruction
    computation: str
    condition: str | None
    body: str | None
    known_trip_count: int | None
    body_instruction_count: int
    trip_count: int | None = None
    op_name: str = ""
    condition_constants: tuple[int, ...] = ()


# ---------------------------------------------------------------------------
# Building the records from the C++ reader's dicts.


def sharding_from_record(record: dict) -> Sharding:
    """A :class:`Sharding` from ``_C.Sharding.record()`` (consumes the dict)."""
    record["tuple_shardings"] = tuple(sharding_from_record(e) for e in record["tuple_shardings"])
    return Sharding(**record)


def computations_from_records(records: dict) -> tuple[HloComputation, ...]:
    """The computations of ``_C.Module.records()`` (consumes the dicts).

    Equal shapes arrive once and become one shared :class:`Shape`.
    """
    shapes: list[Shape] = []
    for rec in records["shapes"]:  # elements come before their tuples
        rec["tuple_shapes"] = tuple(shapes[i] for i in rec["tuple_shapes"])
        shapes.append(Shape(**rec))
    computations = []
    for comp in records["computations"]:
        instructions = []
        for rec in comp["instructions"]:
            rec["shape"] = shapes[rec["shape"]]
            if rec["sharding"] is not None:
                rec["sharding"] = sharding_from_record(rec["sharding"])
            instructions.append(HloInstruction(**rec))
        comp["instructions"] = tuple(instructions)
        computations.append(HloComputation(**comp))
    return tuple(computations)
