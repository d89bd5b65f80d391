"""Sharding forms torch_xla does not produce, against strings recorded from XLA's printer, and the reader's tables and records."""

from __future__ import annotations

import dataclasses

import pytest

from torch_xla_ext import _C
from torch_xla_ext.hlo import HloComputation, HloInstruction, Shape, Sharding, read_hlo, read_sharding

from hlo_encoding import analysis_module, computation, instruction, module, op_sharding, shape


# ---------------------------------------------------------------------------
# Sharding forms torch_xla does not produce: serialized OpSharding protos and
# the string XLA's HloSharding::FromProto(...).ToString() printed for each
# (recorded with XLA from jaxlib 0.7.1, the release paired with torch_xla 2.9).

XLA_SHARDING_STRINGS = [
    ("0802", "{}"),
    ("08022a0e08031a02020630014a010c5201002a002a0f08031a01064a0303020152030200012a0d08031a02030122030100023001", "{{devices=[2,6]<=[12] last_tile_dim_replicate}, {replicated}, {devices=[6]<=[6]}, {devices=[3]1,0,2}}"),
    ("08022a1308031a030104084a04020102085204010300022a1308031a01184a050402010301520501040203002a002a0208042a0e08031a04010109014a01095201002a00", "{{devices=[1,4,8]<=[4,8]T(1,0)}, {devices=[24]<=[4,6]T(1,0)}, {replicated}, {manual}, {devices=[1,1,9,1]<=[9]}, /*index=5*/{replicated}}"),
    ("08022a1508031a03060201220c030809070501020b000a04062a1708031a01102210000102030405060708090a0b0c0d0e0f2a1708031a050304010101220c0406010b05080a00070203092a1408031a040106010230014a0301030452030002012a1408031a02010922090208030105040006074201042a1608031a030109012209000102030405060708420204042a1a08031a04020104022210090b0e070f05010c0203040d0006080a2a1508031a0502010104014a04020201025204030100022a1108031a01404a04080202025204030200012a002a0c08031a020104220400020103", "{{devices=[6,2,1]3,8,9,7,5,1,2,11,0,10,4,6}, {devices=[16]0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}, {devices=[3,4,1,1,1]4,6,1,11,5,8,10,0,7,2,3,9}, {devices=[1,6,1,2]0,4,1,8,5,9,2,6,3,10,7,11 last_tile_dim_replicate}, {manual}, /*index=5*/{manual}, {devices=[2,1,4,2]9,11,14,7,15,5,1,12,2,3,4,13,0,6,8,10}, {devices=[2,1,1,4,1]<=[2,2,2]T(2,1,0)}, {devices=[64]<=[16,2,2]T(2,1,0)}, {replicated}, /*index=10*/{devices=[1,4]0,2,1,3}}"),
    ("", "{replicated}"),
    ("08011a0101220106", "{maximal device=6}"),
    ("08011a0101220102", "{maximal device=2}"),
    ("08031a010222020100", "{devices=[2]1,0}"),
    ("08031a02010822080001020304050607", "{devices=[1,8]0,1,2,3,4,5,6,7}"),
    ("08031a02020122020001420104", "{devices=[2]0,1}"),
    ("08031a0404010101220403000201420300000058016002", "{devices=[4]3,0,2,1 shard_as 2}"),
    ("08031a0301010222020001420104", "{manual}"),
    ("08031a040106010122060204050001034203040104", "{manual}"),
    ("08031a02010222020001420100", "{replicated}"),
    ("08031a040103010122030001024203000004", "{replicated}"),
    ("08031a020202220400010203420100", "{devices=[2,2]0,1,2,3 last_tile_dim_replicate}"),
    ("08031a050404020201224023070d1915182d1d362c272e3d170f08221b282f020435121632341c3b00381a14292026091e052a3f330b113e062524130a2130033a2b37010e10311f0c3c3942020000", "{devices=[4,4,2,2]7,35,13,25,21,24,29,45,44,54,39,46,23,61,8,15,27,34,40,47,2,4,18,53,22,50,28,52,0,59,26,56,20,41,32,38,9,30,5,42,51,63,11,17,6,62,36,37,10,19,33,48,3,58,43,55,1,14,16,49,12,31,57,60 last_tile_dim_replicate}"),
    ("08031a0201032203000102420101", "{devices=[1,3]0,1,2 last_tile_dims={maximal}}"),
    ("08031a0302020822201d130e0a1907170f030d1c1209151f10021a18050c080004141b110b0116061e42020401", "{devices=[2,8,2]29,3,19,13,14,28,10,18,25,9,7,21,23,31,15,16,2,20,26,27,24,17,5,11,12,1,8,22,0,6,4,30 last_tile_dims={maximal, manual}}"),
    ("08031a020201220200013001", "{devices=[2]0,1}"),
    ("08031a05010301020122060001020304053001", "{devices=[1,3,1,2]0,1,2,3,4,5}"),
    ("08031a020102220201003001", "{replicated}"),
    ("08031a020108220800010203040506073001", "{replicated}"),
    ("08031a0202022204000102033001", "{devices=[2,2]0,1,2,3 last_tile_dim_replicate}"),
    ("08031a030401042210000102030405060708090a0b0c0d0e0f3001", "{devices=[4,1,4]0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15 last_tile_dim_replicate}"),
    ("08031a01084a0108520100", "{devices=[8]<=[8]}"),
    ("08031a01204a02200152020001580160046801", "{devices=[32]<=[32] shard_like 4}"),
    ("08031a0201024201044a0102520100", "{manual}"),
    ("08031a050101010201420204004a0102520100", "{manual}"),
    ("08031a0201084201004a0108520100", "{replicated}"),
    ("08031a03010601420200044a02060152020100", "{replicated}"),
    ("08031a04060101044201004a02060452020100", "{devices=[6,1,1,4]0,4,8,12,1,5,16,20,9,13,17,21,2,6,10,14,3,7,18,22,11,15,19,23 last_tile_dim_replicate}"),
    ("08031a0404010601420200004a030401065203020100", "{devices=[4,1,6]0,1,6,7,12,18,2,8,13,14,19,20,3,4,9,10,15,21,5,11,16,17,22,23 last_tile_dim_replicate}"),
    ("08031a03040203420200044a0402020106520400030201", "{devices=[4,3,2]0,7,2,6,1,8,3,10,5,9,4,11,12,19,14,18,13,20,15,22,17,21,16,23 last_tile_dims={manual, replicated}}"),
    ("08031a040101030242030104004a030302015203010200", "{devices=[1,3,2]0,2,1,4,3,5 last_tile_dims={manual, replicated}}"),
    ("08031a0220014201014a0120520100", "{devices=[32]<=[32]}"),
    ("08031a04010109014201044a02030352020100580160036801", "{devices=[1,1,9]<=[3,3]T(1,0) shard_like 3}"),
    ("08031a0208044201004a0120520100", "{devices=[8,4]<=[32] last_tile_dim_replicate}"),
    ("08031a03020208420200004a0120520100", "{devices=[2,16]<=[32] last_tile_dim_replicate}"),
    ("08031a0208044201044a0120520100", "{devices=[8,4]<=[32] last_tile_dims={manual}}"),
    ("08031a040202010242030000044a030104025203020001", "{devices=[2,2,2]<=[2,2,2]T(2,1,0) last_tile_dims={manual, replicated}}"),
    ("08031a02010630014a0106520100", "{replicated}"),
    ("08031a02010330014a050101030101520500020103045801", "{replicated shard_as 0}"),
    ("08031a02040330014a02020652020100", "{devices=[4,3]0,1,6,2,7,8,3,4,9,5,10,11 last_tile_dim_replicate}"),
    ("08031a02020630014a0403020201520400030201", "{devices=[2,6]0,1,2,3,4,6,5,7,8,9,10,11 last_tile_dim_replicate}"),
    ("08031a02020130014a0102520100", "{devices=[2]<=[2]}"),
    ("08031a040104030130014a0402020103520402000103", "{devices=[1,4,3]<=[12]}"),
    ("08031a02080230014a0110520100", "{devices=[8,2]<=[16] last_tile_dim_replicate}"),
    ("08031a05010201030430014a030206025203010200580160026801", "{devices=[1,2,1,3,4]<=[2,6,2]T(1,0,2) last_tile_dim_replicate shard_like 2}"),
    ("0804", "{manual}"),
    ("0805", "{unknown}"),
]


