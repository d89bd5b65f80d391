"""Cost bounds for hostile input: the reader's memory budget and linear-time analyses."""

from __future__ import annotations

import re
import time

from torch_xla_ext import _C
from torch_xla_ext.hlo import read_hlo

from child_process import run_child
from hlo_encoding import (F32, TUPLE, _expect_parse_error, analysis_module, attrs, computation, f_int, f_len, f_msg, f_packed,
                          f_str, instruction, module, op_sharding, shape)
from hlo_graphs import g_matmul, g_tuple_outputs, g_while, lower


# ---------------------------------------------------------------------------
# Cost bounds for hostile input: memory proportional to the input size, work
# linear in it. Sizes are chosen so that a return of a quadratic path would
# take minutes where the linear one takes milliseconds; the few time bounds
# below are that far from the measured times.

_GENEROUS_SECONDS = 15.0

_PEAK_RSS_SCRIPT = r"""
import importlib.util, resource, sys
spec = importlib.util.spec_from_file_location("torch_xla_ext._C", sys.argv[1])
C = importlib.util.module_from_spec(spec)
spec.loader.exec_module(C)
data = open(sys.argv[2], "rb").read()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    m = C.read_module(data)
    m.collectives(), m.host_transfers(), m.while_loops(), m.constants_bytes()
    result = "ok"
except ValueError as e:
    result = str(e)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print((after - before) * 1024)
print(result)
"""


def _peak_rss_of_read(tmp_path, data: bytes) -> tuple[int, str]:
    """Peak RSS growth (bytes) of reading `data` with the C++ reader alone, in
    a fresh process that loads only the extension (no torch), and the outcome."""
    path = tmp_path / "input.pb"
    path.write_bytes(data)
    out = run_child(["-c", _PEAK_RSS_SCRIPT, _C.__file__, str(path)], devices=None, timeout=300).stdout.splitlines()
    return int(out[0]), "\n".join(out[1:])


def _fast_module(computations: list[tuple[str, int, list[bytes]]], entry_id: int = 1) -> bytes:
    """module(...) for large inputs: one join instead of repeated concatenation."""
    return b"".join(
        f_len(3, b"".join([f_str(1, name), *(f_len(2, ins) for ins in instructions), f_int(5, cid)]))
        for name, cid, instructions in computations
    ) + f_int(6, entry_id)


def _budget_limit(data: bytes) -> int:
    return _C.BUDGET_BYTES_PER_INPUT_BYTE * len(data) + _C.BUDGET_BASE_BYTES


def _iota_bomb(instructions: int = 256, groups: int = 1 << 18) -> bytes:
    # Each instruction names `groups` replica groups of 0 devices in 16 bytes.
    dl = f_msg(2, f_int(1, groups), f_int(2, 0))
    ins = [f_int(35, i + 1) + f_len(87, dl) for i in range(instructions)]
    return f_len(3, f_str(1, "c") + b"".join(f_len(2, x) for x in ins) + f_int(5, 1)) + f_int(6, 1)


def _empty_instructions(size: int) -> bytes:
    n = (size - 16) // 2
    return f_len(3, f_str(1, "c") + b"\x12\x00" * n + f_int(5, 1)) + f_int(6, 1)


def test_budget_constants_and_bookkeeping():
    assert _C.BUDGET_BYTES_PER_INPUT_BYTE == 64 and _C.BUDGET_BASE_BYTES == 1 << 20
    data = analysis_module()
    m = _C.read_module(data)
    assert m.budget_limit == _budget_limit(data)
    assert 0 < m.budget_used <= m.budget_limit
    assert _C.read_module(b"").budget_used == 0


