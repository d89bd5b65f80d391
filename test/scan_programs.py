"""Differential testing of scan and scan_layers: small random step programs checked against the Python loop.

A :class:`Program` is drawn from a seed (:func:`draw`): a short sequence of ops
on the carry (elementwise maps, matmuls with an x slice or an outside weight,
reductions, in-place updates of the carry, of the x slice and of tensors the
step creates, setitem), a carry that is a tensor or a pytree, ys that are a
tensor, a pytree with a None leaf, or None, ``reverse``, scanning over
``length`` without xs, float32 or bfloat16, with or without gradients, and a
closure over a context dict holding outside tensors and Python numbers.

:func:`check` runs a program three times through ``txe.scan`` (and, for layer
programs, ``txe.scan_layers`` over modules whose forward is the program):

1. cold, with the context's first values, against the Python loop on the CPU;
2. again with the same values: served from the cache, bit-identical to call 1;
3. with new context values (new tensors, new Python numbers) and new inputs:
   against the Python loop again, so a stale plan shows as a wrong number.

A program may also carry a *hazard*, something ordinary Python does that a
traced loop must either reproduce or refuse: a host tensor written behind its
version counter between calls (``.data``; with gradients it is refused), a numpy table rewritten in place
between calls and read through ``torch.tensor``, a numpy zero whose sign changes between calls, per-layer
private attributes (equal: accepted; different: refused), per-layer settings dicts changed in place between
calls, a loader thread drawing from every global host generator and uploading while the calls run (its draws
must come out as if alone), a counter fn bumps and computes with (refused), a module hook on one layer, a
host random draw,
``create_graph=True`` through the scan, and (:func:`draw` with ``crashy=True``,
for ``scripts/fuzz_scan.py``, which runs in its own process) the ones that used
to kill the process: a host read (``.item()``), a nested scan, an intermediate
kept in a list. A refused hazard must raise the documented error before
anything runs, leave the host generators as they were, and the same program
without it must then still match the loop.

Values and gradients (of init, xs, the outside tensors, the layers'
parameters) are compared with :func:`~torch_xla_ext.testing.tolerances.tolerance`
for the program's dtype and the length of its longest accumulation chain;
scan_layers programs also compare the buffers each layer updates in place.

That tolerance assumes every op is rounded about as well as the CPU's, which
XLA:CPU's transcendental functions are not everywhere: near saturation its
``tanh`` gives ``1 - tanh(x)**2`` with a relative error of tens of percent
(seed 90056: a gradient of 2.0e-5 on XLA against 3.4e-5 on the CPU, for scan
and for the Python loop on the device alike). Where a result misses the CPU
reference, it must then match the same Python loop run on the XLA device (the
same XLA kernels, op for op) within the same tolerance: a scan that computes
something else still fails, and XLA's own op numerics do not.
"""

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

__all__ = ["Program", "draw", "check"]

_ACTS = {"tanh": torch.tanh, "sin": torch.sin, "sigmoid": torch.sigmoid}
# Ops that read the x slice; a program scanning over ``length`` alone has none.
_NEEDS_X = {"mm_x", "add_x", "iadd_x_slice"}
_OPS = ["ew", "mm_out", "mm_x", "bias", "center", "norm", "imul_created", "setitem", "add_x", "iadd_x_slice"]


@dataclasses.dataclass(frozen=True)
class Program:
    seed: int
    dtype: torch.dtype
    batch: int
    dim: int
    length: int
    reverse: bool
    xs_none: bool
    pytree_carry: bool
    y_kind: str            # "sum" | "tree" | "none"
    grad: bool
    iadd_carry: bool       # the step starts with an in-place update of its carry
    ops: tuple[tuple, ...]
    layers: bool           # also run as scan_layers over modules
    buffers: bool          # the layers update buffers in place
    hazard: str = "none"   # see the module doc and _HAZARDS

    def describe(self) -> str:
        fields = dataclasses.asdict(self)
        fields["dtype"] = str(self.dtype).replace("torch.", "")
        return ", ".join(f"{k}={v}" for k, v in fields.items())


