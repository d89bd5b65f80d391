"""Running a script in a child process that must survive: for cases that used to kill the process.

``SPMD_CHILD`` is the preamble such scripts start with: 8 virtual CPU devices
under SPMD, an ``fsdp`` mesh over them, ``dev`` the XLA device.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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


def run_surviving(tmp_path: Path, source: str, *args: str, timeout: int = 600) -> str:
    """Run ``source`` as a script in a child process; assert it exited cleanly and return its stdout."""
    script = tmp_path / "child.py"
    script.write_text(source)
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"}
    proc = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"child exited with {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-3000:]}"
    return proc.stdout