def test_iota_replica_groups_of_empty_groups_cost_no_more_than_the_budget(tmp_path):
    # 4.2 KB that asked for 256 x 2^18 empty groups: +2.0 GB and 5.4 s before.
    bomb = _iota_bomb()
    assert len(bomb) < 4400
    m = _C.read_module(bomb)
    assert m.budget_used <= m.budget_limit == _budget_limit(bomb)
    groups = [i.replica_groups for i in m.computations[0].instructions]
    assert len(groups) == 256 and all(g == [] for g in groups)
    # Measured: +0.1 MB of peak RSS.
    rss, result = _peak_rss_of_read(tmp_path, bomb)
    assert result == "ok" and rss < 64 << 20, rss
    # The Python view stays within the budget's order too (measured 36 x input).
    import tracemalloc

    tracemalloc.start()
    try:
        mod = read_hlo(bomb)
        mod.summary()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < _budget_limit(bomb), peak
    # Within the budget such groups are still listed.
    few = _iota_bomb(instructions=2, groups=3)
    assert [i.replica_groups for i in read_hlo(few).computations[0].instructions] == [((),) * 3] * 2


def test_memory_budget_error_names_the_offset(tmp_path):
    # 1 MB of empty instructions: +344 MB in the C++ reader (+652 MB through
    # read_hlo) before; now refused before they are allocated.
    data = _empty_instructions(1_000_000)
    message = _expect_parse_error(data, "exceeds the reader's memory budget")
    # The offset of the computation's payload, where its instructions are
    # counted and reserved.
    assert "byte offset 4 " in message and "HloModuleProto.computations[0]" in message
    assert f"limit for a {len(data)}-byte input" in message and "64 bytes per input byte" in message
    rss, result = _peak_rss_of_read(tmp_path, data)
    assert "memory budget" in result and rss < 64 << 20, rss
    # Empty instructions cost 736 bytes each: the base allows about 1,700.
    m = _C.read_module(_empty_instructions(3000))
    assert m.num_instructions() == 1492 and m.budget_used <= m.budget_limit


def test_every_decoded_field_counts_against_the_budget():
    # n elements of each kind of repeated data raise the charge by at least
    # what they occupy in the C++ structures (sizes from libstdc++ on x86-64).
    n = 1000
    cases = {
        "operands": (lambda k: instruction("x", "add", 1, shape(F32), extra=b"".join(f_int(36, 1) for _ in range(k))), 8),
        "dims": (lambda k: instruction("x", "add", 1, f_int(2, F32) + f_packed(3, [1] * k)), 8),
        "tuple shapes": (lambda k: instruction("x", "tuple", 1, f_int(2, TUPLE) + f_len(4, b"") * k), 96),
        "groups": (lambda k: instruction("x", "all-reduce", 1, shape(F32), extra=f_len(49, b"") * k), 24),
        "pairs": (lambda k: instruction("x", "collective-permute", 1, shape(F32), extra=f_len(52, b"") * k), 16),
        "attributes": (lambda k: instruction("x", "add", 1, shape(F32), frontend=f_len(1, b"") * k), 64),
        "tuple shardings": (lambda k: instruction("x", "add", 1, shape(F32), sharding=f_int(1, 2) + f_len(5, b"") * k), 184 + 272),
        "device list": (lambda k: instruction("x", "all-reduce", 1, shape(F32), device_list=f_len(1, b"") * k), 24),
        "name": (lambda k: instruction("x" * k, "add", 1, shape(F32)), 1),
        "backend config": (lambda k: instruction("x", "add", 1, shape(F32), backend=b"x" * k), 1),
        "instructions": (lambda k: b"".join(f_len(2, b"") for _ in range(k)), 688),
    }
    for what, (build, each) in cases.items():
        def charged(k: int) -> int:
            body = build(k) if what == "instructions" else f_len(2, build(k))
            return _C.read_module(f_len(3, f_str(1, "c") + body)).budget_used

        assert charged(n) - charged(0) >= n * each, what
    # Kinds that cost far more than their bytes run out of budget, with an
    # error naming where, before they are allocated.
    for ins in [cases["tuple shardings"][0](400_000), cases["attributes"][0](400_000)]:
        data = module("m", "c", 1, [computation("c", 1, 1, [ins])])
        message = _expect_parse_error(data, "memory budget")
        assert "instructions[0]" in message, message


