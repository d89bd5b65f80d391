"""A minimal protobuf encoder, hand-encoded HloModuleProtos and the parse-error check shared by the HLO reader tests."""

from __future__ import annotations

import re
import struct

import pytest

from torch_xla_ext.hlo import HloModule, HloParseError, read_hlo


# ---------------------------------------------------------------------------
# A minimal protobuf encoder for hand-written modules.


def varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def key(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def f_int(field: int, value: int) -> bytes:
    return key(field, 0) + varint(value)


def f_len(field: int, payload: bytes) -> bytes:
    return key(field, 2) + varint(len(payload)) + payload


def f_str(field: int, text: str) -> bytes:
    return f_len(field, text.encode())


def f_msg(field: int, *parts: bytes) -> bytes:
    return f_len(field, b"".join(parts))


def f_packed(field: int, values) -> bytes:
    return f_len(field, b"".join(varint(v) for v in values))


def f_unpacked(field: int, values) -> bytes:
    return b"".join(f_int(field, v) for v in values)


def f_fixed64(field: int, value: int) -> bytes:
    return key(field, 1) + struct.pack("<Q", value)


def f_fixed32(field: int, value: int) -> bytes:
    return key(field, 5) + struct.pack("<I", value)


def f_group(field: int, *parts: bytes) -> bytes:
    return key(field, 3) + b"".join(parts) + key(field, 4)


# xla.PrimitiveType values used below.
PRED, S32, S64, F32, TUPLE, BF16, TOKEN, S4, F16, U8, U32, U64 = 1, 4, 5, 11, 13, 16, 17, 21, 10, 6, 8, 9


def shape(element_type: int, dims=(), tuple_shapes=()) -> bytes:
    out = f_int(2, element_type)
    if dims:
        out += f_packed(3, dims)
    for t in tuple_shapes:
        out += f_len(4, t)
    # A layout, which the reader skips.
    if dims:
        out += f_msg(5, f_packed(1, list(range(len(dims)))[::-1]))
    return out


def op_sharding(type_=3, dims=(), devices=(), rep_last=False, last_tile_dims=(), iota=(), perm=(), tuple_=(), shard_group=None) -> bytes:
    out = f_int(1, type_)
    if dims:
        out += f_packed(3, dims)
    if devices:
        out += f_packed(4, devices)
    for t in tuple_:
        out += f_len(5, t)
    if rep_last:
        out += f_int(6, 1)
    if last_tile_dims:
        out += f_packed(8, last_tile_dims)
    if iota:
        out += f_packed(9, iota) + f_packed(10, perm)
    if shard_group is not None:
        out += f_int(11, 1) + f_int(12, shard_group[1]) + f_int(13, shard_group[0])
    return out


def attrs(**kv: str) -> bytes:
    return b"".join(f_msg(1, f_str(1, k), f_str(2, v)) for k, v in kv.items())


def instruction(name, opcode, id_, shp, operands=(), called=(), *, param=None, target=None, host=False, channel=None, groups=None, device_list=None, sharding=None, frontend=None, backend=None, pairs=(), extra=b"") -> bytes:
    out = f_str(1, name) + f_str(2, opcode) + f_len(3, shp)
    if param is not None:
        out += f_int(9, param)
    if channel is not None:
        out += f_int(26, channel)
    if target is not None:
        out += f_str(28, target)
    out += f_int(35, id_)
    if operands:
        out += f_packed(36, operands)
    if called:
        out += f_packed(38, called)
    if sharding is not None:
        out += f_len(40, sharding)
    if backend is not None:
        out += f_len(43, backend)
    if host:
        out += f_int(47, 1)
    for g in groups or ():
        out += f_msg(49, f_packed(1, g))
    for s, t in pairs:
        out += f_msg(52, f_int(1, s), f_int(2, t))
    if frontend is not None:
        out += f_len(68, frontend)
    if device_list is not None:
        out += f_len(87, device_list)
    return out + extra


def computation(name, id_, root_id, instructions) -> bytes:
    out = f_str(1, name)
    for ins in instructions:
        out += f_len(2, ins)
    return out + f_int(5, id_) + f_int(6, root_id)


def module(name, entry_name, entry_id, computations) -> bytes:
    out = f_str(1, name) + f_str(2, entry_name)
    for c in computations:
        out += f_len(3, c)
    return out + f_int(6, entry_id)


# ---------------------------------------------------------------------------
# Hand-encoded modules for the analyses.

BODY_ID, BODY2_ID, COND_ID, HELPER_ID, ENTRY_ID = 200, 201, 300, 400, 100


def analysis_module() -> bytes:
    f32 = lambda *d: shape(F32, d)  # noqa: E731
    token = shape(TOKEN)
    helper = computation(
        "helper",
        HELPER_ID,
        403,
        [
            instruction("h.p", "parameter", 401, f32(4), param=0),
            instruction("h.neg", "negate", 402, f32(4), [401]),
            instruction("h.abs", "abs", 403, f32(4), [402]),
        ],
    )
    body = computation(
        "body",
        BODY_ID,
        205,
        [
            instruction("b.p", "parameter", 201, f32(4), param=0),
            instruction("b.call1", "call", 202, f32(4), [201], [HELPER_ID]),
            instruction("b.call2", "call", 203, f32(4), [202], [HELPER_ID]),
            instruction("b.c", "constant", 204, f32(2, 2)),
            instruction("b.add", "add", 205, f32(4), [203, 203]),
        ],
    )
    body2 = computation("body2", BODY2_ID, 211, [instruction("b2.p", "parameter", 211, f32(4), param=0)])
    cond = computation(
        "cond",
        COND_ID,
        302,
        [instruction("c.p", "parameter", 301, f32(4), param=0), instruction("c.lt", "compare", 302, shape(PRED), [301, 301])],
    )
    iota_groups = f_msg(2, f_int(1, 2), f_int(2, 4), f_packed(3, [4, 2]), f_unpacked(4, [1, 0]))
    explicit_groups = f_msg(1, f_packed(1, [0, 1])) + f_msg(1, f_packed(1, [2, 3]))
    trip_json = b'{"known_trip_count":{"n":"7"},"known_init_step":{"init":"0","step":"1"}}'
    trip_binary = f_msg(1, f_int(1, 3)) + f_msg(2, f_int(1, 0), f_int(2, 1))
    entry = computation(
        "main",
        ENTRY_ID,
        40,
        [
            instruction("p0", "parameter", 1, f32(1024), param=0, sharding=op_sharding(3, dims=[8], iota=[8], perm=[0])),
            instruction("p1", "parameter", 2, f32(16, 16), param=2),
            instruction("p2", "parameter", 3, shape(TUPLE, tuple_shapes=[f32(2), shape(S4, [3])]), param=1,
                        sharding=op_sharding(2, tuple_=[op_sharding(0), op_sharding(1, dims=[1], devices=[3])])),
            instruction("ag", "all-gather", 4, f32(8192), [1], groups=[[0, 1, 2, 3, 4, 5, 6, 7]], channel=5),
            instruction("ars", "all-reduce-start", 5, f32(16, 16), [2], device_list=iota_groups, channel=6),
            instruction("ard", "all-reduce-done", 6, f32(16, 16), [5]),
            instruction("rs", "reduce-scatter", 7, f32(512), [1], device_list=explicit_groups),
            instruction("a2a", "all-to-all", 8, f32(16, 16), [2, 2], groups=[[0, 1], [2, 3]], channel=0),
            instruction("cp", "collective-permute", 9, f32(16, 16), [2], pairs=[(0, 1), (1, 0)], channel=9),
            instruction("tok", "after-all", 10, token),
            instruction("inf", "infeed", 11, shape(TUPLE, tuple_shapes=[f32(4), token]), [10]),
            instruction("outf", "outfeed", 12, token, [1, 10]),
            instruction("snd", "send", 13, shape(TUPLE, tuple_shapes=[f32(4), shape(S32), token]), [1, 10], host=True, channel=7),
            instruction("snd.done", "send-done", 14, token, [13], host=True, channel=7),
            instruction("rcv", "recv", 15, shape(TUPLE, tuple_shapes=[f32(4), shape(S32), token]), [10], host=True, channel=8),
            instruction("rcv.done", "recv-done", 16, shape(TUPLE, tuple_shapes=[f32(4), token]), [15], host=True, channel=8),
            instruction("snd.dev", "send", 17, shape(TUPLE, tuple_shapes=[f32(4), shape(S32), token]), [1, 10], channel=11),
            instruction("to_host", "custom-call", 18, f32(1024), [1], target="MoveToHost"),
            instruction("to_dev", "custom-call", 19, f32(1024), [18], target="MoveToDevice"),
            instruction("place", "custom-call", 20, f32(16, 16), [2], target="annotate_device_placement", frontend=attrs(_xla_buffer_placement="pinned_host")),
            instruction("place.dev", "custom-call", 21, f32(16, 16), [2], target="annotate_device_placement", frontend=attrs(_xla_buffer_placement="device")),
            instruction("cb", "custom-call", 22, f32(4), [1], target="xla_ffi_python_cpu_callback"),
            instruction("host.add", "add", 23, f32(16, 16), [2, 2], frontend=attrs(_xla_compute_type="host", other="x")),
            instruction("dev.add", "add", 24, f32(16, 16), [2, 2], frontend=attrs(_xla_compute_type="device")),
            instruction("k1", "constant", 25, f32(10)),
            instruction("k2", "constant", 26, shape(S4, [3])),
            instruction("w1", "while", 27, f32(4), [1], [BODY_ID, COND_ID], backend=trip_json),
            instruction("w2", "while", 28, f32(4), [1], [BODY2_ID, COND_ID], backend=trip_binary),
            instruction("w3", "while", 29, f32(4), [1], [BODY_ID, COND_ID]),
            instruction("root", "tuple", 40, shape(TUPLE, tuple_shapes=[f32(4)]), [27]),
        ],
    )
    return module("analysis", "main", ENTRY_ID, [helper, body, body2, cond, entry])


def _simple_module(extra_instruction=b"", extra_shape=b"", extra_sharding=b"", extra_computation=b"", extra_module=b"", packed=True):
    ids = f_packed(36, [1, 1]) if packed else f_unpacked(36, [1, 1])
    ins = [
        instruction("p", "parameter", 1, shape(F32, [4, 2]) + extra_shape, param=0,
                    sharding=op_sharding(3, dims=[2, 1, 4], devices=list(range(8)), rep_last=True) + extra_sharding),
        f_str(1, "sum") + f_str(2, "add") + f_len(3, shape(F32, [4, 2])) + f_int(35, 2) + ids + extra_instruction,
    ]
    comp = computation("main", 1, 2, ins) + extra_computation
    return module("mod", "main", 1, [comp]) + extra_module


def _digest(mod: HloModule):
    return [
        (c.name, c.id, c.root_id, [(i.name, i.opcode, i.id, str(i.shape), i.operand_ids, str(i.sharding)) for i in c.instructions])
        for c in mod.computations
    ] + [mod.name, mod.entry_computation_id]


def _expect_parse_error(data: bytes, match: str | None = None) -> str:
    with pytest.raises(ValueError) as info:
        read_hlo(data)
    message = str(info.value)
    assert isinstance(info.value, HloParseError)
    offset = re.search(r"byte offset (\d+)", message)
    assert offset is not None, message
    assert 0 <= int(offset.group(1)) <= len(data), message
    if match is not None:
        assert re.search(match, message), message
    return message


def counted_loop_module(start, step, bound, direction, *, bound_first=False, counter_dtype=S64, literal_field=5,
                        step_elsewhere=False) -> bytes:
    """A module with one while loop over state (counter, f32[4]): the counter starts at `start`, the body
    adds `step`, the condition compares it with `bound` by `direction` (the bound first if `bound_first`).
    ``step_elsewhere`` adds the step to the other state element instead (no counted form)."""
    counter, vec = shape(counter_dtype), shape(F32, (4,))
    state = shape(TUPLE, tuple_shapes=(counter, vec))

    def const(name, id_, value):
        return instruction(name, "constant", id_, counter, extra=f_msg(8, f_len(1, counter), f_packed(literal_field, [value])))

    def gte(name, id_, operand, index, shp):
        return instruction(name, "get-tuple-element", id_, shp, (operand,), extra=f_int(13, index))

    body = computation("body", 20, 25, [
        instruction("bp", "parameter", 21, state, param=0),
        gte("bi", 22, 21, 0, counter),
        const("bstep", 23, step),
        instruction("bnext", "add", 24, counter, (23, 22) if step_elsewhere is False else (23, 23)),
        instruction("broot", "tuple", 25, state, (24, 26)),
        gte("bv", 26, 21, 1, vec),
    ])
    compare_operands = (33, 32) if bound_first else (32, 33)
    cond = computation("cond", 30, 34, [
        instruction("cp", "parameter", 31, state, param=0),
        gte("ci", 32, 31, 0, counter),
        const("cbound", 33, bound),
        instruction("ctest", "compare", 34, shape(PRED), compare_operands, extra=f_str(63, direction)),
    ])
    entry = computation("main", 10, 14, [
        const("start", 11, start),
        instruction("x", "parameter", 12, vec, param=0),
        instruction("init", "tuple", 13, state, (11, 12)),
        instruction("loop", "while", 14, state, (13,), (20, 30), extra=f_msg(7, f_str(2, "scan/loop"))),
    ])
    return module("counted", "main", 10, [body, cond, entry])
