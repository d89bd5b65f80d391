"""LoweringContext: device-resident parameter mapping with shardings, zero host transfers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla.distributed.spmd as xs

import torch_xla_ext as txe
from torch_xla_ext.lowering import DEVICE_MAPPING_ENV
from torch_xla_ext.testing import measure_transfers
from torch_xla_ext.testing.tolerances import tolerance

X = torch_xla._XLAC


EXACT = {"atol": 0.0, "rtol": 0.0}  # the same device buffer read back: no arithmetic, no rounding


def spec(t: torch.Tensor) -> str:
    return X._get_xla_sharding_spec(t)


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded host generator per test; the XLA device's RNG is seeded too."""
    torch_xla.manual_seed(1234)
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def two_sharded(device, mesh_4x2, gen):
    """The sharded two-tensor case: a[32, 2048] on ('x', 'y'), b[2048] on ('x',)."""
    a = torch.randn(32, 2048, generator=gen).to(device)
    xs.mark_sharding(a, mesh_4x2, ("x", "y"))
    b = torch.randn(2048, generator=gen).to(device)
    xs.mark_sharding(b, mesh_4x2, ("x",))
    torch_xla.sync()
    return a, b


def lowered(outputs, **kw) -> txe.LoweringContext:
    ctx = txe.LoweringContext("test", **kw)
    ctx.build(list(outputs))
    return ctx


@pytest.mark.parametrize("impl", ["native", "fallback"])
def test_sharded_two_tensor_case_moves_nothing(two_sharded, impl):
    a, b = two_sharded
    ctx = lowered([a + b], device_mapping=impl)
    with measure_transfers() as m:
        mapping = ctx.device_parameter_id_tensor_mapping()
    assert m.d2h_transfers == 0 and m.d2h_bytes == 0, m.report()
    assert m.replicate_sharded_data == 0, m.report()

    ia, ib = ctx.tensor_parameter_id(a), ctx.tensor_parameter_id(b)
    assert ia >= 0 and ib >= 0 and ia != ib
    assert set(mapping) == {ia, ib}
    assert spec(mapping[ia]) == spec(a) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert spec(mapping[ib]) == spec(b) == "{devices=[4,2]0,1,2,3,4,5,6,7 last_tile_dim_replicate}"
    assert all(t.device.type == "xla" for t in mapping.values())
    # same device buffers, not copies
    assert X._get_tensors_handle([mapping[ia], mapping[ib]]) == X._get_tensors_handle([a, b])
    # and the same values as the (slow) host mapping, compared outside the measured block
    host = ctx.parameter_id_tensor_mapping()
    torch.testing.assert_close(mapping[ia].cpu(), host[ia], **EXACT)
    torch.testing.assert_close(mapping[ib].cpu(), host[ib], **EXACT)


def test_host_mapping_really_transfers(two_sharded):
    a, b = two_sharded
    ctx = lowered([a * b])
    with measure_transfers() as m:
        ctx.parameter_id_tensor_mapping()
    assert m.replicate_sharded_data >= 1 and m.d2h_bytes >= 32 * 2048 * 4, m.report()


def test_native_and_fallback_give_identical_mappings(two_sharded, device):
    a, b = two_sharded
    c = torch.tensor([1.0, 2.0], device=device)
    out = [(a * 3.5 + b).sum(0), c * 3.5, (a + torch.rand(2048, device=device)).mean()]
    native = lowered(out, device_mapping="native").device_parameter_id_tensor_mapping()
    fallback = lowered(out, device_mapping="fallback").device_parameter_id_tensor_mapping()
    assert list(native) == list(fallback)
    assert len(native) >= 5  # a, b, c, the 3.5 scalar, the RNG seed
    keys = list(native)
    assert X._get_tensors_handle([native[k] for k in keys]) == X._get_tensors_handle([fallback[k] for k in keys])
    assert [spec(native[k]) for k in keys] == [spec(fallback[k]) for k in keys]
    assert [(native[k].shape, native[k].dtype) for k in keys] == [(fallback[k].shape, fallback[k].dtype) for k in keys]


def test_environment_variable_forces_the_fallback(two_sharded, monkeypatch):
    a, b = two_sharded
    monkeypatch.setenv(DEVICE_MAPPING_ENV, "fallback")
    ctx = lowered([a - b])
    assert ctx.device_mapping_impl == "fallback"
    monkeypatch.setenv(DEVICE_MAPPING_ENV, "native")
    assert txe.LoweringContext().device_mapping_impl == "native"
    monkeypatch.setenv(DEVICE_MAPPING_ENV, "sometimes")
    with pytest.raises(ValueError, match=DEVICE_MAPPING_ENV):
        txe.LoweringContext()


