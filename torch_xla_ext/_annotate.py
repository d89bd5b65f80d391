"""A functional, traceable sharding annotation shared by ``scan`` and ``fully_shard``.

``annotate_sharding(t, mesh, spec)`` returns a new tensor equal to ``t`` whose
value carries the sharding ``spec`` over ``mesh`` (GSPMD inserts the
collective that produces it: an all-gather for a replicated spec on a sharded
input, a reduce-scatter for a sharded spec on a partial sum). It is a custom op,
so AOTAutograd can trace it inside ``scan``; with ``recompute_in_backward=True``
the backward of a ``scan`` recomputes it from the scan input it was applied to
instead of stacking the result across iterations (FSDP's reshard after forward).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ._weak import WeakIdMap
from ._xla import xlac

__all__ = ["Annotator", "annotate_sharding", "mark_sharding", "mesh_text", "behind_barrier", "shard_activation", "fresh_node",
           "is_fake_tensor",
           "ANNOTATE_OP", "regather_mark", "scan_step_trace", "in_scan_step_trace", "traced"]

_REPLICATED = ("", "{replicated}")
_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def is_fake_tensor(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tracer's tensor (a fake tensor, or a functional one over it), not a lazy XLA tensor.

    The one test the package uses (scan's AOTAutograd traces, ``torch.compile``
    of a fully sharded forward). ``is_fake`` unwraps torch_xla's functional
    tensors on every call (~2.4 us); a plain tensor while no fake mode is
    active is answered without it (~0.5 us). The annotations of a fully
    sharded step ask this hundreds of times.
    """
    if type(t) in _PLAIN_TYPES and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
        return False
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is being traced (``torch.compile``, or a fake tensor of an AOTAutograd trace), not run."""
    return torch.compiler.is_compiling() or is_fake_tensor(t)


def fresh_node(t: torch.Tensor) -> torch.Tensor:
    """A new lazy node equal to ``t`` (XLA removes the no-op).

    Unlike ``t`` itself (device data, or a node already annotated), it can be
    annotated with a sharding without replacing anything ``t`` refers to.
    """
    return t * 1 if t.dtype != torch.bool else t ^ False


def behind_barrier(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` that XLA may not merge with computations before it.

    Recomputing a value (a gather) from this copy in the backward keeps XLA
    from reusing the forward's value, which would keep it alive until then.
    """
    import torch_xla.core.xla_model as xm

    fresh = [fresh_node(t)]
    xm.optimization_barrier_(fresh)
    return fresh[0]


def is_replicated_spec(spec: str) -> bool:
    """torch_xla reports an unannotated tensor as ``''`` before its first execution and
    ``'{replicated}'`` after it; both mean "no sharding"."""
    return spec in _REPLICATED


@functools.lru_cache(maxsize=1024)
def _op_sharding(mesh: str, spec: str):
    """The OpSharding for a (mesh, partition spec) pair, parsed once."""
    import torch_xla.distributed.spmd as xs

    return xs.Mesh.from_str(mesh).get_op_sharding(ast.literal_eval(spec))


def mark_sharding(t: torch.Tensor, mesh, spec: tuple) -> None:
    """Annotate the XLA tensor ``t`` itself with partition ``spec`` over ``mesh`` (a ``Mesh`` or its text).

    What ``xs.mark_sharding`` records, without its detour through torchax:
    torch_xla's version imports torchax on every call where it is installed,
    and importing torchax renames PyTorch's ``privateuse1`` backend to
    ``jax`` for the whole process (``torch.distributed.checkpoint``'s
    default writer then fails on ``torchax.device_module.current_stream``).
    The library never calls ``xs.mark_sharding``; it places tensors with this.

    A placeholder (a tensor with a shape and no data) has nothing to shard:
    its value is annotated in the graph instead, and the lowered program's
    parameter gets the sharding (:mod:`torch_xla_ext._placeholders`).
    """
    sharding = _op_sharding(_mesh_text(mesh), str(tuple(spec)))
    if xlac()._is_placecholder(t):  # (torch_xla's spelling)
        from ._placeholders import mark_placeholder

        mark_placeholder(t, sharding)
        return
    xlac()._xla_mark_sharding(t, sharding)


def _annotated_copy(t: torch.Tensor, sharding) -> torch.Tensor:
    """A copy of the XLA tensor ``t`` whose value carries ``sharding`` (an ``OpSharding``); ``t`` is left as it is.

    ``clone`` gives a new tensor over the same value (device data included),
    and torch_xla's custom-sharding annotation puts a ``Sharding`` custom call
    on the copy's value only: no data moves, whatever ``t`` holds (marking a
    clone of device data instead would reshard that data through the host).
    """
    out = t.clone()
    xlac()._xla_annotate_custom_sharding(out, sharding)
    return out


def _annotated(t: torch.Tensor, mesh: str, spec: str) -> torch.Tensor:
    if t.device.type != "xla":
        return t.clone()
    return _annotated_copy(t, _op_sharding(mesh, spec))


@torch.library.custom_op("txe::annotate_sharding", mutates_args=())
def _annotate_sharding(t: torch.Tensor, mesh: str, spec: str, recompute_in_backward: bool) -> torch.Tensor:
    return _annotated(t, mesh, spec)


