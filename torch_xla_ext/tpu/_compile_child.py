"""``tpu_fit``'s second child per path: it compiles the lowered step for the TPU, and never imports torch.

The TPU compiler's own host memory is most of a sizing's: libtpu 0.0.21
peaks at 2.5 GiB compiling Llama-3 8B's scanned step in a process that holds
nothing else. In the process that lowered the step, that peak sat on top of
torch, torch_xla's virtual devices and the model (1.0 GiB more). Here it
does not. The parent (:mod:`.fit`) runs this file by its path with
``python -P``, not with ``-m``: ``-m`` would import the package first, and
so torch. This file loads :mod:`._client` alone and compiles; the parent,
which has imported torch already, describes the program it hands back
(:func:`read_answer`, then :func:`torch_xla_ext.tpu._described`).

The child loads libtpu, then reads a request on stdin, as JSON (``fit``
starts it while the first child lowers, and hands the request over once
that one has exited): ``hlo``, a file holding the serialized
HloModuleProto that :func:`~._fit_step.compile_step` wrote, ``topology``,
``program_to``, where to write the compiled program (two files: that path
with ``.pb`` and ``.txt`` appended), and the parent's pid
(:mod:`._parent`). It prints one JSON line: the compile's plain fields
(:class:`~._client.SizedCompile` but its program), the program's memory
statistics (None when the compiler refused the step for HBM), and
``host_rss_bytes``, this process's peak.
"""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import sys
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._client import SizedCompile


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


def main() -> int:
    parent = _alone("_parent")
    parent.exit_with_parent(None)  # killed with the process that started it, while it waits for the request too
    client = _alone("_client")
    client._jax()  # libtpu, before the request: ``fit`` starts this process while the step is being lowered
    request = json.loads(sys.stdin.read())
    parent.exit_with_parent(request.get(parent.PARENT_KEY))
    with open(request["hlo"], "rb") as f:
        hlo = f.read()
    answer = write_answer(client.compile_sized(hlo, client.topology_devices(request["topology"])),
                          request["program_to"])
    answer["host_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps(answer), flush=True)
    return 0


def write_answer(compiled: SizedCompile, program_to: str) -> dict:
    """``compiled`` handed back: its program in files at ``program_to``, the rest as the JSON-able dict returned."""
    program = compiled.program
    if program is not None:
        with open(program_to + ".pb", "wb") as f:
            f.write(program.optimized)
        with open(program_to + ".txt", "w") as f:
            f.write(program.optimized_text)
    return {"seconds": compiled.seconds, "hbm_buffer_bytes": compiled.hbm_buffer_bytes, "refusal": compiled.refusal,
            "memory": None if program is None else program.memory}


def read_answer(answer: dict, program_to: str) -> SizedCompile:
    """The :class:`~._client.SizedCompile` a child handed back (:func:`write_answer`): its JSON ``answer``, its
    files at ``program_to``."""
    client = _alone("_client")
    program = None
    if answer["memory"] is not None:
        with open(program_to + ".pb", "rb") as f:
            optimized = f.read()
        with open(program_to + ".txt") as f:
            text = f.read()
        program = client.CompiledProgram(answer["memory"], optimized, text)
    return client.SizedCompile(program, answer["seconds"], answer["hbm_buffer_bytes"], answer["refusal"])


if __name__ == "__main__":
    sys.exit(main())