def test_scalar_parameters_are_deduplicated(device, gen):
    a = torch.randn(16, generator=gen).to(device)
    b = torch.randn(16, generator=gen).to(device)
    torch_xla.sync()
    ctx = lowered([a * 2.75 + b * 2.75 - 2.75])
    params = ctx.parameters(inputs=[a, b])
    scalars = [p for p in params if p.shape == () and p.dtype == torch.float32]
    assert len(scalars) == 1, [(p.number, p.name, p.shape) for p in params]
    assert scalars[0].kind == "hoisted"
    assert scalars[0].tensor.cpu().item() == 2.75
    assert sorted(p.kind for p in params) == ["hoisted", "input", "input"]


def test_tensors_created_inside_the_lowered_code(device, gen):
    a = torch.randn(3, generator=gen).to(device)
    torch_xla.sync()

    def fn(x):
        table = torch.tensor([10.0, 20.0, 30.0], device=device)  # device data created in the code
        return x + table + torch.zeros(3, device=device)

    ctx = lowered([fn(a)])
    with measure_transfers() as m:
        params = ctx.parameters(inputs=[a])
    assert not m.device_to_host, m.report()
    hoisted = [p for p in params if p.kind == "hoisted" and p.shape == (3,)]
    assert len(hoisted) == 1
    torch.testing.assert_close(hoisted[0].tensor.cpu(), torch.tensor([10.0, 20.0, 30.0]), **EXACT)
    assert [p.kind for p in params if p.tensor is not None and p.tensor.shape == (3,)].count("input") == 1


def test_placeholder_tensors(device, gen):
    a = torch.randn(4, generator=gen).to(device)
    torch_xla.sync()
    outside = xb.create_placeholder_tensor((4,), torch.float32)
    inside = xb.create_placeholder_tensor((4,), torch.float32)
    ctx = lowered([a * inside])
    assert ctx.tensor_parameter_id(outside) == -1
    pid = ctx.tensor_parameter_id(inside)
    assert pid >= 0
    with measure_transfers() as m:
        mapping = ctx.device_parameter_id_tensor_mapping()
        params = {p.number: p for p in ctx.parameters()}
    assert not m.device_to_host, m.report()
    assert X._is_placecholder(mapping[pid])
    assert params[pid].tensor is not None and params[pid].shape == (4,)


def test_mapped_tensors_reused_without_transfers(two_sharded):
    a, b = two_sharded
    ctx = lowered([a * b])
    with measure_transfers() as m:
        mapping = ctx.device_parameter_id_tensor_mapping()
        ia, ib = ctx.tensor_parameter_ids([a, b])
        out = mapping[ia] * 2 + mapping[ib]
        torch_xla.sync()
    assert not m.device_to_host, m.report()
    assert spec(out) != ""  # sharding propagated through the reuse
    torch.testing.assert_close(out.cpu(), a.cpu() * 2 + b.cpu(), **tolerance(torch.float32))  # elementwise


def test_tensor_parameter_ids_match_native_lookup(two_sharded, device, gen):
    a, b = two_sharded
    unrelated = torch.randn(5, generator=gen).to(device)
    torch_xla.sync()
    pending = a * 2  # holds IR, not device data
    ctx = lowered([(a + b).sum() + pending.sum()])
    queries = [b, pending, unrelated, a, a]
    ids = ctx.tensor_parameter_ids(queries)
    assert ids == [ctx._ctx.tensor_parameter_id(t) for t in queries]
    assert ids[1] == -1 and ids[2] == -1 and ids[0] >= 0 and ids[3] == ids[4] >= 0
    assert ctx.tensor_parameter_ids([]) == []
    assert ctx.tensor_parameter_ids(iter([a])) == [ids[3]]


def test_parameters_join_the_reader_with_the_device_mapping(two_sharded, device):
    a, b = two_sharded
    noise = torch.rand(2048, device=device)
    ctx = lowered([(a + b * 1.5 + noise).sum(0)])
    with measure_transfers() as m:
        params = ctx.parameters(inputs=[a, b])
    assert not m.device_to_host, m.report()
    assert [p.number for p in params] == list(range(len(params)))
    by_kind = {}
    for p in params:
        by_kind.setdefault(p.kind, []).append(p)
    assert len(by_kind["input"]) == 2
    assert len(by_kind["seed"]) == 1 and by_kind["seed"][0].dtype == torch.int64
    assert len(by_kind["hoisted"]) == 1 and by_kind["hoisted"][0].shape == ()  # the 1.5
    pa = next(p for p in params if p.number == ctx.tensor_parameter_id(a))
    assert pa.shape == (32, 2048) and pa.dtype == torch.float32
    assert pa.sharding == spec(a)
    assert X._get_tensors_handle([pa.tensor]) == X._get_tensors_handle([a])
    assert len(params) == len(ctx.module.entry_parameters)


