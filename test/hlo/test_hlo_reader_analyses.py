"""The reader's analyses (parameters, collectives, host transfers, while loops) on hand-encoded modules."""

from __future__ import annotations

import pytest
import torch

from torch_xla_ext.hlo import read_hlo

from hlo_encoding import (BODY_ID, COND_ID, F32, S32, S64, U32, U64, analysis_module, computation, counted_loop_module, f_len,
                          f_str, instruction, module, shape)


# ---------------------------------------------------------------------------
# Hand-encoded modules for the analyses.


def test_analyses_on_hand_encoded_module():
    mod = read_hlo(analysis_module())
    assert mod.entry.name == "main" and mod.entry.root.name == "root"
    assert mod.num_instructions == 3 + 5 + 1 + 2 + 30

    params = mod.entry_parameters
    assert [(p.number, p.name) for p in params] == [(0, "p0"), (1, "p2"), (2, "p1")]
    assert params[0].sharding == "{devices=[8]<=[8]}" and params[0].shape == (1024,) and params[0].dtype == torch.float32
    assert params[1].sharding == "{{replicated}, {maximal device=3}}"
    assert params[1].shape == () and params[1].dtype is None and params[1].hlo_shape.byte_size == 8 + 2
    assert params[2].sharding is None and params[2].kind is None and params[2].tensor is None

    cols = mod.collectives()
    assert [(c.kind, c.opcode, c.instruction.name) for c in cols] == [
        ("all-gather", "all-gather", "ag"),
        ("all-reduce", "all-reduce-start", "ars"),
        ("reduce-scatter", "reduce-scatter", "rs"),
        ("all-to-all", "all-to-all", "a2a"),
        ("collective-permute", "collective-permute", "cp"),
    ]
    by_name = {c.instruction.name: c for c in cols}
    assert by_name["ag"].operand_bytes == 4096 and by_name["ag"].channel_id == 5
    assert by_name["ag"].replica_groups == (tuple(range(8)),)
    assert by_name["ars"].replica_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert by_name["ars"].operand_bytes == 1024 and by_name["ars"].channel_id == 6
    assert by_name["rs"].replica_groups == ((0, 1), (2, 3)) and by_name["rs"].channel_id is None
    assert by_name["a2a"].operand_bytes == 2048 and by_name["a2a"].channel_id is None
    assert by_name["cp"].instruction.source_target_pairs == ((0, 1), (1, 0))
    assert all(c.computation == "main" for c in cols)

    transfers = {t.instruction.name: t.reason for t in mod.host_transfers()}
    assert set(transfers) == {"inf", "outf", "snd", "snd.done", "rcv", "rcv.done", "to_host", "to_dev", "place", "cb", "host.add"}
    assert "infeed" in transfers["inf"] and "outfeed" in transfers["outf"]
    assert "MoveToHost" in transfers["to_host"] and "pinned_host" in transfers["place"]
    assert "callback" in transfers["cb"] and "_xla_compute_type" in transfers["host.add"]
    assert mod.instruction(23).frontend_attributes == {"_xla_compute_type": "host", "other": "x"}

    loops = {w.instruction.name: w for w in mod.while_loops()}
    assert loops["w1"].known_trip_count == 7 and loops["w2"].known_trip_count == 3 and loops["w3"].known_trip_count is None
    assert loops["w1"].body == "body" and loops["w1"].condition == "cond" and loops["w2"].body == "body2"
    assert loops["w1"].body_instruction_count == 5 + 3  # helper is called twice, counted once
    assert loops["w2"].body_instruction_count == 1

    assert mod.constants_bytes == 40 + 2 + 16
    text = mod.summary()
    for piece in ["Parameters (3)", "{devices=[8]<=[8]}", "Collectives (5", "all-reduce-start", "{0,2,4,6}",
                  "Host transfers (11)", "MoveToHost", "While loops (3)", "body2", "Constants: 58 B"]:
        assert piece in text, piece

    with pytest.raises(KeyError):
        mod.instruction(12345)
    with pytest.raises(KeyError):
        mod.computation("nope")
    with pytest.raises(TypeError):
        mod.computation(1.5)
    assert mod.computation(COND_ID).name == "cond" and mod.computation("body").id == BODY_ID
    assert mod.computation("body").instruction(205).opcode == "add"