def test_lowered_modules_use_a_fraction_of_the_budget(device, mesh_4x2):
    # Measured: 13-18 x the input for the seeds and lowered graphs.
    import pathlib

    seeds = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "fuzz" / "corpus"
    inputs = [p.read_bytes() for p in sorted(seeds.glob("*.pb")) if p.name != "shardings.pb"]
    for graph in (g_matmul, g_while, g_tuple_outputs):
        _, outputs = graph(device, mesh_4x2)
        inputs.append(lower(outputs, "budget").hlo())
    for data in inputs:
        m = _C.read_module(data)
        assert m.budget_used <= 24 * len(data) + (64 << 10), (len(data), m.budget_used)


def _while_chain(n: int, shared_tail: bool = False) -> bytes:
    # c0 holds a while loop whose body is c1, which holds one whose body is
    # c2, ...; with shared_tail every ci also calls the last computation.
    comps = []
    for i in range(n):
        called = [i + 2, n + 1] if shared_tail else [i + 2, 0]
        comps.append((f"c{i}", i + 1, [f_str(2, "while") + f_int(35, i + 1) + f_packed(38, called)]))
    comps.append((f"c{n}", n + 1, [f_str(2, "add") + f_int(35, n + 1)]))
    return _fast_module(comps)


def test_nested_while_loops_are_counted_in_linear_time():
    # 3.3 MB of nested loops: 470 KB took 8.6 s (3.1 s here) before, growing
    # with the square of the size; now no step of the walk is needed.
    n = 100_000
    data = _while_chain(n)
    start = time.perf_counter()
    m = _C.read_module(data)
    loops = m.while_loops()
    elapsed = time.perf_counter() - start
    assert m.while_walk_steps == 0
    assert [w.body_instruction_count for w in loops[:3]] == [n, n - 1, n - 2]
    assert loops[-1].body_instruction_count == 1
    assert elapsed < _GENEROUS_SECONDS, elapsed
    # The Python view reports the same counts.
    assert read_hlo(_while_chain(50)).while_loops()[0].body_instruction_count == 50


def test_while_walk_steps_are_bounded_by_the_call_graph():
    # Bodies that reach a shared callee are walked; the walk is exact.
    m = _C.read_module(_while_chain(100, shared_tail=True))
    assert [w.body_instruction_count for w in m.while_loops()[:3]] == [100, 99, 98]
    assert 0 < m.while_walk_steps <= _C.WHILE_WALK_STEPS_PER_EDGE * (101 + 199)
    # Sibling loops whose bodies share a callee: steps grow with the count.
    def siblings(k: int) -> bytes:
        shared = computation("shared", 2, 1, [f_str(2, "add") + f_int(35, 1)])
        bodies = [computation(f"b{i}", 10 + i, 1, [f_str(2, "call") + f_int(35, 1) + f_packed(38, [2]),
                                                   f_str(2, "add") + f_int(35, 2)]) for i in range(k)]
        loops = [f_str(2, "while") + f_int(35, 100 + i) + f_packed(38, [10 + i, 0]) for i in range(k)]
        return module("m", "e", 1, [shared, *bodies, computation("e", 1, 100, loops)])

    small, large = _C.read_module(siblings(1000)), _C.read_module(siblings(2000))
    assert all(w.body_instruction_count == 3 for w in large.while_loops())
    assert large.while_walk_steps <= 2 * small.while_walk_steps
    # Deep nesting that shares a callee at every level would take steps
    # quadratic in the depth: refused, naming the loop.
    data = _while_chain(400, shared_tail=True)
    message = _expect_parse_error(data, "exceeds the reader's work limit")
    offset = int(re.search(r"byte offset (\d+)", message).group(1))
    assert "while instruction" in message and data[offset:offset + 7] == f_str(2, "while")


