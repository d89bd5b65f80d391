"""Running a child process that must survive: for cases that used to kill the process, for a fresh process
(nothing imported yet, XLA's flags read at start-up), for the command line. Every test's child starts here.

``SPMD_CHILD`` is the preamble such scripts start with: 8 virtual CPU devices
under SPMD, an ``fsdp`` mesh over them, ``dev`` the XLA device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

#: The suite's folder: the helpers (this module, the model builders) live here, the tests in its subfolders by
#: feature. A child that imports helpers puts it on its path.
TEST_DIR = Path(__file__).resolve().parent

SPMD_CHILD = textwrap.dedent('''
    import gc, os, sys
    os.environ.setdefault("PJRT_DEVICE", "CPU"); os.environ.setdefault("CPU_NUM_DEVICES", "8")
    import numpy as np, torch, torch_xla, torch_xla.runtime as xr
    import torch_xla.distributed.spmd as xs
    xr.use_spmd()
    dev = torch_xla.device()
    mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
''')


def run_child(argv: Sequence[str], *, devices: int | None = 8, env: Mapping[str, str] | None = None,
              unset: Sequence[str] = (), timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``python argv...``; assert it exited cleanly (else show its output's tail) and return it.

    ``devices``: as many virtual PJRT CPU devices (None: leave ``PJRT_DEVICE`` and ``CPU_NUM_DEVICES`` as
    this process has them); ``env``: more variables (``XLA_FLAGS``, ...); ``unset``: variables the child
    must not see (applied last).
    """
    child_env = dict(os.environ)
    if devices is not None:
        child_env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    child_env.update(env or {})
    for name in unset:
        child_env.pop(name, None)
    proc = subprocess.run([sys.executable, *argv], env=child_env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"child exited with {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def run_surviving(tmp_path: Path, source: str, *args: str, timeout: int = 600,
                  env: Mapping[str, str] | None = None) -> str:
    """Run ``source`` as a script in a child process on 8 devices (:func:`run_child`); return its stdout."""
    script = tmp_path / "child.py"
    script.write_text(source)
    return run_child([str(script), *args], env=env, timeout=timeout).stdout