#: Hazards a traced loop reproduces (compared with the loop) ...
_KEPT_HAZARDS = ("host_table", "private_equal", "numpy_table", "signed_zero", "layer_cfg", "loader_thread")
#: ... and those it refuses: (error type, text the message must contain).
_REFUSED = {
    "private_differs": (txe.ScanInputError, "_k"),
    "host_table_grad": (txe.ScanUnsupportedError, "reads a tensor on the host"),
    "hook": (txe.ScanInputError, "forward hook"),
    "host_rng": (txe.ScanUnsupportedError, "draws random numbers"),
    "create_graph": (txe.ScanUnsupportedError, "create_graph"),
    "host_read": (txe.ScanUnsupportedError, "item()"),
    "nested": (txe.ScanUnsupportedError, "nested"),
    "keep": (txe.ScanUnsupportedError, "keeps"),
    "periodic": (txe.ScanUnsupportedError, "changes Python state"),
}
#: Hazards that killed the process before they were refused: drawn only for the fuzz script's own process.
_CRASHY = ("host_read", "nested", "keep")
_LAYER_ONLY = ("private_equal", "private_differs", "hook", "layer_cfg")
_HAZARDS = _KEPT_HAZARDS + tuple(_REFUSED)

_kept: list = []  # where the "keep" hazard keeps its intermediates


def draw(seed: int, crashy: bool = False) -> Program:
    """The program of ``seed`` (the same on every machine and run); ``crashy``: see the module doc."""
    rng = random.Random(seed)
    xs_none = rng.random() < 0.15
    ops = []
    for _ in range(rng.randint(1, 5)):
        name = rng.choice([o for o in _OPS if not (xs_none and o in _NEEDS_X)])
        ops.append((name, rng.choice(sorted(_ACTS))) if name == "ew" else (name,))
    # The last op adds (saves nothing for the backward), so the next iteration's
    # in-place update of the carry is legal in the eager reference too.
    ops.append(("add_x",) if not xs_none else ("bias",))
    layers = not xs_none and rng.random() < 0.4
    program = Program(
        seed=seed,
        dtype=torch.bfloat16 if rng.random() < 0.2 else torch.float32,
        batch=rng.choice([1, 2, 3]),
        dim=rng.choice([4, 8, 16]),
        length=rng.choice([1, 2, 3, 5]),
        reverse=rng.random() < 0.3,
        xs_none=xs_none,
        pytree_carry=rng.random() < 0.3,
        y_kind=rng.choice(["sum", "tree", "none"]),
        grad=rng.random() < 0.6,
        iadd_carry=rng.random() < 0.3,
        ops=tuple(ops),
        layers=layers,
        buffers=layers and rng.random() < 0.5,
    )
    # Drawn last, so every other field of a seed is what it was before hazards existed.
    choices = [h for h in _HAZARDS if (layers or h not in _LAYER_ONLY) and (crashy or h not in _CRASHY)
               and (program.grad or h not in ("create_graph", "host_table_grad"))
               and not (program.grad and h in ("host_table", "numpy_table"))
               and not (program.length == 1 and h == "periodic")]  # one iteration: the loop's own count
    hazard = rng.choice(choices) if rng.random() < 0.4 else "none"
    return dataclasses.replace(program, hazard=hazard)


# --------------------------------------------------------------------------- the step


def _apply(op: tuple, h: torch.Tensor, w: torch.Tensor | None, a: torch.Tensor | None, ctx: dict) -> torch.Tensor:
    name = op[0]
    if name == "ew":
        return _ACTS[op[1]](h * ctx["s"] + ctx["k"])
    if name == "mm_out":
        return torch.tanh(h @ ctx["W"])
    if name == "mm_x":
        return torch.tanh(h @ w)
    if name == "bias":
        return h + ctx["b"]
    if name == "center":
        return h - h.mean(-1, keepdim=True)
    if name == "norm":
        return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1.0)
    if name == "imul_created":
        t = h * 1
        t.mul_(ctx["s"])
        return t
    if name == "setitem":
        t = torch.zeros_like(h)
        half = h.shape[-1] // 2
        t[..., :half] = h[..., :half]
        return h + t * ctx["s"]
    if name == "add_x":
        return h + a
    if name == "iadd_x_slice":
        a.mul_(ctx["s"])  # an in-place update of the x slice (fn's own copy)
        return h + a
    raise AssertionError(name)


