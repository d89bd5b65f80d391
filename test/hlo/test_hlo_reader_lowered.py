"""The reader's view of lowered torch_xla graphs against torch_xla's protobuf JSON and XLA's sharding strings."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import torch_xla
import torch_xla.distributed.spmd as xs

from torch_xla_ext.hlo import HloModule, Shape, Sharding, read_hlo

from hlo_graphs import GRAPHS, g_while, lower

XLAC = torch_xla._XLAC


# ---------------------------------------------------------------------------
# Comparison of the reader's view with torch_xla's JSON of the same proto.

_JSON_TYPE_NAMES = {"OPAQUE_TYPE": "opaque", "PRIMITIVE_TYPE_INVALID": "invalid"}


def _ints(values) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _expand_iota(reshape, perm) -> tuple[int, ...]:
    n = int(np.prod(reshape))
    return tuple(int(v) for v in np.arange(n).reshape(reshape).transpose(perm).reshape(-1))


def check_shape(shape: Shape, js: dict) -> None:
    name = js.get("elementType", "PRIMITIVE_TYPE_INVALID")
    assert shape.element_type == _JSON_TYPE_NAMES.get(name, name.lower())
    assert shape.dimensions == _ints(js.get("dimensions", []))
    dyn = tuple(js.get("isDynamicDimension", []))
    assert shape.is_dynamic_dimension == (dyn if any(dyn) else ())
    tuples = js.get("tupleShapes", [])
    assert len(shape.tuple_shapes) == len(tuples)
    for s, t in zip(shape.tuple_shapes, tuples):
        check_shape(s, t)


def check_sharding(sharding: Sharding, js: dict) -> None:
    assert sharding.type == js.get("type", "REPLICATED").lower()
    assert sharding.tile_assignment_dimensions == _ints(js.get("tileAssignmentDimensions", []))
    iota = _ints(js.get("iotaReshapeDims", []))
    perm = _ints(js.get("iotaTransposePerm", []))
    assert sharding.iota_reshape_dims == iota
    assert sharding.iota_transpose_perm == perm
    if iota:
        assert sharding.tile_assignment_devices == _expand_iota(iota, perm)
    else:
        assert sharding.tile_assignment_devices == _ints(js.get("tileAssignmentDevices", []))
    assert sharding.replicate_on_last_tile_dim == js.get("replicateOnLastTileDim", False)
    assert sharding.last_tile_dims == tuple(t.lower() for t in js.get("lastTileDims", []))
    subs = js.get("tupleShardings", [])
    assert len(sharding.tuple_shardings) == len(subs)
    for s, t in zip(sharding.tuple_shardings, subs):
        check_sharding(s, t)
    assert sharding.valid


def _json_groups(ji: dict) -> tuple[tuple[int, ...], ...]:
    if "collectiveDeviceList" in ji:
        cdl = ji["collectiveDeviceList"]
        if "iotaReplicaGroupList" in cdl:
            il = cdl["iotaReplicaGroupList"]
            flat = _expand_iota(_ints(il["iotaReshapeDims"]), _ints(il["iotaTransposePerm"]))
            n = int(il.get("numDevicesPerGroup", 0))
            return tuple(flat[i : i + n] for i in range(0, len(flat), n))
        groups = cdl.get("replicaGroups", [])
    else:
        groups = ji.get("replicaGroups", [])
    return tuple(_ints(g.get("replicaIds", [])) for g in groups)


def check_module(mod: HloModule, j: dict) -> int:
    """Asserts that every decoded field equals the JSON; returns the instruction count."""
    assert mod.name == j["name"]
    assert mod.entry_computation_name == j["entryComputationName"]
    assert mod.entry_computation_id == int(j.get("entryComputationId", 0))
    assert len(mod.computations) == len(j["computations"])
    count = 0
    for comp, jc in zip(mod.computations, j["computations"]):
        assert comp.name == jc["name"]
        assert comp.id == int(jc.get("id", 0))
        assert comp.root_id == int(jc.get("rootId", 0))
        assert len(comp.instructions) == len(jc.get("instructions", []))
        for ins, ji in zip(comp.instructions, jc.get("instructions", [])):
            count += 1
            assert ins.name == ji["name"]
            assert ins.opcode == ji["opcode"]
            assert ins.id == int(ji.get("id", 0))
            assert ins.computation == comp.name
            check_shape(ins.shape, ji.get("shape", {}))
            assert ins.operand_ids == _ints(ji.get("operandIds", []))
            assert ins.called_computation_ids == _ints(ji.get("calledComputationIds", []))
            if ins.opcode == "parameter":
                assert ins.parameter_number == int(ji.get("parameterNumber", 0))
            else:
                assert ins.parameter_number is None
            assert ins.custom_call_target == ji.get("customCallTarget", "")
            assert ins.is_host_transfer == ji.get("isHostTransfer", False)
            channel = int(ji.get("channelId", 0))
            assert ins.channel_id == (channel if channel > 0 else None)
            assert ins.replica_groups == _json_groups(ji)
            pairs = tuple((int(p.get("source", 0)), int(p.get("target", 0))) for p in ji.get("sourceTargetPairs", []))
            assert ins.source_target_pairs == pairs
            if "sharding" in ji:
                assert ins.sharding is not None
                check_sharding(ins.sharding, ji["sharding"])
            else:
                assert ins.sharding is None
            assert dict(ins.frontend_attributes) == ji.get("frontendAttributes", {}).get("map", {})
            assert mod.instruction(ins.id) is ins or mod.instruction(ins.id).id == ins.id
    assert mod.num_instructions == count
    return count


def _sharding_strings_in_hlo_text(text: str) -> list[str]:
    """Every `sharding={...}` of an HLO text, braces balanced."""
    out = []
    for m in re.finditer(r"sharding=\{", text):
        depth, i = 0, m.end() - 1
        start = i
        while True:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    break
            i += 1
        out.append(text[start : i + 1])
    return out


# ---------------------------------------------------------------------------
# Lowered graphs: reader vs protobuf JSON, sharding strings vs XLA.


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.__name__)
def test_reader_matches_xla_json(graph, device, mesh_4x2):
    inputs, outputs = graph(device, mesh_4x2)
    ctx = lower(outputs, graph.__name__)
    data = ctx.hlo()
    mod = read_hlo(data)
    j = json.loads(ctx.hlo_json())
    assert check_module(mod, j) > 0

    # Every sharding string the HLO text shows, and none it does not.
    text = XLAC._get_xla_tensors_hlo(outputs)
    expected = sorted(_sharding_strings_in_hlo_text(text))
    got = sorted(str(i.sharding) for c in mod.computations for i in c.instructions if i.sharding is not None)
    assert got == expected

    # Parameters: XLA's sharding string of the tensor behind each one.
    params = {p.number: p for p in mod.entry_parameters}
    assert [p.number for p in mod.entry_parameters] == sorted(params)
    for t in inputs:
        pid = ctx.tensor_parameter_id(t)
        if pid < 0:
            continue
        p = params[pid]
        # In SPMD mode an unannotated input becomes a replicated parameter.
        assert p.sharding == (XLAC._get_xla_sharding_spec(t) or "{replicated}")
        assert p.shape == tuple(t.shape)
        assert p.dtype == t.dtype
        assert p.hlo_shape.byte_size == t.numel() * t.element_size()

    # The input bytes are the same in every buffer flavour.
    assert read_hlo(bytearray(data)).num_instructions == mod.num_instructions
    assert read_hlo(memoryview(data)).num_instructions == mod.num_instructions


def test_while_loop_analysis_of_lowered_graph(device, mesh_4x2):
    _, outputs = g_while(device, mesh_4x2)
    mod = read_hlo(lower(outputs, "loop").hlo())
    loops = mod.while_loops()
    assert len(loops) == 1
    loop = loops[0]
    assert loop.instruction.opcode == "while"
    body = mod.computation(loop.body)
    cond = mod.computation(loop.condition)
    assert loop.instruction.called_computation_ids == (body.id, cond.id)
    # Body plus everything it calls, each computation once.
    seen, todo, expected = set(), [body.id], 0
    while todo:
        cid = todo.pop()
        if cid in seen:
            continue
        seen.add(cid)
        comp = mod.computation(cid)
        expected += len(comp.instructions)
        todo += [c for i in comp.instructions for c in i.called_computation_ids]
    assert loop.body_instruction_count == expected > len(body.instructions)
    assert loop.known_trip_count is None
    assert mod.collectives() == [] and mod.host_transfers() == []
    assert "While loops (1)" in mod.summary()


MESH_SPECS = [
    ((4, 2), ("x", "y"), ("x", "y")),
    ((4, 2), ("x", "y"), ("y", "x")),
    ((4, 2), ("x", "y"), ("x", None)),
    ((4, 2), ("x", "y"), (None, "y")),
    ((4, 2), ("x", "y"), (None, None)),
    ((4, 2), ("x", "y"), (("x", "y"), None)),
    ((4, 2), ("x", "y"), (None, ("y", "x"))),
    ((8,), ("fsdp",), ("fsdp", None)),
    ((8,), ("fsdp",), (None, "fsdp")),
    ((2, 2, 2), ("a", "b", "c"), ("a", ("b", "c"))),
    ((2, 2, 2), ("a", "b", "c"), (("c", "a"), None)),
    ((2, 2, 2), ("a", "b", "c"), ("b", None)),
    ((2, 2, 2), ("a", "b", "c"), (None, "c")),
    ((1, 8), ("r", "s"), ("r", "s")),
]


@pytest.mark.parametrize("permuted", [False, True], ids=["iota-devices", "permuted-devices"])
def test_sharding_strings_match_torch_xla(permuted, device, num_devices):
    devices = np.array([3, 1, 0, 2, 7, 5, 4, 6]) if permuted else np.arange(num_devices)
    tensors = []
    for mesh_shape, axes, spec in MESH_SPECS:
        mesh = xs.Mesh(devices, mesh_shape, axes)
        t = torch.randn(16, 8).to(device)
        xs.mark_sharding(t, mesh, spec)
        tensors.append(t)
    ctx = lower([sum(t.sum() for t in tensors)], "shardings")
    mod = read_hlo(ctx.hlo())
    params = {p.number: p for p in mod.entry_parameters}
    specs = set()
    for t in tensors:
        want = XLAC._get_xla_sharding_spec(t)
        p = params[ctx.tensor_parameter_id(t)]
        assert p.sharding == want
        ins = next(i for i in mod.entry.instructions if i.name == p.name)
        if want != "{replicated}":
            # The expanded devices are the tile assignment XLA printed.
            assert ",".join(map(str, ins.sharding.tile_assignment_devices)) in want
        specs.add(want)
    assert len(specs) >= 10  # the cases really differ
    assert any("last_tile_dim_replicate" in s for s in specs)