def test_hand_encoded_module_matches_independent_decoding():
    """The analysis module through Python's own view of the same fields."""
    mod = read_hlo(analysis_module())
    sharded = {i.name: str(i.sharding) for c in mod.computations for i in c.instructions if i.sharding is not None}
    assert sharded == {"p0": "{devices=[8]<=[8]}", "p2": "{{replicated}, {maximal device=3}}"}
    p2 = mod.instruction(3)
    assert p2.sharding.type == "tuple" and p2.sharding.tuple_shardings[1].tile_assignment_devices == (3,)
    assert str(p2.shape) == "(f32[2], s4[3])"


def test_entry_lookup_and_missing_entry():
    comp = computation("c", 7, 1, [instruction("p", "parameter", 1, shape(F32, [2]), param=0)])
    # Old protos name the entry without an id.
    assert read_hlo(f_str(1, "m") + f_str(2, "c") + f_len(3, comp)).entry.id == 7
    mod = read_hlo(module("m", "other", 99, [comp]))
    with pytest.raises(ValueError, match="no entry computation"):
        mod.entry
    assert "entry <missing>" in mod.summary()
    empty = read_hlo(b"")
    assert empty.name == "" and empty.computations == () and empty.num_instructions == 0
    # Hand-written protos may reuse ids; every parameter is still listed once.
    dup = computation("c", 1, 1, [instruction(f"p{n}", "parameter", 1, shape(F32, [n + 1]), param=n) for n in (1, 0)])
    params = read_hlo(module("m", "c", 1, [dup])).entry_parameters
    assert [(p.number, p.name, p.shape) for p in params] == [(0, "p0", (1,)), (1, "p1", (2,))]


def test_the_summary_clips_very_long_names():
    """A module saved elsewhere may carry megabyte-long names: the report shows their ends and their length."""
    long_param, long_module = "p" * 5_000_000, "m" * 3_000
    comp = computation("c", 7, 1, [instruction(long_param, "parameter", 1, shape(F32, [2]), param=0)])
    text = read_hlo(module(long_module, "c", 7, [comp])).summary()
    assert len(text) < 2_000, len(text)
    assert "(5000000 chars)" in text and "(3000 chars)" in text


# ---------------------------------------------------------------------------
# Trip counts read from the loop itself.


@pytest.mark.parametrize(
    "start, step, bound, direction, bound_first, expected",
    [
        (0, 1, 16, "LT", False, 16),
        (0, 1, 16, "LE", False, 17),
        (3, 2, 10, "LT", False, 4),  # 3, 5, 7, 9
        (3, 2, 11, "LT", False, 4),
        (0, 1, 16, "GT", True, 16),  # 16 > i
        (0, 1, 16, "GE", True, 17),
        (0, 4, 16, "NE", False, 4),
        (5, 1, 2, "LT", False, 0),  # never runs
        (-4, 1, 4, "LT", False, 8),
        (0, 1, 16, "GT", False, None),  # counts down from the start: not the counted form
        (0, 1, 16, "LT", True, None),  # 16 < i
        (0, 3, 16, "NE", False, None),  # steps over the bound: runs forever
        (0, 0, 16, "LT", False, None),
        (0, -1, 16, "LT", False, None),
        (0, 1, 2**63 - 1, "LE", False, None),  # the bound + 1 overflows
    ],
)
def test_trip_count_is_read_from_a_counted_loop(start, step, bound, direction, bound_first, expected):
    mod = read_hlo(counted_loop_module(start, step, bound, direction, bound_first=bound_first))
    (loop,) = mod.while_loops()
    assert loop.known_trip_count is None and loop.trip_count == expected
    assert loop.op_name == "scan/loop" and loop.condition_constants == (bound,)
    assert mod.instruction(11).integer_value == start and mod.instruction(34).comparison_direction == direction


def test_trip_count_needs_the_counter_stepped_in_the_body():
    (loop,) = read_hlo(counted_loop_module(0, 1, 16, "LT", step_elsewhere=True)).while_loops()
    assert loop.trip_count is None


@pytest.mark.parametrize("dtype, field, value", [(S32, 4, -7), (S64, 5, -(2**40)), (U32, 6, 2**32 - 1), (U64, 7, 2**63 - 1)])
def test_integer_constants_of_each_width(dtype, field, value):
    mod = read_hlo(counted_loop_module(value, 1, 0, "LT", counter_dtype=dtype, literal_field=field))
    assert mod.instruction(11).integer_value == value


def test_an_integer_past_int64_or_a_float_constant_has_no_integer_value():
    assert read_hlo(counted_loop_module(2**63, 1, 0, "LT", literal_field=7)).instruction(11).integer_value is None
    with_float = read_hlo(counted_loop_module(0, 1, 4, "LT", literal_field=8))  # an f32s field
    assert with_float.instruction(11).integer_value is None and with_float.while_loops()[0].trip_count is None