def test_recursive_calls_do_not_hang_the_while_count():
    # Invalid HLO, but it must terminate: b -> h -> b, and b's loop names b.
    b = computation("b", 2, 1, [f_str(2, "while") + f_int(35, 1) + f_packed(38, [2, 3]), f_str(2, "call") + f_int(35, 2) + f_packed(38, [3])])
    h = computation("h", 3, 3, [f_str(2, "call") + f_int(35, 3) + f_packed(38, [2, 3])])
    loops = read_hlo(module("m", "b", 2, [b, h])).while_loops()
    assert [w.body_instruction_count for w in loops] == [3]


def test_ids_that_collide_in_a_hash_table_stay_fast():
    # 200,000 instruction ids that all fall in one bucket of the table
    # libstdc++'s unordered_map has at that size (351061 buckets): the index
    # used one and took 15 s to build; it is now a sorted list.
    n, buckets = 200_000, 351_061
    ins = [f_str(1, "x" * 8) + f_int(35, i * buckets) for i in range(n)]
    ins.append(instruction("ag", "all-gather", -1, shape(F32), [(n - 1) * buckets, 7 * buckets, 12345]))
    data = _fast_module([("c", 1, ins)])
    start = time.perf_counter()
    m = _C.read_module(data)
    (col,) = m.collectives()
    assert time.perf_counter() - start < _GENEROUS_SECONDS
    assert m.num_instructions() == n + 1 and col.operand_bytes == 0


def test_duplicate_ids_and_names_resolve_to_the_first():
    a = computation("c", 1, 1, [instruction("a", "parameter", 5, shape(F32, [2]), param=0), instruction("b", "parameter", 5, shape(F32, [3]), param=1)])
    b = computation("c", 1, 1, [instruction("d", "negate", 5, shape(F32, [4]), [5]), instruction("e", "all-gather", 6, shape(F32, [4]), [5])])
    mod = read_hlo(module("m", "c", 1, [a, b]))
    assert mod.entry is mod.computations[0] and mod.computation("c") is mod.computations[0]
    assert mod.instruction(5).name == "a"
    # An operand is looked up in its own computation first.
    assert mod.collectives()[0].operand_bytes == 16


def test_collective_operand_sizes_are_computed_once_per_operand():
    # 200,000 operands naming one instruction whose shape is a 20,000-element
    # tuple: its size was summed once per operand (4e9 steps) before.
    wide = shape(TUPLE, tuple_shapes=[f_int(2, F32)] * 20_000)
    ins = [instruction("t", "tuple", 1, wide), instruction("ag", "all-gather", 2, shape(F32), [1] * 200_000)]
    start = time.perf_counter()
    (col,) = _C.read_module(module("m", "c", 1, [computation("c", 1, 2, ins)])).collectives()
    assert time.perf_counter() - start < _GENEROUS_SECONDS
    assert col.operand_bytes == 200_000 * 20_000 * 4


def test_size_one_dims_do_not_slow_iota_expansion():
    # An iota of 2^17 devices with 100,000 trailing dimensions of size one:
    # the expansion stepped through every one of them per device (1.3e10
    # steps) before.
    dims = [1 << 17] + [1] * 100_000
    s = op_sharding(3, dims=[1 << 17], iota=dims, perm=list(range(len(dims))))
    data = module("m", "c", 1, [computation("c", 1, 1, [instruction("p", "parameter", 1, shape(F32, [1 << 17]), param=0, sharding=s)])])
    start = time.perf_counter()
    sharding = _C.read_module(data).computations[0].instructions[0].sharding
    assert time.perf_counter() - start < _GENEROUS_SECONDS
    assert sharding.devices == list(range(1 << 17)) and sharding.text == "{devices=[131072]<=[131072]}"


def test_repeated_frontend_attribute_keys_keep_first_position_and_last_value():
    fa = attrs(a="1", b="2") + attrs(a="3", c="4") + attrs(b="5")
    ins = instruction("x", "add", 1, shape(F32), frontend=fa)
    mod = read_hlo(module("m", "c", 1, [computation("c", 1, 1, [ins])]))
    assert list(mod.instruction(1).frontend_attributes.items()) == [("a", "3"), ("b", "5"), ("c", "4")]
