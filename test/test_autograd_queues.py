"""The platform note on autograd's device queues (docs/design.md): its advice holds, and is needed.

torch 2.9 sizes autograd's per-device queues once, at the first backward of the process, from the device
counts the runtimes report then. Under SPMD, torch_xla's runtime reports none until it is initialized, and
creating a tensor on the device does not initialize it: a CPU-only first backward then leaves every later XLA
backward failing an internal assert. Initializing the runtime first (``xr.global_runtime_device_count()``)
is the note's advice. Each case runs in its own child process (the queues are sized once per process).
"""

from __future__ import annotations

import textwrap

import pytest

from child_process import run_surviving

_CASE = textwrap.dedent('''
    import os, sys
    os.environ.setdefault("PJRT_DEVICE", "CPU"); os.environ.setdefault("CPU_NUM_DEVICES", "8")
    import torch, torch_xla, torch_xla.runtime as xr
    xr.use_spmd()
    dev = torch_xla.device()
    if sys.argv[1] == "advice":
        xr.global_runtime_device_count()
    elif sys.argv[1] == "tensor":
        torch.zeros(1).to(dev)
    cpu = torch.ones(2, requires_grad=True)
    cpu.sum().backward()  # a CPU-only first backward
    x = torch.ones(2, device=dev, requires_grad=True)
    try:
        (x * 3).sum().backward()
        print("grad", x.grad.cpu().tolist())
    except RuntimeError as error:
        print("failed", "device_ready_queues_" in str(error))
''')


@pytest.mark.parametrize("start, expected", [("advice", "grad [3.0, 3.0]"), ("tensor", "failed True"),
                                             ("nothing", "failed True")])
def test_initializing_the_runtime_before_a_cpu_only_first_backward_keeps_xla_backwards_working(
        tmp_path, start, expected):
    assert run_surviving(tmp_path, _CASE, start).strip().splitlines()[-1] == expected
