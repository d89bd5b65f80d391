"""``no_recompiles()``: raise when XLA compiles inside a block, and say what changed.

A recompile is the other silent TPU stall beside a host transfer: a shape
that varies, a new code path, a different sharding each make torch_xla compile
a new program (seconds on a TPU) where the step should reuse a cached one.
The guard counts torch_xla's compilations (the ``CompileTime`` metric) over
exactly the block; on exit it raises :class:`RecompileError` if any happened.

What changed. The first guard opened in the process wraps ``torch_xla.sync``
(``xm.mark_step`` calls it) for the rest of the process; a wrapped sync made
inside a guarded block records where it was called (the innermost frame
outside torch, torch_xla and this package) and the IR it is about to compile:
the XLA tensors Python holds whose values are pending, in torch_xla's sync
order, and their graph dumped once (``torch_xla._XLAC._get_xla_tensors_text``),
each node a single time however many tensors share it. A pending value that
only torch holds (a tensor autograd saved for backward) is compiled too, but
its own ops are missing from the diff. When a sync compiles, the error compares
that program with the one the same call site synced last under a guard, as
multisets of inputs (shape and dtype), outputs, the outputs' shardings and
ops with their output shapes, and lists what only one of them has: an input
that grew a row, an op that appeared, an output sharded another way.
torch_xla's IR text shows no sharding of an input or of an intermediate
value, so a compile caused by one of those is reported as a graph that did
not change. A compile made elsewhere (a host read such as ``.cpu()`` or
``.item()`` that runs pending work, a ``sync`` imported by name before the
first guard) is counted and reported without a diff. Reading the IR costs,
in guarded blocks only, a walk over Python's tracked objects and time
proportional to the pending graph (not to its size times the number of
pending tensors, as torch_xla's live tensors report does), and a wait for
the last sync's execution to finish first (its results are read by the new
graph, and torch_xla 2.9 crashes reading results still in flight): a
guarded step does not overlap its tracing with the previous step's run.

Threads: torch_xla's metrics are process-wide, so a compile made by another
thread during the block is counted too; the error says which other Python
threads were alive. Guards nest; each judges its own block.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ._frames import user_frame
from ._transfer.metrics import _metric
from ._xla import wait_for_executions_in_flight, xlac

__all__ = ["RecompileError", "no_recompiles"]


class RecompileError(RuntimeError):
    """XLA compiled a program inside a :func:`no_recompiles` block."""


@dataclass
class _Compile:
    site: str
    count: int
    changes: list[str] | None  # diff lines against the site's previous IR; None: no previous IR seen


@dataclass
class _Block:
    start: int
    compiles: list[_Compile] = field(default_factory=list)


_local = threading.local()
_lock = threading.Lock()
_last_ir: dict[str, str] = {}  # call site -> the normalized IR it synced last under a guard
_LAST_IR_SITES = 256
_installed = False
_OUTPUT, _OUTPUT_SHARDING = "Tensor: shape=", " sharding="  # an output line of _pending_ir()
_INFO_SHARDING = re.compile(r"^ShardingSpec: (.+)$", re.MULTILINE)
_INFO_ID = re.compile(r"^TensorID: (\d+)$", re.MULTILINE)
_INFO_SHAPE = re.compile(r"^XLA Shape: (\S+)$", re.MULTILINE)


def _blocks() -> list[_Block]:
    return _local.__dict__.setdefault("blocks", [])


def _compile_count() -> int:
    return _metric("CompileTime")[0]


def _pending_tensors() -> list[tuple[str, torch.Tensor]]:
    """(output line, tensor) of each XLA tensor Python holds whose value a sync would compute, by tensor id."""
    info_of = xlac()._get_xla_tensor_debug_info
    is_tensor_type: dict[type, bool] = {}
    pending = {}
    for obj in gc.get_objects():
        kind = type(obj)
        known = is_tensor_type.get(kind)
        if known is None:
            known = is_tensor_type[kind] = issubclass(kind, torch.Tensor)
        if not known:
            continue
        info = info_of(obj)  # "Not a XLATensor" for any other tensor; unlike .device, never calls Python code
        # Pending: an IR value and no device data (a tensor holding data keeps a device_data node as its IR).
        if "\nIR: None" in info or "\nXLAData: None" not in info:
            continue
        ident, shape, sharding = (pattern.search(info) for pattern in (_INFO_ID, _INFO_SHAPE, _INFO_SHARDING))
        if ident is None or shape is None or sharding is None:
            raise RuntimeError(f"no_recompiles(): unexpected torch_xla tensor debug info (torch_xla changed?):\n{info}")
        line = _OUTPUT + shape.group(1)
        if sharding.group(1) != "None":
            line += _OUTPUT_SHARDING + sharding.group(1)
        pending[int(ident.group(1))] = (line, obj)
    return [pending[ident] for ident in sorted(pending)]


def _pending_ir() -> str:
    """The pending outputs and their graph, each node once, without tensor ids, in torch_xla's sync order.

    It first waits for the executions in flight (:func:`wait_for_executions_in_flight`): the pending
    graph reads the last sync's results (a step's parameters), which are not readable until then.
    """
    wait_for_executions_in_flight()
    pending = _pending_tensors()
    if not pending:
        return ""
    text = xlac()._get_xla_tensors_text([tensor for _, tensor in pending])
    return "\n".join(line for line, _ in pending) + "\n" + text


_NODE = re.compile(r"^\s*%\d+ = (\S+) ([\w:.]+)\(")


def _summary(ir: str) -> collections.Counter:
    """What a compiled program depends on, as a multiset: inputs, ops with output shapes, outputs, their shardings."""
    items: collections.Counter = collections.Counter()
    for line in ir.splitlines():
        if line.startswith(_OUTPUT):
            shape, _, sharding = line[len(_OUTPUT):].partition(_OUTPUT_SHARDING)
            items[("output", shape)] += 1
            if sharding:
                items[("sharding", f"output {shape} {sharding}")] += 1
            continue
        node = _NODE.match(line)
        if node is None:
            continue
        shape, op = node.groups()
        if op == "xla::device_data":
            items[("input", shape)] += 1
        else:
            items[("op", f"{op} -> {shape}")] += 1
    return items


def _diff(before: str, after: str, limit: int = 12) -> list[str]:
    """What differs between two programs' summaries, kind by kind: inputs, outputs, shardings, then ops."""
    old, new = _summary(before), _summary(after)
    lines = []
    for kind in ("input", "output", "sharding", "op"):
        gone = sorted((v, n) for (k, v), n in (old - new).items() if k == kind)
        came = sorted((v, n) for (k, v), n in (new - old).items() if k == kind)
        if gone or came:
            show = lambda items: ", ".join(f"{v}" + (f" (x{n})" if n > 1 else "") for v, n in items) or "-"
            lines.append(f"{kind}s: before {show(gone)}; now {show(came)}")
    if not lines and before != after:
        lines.append("the same inputs, ops and shapes, in another arrangement (the dataflow changed)")
    return lines[:limit]