@pytest.mark.parametrize("hex_bytes, expected", XLA_SHARDING_STRINGS, ids=[f"xla{i}" for i in range(len(XLA_SHARDING_STRINGS))])
def test_sharding_string_matches_xla_printer(hex_bytes, expected):
    sharding = read_sharding(bytes.fromhex(hex_bytes))
    assert str(sharding) == expected
    assert sharding.valid
    # Formatting from the dataclass fields gives the same string.
    rebuilt = dataclasses.replace(sharding, text="")
    if "shard_" not in expected:  # shard groups are not dataclass fields
        assert str(rebuilt) == expected


def test_hand_encoded_sharding_forms():
    """Maximal, manual, tuple, iota and subgroup forms (strings checked against XLA's printer)."""
    cases = {
        op_sharding(1, dims=[1], devices=[5]): "{maximal device=5}",
        op_sharding(4): "{manual}",
        op_sharding(5): "{unknown}",
        op_sharding(0): "{replicated}",
        op_sharding(3, dims=[4, 2], iota=[8], perm=[0]): "{devices=[4,2]<=[8]}",
        op_sharding(3, dims=[2, 4], iota=[4, 2], perm=[1, 0]): "{devices=[2,4]<=[4,2]T(1,0)}",
        op_sharding(3, dims=[4, 2], iota=[2, 4], perm=[0, 1]): "{devices=[4,2]<=[8]}",
        op_sharding(3, dims=[2, 1, 4], iota=[8], perm=[0], rep_last=True): "{devices=[2,1,4]<=[8] last_tile_dim_replicate}",
        op_sharding(3, dims=[2, 2, 2], devices=[0, 1, 2, 3, 4, 5, 6, 7], last_tile_dims=[4, 0]): "{devices=[2,2,2]0,1,2,3,4,5,6,7 last_tile_dims={manual, replicated}}",
        op_sharding(3, dims=[2, 4], devices=[0, 1, 2, 3, 4, 5, 6, 7], last_tile_dims=[4]): "{devices=[2,4]0,1,2,3,4,5,6,7 last_tile_dims={manual}}",
        op_sharding(3, dims=[2, 2, 2], devices=[1, 0, 3, 2, 5, 4, 7, 6], rep_last=True): "{devices=[2,2,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}",
        op_sharding(3, dims=[1, 8], devices=list(range(8)), rep_last=True): "{replicated}",
        op_sharding(3, dims=[8, 1], devices=list(range(8)), rep_last=True): "{devices=[8]0,1,2,3,4,5,6,7}",
        op_sharding(0, shard_group=(0, 3)): "{replicated shard_as 3}",
        op_sharding(3, dims=[8], iota=[8], perm=[0], shard_group=(1, 2)): "{devices=[8]<=[8] shard_like 2}",
        op_sharding(2, tuple_=[op_sharding(0), op_sharding(1, dims=[1], devices=[2])]): "{{replicated}, {maximal device=2}}",
        op_sharding(2, tuple_=[op_sharding(0)] * 6): "{{replicated}, {replicated}, {replicated}, {replicated}, {replicated}, /*index=5*/{replicated}}",
        op_sharding(2): "{}",
    }
    for data, expected in cases.items():
        assert str(read_sharding(data)) == expected, data.hex()


