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

import dataclasses
import math
import random

import torch

import torch_xla_ext as txe


__all__ = ["Program", "draw", "make_step"]

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