def _install() -> None:
    """Wrap ``torch_xla.sync`` once per process (see the module doc)."""
    global _installed
    with _lock:
        if _installed:
            return
        import torch_xla

        original = torch_xla.sync

        def sync(*args, **kwargs):
            blocks = _blocks()
            if not blocks or getattr(_local, "syncing", False):
                return original(*args, **kwargs)
            site = user_frame()
            ir = _pending_ir()
            before = _compile_count()
            _local.syncing = True
            try:
                result = original(*args, **kwargs)
            finally:
                _local.syncing = False
            compiled = _compile_count() - before
            with _lock:
                previous = _last_ir.get(site)
                if len(_last_ir) >= _LAST_IR_SITES and site not in _last_ir:
                    _last_ir.pop(next(iter(_last_ir)))
                _last_ir[site] = ir
            if compiled:
                blocks[-1].compiles.append(_Compile(site, compiled, None if previous is None
                                                    else _diff(previous, ir)))
            return result

        sync.__wrapped__ = original  # type: ignore[attr-defined]
        torch_xla.sync = sync
        _installed = True


def _report(block: _Block, total: int) -> str:
    lines = [f"XLA compiled {total} program(s) inside a no_recompiles() block:"]
    seen = 0
    for c in block.compiles:
        seen += c.count
        lines.append(f"  torch_xla.sync() at {c.site} compiled {c.count}")
        if c.changes is None:
            lines.append("    (no earlier graph from this call site was seen under a guard: open the guard one "
                         "step earlier to see what changed)")
        elif not c.changes:
            lines.append("    the pending graph is the same as this call site's last one; what differs is "
                         "not in torch_xla's IR text (an input's or an intermediate's sharding, a layout, or "
                         "a graph cached out)")
        else:
            lines.append("    what changed against this call site's last graph (what only it had; what only the "
                         "new one has):")
            lines += [f"      {line}" for line in c.changes]
    if total > seen:
        lines.append(f"  {total - seen} more compiled outside a wrapped torch_xla.sync(): a host read (.cpu(), "
                     f".item(), print) that runs pending work, or a sync imported by name before the first guard")
    others = [t.name for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
    if others:
        lines.append(f"  (torch_xla counts compiles per process: other threads alive: {', '.join(others[:5])})")
    return "\n".join(lines)


@contextlib.contextmanager
def no_recompiles() -> Iterator[None]:
    """Raise :class:`RecompileError` on exit if XLA compiled anything inside the block.

    Warm up outside the block (the first step compiles by design), then
    guard the steps that must reuse it::

        step(); step()                      # compiles, and caches
        with txe.no_recompiles():
            for _ in range(10): step()      # raises if any step compiles, naming what changed

    Nothing is executed or transferred by the guard itself. An exception from
    the body propagates unchanged (the block is not judged).
    """
    _install()
    block = _Block(_compile_count())
    blocks = _blocks()
    blocks.append(block)
    try:
        yield
    finally:
        blocks.remove(block)
    total = _compile_count() - block.start
    if total:
        if blocks:  # an enclosing guard sees these compiles too, with their causes
            blocks[-1].compiles.extend(block.compiles)
        raise RecompileError(_report(block, total))
