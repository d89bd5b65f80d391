"""Malformed input: every bad byte string ends in a ValueError naming the byte offset, never in a crash."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torch_xla_ext import _C
from torch_xla_ext.hlo import read_hlo, read_sharding

from hlo_encoding import (F32, TUPLE, _digest, _expect_parse_error, _simple_module, analysis_module, computation, f_int, f_len,
                          f_msg, f_packed, f_str, instruction, key, module, op_sharding, shape, varint)
from hlo_graphs import g_matmul, lower


# ---------------------------------------------------------------------------
# Malformed input.


def test_type_errors():
    for bad in ["text", 5, None, [1, 2], np.zeros(3)]:
        with pytest.raises(TypeError):
            read_hlo(bad)
    # A strided memoryview is copied rather than rejected.
    data = _simple_module()
    doubled = bytes(b for c in data for b in (c, 0))
    assert _digest(read_hlo(memoryview(doubled)[::2])) == _digest(read_hlo(data))


@pytest.mark.parametrize(
    "data, match, offset",
    [
        (b"\x0a", "truncated varint", 1),
        (b"\x08" + b"\xff" * 11, "longer than 10 bytes", 1),
        (b"\x08" + b"\xff" * 9 + b"\x02", "does not fit in 64 bits", 1),
        (b"\x0a\x05abc", "length 5 exceeds the 3 bytes left", 1),
        (b"\x0a" + varint(2**62), "exceeds", 1),
        (f_str(1, "ok") + b"\x0e\x00", "invalid wire type 6", 4),
        (b"\x0f", "invalid wire type 7", 0),
        (b"\x00\x01", "field number 0", 0),
        (key(15, 1) + b"\x00" * 7, "truncated fixed64", 1),
        (key(15, 5) + b"\x00" * 3, "truncated fixed32", 1),
        (key(15, 4), "end-group tag for field 15 without a matching start-group", 0),
        (key(15, 3) + key(14, 4), "does not match the open group 15", 1),
        (key(15, 3) + f_int(1, 1), "truncated group", 3),
        (varint(2**35), "field tag out of range", 0),
        (f_len(1, b"\xff"), "not valid UTF-8", 2),
        (f_len(1, b"\xed\xa0\x80"), "not valid UTF-8", 2),  # a surrogate
        (f_len(1, b"\xc0\xaf"), "not valid UTF-8", 2),  # overlong
    ],
)
def test_malformed_bytes(data, match, offset):
    message = _expect_parse_error(data, match)
    assert f"byte offset {offset}" in message


def test_error_messages_name_the_path():
    bad_shape = f_len(3, f_str(1, "c") + f_len(2, f_str(1, "i") + f_len(3, b"\x10\x0b\x1a\x05\x01")))
    message = _expect_parse_error(bad_shape, "computations\\[0\\]\\.instructions\\[0\\]\\.shape")
    assert "exceeds" in message


def _nested_tuple(depth: int) -> bytes:
    s = shape(F32, [1])
    for _ in range(depth):
        s = shape(TUPLE, tuple_shapes=[s])
    return s


def test_nesting_depth_is_bounded():
    ok = module("m", "c", 1, [computation("c", 1, 1, [instruction("p", "parameter", 1, _nested_tuple(90), param=0)])])
    s = read_hlo(ok).instruction(1).shape
    depth = 0
    while s.is_tuple:
        s, depth = s.tuple_shapes[0], depth + 1
    assert depth == 90
    deep = module("m", "c", 1, [computation("c", 1, 1, [instruction("p", "parameter", 1, _nested_tuple(400), param=0)])])
    _expect_parse_error(deep, "nested deeper than 100")
    groups = key(9, 3) * 150 + key(9, 4) * 150
    _expect_parse_error(groups, "groups nested deeper than 100")
    # Deep tuple shardings and 10 MB of nesting do not overflow the stack.
    deep_sharding = op_sharding(0)
    for _ in range(300):
        deep_sharding = op_sharding(2, tuple_=[deep_sharding])
    with pytest.raises(ValueError, match="byte offset"):
        read_sharding(deep_sharding)


def test_truncated_real_proto_at_every_length(device, mesh_4x2):
    _, outputs = g_matmul(device, mesh_4x2)
    data = lower(outputs, "trunc").hlo()
    full = _digest(read_hlo(data))
    complete = 0
    for n in range(len(data)):
        try:
            _C.read_module(data[:n])
            complete += 1
        except ValueError as e:
            assert "byte offset" in str(e)
    # Only cuts at field boundaries of the top-level message can parse.
    assert 0 < complete < len(data) // 4
    assert _digest(read_hlo(data)) == full


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_never_crash(data):
    try:
        read_hlo(data)
    except ValueError as e:
        assert "byte offset" in str(e)
    try:
        read_sharding(data)
    except ValueError as e:
        assert "byte offset" in str(e)


_SEED = analysis_module()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(_SEED) - 1), st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_module_never_crashes(edits):
    data = bytearray(_SEED)
    for pos, value in edits:
        data[pos] = value
    try:
        mod = read_hlo(bytes(data))
    except ValueError as e:
        assert "byte offset" in str(e)
        return
    # Whatever parsed must also survive every analysis.
    mod.summary()


def test_large_inputs_stay_linear():
    # Many instructions.
    n = 20000
    ins = [instruction(f"c{i}", "constant", i + 1, shape(F32, [4])) for i in range(n)]
    data = module("big", "c", 1, [computation("c", 1, n, ins)])
    start = time.perf_counter()
    mod = _C.read_module(data)
    assert mod.num_instructions() == n and mod.constants_bytes() == 16 * n
    # Many while loops sharing one large body, each asking for its size.
    body = computation("b", 2, 1, [instruction(f"b{i}", "add", i + 1, shape(F32)) for i in range(5000)])
    loops = [instruction(f"w{i}", "while", 10**6 + i, shape(F32), [], [2, 3]) for i in range(5000)]
    data = module("loops", "e", 4, [body, computation("e", 4, 10**6, loops)])
    assert all(w.body_instruction_count == 5000 for w in _C.read_module(data).while_loops())
    # Iota shardings for a million devices are described without expanding.
    huge = op_sharding(3, dims=[1024, 1024], iota=[1024, 1024], perm=[1, 0])
    ins = [instruction(f"p{i}", "parameter", i + 1, shape(F32, [1024, 1024]), param=i, sharding=huge) for i in range(2000)]
    mod = _C.read_module(module("wide", "c", 1, [computation("c", 1, 1, ins)]))
    assert str(mod.computations[0].instructions[0].sharding) == "{devices=[1024,1024]<=[1024,1024]T(1,0)}"
    assert time.perf_counter() - start < 10


def test_iota_replica_groups_over_the_limit_are_not_expanded():
    dl = f_msg(2, f_int(1, 1 << 20), f_int(2, 1 << 20), f_packed(3, [1 << 40]), f_packed(4, [0]))
    ins = instruction("ar", "all-reduce", 1, shape(F32, [4]), device_list=dl)
    mod = read_hlo(module("m", "c", 1, [computation("c", 1, 1, [ins])]))
    assert mod.instruction(1).replica_groups == ()
