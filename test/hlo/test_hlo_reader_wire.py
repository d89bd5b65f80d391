"""Protobuf wire-format details: packed and unpacked fields, unknown fields, merging, varints, shapes."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torch_xla_ext import _C
from torch_xla_ext.hlo import HloParameter, Shape, read_hlo

from hlo_encoding import (BF16, F32, PRED, S4, TOKEN, TUPLE, _digest, _simple_module, computation, f_fixed32, f_fixed64,
                          f_group, f_int, f_len, f_msg, f_packed, f_str, instruction, module, shape)


# ---------------------------------------------------------------------------
# Wire-format details.


def test_packed_and_unpacked_repeated_fields_agree():
    assert _digest(read_hlo(_simple_module(packed=True))) == _digest(read_hlo(_simple_module(packed=False)))
    # Packed and unpacked runs of one field concatenate.
    mixed = _simple_module(extra_instruction=f_int(36, 1) + f_packed(36, [2, 1]))
    assert read_hlo(mixed).instruction(2).operand_ids == (1, 1, 1, 2, 1)


UNKNOWN_FIELDS = (
    f_int(1999, 12345)
    + f_fixed64(1998, 2**63 + 5)
    + f_len(1997, b"\xff\xfe whatever")
    + f_fixed32(1996, 7)
    + f_group(1995, f_int(1, 3), f_group(2, f_len(3, b"x")), f_fixed32(4, 1))
    + f_int(0x1FFFFFFF, 1)  # the largest field number
)


def test_unknown_fields_of_every_wire_type_are_skipped():
    base = _digest(read_hlo(_simple_module()))
    noisy = _simple_module(
        extra_instruction=UNKNOWN_FIELDS,
        extra_shape=UNKNOWN_FIELDS,
        extra_sharding=UNKNOWN_FIELDS,
        extra_computation=UNKNOWN_FIELDS,
        extra_module=UNKNOWN_FIELDS,
    )
    assert _digest(read_hlo(noisy)) == base
    # Known fields sent with an unexpected wire type are skipped too.
    odd = _simple_module(extra_instruction=f_len(35, b"\x05") + f_fixed32(1, 9) + f_fixed64(3, 1))
    assert _digest(read_hlo(odd)) == base


def test_singular_fields_last_wins_and_messages_merge():
    extra = f_str(1, "renamed") + f_msg(3, f_packed(3, [7]))
    mod = read_hlo(_simple_module(extra_instruction=extra))
    ins = mod.instruction(2)
    assert ins.name == "renamed"
    assert ins.shape.dimensions == (4, 2, 7)  # protobuf merges repeated message fields


def test_negative_and_large_varints():
    big = computation("c", -5, 2**62, [instruction("p", "parameter", -1, shape(F32, [2**40]), param=-3)])
    mod = read_hlo(module("m", "c", -5, [big]))
    p = mod.instruction(-1)
    assert mod.entry.id == -5 and mod.entry.root_id == 2**62 and p.parameter_number == -3
    assert p.shape.num_elements == 2**40 and p.shape.byte_size == 2**42


def test_shapes_and_dtypes():
    s = read_hlo(module("m", "c", 1, [computation("c", 1, 1, [instruction("p", "parameter", 1, shape(TUPLE, tuple_shapes=[shape(S4, [3, 3]), shape(PRED, [5]), shape(BF16, [2, 3]), shape(TOKEN), shape(TUPLE)]), param=0)])])).instruction(1).shape
    assert str(s) == "(s4[3,3], pred[5], bf16[2,3], token, ())"
    assert s.is_tuple and s.byte_size == 5 + 5 + 12 and s.num_elements == 9 + 5 + 6
    assert [t.torch_dtype for t in s.tuple_shapes] == [None, torch.bool, torch.bfloat16, None, None]
    assert Shape("u1", (9,)).byte_size == 2 and Shape("f32", ()).byte_size == 4 and Shape("c128", (2,)).byte_size == 32
    assert str(Shape("f32", (4, 3), is_dynamic_dimension=(True, False))) == "f32[<=4,3]"
    assert str(Shape("f32", (-(2**63),))) == "f32[?]"
    assert _C.primitive_type_name(99) == "invalid" and _C.primitive_type_name(28) == "f8e4m3"


def test_hlo_parameter_is_replaceable():
    p = HloParameter(number=0, name="p0", shape=(2,), dtype=torch.float32, sharding=None, hlo_shape=Shape("f32", (2,)))
    t = torch.ones(2)
    q = dataclasses.replace(p, tensor=t, kind="input")
    assert q.tensor is t and q.kind == "input" and q == dataclasses.replace(p, kind="input")
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.kind = "seed"
