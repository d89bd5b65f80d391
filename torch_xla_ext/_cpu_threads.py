"""Threads for XLA's CPU client: enough that virtual devices' collectives cannot all wait at once.

torch_xla 2.9's PJRT CPU client (``PJRT_DEVICE=CPU``, ``CPU_NUM_DEVICES=N``)
gives two pools ``max(cores, N)`` threads each: one runs each device's share of
a program, the other the work inside it (XLA's collectives and Eigen's
matrix products). On a machine with fewer cores than devices that is exactly
``N`` threads for ``N`` devices. A device waiting in a collective holds its
thread, and so, it appears, does a device waiting for the parts of a large
matrix product it handed to the pool; once every thread waits, nothing runs,
and after a fixed 10 seconds XLA aborts the process ("Termination timeout for
`all reduce` ... only 5 of them arrived on time"). No flag changes that limit.

Measured on 2 cores with 8 devices, 50 steps of a program that multiplies a
batch-sharded ``[1024, 512]`` by a ``[512, 512]`` and all-reduces its sum,
eight times (the test suite running beside it): the process aborted in 4 of
5 runs with 8 threads and in none of 5 with 16, no slower (8.3-10.0 s a run;
9.1 s for the one run with 8 threads that finished).

XLA reads the pools' size from ``PJRT_NPROC`` when the client is created (the
first time torch_xla touches a device), so this must run before that.
:func:`widen_cpu_client_threads` runs when ``torch_xla_ext`` is imported and
wherever the package itself sets ``CPU_NUM_DEVICES``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

__all__ = ["widen_cpu_client_threads"]


def _cores() -> int:
    """What XLA counts as the machine's parallelism: the CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def widen_cpu_client_threads(environ: MutableMapping[str, str] | None = None) -> int | None:
    """Set ``PJRT_NPROC`` to twice the CPU client's devices where XLA would give it one thread per device.

    Only for the CPU client (``PJRT_DEVICE`` unset or ``CPU``) with more than
    one device, and only where the machine has fewer than twice as many cores
    as devices; never where ``PJRT_NPROC`` or ``NPROC`` is already set (a
    user's choice, or an earlier call). Returns the value set, or None.
    A client created before this runs keeps its threads.
    """
    env = os.environ if environ is None else environ
    if env.get("PJRT_DEVICE", "CPU").upper() != "CPU" or "PJRT_NPROC" in env or "NPROC" in env:
        return None
    try:
        devices = int(env.get("CPU_NUM_DEVICES", "1"))
    except ValueError:
        return None  # torch_xla reports a malformed device count itself
    threads = 2 * devices
    if devices < 2 or _cores() >= threads:
        return None
    env["PJRT_NPROC"] = str(threads)
    return threads
