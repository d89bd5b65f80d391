"""XLA's CPU client gets twice as many threads as virtual devices where it would get one per device."""

from __future__ import annotations

import textwrap

import pytest

from child_process import SPMD_CHILD, run_surviving
from torch_xla_ext import _cpu_threads
from torch_xla_ext._cpu_threads import widen_cpu_client_threads


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(_cpu_threads, "_cores", lambda: 2)


def test_eight_devices_on_two_cores_get_sixteen_threads(two_cores):
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"}
    assert widen_cpu_client_threads(env) == 16
    assert env["PJRT_NPROC"] == "16"
    assert widen_cpu_client_threads(env) is None and env["PJRT_NPROC"] == "16"  # a second call changes nothing
    env = {"CPU_NUM_DEVICES": "4"}  # PJRT_DEVICE unset: torch_xla's CPU client is still the one configured
    assert widen_cpu_client_threads(env) == 8 and env["PJRT_NPROC"] == "8"


@pytest.mark.parametrize("env", [
    {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "PJRT_NPROC": "3"},  # the user's choice stands
    {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "NPROC": "3"},       # XLA reads this one too
    {"PJRT_DEVICE": "TPU", "CPU_NUM_DEVICES": "8"},                     # not the CPU client
    {"PJRT_DEVICE": "CPU"},                                             # one device: no collectives
    {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "eight"},                 # torch_xla reports this itself
])
def test_other_settings_are_left_alone(two_cores, env):
    before = dict(env)
    assert widen_cpu_client_threads(env) is None
    assert env == before


def test_a_machine_with_enough_cores_keeps_xlas_own_count(monkeypatch):
    monkeypatch.setattr(_cpu_threads, "_cores", lambda: 16)
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"}
    assert widen_cpu_client_threads(env) is None and "PJRT_NPROC" not in env


def test_sharded_matmuls_between_all_reduces_run_after_importing_the_package(tmp_path):
    # The program that aborted this 2-core machine's process in 4 of 5 runs with XLA's 8 threads (each device
    # multiplies its [128, 512] rows by a [512, 512], then all devices add up a sum, eight times a step): the
    # package's import sets the threads before the client exists, and the child finishes.
    source = textwrap.dedent("""
        import os
        os.environ.pop("PJRT_NPROC", None)  # inherited from this suite's process: the import below must set it
        import torch_xla_ext
        from torch_xla_ext._cpu_threads import _cores
    """) + SPMD_CHILD + textwrap.dedent("""
        import torch_xla.core.xla_model as xm
        torch.manual_seed(0)
        h = torch.randn(8 * 128, 512).to(dev)
        xs.mark_sharding(h, mesh, ("fsdp", None))
        w = (torch.randn(512, 512) / 512 ** 0.5).to(dev)
        for step in range(30):
            for _ in range(8):
                h = torch.tanh(h @ w)
                h = h + h.sum() * 1e-9
            torch_xla.sync()
        xm.wait_device_ops()
        print(os.environ.get("PJRT_NPROC"), _cores(), torch.isfinite(h.cpu()).all().item())
    """)
    threads, cores, finite = run_surviving(tmp_path, source).split()
    assert threads == ("16" if int(cores) < 16 else "None")
    assert finite == "True"