def test_invalid_shardings_are_flagged_not_fatal():
    for data in [
        op_sharding(1),  # maximal without a device
        op_sharding(3, dims=[4, 2], devices=[0, 1, 2]),  # 8 tiles, 3 devices
        op_sharding(3, dims=[4], iota=[2, 2], perm=[0, 0]),  # perm is not a permutation
        op_sharding(3, dims=[2, 2], devices=[0, 1, 2, 3], rep_last=True, last_tile_dims=[0]),
        op_sharding(3, dims=[2, 2], devices=[0, 1, 2, 3], last_tile_dims=[9]),
    ]:
        s = read_sharding(data)
        assert not s.valid
        assert str(s).startswith("{invalid")
    # A tuple with one bad element is itself invalid.
    t = read_sharding(op_sharding(2, tuple_=[op_sharding(0), op_sharding(1)]))
    assert not t.valid and t.tuple_shardings[0].valid


def test_sharding_properties():
    s = read_sharding(op_sharding(3, dims=[2, 1, 4], iota=[8], perm=[0], rep_last=True))
    assert s.tile_assignment_devices == tuple(range(8))
    assert s.data_tile_dimensions == (2, 1) and s.num_shards == 2 and not s.is_replicated
    assert read_sharding(op_sharding(3, dims=[1, 1, 8], devices=list(range(8)), rep_last=True)).is_replicated
    assert read_sharding(op_sharding(0)).is_replicated
    assert not read_sharding(op_sharding(4)).is_replicated
    assert read_sharding(op_sharding(2, tuple_=[op_sharding(0), op_sharding(0)])).is_replicated
    assert not read_sharding(op_sharding(2, tuple_=[op_sharding(0), op_sharding(4)])).is_replicated
    t = read_sharding(op_sharding(3, dims=[2, 4], iota=[4, 2], perm=[1, 0]))
    assert t.tile_assignment_devices == (0, 2, 4, 6, 1, 3, 5, 7)
    assert t.num_shards == 8 and t.type == "other"
    m = read_sharding(op_sharding(3, dims=[2, 2, 2], devices=list(range(8)), last_tile_dims=[4, 0]))
    assert m.last_tile_dims == ("manual", "replicated") and m.data_tile_dimensions == (2,)
    # A hand-made Sharding prints through the same C++ code.
    made = Sharding(type="other", tile_assignment_dimensions=(2, 4), iota_reshape_dims=(4, 2), iota_transpose_perm=(1, 0))
    assert str(made) == "{devices=[2,4]<=[4,2]T(1,0)}"
    assert str(Sharding(type="tuple", tuple_shardings=(Sharding(type="manual"), made))) == "{{manual}, {devices=[2,4]<=[4,2]T(1,0)}}"
    # The printer reads type names itself, including the "type_<N>" spelling of unknown values.
    assert str(Sharding(type="other", tile_assignment_dimensions=(2,), tile_assignment_devices=(1, 0), last_tile_dims=("replicated",))) == "{replicated}"
    assert str(read_sharding(op_sharding(9))).startswith("{invalid type_9 ")
    assert str(Sharding(type="type_9")) == str(read_sharding(op_sharding(9)))
    with pytest.raises(ValueError, match="unknown sharding type 'tiled'"):
        str(Sharding(type="tiled"))
    with pytest.raises(ValueError, match="unknown sharding type 'both'"):
        str(Sharding(type="other", tile_assignment_dimensions=(2, 1), tile_assignment_devices=(0, 1), last_tile_dims=("both",)))


