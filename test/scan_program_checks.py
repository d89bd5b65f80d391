"""Checking a :class:`~scan_programs.Program` (see scan_programs.py's docstring): :func:`check` runs it cold,
cached and with new context values through ``txe.scan`` (and ``txe.scan_layers`` for layer programs)
against the Python loop on the CPU, or refuses it as its hazard says."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import random
import re
import threading
from collections.abc import Callable

import numpy as np
import pytest

import torch
import torch.utils._pytree as pt

import torch_xla_ext as txe
from torch_xla_ext.scan import scan_cache_info
from torch_xla_ext.testing.tolerances import tolerance

from scan_reference import python_scan
from scan_programs import _LAYER_ONLY, _REFUSED, Program, _kept, _Layer, make_step

__all__ = ["check"]


# ------------------------------------------------------------------------- checking


def _context(p: Program, gen: torch.Generator, device) -> dict:
    d = p.dim
    return _with_table({
        "W": (torch.randn(d, d, generator=gen) / math.sqrt(d)).to(p.dtype).to(device).requires_grad_(p.grad),
        "b": (torch.randn(d, generator=gen) * 0.5).to(p.dtype).to(device).requires_grad_(p.grad),
        "s": round(0.5 + torch.rand((), generator=gen).item(), 3),
        "k": round(torch.rand((), generator=gen).item() - 0.5, 3),
    })


def _with_table(ctx: dict) -> dict:
    # The host_table hazard's host tensor and the numpy_table hazard's array, derived from b (no draw, so the
    # other values of a seed stay as they were); the periodic hazard's counter.
    table = 0.5 + torch.sigmoid(ctx["b"].detach().float().cpu())
    return {**ctx, "T": table, "N": table.numpy().copy(), "count": [0]}


def _inputs(p: Program, gen: torch.Generator) -> tuple:
    d, b, n = p.dim, p.batch, p.length
    h = torch.randn(b, d, generator=gen).to(p.dtype)
    init = {"h": h, "n": torch.zeros((), dtype=torch.int32)} if p.pytree_carry else h
    xs = None if p.xs_none else {"w": (torch.randn(n, d, d, generator=gen) / math.sqrt(d)).to(p.dtype),
                                 "a": (torch.randn(n, b, d, generator=gen) * 0.5).to(p.dtype)}
    return init, xs


def _to(tree, device, grad: bool):
    def move(t):
        if t is None:
            return None
        t = t.detach().to(device)
        return t.requires_grad_(grad and t.is_floating_point())

    return pt.tree_map(move, tree)


def _ctx_to(ctx: dict, device) -> dict:
    return {k: (v.detach().to(device).requires_grad_(v.requires_grad) if isinstance(v, torch.Tensor) and k != "T"
                else v.clone() if k == "T" else v.copy() if k in ("N", "count") else v)
            for k, v in ctx.items()}


def _set_ctx(ctx: dict, values: dict, device) -> None:
    """Put a round's values into the dict a step reads: new objects, except the host table.

    The host table ``T`` keeps its object and is rewritten through ``.data``,
    which moves no version counter (the "host_table" hazard).
    """
    new = _ctx_to(values, device)
    if "T" in ctx:
        ctx["T"].data.copy_(new.pop("T"))
    if "N" in ctx:
        ctx["N"][...] = new.pop("N")  # the numpy_table hazard: the same array, new values
        new.pop("count")  # the periodic hazard's counter goes on
    ctx.update(new)


def _loss(carry, ys, weights: torch.Tensor) -> torch.Tensor:
    total = sum((leaf.float() * leaf.float()).sum() for leaf in _leaves(carry) if leaf.is_floating_point())
    for leaf in _leaves(ys):
        flat = leaf.float().reshape(-1)
        total = total + (flat * weights[: flat.numel()].to(flat.device)).sum()
    return total


def _grads(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.zeros(t.shape) if t.grad is None else t.grad.detach().float().cpu() for t in tensors]


def _leaves(tree) -> list[torch.Tensor]:
    return [t for t in pt.tree_leaves(tree) if t is not None]


def _run_scan(p: Program, step, init, xs, ctx: dict, use_txe: bool, weights: torch.Tensor):
    # Fresh copies: scan never writes into init or xs, the loop's fn would.
    fresh = pt.tree_map(lambda t: None if t is None else t * 1 if t.is_floating_point() else t.clone(), (init, xs))
    with torch.set_grad_enabled(p.grad):
        if use_txe:
            carry, ys = txe.scan(step, fresh[0], fresh[1], length=p.length, reverse=p.reverse)
        else:
            carry, ys = python_scan(step, fresh[0], fresh[1], length=p.length, reverse=p.reverse)
    leaves = [t for t in _leaves((init, xs)) if t.requires_grad] + [v for v in ctx.values()
                                                                    if isinstance(v, torch.Tensor)]
    grads = []
    if p.grad:
        _loss(carry, ys, weights).backward()
        grads = _grads(leaves)
    values = [t.detach().float().cpu() for t in _leaves((carry, ys))]
    return values, grads, pt.tree_structure((carry, ys))


def _run_layers(p: Program, layers: torch.nn.ModuleList, h: torch.Tensor, use_txe: bool, weights):
    with torch.set_grad_enabled(p.grad):
        if use_txe:
            out = txe.scan_layers(layers, h * 1)
        else:
            out = h * 1
            for layer in layers:
                out = layer(out)
    grads = []
    if p.grad:
        _loss(out, None, weights).backward()
        grads = _grads([h, *layers.parameters(), *(v for v in layers[0].ctx.values() if isinstance(v, torch.Tensor))])
        layers.zero_grad()
    buffers = [b.detach().float().cpu() for b in layers.buffers()]
    return [out.detach().float().cpu()], grads, buffers


def _tol(p: Program, reference: torch.Tensor) -> dict:
    chain = p.length * (p.dim + 2) * (len(p.ops) + 2)
    scale = max(1.0, float(reference.float().pow(2).mean().sqrt())) if reference.numel() else 1.0
    # The reference is the same program in the same dtype on the CPU, op by op;
    # XLA fuses and may keep low-precision intermediates in float32.
    return tolerance(p.dtype, chain, scale=scale)


def _compare(what: str, got: list, want: list, p: Program, on_device: Callable[[], list] | None = None) -> None:
    """``got`` against the CPU reference ``want``; where that misses, against ``on_device()`` (see the module doc).

    ``on_device`` runs the same reference on the XLA device and returns its
    results in the same order; it runs only when the CPU comparison fails.
    """
    assert len(got) == len(want), f"{what}: {len(got)} tensors, expected {len(want)}"

    def against(reference: list, label: Callable[[int, str], str]) -> None:
        for k, (g, w) in enumerate(zip(got, reference)):
            torch.testing.assert_close(g, w, **_tol(p, w), msg=lambda m, k=k: label(k, m))

    try:
        against(want, lambda k, m: f"{what}[{k}]: {m}")
    except AssertionError as cpu_miss:
        if on_device is None:
            raise
        against(on_device(), lambda k, m: f"{what}[{k}] against the Python loop on the device: {m} (and against "
                                          f"the CPU: {cpu_miss})")


def _check_refused(p: Program, device) -> None:
    """``p``'s hazard is refused with its documented error; the host generators are left as they were."""
    error, text = _REFUSED[p.hazard]
    gen = torch.Generator().manual_seed(p.seed)
    ctx = _ctx_to(_context(p, gen, "cpu"), device)
    init, xs = _to(_inputs(p, gen), device, p.grad)
    rng_before = (torch.random.get_rng_state(), random.getstate())
    try:
        if p.hazard in _LAYER_ONLY:
            layers = torch.nn.ModuleList([_Layer(p, ctx, gen) for _ in range(p.length)]).to(p.dtype).to(device)
            if p.hazard == "private_differs":
                for i, layer in enumerate(layers):
                    layer._k = 1.0 + 0.25 * i
                if p.length == 1:
                    return  # one layer cannot differ from itself
            else:
                layers[p.seed % p.length].register_forward_hook(lambda m, i, o: o * 2)
            with pytest.raises(error, match=re.escape(text)):
                txe.scan_layers(layers, (init["h"] if p.pytree_carry else init) * 1)
        elif p.hazard == "create_graph":
            with torch.enable_grad():
                carry, ys = txe.scan(make_step(dataclasses.replace(p, hazard="none"), ctx), init, xs,
                                     length=p.length, reverse=p.reverse)
                loss = _loss(carry, ys, torch.ones(4096))
                wrt = [t for t in _leaves((init, xs)) + [ctx["W"], ctx["b"]] if t.requires_grad]
                with pytest.raises(error, match=re.escape(text)):
                    torch.autograd.grad(loss, wrt, create_graph=True)
        else:
            with pytest.raises(error, match=re.escape(text)), torch.set_grad_enabled(p.grad):
                txe.scan(make_step(p, ctx), init, xs, length=p.length, reverse=p.reverse)
    finally:
        _kept.clear()
    assert torch.equal(torch.random.get_rng_state(), rng_before[0]) and random.getstate() == rng_before[1], \
        "a refused call moved a host random generator"


