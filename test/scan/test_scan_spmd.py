"""scan and scan_layers on the 8-device SPMD mesh: shardings kept, nothing moved to the host, no recompiles."""

from __future__ import annotations

import contextlib

import torch
import torch_xla
import torch_xla.distributed.spmd as xs

import torch_xla_ext as txe
from torch_xla_ext.testing import measure_transfers

from scan_blocks import make_blocks
from scan_reference import assert_close_derived, python_scan

X = torch_xla._XLAC


def spec(t: torch.Tensor) -> str:
    return X._get_xla_sharding_spec(t)


def test_spmd_1d_forward_backward_without_host_transfers(device, mesh):
    L, D = 4, 64
    ws = torch.randn(L, D, D).to(device) / D**0.5
    xs.mark_sharding(ws, mesh, (None, "fsdp", None))
    ws.requires_grad_()
    emb = torch.randn(D, D).to(device)
    xs.mark_sharding(emb, mesh, ("fsdp", None))
    emb.requires_grad_()
    h0 = torch.randn(16, D).to(device)
    xs.mark_sharding(h0, mesh, ("fsdp", None))
    torch_xla.sync()

    def layer(h, w):
        out = torch.relu(h @ w) @ emb + h
        return out, out.mean()

    with measure_transfers() as m:
        with txe.no_host_transfers():
            carry, ys = txe.scan(layer, h0, ws)
            (carry.sum() + ys.sum()).backward()
            torch_xla.sync()
    assert not m.device_to_host, m.report()
    assert spec(carry) == spec(h0)
    assert spec(ws.grad) == spec(ws) and spec(emb.grad) == spec(emb)
    # numerics against an eager CPU loop
    ws_c, emb_c, h_c = ws.detach().cpu().requires_grad_(), emb.detach().cpu().requires_grad_(), h0.cpu()
    ref_carry, ref_ys = python_scan(lambda h, w: ((torch.relu(h @ w) @ emb_c + h),) * 2, h_c, ws_c)
    (ref_carry.sum() + ref_ys.mean(dim=(1, 2)).sum()).backward()
    assert_close_derived(carry, ref_carry, L * 2 * D)
    assert_close_derived(ws.grad, ws_c.grad, L * 2 * D * 16)
    assert_close_derived(emb.grad, emb_c.grad, L * 2 * D * 16)


def test_spmd_2d_shardings_and_mark_sharding_inside_fn(device, mesh_4x2):
    D = 32
    ws = torch.randn(3, D, D).to(device) / D**0.5
    xs.mark_sharding(ws, mesh_4x2, (None, "x", "y"))
    ws.requires_grad_()
    h0 = torch.randn(8, D).to(device)
    xs.mark_sharding(h0, mesh_4x2, ("x", "y"))
    h0.requires_grad_()
    torch_xla.sync()

    def layer(h, w):
        xs.mark_sharding(h, mesh_4x2, ("x", None))  # torch_xla issue 8742: the input is device data
        out = torch.tanh(h @ w)
        return out, None

    with measure_transfers() as m:
        with txe.no_host_transfers():
            carry, _ = txe.scan(layer, h0, ws)
            carry.sum().backward()
            torch_xla.sync()
    assert not m.device_to_host, m.report()
    assert spec(carry) == spec(h0) == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    assert spec(ws.grad) == spec(ws) and spec(h0.grad) == spec(h0)
    ws_c, h_c = ws.detach().cpu().requires_grad_(), h0.detach().cpu().requires_grad_()
    ref, _ = python_scan(lambda h, w: (torch.tanh(h @ w), None), h_c, ws_c)
    ref.sum().backward()
    assert_close_derived(carry, ref, 3 * D)
    assert_close_derived(ws.grad, ws_c.grad, 3 * D * 8)
    assert_close_derived(h0.grad, h_c.grad, 3 * D * 8)


def test_scan_layers_keeps_shardings_and_moves_nothing_to_host(device, mesh):
    layers = make_blocks(3, dim=32, hidden=64).to(device)
    for layer in layers:
        xs.mark_sharding(layer.up.weight, mesh, ("fsdp", None))
        xs.mark_sharding(layer.down.weight, mesh, (None, "fsdp"))
    x = torch.randn(8, 32).to(device)
    xs.mark_sharding(x, mesh, ("fsdp", None))
    torch_xla.sync()
    with measure_transfers() as m:
        with txe.no_host_transfers():
            out = txe.scan_layers(layers, x)
            out.sum().backward()
            torch_xla.sync()
    assert not m.device_to_host, m.report()
    for layer in layers:
        assert spec(layer.up.weight.grad) == spec(layer.up.weight) != ""
        assert spec(layer.down.weight.grad) == spec(layer.down.weight) != ""
    assert spec(out) == spec(x)


def test_scan_layers_on_a_2d_mesh_matches_the_plain_loop(device, mesh_4x2):
    # Weights sharded on both dims, on the minor dim only, partially
    # replicated, and a sharded bias: each takes another stacked layout.
    cpu_layers = make_blocks(3, dim=16, hidden=32)
    layers = make_blocks(3, dim=16, hidden=32).to(device)
    for layer in layers:
        xs.mark_sharding(layer.up.weight, mesh_4x2, ("x", "y"))
        xs.mark_sharding(layer.up.bias, mesh_4x2, ("y",))
        xs.mark_sharding(layer.down.weight, mesh_4x2, (None, "x"))
    x_cpu = torch.randn(8, 16)
    x = x_cpu.to(device)
    xs.mark_sharding(x, mesh_4x2, ("x", None))
    torch_xla.sync()
    with measure_transfers() as m:
        with txe.no_host_transfers():
            out = txe.scan_layers(layers, x)
            out.square().sum().backward()
            torch_xla.sync()
    assert not m.device_to_host, m.report()
    ref = x_cpu
    for layer in cpu_layers:
        ref = layer(ref)
    ref.square().sum().backward()
    assert_close_derived(out, ref, 3 * (16 + 32))
    annotated = {"up.weight", "up.bias", "down.weight"}  # the rest are left to propagation, as in a loop
    for (name, p), (_, p_ref) in zip(layers.named_parameters(), cpu_layers.named_parameters()):
        if name.split(".", 1)[1] in annotated:
            assert spec(p.grad) == spec(p) != "{replicated}", name
        assert_close_derived(p.grad, p_ref.grad, 3 * (16 + 32) * 8, msg=name)


def test_training_steps_after_the_first_do_not_recompile(device, mesh):
    """Unannotated parameters read '' before their first execution and '{replicated}' after it."""
    layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(2)).to(device)
    for layer in layers:
        xs.mark_sharding(layer.weight, mesh, ("fsdp", None))  # biases stay unannotated
    x = torch.randn(8, 16)
    for step in range(3):
        with txe.no_recompiles() if step else contextlib.nullcontext():  # only the first step compiles
            layers.zero_grad(set_to_none=True)
            xd = x.to(device)
            xs.mark_sharding(xd, mesh, ("fsdp", None))
            txe.scan_layers(layers, xd).sum().backward()
            torch_xla.sync()
