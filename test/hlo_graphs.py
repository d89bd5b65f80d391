"""Small torch_xla graphs, sharded on a mesh, lowered to HloModuleProtos for the HLO reader tests."""

from __future__ import annotations

import torch
import torch_xla
import torch_xla.distributed.spmd as xs

XLAC = torch_xla._XLAC


def lower(outputs, name="t"):
    ctx = XLAC.lowering.LoweringContext(name)
    ctx.build(list(outputs))
    return ctx


def _on_device(t, device, mesh=None, spec=None):
    t = t.to(device)
    if mesh is not None:
        xs.mark_sharding(t, mesh, spec)
    return t


def g_elementwise(device, mesh):
    a = _on_device(torch.randn(8, 16), device, mesh, ("x", "y"))
    b = _on_device(torch.randn(8, 16, dtype=torch.bfloat16), device, mesh, ("y", None))
    c = _on_device(torch.randn(16), device, mesh, (None,))
    out = torch.where(a > 0, torch.sin(a) * b.float(), torch.exp(-a)) + c
    return [a, b, c], [out]


def g_matmul(device, mesh):
    x = _on_device(torch.randn(16, 32), device, mesh, ("x", None))
    w = _on_device(torch.randn(32, 8), device, mesh, (None, "y"))
    h = torch.relu(x @ w)
    xs.mark_sharding(h, mesh, ("x", "y"))  # a Sharding custom-call
    return [x, w], [h @ h.T]


def g_reductions(device, mesh):
    x = _on_device(torch.randn(8, 6, 4), device, mesh, ("y", None, None))
    i = _on_device(torch.arange(48, dtype=torch.int64).reshape(8, 6), device, mesh, (("x", "y"), None))
    outs = [x.sum(dim=(0, 2)), x.amax(dim=1), x.argmax(dim=2), x.mean(), i.sum(dim=0), (i % 3 == 0).any(dim=1)]
    return [x, i], outs


def g_tuple_outputs(device, mesh):
    x = _on_device(torch.randn(4, 8), device, mesh, (None, "x"))
    outs = [x.to(torch.float16), x.to(torch.bfloat16), x.to(torch.int8), (x * 10).to(torch.uint8), x > 0, x.to(torch.float64), x.to(torch.int32)]
    return [x], outs


def g_views_and_indexing(device, mesh):
    x = _on_device(torch.randn(16, 8), device, mesh, ("x", None))
    idx = _on_device(torch.tensor([3, 1, 4, 1, 5]), device)
    y = torch.cat([x[2:10:2], x.index_select(0, idx), x.flip(0)[:3]], dim=0)
    z = torch.zeros(16, 8, device=device).scatter_add(0, torch.zeros(16, 8, dtype=torch.int64, device=device), x)
    return [x, idx], [y.t().contiguous(), z, x.view(8, 16)[:, ::3]]


def g_sort_topk(device, mesh):
    x = _on_device(torch.randn(6, 10), device, mesh, ("y", None))
    values, indices = torch.sort(x, dim=1)
    top = torch.topk(x, 3, dim=1)
    return [x], [values, indices, top.values, top.indices, torch.cumsum(x, dim=1)]


def g_random(device, mesh):
    x = _on_device(torch.randn(8, 8), device, mesh, ("x", "y"))
    noise = torch.rand(8, 8, device=device)
    drop = torch.nn.functional.dropout(x, p=0.5, training=True)
    return [x], [x + noise, drop, torch.randint(0, 10, (5,), device=device)]


def g_while(device, mesh):
    from torch._higher_order_ops.while_loop import while_loop

    import torch_xla.experimental.fori_loop  # noqa: F401  registers the XLA lowering

    # torch_xla 2.9's while_loop mis-assigns loop parameters fed by device
    # data, so the loop starts from values computed on the device.
    i0 = torch.tensor(0, dtype=torch.int64, device=device)
    x = torch.ones(4, 4, device=device)

    def cond_fn(i, v):
        return i < 5

    def body_fn(i, v):
        return i + 1, torch.sin(v) @ v

    _, out = while_loop(cond_fn, body_fn, (i0, x))
    return [], [out]


def g_manual(device, mesh):
    x = _on_device(torch.randn(16, 16), device, mesh, ("x", "y"))
    local = xs.enable_manual_sharding(x, ("x", "y"), mesh=mesh).global_tensor
    back = xs.disable_manual_sharding(local * 2, ("x", "y"), (16, 16), mesh=mesh).global_tensor
    return [x], [back]


def g_conv(device, mesh):
    img = _on_device(torch.randn(4, 3, 8, 8), device, mesh, ("x", None, None, None))
    conv = torch.nn.Conv2d(3, 4, 3).to(device)
    return [img], [torch.nn.functional.max_pool2d(conv(img), 2).softmax(dim=1)]


GRAPHS = [g_elementwise, g_matmul, g_reductions, g_tuple_outputs, g_views_and_indexing, g_sort_topk, g_random, g_while, g_manual, g_conv]