def check(p: Program, device) -> dict:
    """Run ``p`` cold, cached and with new values through scan (and scan_layers); raise on any mismatch.

    A refused hazard is checked first (:func:`_check_refused`), then the same
    program without it. Returns counters: how many plans each call built and
    served from the cache.
    """
    if p.hazard in _REFUSED:
        _check_refused(p, device)
        p = dataclasses.replace(p, hazard="none")
    with _loader_thread(device) if p.hazard == "loader_thread" else contextlib.nullcontext():
        return _check(p, device)


def _check(p: Program, device) -> dict:
    gen = torch.Generator().manual_seed(p.seed)
    weights = torch.randn(4096, generator=gen)
    stats = {"scan_traces": 0, "scan_hits": 0}
    ctx_cpu = _context(p, gen, "cpu")
    init, xs = _inputs(p, gen)
    new_ctx_cpu = _context(p, gen, "cpu")
    new_init, new_xs = _inputs(p, gen)
    ctx_cpu["z"], new_ctx_cpu["z"] = np.float32(0.0), np.float32(-0.0)  # the signed_zero hazard's zeros

    # One step function per side, as a user keeps one: each round puts new
    # values (new tensor objects, new Python numbers) into the dict it reads.
    ctx_dev, ctx_ref = {}, {}
    step_dev, step_ref = make_step(p, ctx_dev), make_step(p, ctx_ref)

    def scan_round(ctx_cpu_vals, init_c, xs_c):
        _set_ctx(ctx_dev, ctx_cpu_vals, device)
        _set_ctx(ctx_ref, ctx_cpu_vals, "cpu")
        got = _run_scan(p, step_dev, _to(init_c, device, p.grad), _to(xs_c, device, p.grad), ctx_dev, True,
                        weights)
        ref = _run_scan(p, step_ref, _to(init_c, "cpu", p.grad), _to(xs_c, "cpu", p.grad), ctx_ref, False,
                        weights)
        assert got[2] == ref[2], f"output structure {got[2]} != {ref[2]}"
        loop_ctx = _ctx_to(ctx_cpu_vals, device)  # its own tensors: the gradients are its own
        # Cached: it runs at most once, since a second backward would add to loop_ctx's gradients.
        on_device = functools.cache(lambda: _run_scan(p, make_step(p, loop_ctx), _to(init_c, device, p.grad),
                                                      _to(xs_c, device, p.grad), loop_ctx, False, weights))
        return got, ref, on_device

    before = scan_cache_info()
    cold, ref, on_device = scan_round(ctx_cpu, init, xs)
    _compare("cold values", cold[0], ref[0], p, lambda: on_device()[0])
    _compare("cold grads", cold[1], ref[1], p, lambda: on_device()[1])
    mid = scan_cache_info()
    cached, _, _ = scan_round(ctx_cpu, init, xs)
    after = scan_cache_info()
    assert after.hits == mid.hits + 1 and after.traces == mid.traces, "an unchanged call was not served from the cache"
    for what, a, b in (("values", cached[0], cold[0]), ("grads", cached[1], cold[1])):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"cached call's {what} differ from the cold call's"
    changed, ref, on_device = scan_round(new_ctx_cpu, new_init, new_xs)
    _compare("changed-context values", changed[0], ref[0], p, lambda: on_device()[0])
    _compare("changed-context grads", changed[1], ref[1], p, lambda: on_device()[1])
    end = scan_cache_info()
    stats["scan_traces"], stats["scan_hits"] = end.traces - before.traces, end.hits - before.hits

    if p.layers:
        _check_layers(p, gen, ctx_cpu, new_ctx_cpu, device, weights)
    return stats