@_annotate_sharding.register_fake
def _annotate_sharding_fake(t: torch.Tensor, mesh: str, spec: str, recompute_in_backward: bool) -> torch.Tensor:
    return torch.empty_like(t)


ANNOTATE_OP = torch.ops.txe.annotate_sharding.default


class Annotator:
    """:func:`annotate_sharding` for one fixed ``(mesh, spec)``, with its lookups done once.

    A fully sharded step annotates every gradient: this is that call with the
    per-call work (the mesh and spec texts, the ``OpSharding`` lookup) moved to
    construction.
    """

    __slots__ = ("mesh", "spec", "_sharding")

    def __init__(self, mesh, spec: tuple) -> None:
        self.mesh, self.spec = _mesh_text(mesh), str(tuple(spec))
        self._sharding = _op_sharding(self.mesh, self.spec)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        if traced(t) or in_scan_step_trace():  # see annotate_sharding
            return torch.ops.txe.annotate_sharding(t, self.mesh, self.spec, False)
        if t.device.type != "xla":
            return t.clone()
        return _annotated_copy(t, self._sharding)


# --------------------------------------------------------------------------- #
# The contract between scan and fully_shard, in both directions.
# --------------------------------------------------------------------------- #

_ANNOTATE_ARGS = [a.name for a in ANNOTATE_OP._schema.arguments]


def regather_mark(node: Any) -> bool | None:
    """For a node of an FX graph: None if it is not a sharding annotation, else its ``recompute_in_backward``.

    fully_shard marks the gathers of its parameters; scan's backward
    recomputes a marked gather from the sharded input it was applied to
    instead of stacking the gathered value across iterations.
    """
    if getattr(node, "target", None) is not ANNOTATE_OP:
        return None
    bound = dict(zip(_ANNOTATE_ARGS, node.args))
    bound.update(node.kwargs)
    return bool(bound["recompute_in_backward"])


_scan_trace = threading.local()


@contextlib.contextmanager
def scan_step_trace() -> Iterator[None]:
    """Entered by scan while it traces a step in this thread: on placeholders, or with AOTAutograd."""
    depth = getattr(_scan_trace, "depth", 0)
    _scan_trace.depth = depth + 1
    try:
        yield
    finally:
        _scan_trace.depth = depth


def in_scan_step_trace() -> bool:
    """Whether this thread runs inside one of scan's traces of a step.

    There fully_shard gathers the parameters of its modules with the
    ``recompute_in_backward`` mark (see :func:`regather_mark`), in both traces
    alike, so the trace scan caches and the one it differentiates agree.
    """
    return getattr(_scan_trace, "depth", 0) > 0


# Mesh -> its text, held weakly (a dropped Mesh leaves no entry).
_mesh_texts: WeakIdMap = WeakIdMap()


def _mesh_text(mesh) -> str:
    """``str(mesh)`` (what the op carries), computed once per mesh object; a string is taken as that text.

    Code that ``torch.compile`` traces passes the text (see :func:`mesh_text`):
    dynamo cannot trace ``str(mesh)`` into a constant.
    """
    if isinstance(mesh, str):
        return mesh
    text = _mesh_texts.get(mesh)
    if text is None:
        text = str(mesh)
        try:
            _mesh_texts[mesh] = text
        except TypeError:  # a mesh-like object that takes no weak reference: its text is not kept
            pass
    return text


def mesh_text(mesh) -> str:
    """The text of a torch_xla ``Mesh`` that :func:`annotate_sharding` accepts in its place.

    Compute it outside ``torch.compile`` (for example when a module is set up)
    and pass it to code that dynamo traces.
    """
    return _mesh_text(mesh)


def annotate_sharding(t: torch.Tensor, mesh, spec: tuple, *, recompute_in_backward: bool = False) -> torch.Tensor:
    """``t`` annotated with partition ``spec`` over the torch_xla ``mesh`` (no autograd formula).

    ``mesh`` is a ``Mesh`` or its :func:`mesh_text`. Recorded as the
    ``txe::annotate_sharding`` op while a tracer runs on fake tensors (scan's
    AOTAutograd trace, ``torch.compile``); applied directly to lazy XLA tensors
    otherwise. The openxla backend then runs the op on lazy tensors, which
    applies the annotation in the compiled graph.
    """
    mesh_text, spec_text = _mesh_text(mesh), str(tuple(spec))
    if traced(t) or in_scan_step_trace():
        # In scan's trace of a step the op is what scan's fingerprint records: a step annotated
        # differently (another spec, another recompute_in_backward) is another plan, never a reused one.
        return torch.ops.txe.annotate_sharding(t, mesh_text, spec_text, recompute_in_backward)
    return _annotated(t, mesh_text, spec_text)


class _ShardActivation(torch.autograd.Function):
    """Annotate a value and its gradient with the same sharding."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, mesh, spec: tuple) -> torch.Tensor:
        ctx.mesh, ctx.spec = mesh, spec
        return annotate_sharding(t, mesh, spec)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return annotate_sharding(grad, ctx.mesh, ctx.spec), None, None


def shard_activation(t: torch.Tensor, mesh, spec: tuple) -> torch.Tensor:
    """``t`` and, in the backward, its gradient annotated with ``spec`` over ``mesh``."""
    return _ShardActivation.apply(t, mesh, tuple(spec))
