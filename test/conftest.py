"""Test session setup: an 8-device PJRT CPU client in SPMD mode, and no test left to chance.

The environment (devices, threads, the compilation cache's size) must be set
before torch_xla is imported, SPMD must be enabled before the first XLA
tensor exists, and one backward runs on the XLA device
before any test: torch 2.9 sizes autograd's per-device queues at the first
backward in the process, and after a CPU-only first backward every XLA
backward fails an internal assert (``device_ready_queues_``).

torchax is made unimportable for the session: torch_xla's ``xs.mark_sharding``
imports it wherever it is installed (the ``bench`` extra brings it), and the
import renames PyTorch's ``privateuse1`` backend for the whole process, which
breaks ``torch.distributed.checkpoint``'s default writer. No test uses it, and
the suite runs the same whether or not it is installed.

Every test starts from the same random state (torch, numpy and ``random`` are
seeded before each one), and hypothesis runs derandomized with no example
database: a test that passes once passes every time.
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
# Each program XLA:CPU compiles holds memory mappings of its code until torch_xla's compilation cache
# drops it (about 6 for a tiny program, more for a large one), and torch_xla keeps thousands. A worker that
# runs a few hundred tests reached the kernel's limit of mappings per process (vm.max_map_count, 65,530):
# LLVM then failed with "Cannot allocate memory" and the next run of the half-built program segfaulted.
# A capped cache keeps them flat (300 distinct tiny programs: 1,161 with 64 cached, 2,570 uncapped; a
# full run with 128: workers at 24,443-28,386 mappings, against 60,899 uncapped).
os.environ.setdefault("XLA_COMPILATION_CACHE_SIZE", "128")

from torch_xla_ext._cpu_threads import widen_cpu_client_threads  # noqa: E402

widen_cpu_client_threads()  # the package was imported (as a pytest plugin) before the line above

import random  # noqa: E402
import sys  # noqa: E402

sys.modules["torchax"] = None  # an import of it raises ImportError; torch_xla then goes without it

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()
_probe = torch.ones(2).to(torch_xla.device()).requires_grad_()
torch.autograd.grad(_probe.sum(), [_probe])
del _probe

pytest_plugins = ["pytester"]

settings.register_profile("torch_xla_ext", derandomize=True, database=None, deadline=None)
settings.load_profile("torch_xla_ext")


# The files that took longest in one two-worker run (2026-11-27), run first: pytest-xdist's --dist loadfile
# hands files out in collection order, and a heavy file handed out last keeps one worker busy while the
# other has nothing left. Replaying that run's per-file times: 1,165 s against 1,091 s in file-name order,
# 1,128 s each heaviest first (the wall-clock gain was within this host's noise).
_HEAVIEST_FILES = ("test_hf.py", "test_hf_trainer.py", "test_hf_sft.py", "test_readme.py", "test_tpu_fit.py",
                   "test_fsdp_compile.py", "test_hf_interleaved.py", "test_hf_trainer_buckets.py",
                   "test_hf_trainer_bf16.py", "test_scan_refusals.py", "test_hf_trainer_run.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Order the heaviest files first; every file's tests keep their order, the rest their files' order."""
    rank = {name: i for i, name in enumerate(_HEAVIEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Seed every source of randomness a test may draw from, before each test."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch_xla.device()


@pytest.fixture(scope="session")
def num_devices() -> int:
    n = xr.global_runtime_device_count()
    assert n == 8, f"the suite expects 8 virtual CPU devices, got {n}"
    return n


@pytest.fixture(scope="session")
def mesh_4x2(num_devices):
    """The 8 devices as a 4 x 2 mesh, axes ``x`` and ``y``."""
    import torch_xla.distributed.spmd as xs

    return xs.Mesh(np.arange(num_devices), (4, 2), ("x", "y"))


@pytest.fixture(scope="session")
def mesh(num_devices):
    """The 8 devices on one ``fsdp`` axis: the mesh of every fully sharded test."""
    import torch_xla.distributed.spmd as xs

    return xs.Mesh(np.arange(num_devices), (num_devices,), ("fsdp",))