def _body(p: Program, h: torch.Tensor, w, a, ctx: dict) -> torch.Tensor:
    if p.iadd_carry:
        h.add_(ctx["k"])  # in place on the carry fn received
    for op in p.ops:
        h = _apply(op, h, w, a, ctx)
    return _hazard(p, h, ctx)


def _hazard(p: Program, h: torch.Tensor, ctx: dict) -> torch.Tensor:
    if p.hazard in ("host_table", "host_table_grad"):  # a host tensor, rewritten through .data between calls
        return h * ctx["T"].to(h.device, h.dtype)
    if p.hazard == "host_rng":
        return h + torch.rand(h.shape[-1]).to(h.device, h.dtype)
    if p.hazard == "host_read":
        return h * (1.0 + 0.0 * h.sum().item())
    if p.hazard == "nested":
        inner, _ = txe.scan(lambda c, _x: (c * 0.5, None), h, None, length=2)
        return inner
    if p.hazard == "keep":
        _kept.append(h * 2)
    if p.hazard == "numpy_table":  # a numpy array, rewritten in place between calls
        return h * torch.tensor(ctx["N"], device=h.device).to(h.dtype)
    if p.hazard == "signed_zero":  # atan2(+-0, -1) = +-pi: the sign of a numpy zero changes the result
        return h + 0.1 * torch.atan2(torch.full_like(h, ctx["z"]), torch.full_like(h, -1.0))
    if p.hazard == "periodic":  # Python state fn changes and computes with: refused, whatever the period
        ctx["count"][0] += 1
        return h * (1 + ctx["count"][0] // 2)
    return h


def _y(p: Program, h: torch.Tensor):
    if p.y_kind == "sum":
        return h.sum(-1)
    if p.y_kind == "tree":
        return {"s": h.sum(-1), "d": (h * 2, None)}
    return None


def make_step(p: Program, ctx: dict):
    def step(carry, x):
        h = carry["h"] if p.pytree_carry else carry
        w, a = (None, None) if x is None else (x["w"], x["a"])
        h = _body(p, h, w, a, ctx)
        new = {"h": h, "n": carry["n"] + 1} if p.pytree_carry else h
        return new, _y(p, h)

    return step


class _Layer(torch.nn.Module):
    def __init__(self, p: Program, ctx: dict, gen: torch.Generator) -> None:
        super().__init__()
        d = p.dim
        self.p = p
        self.w = torch.nn.Parameter(torch.randn(d, d, generator=gen) / math.sqrt(d))
        self.a = torch.nn.Parameter(torch.randn(d, generator=gen) * 0.5)
        if p.buffers:
            self.register_buffer("count", torch.zeros((), dtype=torch.int64))
            self.register_buffer("avg", torch.zeros(d))
        self.__dict__["ctx"] = ctx  # shared, not a submodule
        self._k = 1.5  # private_differs gives each layer its own
        if p.hazard == "layer_cfg":
            self.cfg = {"scale": 1.25}  # each layer's own settings dict, changed in place between calls

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # A parameter must not be written in place (scan_layers refuses it):
        # iadd_x_slice updates a copy of the layer's vector.
        a = self.a * 1 if any(op[0] == "iadd_x_slice" for op in self.p.ops) else self.a
        h = _body(self.p, h, self.w, a, self.ctx)
        if self.p.hazard in ("private_equal", "private_differs"):
            h = h * self._k
        if self.p.hazard == "layer_cfg":
            h = h * self.cfg["scale"]
        if self.p.buffers:
            self.count.add_(1)
            self.avg.mul_(0.5).add_(h.detach().float().mean(0) * 0.5)
        return h


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