@contextlib.contextmanager
def _loader_thread(device):
    """The loader_thread hazard: a thread drawing from every global host generator and uploading, meanwhile.

    Its draws must be exactly those of the same generators seeded alike and drawn from alone: no trace
    rewinds them (the thread seeds them itself; the programs draw from their own generators only).
    """
    done, errors = threading.Event(), []
    drawn: dict[str, list] = {"torch": [], "random": [], "numpy": []}
    started = threading.Event()

    def loader() -> None:
        try:
            torch.default_generator.manual_seed(21)
            random.seed(22)
            np.random.seed(23)
            started.set()
            while not done.is_set():
                t = torch.randn(4)
                drawn["torch"].append(t)
                drawn["random"].append(random.random())
                drawn["numpy"].append(np.random.rand(2))
                t.to(device).mul_(2)  # a host-to-device copy and a lazy op, as a loader does
        except BaseException as error:  # reported below
            errors.append(error)
            started.set()

    thread = threading.Thread(target=loader)
    thread.start()
    started.wait(60)
    try:
        yield
    finally:
        done.set()
        thread.join(60)
    assert not errors, errors
    torch.default_generator.manual_seed(21)
    random.seed(22)
    np.random.seed(23)
    assert all(torch.equal(t, torch.randn(4)) for t in drawn["torch"]), "the loader's torch draws were rewound"
    assert all(r == random.random() for r in drawn["random"]), "the loader's random draws were rewound"
    assert all(np.array_equal(a, np.random.rand(2)) for a in drawn["numpy"]), "the loader's numpy draws were rewound"


