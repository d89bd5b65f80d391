"""scripts/maxtext_program.py rewrites a mesh-axis sharding as the tile assignment JAX itself gives it.

The reference is jax's own ``NamedSharding`` lowering (``_to_xla_hlo_sharding``)
on an abstract mesh, read back with XLA's ``HloSharding``: for each mesh and
partition spec, the rewritten OpSharding must be the same sharding. Fields
the script does not understand must stop it, not be dropped.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

jax = pytest.importorskip("jax")
from jax._src.lib import xla_client  # noqa: E402
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P  # noqa: E402

import maxtext_program as mp  # noqa: E402
from proto_wire import fields, int_field, message_field  # noqa: E402


def _named(sizes: dict[str, int], spec: tuple) -> bytes:
    """An OpSharding carrying only a named sharding, as MaxText's program does (field numbers in the script)."""
    names = list(sizes)
    mesh = b"".join(message_field(1, message_field(1, n.encode()) + int_field(2, s)) for n, s in sizes.items())
    dims = b""
    for entry in spec:
        axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        refs = b"".join(message_field(1, int_field(1, names.index(a)) if names.index(a) else b"") for a in axes)
        dims += message_field(3, refs + int_field(2, 1))
    return message_field(14, message_field(2, mesh) + dims)


def _read(op_sharding: bytes):
    proto = xla_client.OpSharding()
    proto.ParseFromString(op_sharding)
    return xla_client.HloSharding.from_proto(proto)


CASES = [
    ({"fsdp": 8}, ("fsdp", None)),
    ({"fsdp": 8}, (None, "fsdp")),
    ({"fsdp": 8}, (None, None)),
    ({"data": 1, "fsdp": 8, "tensor": 1}, ("fsdp", None, None)),
    ({"x": 2, "y": 4}, ("y", None)),
    ({"x": 2, "y": 4}, (None, "x")),
    ({"x": 2, "y": 4}, ("y", "x")),
    ({"x": 2, "y": 4}, (("y", "x"), None)),
    ({"x": 2, "y": 2, "z": 2}, ("z", None, "x")),
]


@pytest.mark.parametrize("sizes,spec", CASES, ids=[f"{s}-{p}" for s, p in CASES])
def test_the_rewritten_sharding_is_jax_own_for_the_same_mesh_and_spec(sizes, spec):
    expected = NamedSharding(AbstractMesh(tuple(sizes.values()), tuple(sizes)), P(*spec))
    got = _read(mp.rewrite_sharding(_named(sizes, spec)))
    assert got == expected._to_xla_hlo_sharding(len(spec)), (str(got), str(expected._to_xla_hlo_sharding(len(spec))))


def test_tuple_elements_are_rewritten_and_other_fields_kept():
    metadata = message_field(7, message_field(2, b"op_name"))  # OpSharding.metadata, carried as it is
    elements = [_named({"fsdp": 4}, ("fsdp",)) + metadata, _named({"fsdp": 4}, (None,))]
    rewritten = mp.rewrite_sharding(int_field(1, 2) + b"".join(message_field(5, e) for e in elements))
    assert str(_read(rewritten)) == "{{devices=[4]0,1,2,3}, {replicated}}"
    first = next(value for number, value, _ in fields(rewritten) if number == 5)
    assert metadata in first


@pytest.mark.parametrize("named,field", [
    (message_field(14, message_field(2, message_field(1, int_field(2, 4)) + message_field(2, b"\x00"))), "mesh field 2"),
    (message_field(14, message_field(2, message_field(1, int_field(2, 4))) + message_field(4, b"")), "named-sharding field 4"),
    (message_field(14, message_field(2, message_field(1, int_field(2, 4)))
                 + message_field(3, message_field(1, int_field(2, 1)))), "a sub-axis"),
])
def test_a_sharding_it_cannot_read_stops_it_with_the_field_named(named, field):
    with pytest.raises(SystemExit, match=field):
        mp.rewrite_sharding(named)