def test_parameters_check_agreement_with_the_hlo(two_sharded):
    a, b = two_sharded
    ctx = lowered([a + b])
    p = next(p for p in ctx.parameters() if p.number == ctx.tensor_parameter_id(a))
    for bad, what in (
        (dataclasses.replace(p, shape=(32, 1024)), "shape"),
        (dataclasses.replace(p, dtype=torch.bfloat16), "dtype"),
        (dataclasses.replace(p, sharding="{replicated}"), "sharding"),
    ):
        with pytest.raises(RuntimeError, match=what):
            ctx._check_agreement(bad, p.tensor, spec(p.tensor))
    # parameters() itself runs the check: a mapped tensor that no longer matches its HLO
    # parameter (here b, of another shape and sharding, stands in for a) is reported.
    ctx._mapping = {**ctx.device_parameter_id_tensor_mapping(), p.number: b}
    with pytest.raises(RuntimeError, match=rf"parameter {p.number} .*shape \(2048,\) vs HLO \(32, 2048\)"):
        ctx.parameters()


def test_module_and_hlo(two_sharded):
    a, b = two_sharded
    ctx = lowered([a + b])
    data = ctx.hlo()
    assert isinstance(data, bytes) and data == ctx.hlo()
    assert ctx.module is ctx.module
    assert ctx.module.name == txe.read_hlo(data).name
    assert "parameter" in ctx.hlo_text()
    shardings = sorted(p.sharding for p in ctx.module.entry_parameters)
    assert shardings == sorted([spec(a), spec(b)])


def test_bad_use_raises_clear_errors(device, gen):
    a = torch.randn(2, generator=gen).to(device)
    ctx = txe.LoweringContext()
    with pytest.raises(RuntimeError, match="build"):
        ctx.device_parameter_id_tensor_mapping()
    with pytest.raises(TypeError, match="list or tuple"):
        ctx.build(a)
    with pytest.raises(ValueError, match="at least one"):
        ctx.build([])
    with pytest.raises(TypeError, match=r"outputs\[1\].*XLA device"):
        ctx.build([a, torch.ones(2)])
    ctx.build([a + 1])  # the failed calls changed nothing
    with pytest.raises(RuntimeError, match="already built"):
        ctx.build([a + 2])
    with pytest.raises(TypeError, match=r"tensors\[0\]"):
        ctx.tensor_parameter_ids([torch.ones(2)])
    with pytest.raises(ValueError, match="device_mapping"):
        txe.LoweringContext(device_mapping="fast")
    with pytest.raises(ValueError, match="name"):
        txe.LoweringContext("")


def test_a_single_tensor_where_a_list_is_expected_is_a_clear_type_error(device, gen):
    a = torch.randn(8, 4, generator=gen).to(device)
    torch_xla.sync()
    ctx = lowered([a * 2.5])
    with pytest.raises(TypeError, match=r"parameters\(inputs=\.\.\.\) expects a list or tuple of XLA tensors, "
                                        r"got a single Tensor of shape \(8, 4\).*inputs=\[x\]"):
        ctx.parameters(inputs=a)
    with pytest.raises(TypeError, match=r"tensor_parameter_ids\(tensors\) expects a list or tuple .* single Tensor "
                                        r"of shape \(8, 4\).*tensor_parameter_ids\(\[t\]\)"):
        ctx.tensor_parameter_ids(a)
    with pytest.raises(TypeError, match="got int"):
        ctx.tensor_parameter_ids(3)
    with pytest.raises(TypeError, match="got str"):
        ctx.parameters(inputs="a")
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        ctx.tensor_parameter_id([a])
    # Raised before any work: nothing was computed or cached, and the context still answers.
    assert ctx._mapping is None and ctx._handle_to_param is None
    ia = ctx.tensor_parameter_id(a)
    assert ia >= 0 and ctx.tensor_parameter_ids([a]) == [ia] == ctx.tensor_parameter_ids((a,))
    kinds = {p.number: p.kind for p in ctx.parameters(inputs=[a])}
    assert kinds[ia] == "input" and sorted(kinds.values()) == ["hoisted", "input"]  # a and the 2.5