def test_tables_come_from_the_reader():
    assert _C.SHARDING_TYPES == {"replicated": 0, "maximal": 1, "tuple": 2, "other": 3, "manual": 4, "unknown": 5, "unreduced": 6}
    assert all(_C.sharding_type_name(v) == k for k, v in _C.SHARDING_TYPES.items())
    bits = _C.PRIMITIVE_TYPE_BITS
    assert bits["pred"] == 8 and bits["s4"] == 4 and bits["u1"] == 1 and bits["bf16"] == 16 and bits["c128"] == 128
    assert "tuple" not in bits and "token" not in bits and "opaque" not in bits
    # Every array type's size agrees between the C++ shape and the Python one.
    types = {name: value for value in range(64) if (name := _C.primitive_type_name(value)) in bits}
    assert set(types) == set(bits)
    for name, value in types.items():
        native = _C.read_module(module("m", "c", 1, [computation("c", 1, 1, [instruction("p", "parameter", 1, shape(value, [3, 5]), param=0)])])).computations[0].instructions[0].shape
        assert Shape(name, (3, 5)).byte_size == native.byte_size, name
    assert _C.UNBOUNDED_SIZE == -(2**63)


def test_module_records_are_named_and_share_shapes():
    mod = _C.read_module(analysis_module())
    records = mod.records()
    fields = {f.name for f in dataclasses.fields(HloInstruction)}
    for comp, native in zip(records["computations"], mod.computations):
        assert set(comp) == {f.name for f in dataclasses.fields(HloComputation)}
        assert comp["name"] == native.name and len(comp["instructions"]) == len(native.instructions)
        for rec, ins in zip(comp["instructions"], native.instructions):
            assert set(rec) == fields and rec["id"] == ins.id and rec["computation"] == native.name
            assert (rec["sharding"] is None) == (ins.sharding is None)
    # Each distinct shape is listed once, elements before their tuples.
    shapes = records["shapes"]
    keys = [(s["element_type"], s["dimensions"], s["tuple_shapes"], s["is_dynamic_dimension"]) for s in shapes]
    assert len(set(keys)) == len(keys)
    assert all(i < k for k, s in enumerate(shapes) for i in s["tuple_shapes"])
    view = read_hlo(analysis_module())
    by_value = {}
    for comp in view.computations:
        for ins in comp.instructions:
            assert by_value.setdefault(ins.shape, ins.shape) is ins.shape