def _check_layers(p: Program, gen: torch.Generator, ctx_cpu: dict, new_ctx_cpu: dict, device, weights) -> None:
    ctx_dev, ctx_ref, ctx_loop = _ctx_to(ctx_cpu, device), _ctx_to(ctx_cpu, "cpu"), {}
    cpu_layers = torch.nn.ModuleList([_Layer(p, ctx_ref, gen) for _ in range(p.length)]).to(p.dtype)
    dev_layers = torch.nn.ModuleList([_Layer(p, ctx_dev, gen) for _ in range(p.length)])
    dev_layers.load_state_dict(cpu_layers.state_dict())
    dev_layers = dev_layers.to(p.dtype).to(device)
    # The Python loop on the device: the reference for the buffers (the CPU's would differ by rounding only),
    # and for values and gradients where scan_layers misses the CPU reference (see the module doc). Its own
    # context tensors, so that its gradients are its own; its initial values are overwritten by the CPU
    # layers' (a generator of its own leaves the program's draws as they were).
    spare = torch.Generator().manual_seed(0)
    loop_layers = torch.nn.ModuleList([_Layer(p, ctx_loop, spare) for _ in range(p.length)])
    loop_layers.load_state_dict(cpu_layers.state_dict())
    loop_layers = loop_layers.to(p.dtype).to(device)
    for round_ctx, scale in ((ctx_cpu, 1.25), (ctx_cpu, 1.25), (new_ctx_cpu, 0.75)):
        for ctx, device_of in ((ctx_dev, device), (ctx_ref, "cpu"), (ctx_loop, device)):
            _set_ctx(ctx, round_ctx, device_of)
        if p.hazard == "layer_cfg":  # every layer's own dict changed in place, alike
            for layer in (*dev_layers, *cpu_layers, *loop_layers):
                layer.cfg["scale"] = scale
        h_cpu = torch.randn(p.batch, p.dim, generator=gen).to(p.dtype)
        got = _run_layers(p, dev_layers, h_cpu.to(device).requires_grad_(p.grad), True, weights)
        ref = _run_layers(p, cpu_layers, h_cpu.clone().requires_grad_(p.grad), False, weights)
        # Cached: the device loop runs at most once a round, since it updates its layers' buffers.
        on_device = functools.cache(lambda h_cpu=h_cpu: _run_layers(
            p, loop_layers, h_cpu.to(device).requires_grad_(p.grad), False, weights))
        _compare("scan_layers values", got[0], ref[0], p, lambda: on_device()[0])
        _compare("scan_layers grads", got[1], ref[1], p, lambda: on_device()[1])
        if p.buffers:
            _compare("scan_layers buffers", got[2], on_device()[2], p)
