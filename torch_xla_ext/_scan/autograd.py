"""Autograd for scan: AOTAutograd's forward/backward split of the step, each graph run as a while loop.

The forward loop also stacks the activations the backward needs. Where each
saved activation comes from is a named record in ``saved_src``
(:mod:`.saved`): stacked by the forward, re-read from an input, or
recomputed from one. The backward loop runs in reverse,
carrying the carry's gradient and accumulating the gradients of the outside
tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._annotate import is_fake_tensor
from .._partitionable import partitionable_ops
from .._xla import redirected_mark_sharding, torch_xla_device
from . import autocast
from .aot import split
from .backend import cpu_codegen, forced_cpu_codegen
from .errors import ScanUnsupportedError
from .lift import Lifter
from .loop import _Loop, _lower, _run
from .saved import (_Input, _input_source, _Primals, _Recompute, _recompute_chain, _replay, _Saved, _SavedLayout,
                    _Stacked)
from .sharding import _apply_shardings, _sharding_of
from .trace import Sig, _signature, _trace


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _traceable_mark_sharding(lifter: Lifter):
    """Make ``xs.mark_sharding`` inside fn work while AOTAutograd traces it (on this thread only).

    The plain annotation cannot apply to the fake tensors of a trace. While
    tracing, ``torch_xla.distributed.spmd.mark_sharding`` on a fake tensor
    records torch_xla's traceable sharding op (which also shards the
    gradient) and later uses of the tensor read the annotated value.
    """
    def mark_sharding(original, t, mesh, partition_spec, *args, **kwargs):
        if not isinstance(t, torch.Tensor) or not is_fake_tensor(t):
            return original(t, mesh, partition_spec, *args, **kwargs)
        import torch_xla.distributed.spmd.xla_sharding as xla_sharding

        annotated = xla_sharding.MarkShardingFunction.apply(lifter.resolve(t), mesh, partition_spec)
        lifter.alias(t, annotated)
        return annotated

    return redirected_mark_sharding(mark_sharding)


class _GradPlan:
    """``fn`` split into forward/backward graphs, and the loops that run them.

    Primal inputs of the graphs are ``carry + x + outside``. The forward graph
    returns ``carry_out + y + saved``; saved activations that are just an x
    slice or an outside tensor are not stacked by the forward loop but read
    again by the backward loop.
    """

    def __init__(self, step: Callable, carry: list[Sig], x: list[Sig], x_grad: list[bool],
                 outside: list[torch.Tensor], mutated: tuple[int, ...], length: int, reverse: bool,
                 partition_fn: Callable | None) -> None:
        """``outside`` are the current call's outside tensors: traced through, never held.

        ``mutated`` lists the carry and x leaves ``step`` writes into (by
        position in ``carry + x``): ``step`` gets its own copies of them, as
        the Python loop's ``fn`` would write into values it alone holds.
        """
        self.n_c, self.n_x, self.n_o = len(carry), len(x), len(outside)
        self.primals = primals = _Primals(self.n_c, self.n_x, self.n_o)
        self.length, self.reverse = length, reverse
        self.outside_sig: list[Sig] = [_signature(t) for t in outside]
        def primal_fn(*args):
            # AOTAutograd would turn a write into an input into an extra leading
            # output; the step writes into copies instead.
            carry_in, x_in, outside_in = primals.split(args)
            own = [a.clone() if k in mutated else a for k, a in enumerate(carry_in + x_in)]
            lifter = Lifter([*args, *own], None, fixed=list(zip(outside, outside_in)))
            with partitionable_ops(), lifter, _traceable_mark_sharding(lifter):
                carry_out, ys = step(own[:primals.n_c], own[primals.n_c:])
            carry_out = [lifter.resolve(o) for o in carry_out]
            ys = [lifter.resolve(o) for o in ys]
            ins = {id(a) for a in args}
            # Outputs aliasing inputs would be rebuilt outside the captured graph.
            return tuple(o.clone() if id(o) in ins or o._is_view() else o for o in carry_out + ys)
        device = torch_xla_device()

        def example(shape, dtype, grad: bool) -> torch.Tensor:
            return torch.empty(shape, dtype=dtype, device=device).requires_grad_(grad)

        args = [example(s, d, _is_float_dtype(d)) for s, d in carry]
        args += [example(s, d, g and _is_float_dtype(d)) for (s, d), g in zip(x, x_grad)]
        args += [example(t.shape, t.dtype, t.requires_grad) for t in outside]
        captured = split(primal_fn, args, partition_fn)
        outs = captured.outs
        self.tangent_mask = [o.requires_grad for o in outs]
        self.num_y = len(outs) - primals.n_c
        self.fw, self.bw = captured.fw, captured.bw
        self.backward_python = captured.backward_python
        self.backward_functions = captured.backward_functions
        self.grad_mask = [a.requires_grad for a in args]
        out_nodes = list(next(n for n in self.fw.graph.nodes if n.op == "output").args[0])
        placeholders = [n for n in self.fw.graph.nodes if n.op == "placeholder"]
        saved_nodes = out_nodes[len(outs):]
        self.reach = _reach(self.bw, len(saved_nodes), self.tangent_mask, len(args))
        # Where each saved activation comes from (see _Saved).
        self.saved_src: list[_Saved] = []
        stacked = 0
        for node in saved_nodes:
            source = _input_source(node, placeholders, primals)
            chain = _recompute_chain(node, placeholders) if source is None else None
            base = _input_source(chain[0], placeholders, primals) if chain is not None else None
            if source is not None:
                self.saved_src.append(source)
            elif base is not None:
                self.saved_src.append(_Recompute(base, chain[1], chain[2]))
            else:
                self.saved_src.append(_Stacked(stacked))
                stacked += 1
        self.num_stacked = stacked
        self.x_aliased = sorted({read.index for read in self._input_reads() if read.kind == "x"})
        self.saved_layout = _SavedLayout(stacked, len(self.x_aliased))
        self.carry_sig, self.x_sig = carry, x
        # The backward loop is lowered later, on autograd's thread: with the forward's choice.
        self.cpu_choices = cpu_codegen()
        self.fwd_loop = _lower(_trace(self._forward_step, carry, x, self.outside_sig), length, reverse,
                               "scan_forward")
        self.saved_sig = [s for s in self.fwd_loop.y_shapes[self.num_y:]]
        self.y_sig = list(self.fwd_loop.y_shapes[:self.num_y])
        self._bwd_loop: _Loop | None = None

    def _input_reads(self) -> list[_Input]:
        """The inputs the backward loop reads: aliased ones and the bases of recomputations."""
        return [src.base if isinstance(src, _Recompute) else src for src in self.saved_src
                if not isinstance(src, _Stacked)]

    def _forward_step(self, carry, x, outside):
        with autocast.off():  # the graphs hold the forward's casts (see .autocast)
            result = list(self.fw(*carry, *x, *outside))
        n_out = self.n_c + self.num_y
        saved = result[n_out:]
        stacked = [saved[i] for i, src in enumerate(self.saved_src) if isinstance(src, _Stacked)]
        return result[:self.n_c], result[self.n_c:n_out] + stacked

    def _float_carry(self) -> list[int]:
        """The carry leaves the backward carries a gradient for (floating point)."""
        return [i for i in range(self.n_c) if _is_float_dtype(self.carry_sig[i][1])]

    def _grad_outside(self) -> list[int]:
        """The outside tensors whose gradients the backward accumulates in its carry."""
        return [k for k in range(self.n_o) if self.grad_mask[self.primals.outside(k)]]

    def _backward_step(self, carry, x, outside):
        primals = self.primals
        float_carry, grad_outside = self._float_carry(), self._grad_outside()
        g = dict(zip(float_carry, carry[:len(float_carry)]))
        acc = carry[len(float_carry):]
        stacked, aliased, gy = self.saved_layout.split(x)
        x_slices = dict(zip(self.x_aliased, aliased))
        def read(src: _Stacked | _Input) -> torch.Tensor:
            if isinstance(src, _Stacked):
                return stacked[src.index]
            return x_slices[src.index] if src.kind == "x" else outside[src.index]

        tangents = [g[i] for i in range(self.n_c) if self.tangent_mask[i]]
        tangents += [gy[j] for j in range(self.num_y) if self.tangent_mask[primals.y(j)]]
        with autocast.off():  # the graphs hold the forward's casts (see .autocast)
            saved = [_replay(read(src.base), src.ops, barrier=src.barrier) if isinstance(src, _Recompute)
                     else read(src) for src in self.saved_src]
            grads = list(self.bw(*saved, *tangents))

        def grad_or_zeros(pos: int, sig: Sig) -> torch.Tensor:
            value = grads[pos] if pos < len(grads) else None
            return value if value is not None else torch.zeros(sig[0], dtype=sig[1], device=carry[0].device
                                                               if carry else x[0].device)

        new_g = [grad_or_zeros(i, self.carry_sig[i]) for i in float_carry]
        new_acc = [a + grad_or_zeros(primals.outside(k), self.outside_sig[k]) for a, k in zip(acc, grad_outside)]
        gx = [grad_or_zeros(primals.x(j), self.x_sig[j]) for j in range(self.n_x) if self.grad_mask[primals.x(j)]]
        return new_g + new_acc, gx

    def backward_loop(self) -> _Loop:
        if self._bwd_loop is None:
            carry = [self.carry_sig[i] for i in self._float_carry()]
            carry += [self.outside_sig[k] for k in self._grad_outside()]
            xs = list(self.saved_sig) + [self.x_sig[j] for j in self.x_aliased] + list(self.y_sig)
            with forced_cpu_codegen(self.cpu_choices):
                self._bwd_loop = _lower(_trace(self._backward_step, carry, xs, self.outside_sig), self.length,
                                        not self.reverse, "scan_backward")
        return self._bwd_loop


def _is_float_dtype(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def _reach(bw: torch.fx.GraphModule | None, n_saved: int, tangent_mask: list[bool], n_in: int) -> list[frozenset[int]]:
    """For each primal input of the step, the outputs (carry_out + ys, by position) whose gradient reaches it.

    Read from the backward graph: the gradient of input ``k`` depends on the
    tangent of output ``o`` exactly when ``o`` depends differentiably on ``k``.
    """
    if bw is None:
        return [frozenset()] * n_in
    outputs = [o for o, m in enumerate(tangent_mask) if m]
    placeholders = [n for n in bw.graph.nodes if n.op == "placeholder"]
    if len(placeholders) - n_saved != len(outputs):  # pragma: no cover - a graph laid out otherwise
        # Not saved tensors then tangents: claim every output reaches every
        # input, so gradients stay as computed (zeros at worst, never dropped).
        return [frozenset(range(len(tangent_mask)))] * n_in
    deps: dict[torch.fx.Node, frozenset[int]] = {
        node: frozenset([outputs[j]]) for j, node in enumerate(placeholders[n_saved:])}
    for node in bw.graph.nodes:
        if node.op != "placeholder" and node.op != "output":
            deps[node] = frozenset().union(*(deps.get(a, frozenset()) for a in node.all_input_nodes))
    grads = list(next(n for n in bw.graph.nodes if n.op == "output").args[0])
    return [deps.get(grads[k], frozenset()) if k < len(grads) and isinstance(grads[k], torch.fx.Node)
            else frozenset() for k in range(n_in)]


def _reached(plan: "_GradPlan", used: list[bool]) -> tuple[set[int], set[int], set[int]]:
    """The carry, x and outside inputs (by position) whose gradient the used outputs reach over the whole loop.

    ``used`` says which of carry_out + ys the loss depends on. Going back from
    the last iteration, a carry input is reached when an output that is used
    (a y, or a carry component reached in the iteration after) depends on it.
    """
    primals, reach = plan.primals, plan.reach
    ys_used = {primals.y(j) for j in range(plan.num_y) if used[primals.y(j)]}
    live = {i for i in range(plan.n_c) if used[i]}
    x_hit: set[int] = set()
    outside_hit: set[int] = set()
    states: list[frozenset[int]] = [frozenset(live)]  # states[t]: live carry after t iterations back
    first: dict[frozenset[int], int] = {states[0]: 0}
    for t in range(1, plan.length + 1):
        targets = states[-1] | ys_used
        x_hit |= {j for j in range(plan.n_x) if reach[primals.x(j)] & targets}
        outside_hit |= {k for k in range(plan.n_o) if reach[primals.outside(k)] & targets}
        state = frozenset(i for i in range(plan.n_c) if reach[i] & targets)
        if state in first:
            # The states cycle from here on: every x / outside they reach is
            # already counted, and the carry after `length` steps is known.
            start = first[state]
            return set(states[start + (plan.length - t) % (t - start)]), x_hit, outside_hit
        first[state] = t
        states.append(state)
    return set(states[-1]), x_hit, outside_hit


class _ScanFunction(torch.autograd.Function):
    """Forward loop saving activations; backward loop in reverse."""

    @staticmethod
    def forward(ctx, plan: _GradPlan, *flat: torch.Tensor):
        init, xs, outside = plan.primals.split(flat)
        with torch.no_grad():
            carry, ys_all = _run(plan.fwd_loop, init, xs, plan.length, outside)
        ys, stacked = ys_all[:plan.num_y], ys_all[plan.num_y:]
        ctx.plan = plan
        ctx.shardings = [_sharding_of(t) for t in init + xs + outside]
        # The backward reads the outside tensors of this call; saving them lets
        # autograd refuse a backward after they were modified in place, as eager does.
        ctx.save_for_backward(*stacked, *[xs[j] for j in plan.x_aliased], *outside)
        outs = carry + ys
        ctx.mark_non_differentiable(*[t for t in outs if not _is_float(t)])
        ctx.set_materialize_grads(False)  # an output the loss does not use: None (see _reached)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            # create_graph=True: the backward loop is not itself differentiable; a
            # detached gradient would silently drop every second derivative.
            raise ScanUnsupportedError(
                "scan: the backward of a scan is not differentiable, so create_graph=True (a gradient "
                "penalty, a Hessian-vector product, torch.autograd.grad(..., create_graph=True)) cannot go "
                "through it. Compute such terms with a Python loop over the layers, or without "
                "create_graph."
            )
        if autocast.enabled():
            raise ScanUnsupportedError(
                "scan: backward() ran under torch.autocast. The scan's backward was captured as PyTorch advises "
                "autocast to be used, with backward() called after the autocast block (its ops in the dtypes "
                "the forward chose); under autocast eager would cast them again. Call backward() after the "
                "`with torch.autocast(...)` block."
            )
        plan: _GradPlan = ctx.plan
        primals = plan.primals
        stacked, aliased_xs, outside = plan.saved_layout.split(ctx.saved_tensors)
        device = torch_xla_device()

        def or_zeros(g, sig):
            return g if g is not None else torch.zeros(sig[0], dtype=sig[1], device=device)

        float_carry, grad_outside = plan._float_carry(), plan._grad_outside()
        init = [or_zeros(grads[i], plan.carry_sig[i]) for i in float_carry]
        init += [or_zeros(None, plan.outside_sig[k]) for k in grad_outside]
        gys = [or_zeros(grads[primals.y(j)], ((plan.length, *plan.y_sig[j][0]), plan.y_sig[j][1]))
               for j in range(plan.num_y)]
        with torch.no_grad():
            carry, gxs = _run(plan.backward_loop(), init, stacked + aliased_xs + gys, plan.length, outside)
        grad_init: list[torch.Tensor | None] = [None] * plan.n_c
        for i, g in zip(float_carry, carry[:len(float_carry)]):
            grad_init[i] = g
        grad_outside_vals: list[torch.Tensor | None] = [None] * plan.n_o
        for k, g in zip(grad_outside, carry[len(float_carry):]):
            grad_outside_vals[k] = g
        grad_xs: list[torch.Tensor | None] = [None] * plan.n_x
        for j, g in zip([j for j in range(plan.n_x) if plan.grad_mask[primals.x(j)]], gxs):
            grad_xs[j] = g
        # An input no used output depends on gets None, as in the Python loop
        # (where zeros would let an optimizer's weight decay or momentum move it).
        init_hit, x_hit, outside_hit = _reached(plan, [g is not None for g in grads])
        for values, hit in ((grad_init, init_hit), (grad_xs, x_hit), (grad_outside_vals, outside_hit)):
            for k in range(len(values)):
                if k not in hit:
                    values[k] = None
        # Gradients are sharded like the tensors they belong to.
        for values, shardings in zip((grad_init, grad_xs, grad_outside_vals), primals.split(ctx.shardings)):
            _apply_shardings(values, shardings)
        return (None, *grad_init, *grad_xs, *grad_outside_vals)
