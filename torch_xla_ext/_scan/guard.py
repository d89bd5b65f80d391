"""What may not happen while a step function is traced, refused with :class:`ScanUnsupportedError`.

``scan`` runs ``fn`` once, lazily, on placeholder tensors that have a shape
and a dtype but no buffer. Anything that makes torch_xla *execute* the lazy
graph (``.item()``, ``if t > 0``, ``print(t)``, ``.cpu()``, an op whose output
shape depends on values such as ``torch.nonzero``) would run a computation over
those placeholders: torch_xla 2.9 dies with a segmentation fault there. So
while ``fn`` is traced:

* the :class:`~torch_xla_ext._scan.lift.Lifter` refuses the explicit host
  reads it sees (:func:`host_read`), naming the user's line;
* torch_xla's own switch ``_set_allow_execution(False)`` is on
  (:func:`execution_refused`), so any other execution (an op torch_xla runs on
  the CPU, a read we did not list) raises inside torch_xla instead of
  crashing, and :func:`tracing` turns that error into a
  :class:`ScanUnsupportedError`. The switch is process-wide, and must be: a
  ``torch_xla.sync()`` on any thread executes every live lazy tensor of the
  device, the trace's placeholders included, and would crash the process.
  While any thread traces, such an execution on another thread raises
  torch_xla's "Unexpected execution" error instead (docs/scan.md, *Threads*).
  Traces on several threads (a forward on one, the backward's lazy trace on
  autograd's device thread) hold the switch together: it is back on when the
  last of them ends, never before and never left off;
* a scan inside ``fn`` is refused (nested scans are not supported);
* a host random draw by ``fn`` is refused (:mod:`~torch_xla_ext._scan.draws`):
  the loop would draw new numbers each iteration, a trace draws once. Draws
  are told apart per thread, so other threads' draws are neither blamed on
  ``fn`` nor undone. A trace during which Python's ``random`` moved, or
  numpy's global state moved while modules were imported (first uses inside
  torch_xla import jax, whose import draws from numpy), raises
  :class:`TraceAgain`, and the caller traces once more, watching, to tell
  who drew.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

import torch

from .._annotate import scan_step_trace
from .._frames import user_frame
from .._xla import xlac
from .draws import NUMPY_GLOBAL, HostDraw, NumpyGlobalHeld, generator_name, python_random_state, watching
from .errors import ScanUnsupportedError

__all__ = ["TraceAgain", "tracing", "execution_refused", "refusing_draw", "refuse_nested", "host_read", "user_frame",
           "describe_callable", "one_call_at_a_time"]


class TraceAgain(Exception):
    """The trace cannot tell whether fn drew host random numbers: trace again, watching (see :func:`tracing`)."""


_local = threading.local()

#: torch_xla's message when it is asked to execute while execution is switched off.
_EXECUTION_REFUSED = "Unexpected execution happens inside the compiled function"


#: Held by every scan and scan_layers call from its first read of its inputs to its last lazy op.
_one_call = threading.RLock()


@contextlib.contextmanager
def one_call_at_a_time() -> Iterator[None]:
    """Serialize scan calls across threads (a re-entrant lock: scan_layers' autocast path calls itself).

    A call uses state that is not per thread while it traces: AOTAutograd's
    tracing state (not thread-safe), and for ``scan_layers`` the template
    layer's parameters (``torch.func.functional_call`` swaps them in place).
    Two calls on different threads would see each other's: another thread's
    placeholders stacked as weights. A trace takes milliseconds of host time;
    calls wait for each other that long. (The execution switch is shared by
    reference count, :func:`execution_refused`, and the backward's lazy trace
    on autograd's thread does not take this lock.)
    """
    with _one_call:
        yield


def describe_callable(fn: object) -> str:
    """``name (file:line)`` of a function, method or module's forward, for messages.

    A function with a ``describes`` attribute (scan_layers' step) is described
    as what that names (the layer class's forward).
    """
    fn = getattr(fn, "describes", fn)
    if isinstance(fn, torch.nn.Module):
        fn = type(fn).forward
    fn = getattr(fn, "__func__", fn)
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code is not None else name


def refuse_nested(api: str) -> None:
    """Raise :class:`ScanUnsupportedError` when ``api`` is called while this thread traces a step function."""
    if getattr(_local, "depth", 0):
        raise ScanUnsupportedError(
            f"{api}: nested scans are not supported: it was called inside a function that scan or scan_layers "
            f"is tracing (at {user_frame()}). Run the inner loop as a Python loop inside fn, or restructure "
            f"the two loops into one scan whose carry holds both states."
        )


_switch_lock = threading.Lock()
_switch_holders = 0
_switch_saved = True


@contextlib.contextmanager
def execution_refused() -> Iterator[None]:
    """Hold torch_xla's execution switch off (process-wide; see the module docstring).

    Reference-counted across threads: the first holder saves the switch and
    turns it off, the last one puts the saved value back. Two overlapping
    holders that each saved and restored on their own would leave the switch
    off for good when they end in the wrong order (A saves on, B saves off,
    A restores on, B restores off), and every later execution in the process
    would fail.
    """
    global _switch_holders, _switch_saved
    X = xlac()
    with _switch_lock:
        if _switch_holders == 0:
            _switch_saved = X._get_allow_execution()
            X._set_allow_execution(False)
        _switch_holders += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_holders -= 1
            if _switch_holders == 0:
                X._set_allow_execution(_switch_saved)


def refusing_draw(api: str, generators: list[str], where: str) -> ScanUnsupportedError:
    """The refusal of a host random draw by ``fn`` (``where``: the user's line, or ``""``)."""
    at = f" at {where}" if where else ""
    return ScanUnsupportedError(
        f"{api}: fn draws random numbers from {' and '.join(generators)}{at}. scan traces fn once, so every "
        f"iteration (and every later call) would reuse the numbers of that one draw, where the Python loop "
        f"draws new ones each iteration. Draw on the device instead (torch.rand(..., device=x.device), "
        f"F.dropout on a device tensor): device draws differ per iteration and are reproducible under "
        f"torch.manual_seed."
    )


@contextlib.contextmanager
def tracing(api: str = "scan", watch: bool = False, last: bool = True) -> Iterator[None]:
    """The scope in which a step function runs on placeholders (see the module docstring).

    Raises :class:`TraceAgain` (unless ``last``) when the trace cannot tell
    whether ``fn`` drew host random numbers: Python's ``random`` moved during
    an unwatched trace (``fn`` drew, or another thread did meanwhile), or
    numpy's global state moved while modules were imported (an import may
    draw). The caller then traces once more with ``watch`` (Python's random
    watched on this thread, :func:`~torch_xla_ext._scan.draws.watching`).
    """
    modules = len(sys.modules)
    python_random = None if watch else python_random_state()
    _local.depth = getattr(_local, "depth", 0) + 1
    numpy_global = NumpyGlobalHeld()
    try:
        with execution_refused(), scan_step_trace(), (watching() if watch else contextlib.nullcontext()) as watched, \
                numpy_global:
            yield
    except HostDraw as error:
        raise refusing_draw(api, [generator_name(error.args[0])], user_frame(tb=error.__traceback__)) from None
    except RuntimeError as error:
        if _EXECUTION_REFUSED not in str(error) or isinstance(error, ScanUnsupportedError):
            raise
        raise ScanUnsupportedError(
            f"{api}: fn made torch_xla execute the graph while it was being traced (at "
            f"{user_frame(tb=error.__traceback__)}): it read a tensor's value on the host, or called an op "
            f"whose result depends on values (torch.nonzero, boolean-mask indexing, .unique(), ...). scan "
            f"traces fn once on placeholders without running it, so it cannot read values each iteration as "
            f"the Python loop would. Compute with tensors instead (torch.where for an if, a fixed-size mask "
            f"for a data-dependent selection), or do the read outside fn."
        ) from None
    finally:
        _local.depth -= 1
    hit = watched.hit() if watched is not None else None
    if hit is not None:  # fn caught the refusal and went on without the numbers
        raise refusing_draw(api, [generator_name(hit[0])], "")
    if python_random is not None and python_random_state() != python_random and not last:
        raise TraceAgain()  # fn drew, or another thread did meanwhile: the watched trace tells which
    if numpy_global.moved:  # put back already (only this thread could draw)
        if len(sys.modules) != modules and not last:
            raise TraceAgain()
        raise refusing_draw(api, [NUMPY_GLOBAL], "")


#: Tensor methods and torch functions that read a tensor's values on the host,
#: or whose output shape depends on its values (torch_xla then reads it too).
_HOST_READS = frozenset({
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__complex__",
    "__repr__", "__str__", "__format__", "__array__", "__dlpack__", "__contains__", "_local_scalar_dense",
    "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal", "allclose",
    "bincount", "histc",
})


def _to_host(args: tuple, kwargs: dict) -> bool:
    """Whether ``Tensor.to(*args, **kwargs)`` targets a device other than XLA."""
    try:
        device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    except Exception:  # noqa: BLE001 - an odd call: let torch report it
        return False
    return device is not None and device.type != "xla"


def host_read(func: object, args: tuple, kwargs: dict) -> str | None:
    """What ``func(*args, **kwargs)`` reads on the host from an XLA tensor (None: nothing)."""
    name = getattr(func, "__name__", "")
    if name not in _HOST_READS and name not in ("to", "copy_", "where", "__getitem__"):
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not any(t.device.type == "xla" for t in tensors):
        return None
    if name in _HOST_READS:
        return f"{name}()"
    if name == "to":
        return "to() a host device" if _to_host(args, kwargs) else None
    if name == "copy_":  # host_tensor.copy_(xla_tensor)
        return "copy_() into a host tensor" if tensors[0].device.type != "xla" else None
    if name == "where":  # torch.where(cond) is torch.nonzero
        return "where(condition) without values" if len(args) + len(kwargs) == 1 else None
    index = args[1] if len(args) > 1 else None
    leaves = index if isinstance(index, (tuple, list)) else (index,)
    if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in leaves):
        return "indexing with a boolean mask (a data-dependent shape)"
    return None
