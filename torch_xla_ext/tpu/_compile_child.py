"""``tpu_fit``'s second child per path: it compiles the lowered step for the TPU before this process imports torch.

The TPU compiler's own host memory is most of a sizing's: libtpu 0.0.21
peaks at 2.5 GiB compiling Llama-3 8B's scanned step in a process that holds
nothing else. In the process that lowered the step, that peak sat on top of
torch, torch_xla's virtual devices and the model (1.0 GiB more). Here it
does not. The parent (:mod:`.fit`) runs this file by its path with
``python -P``, not with ``-m``: ``-m`` would import the package first, and
so torch. This file loads :mod:`._client` alone, compiles, and hands the
memory the compiler freed back to the system (glibc keeps it otherwise).
Only then does it import the package, to describe the compiled program.

The child loads libtpu, then reads a request on stdin, as JSON (``fit``
starts it while the first child lowers, and hands the request over once
that one has exited): ``hlo``, a file holding the
serialized HloModuleProto that :func:`~._fit_step.compile_step` wrote,
``topology``, and the parent's pid (:mod:`._parent`). It prints
``{"compiled": ..., "host_rss_bytes": ...}`` as one JSON line: ``compiled``
is a :class:`~torch_xla_ext.tpu.CompiledForTpu` as a dict,
``host_rss_bytes`` this process's peak.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import json
import os
import resource
import sys
from types import ModuleType


def _alone(name: str) -> ModuleType:
    """``torch_xla_ext.tpu.<name>`` without its package, under its own name, so the package's import reuses it."""
    qualified = f"torch_xla_ext.tpu.{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    spec = importlib.util.spec_from_file_location(qualified, os.path.join(os.path.dirname(__file__), f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[qualified] = module
    spec.loader.exec_module(module)
    return module


def _release_freed_memory() -> None:
    """Return the heap's free pages to the system: after a compile, glibc holds what the compiler freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass


def main() -> int:
    parent = _alone("_parent")
    parent.exit_with_parent(None)  # killed with the process that started it, while it waits for the request too
    client = _alone("_client")
    client._jax()  # libtpu, before the request: ``fit`` starts this process while the step is being lowered
    request = json.loads(sys.stdin.read())
    parent.exit_with_parent(request.get(parent.PARENT_KEY))
    with open(request["hlo"], "rb") as f:
        hlo = f.read()
    compiled = client.compile_sized(hlo, client.topology_devices(request["topology"]))
    _release_freed_memory()
    from torch_xla_ext import tpu  # torch, from here on

    described = tpu._described(compiled, hlo, request["topology"])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"compiled": dataclasses.asdict(described), "host_rss_bytes": peak}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
