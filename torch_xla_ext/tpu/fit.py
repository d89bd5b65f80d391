"""Does a transformers model's training step fit a TPU slice? Lowered from shapes, compiled for the slice, here.

``fit(config, "v5p:4x4x4", batch=64, seq=2048)`` builds the model of
``config`` (a transformers config) with no weights, prepares it as a real
job would (:func:`torch_xla_ext.hf.prepare`: every decoder layer and the
model fully sharded over a 1-D ``fsdp`` mesh of the slice's chips, the layers
scanned or looped), lowers one whole training step over it (forward with
``labels``, backward, ``torch.optim.AdamW``'s update) and compiles that step
for the slice with libtpu's compile-only client (:func:`torch_xla_ext.tpu.compile`).

Parameters and AdamW's moments are fp32 whatever the config's ``torch_dtype``
says (``+bf16`` paths compute in bf16 over them, as FSDP2's mixed precision
does). From shapes: every parameter, every AdamW moment and the batch are torch_xla
placeholders (``torch_xla.core.xla_builder.create_placeholder_tensor``: an
XLA tensor over a data handle with no buffer, 0 bytes however large), so an
8B or 70B model lowers in a few GB of host memory. The mesh is virtual: as
many PJRT CPU devices as the slice has chips (``CPU_NUM_DEVICES``; a CPU
device costs about 3 MB of host memory), or for 128 chips and more a divisor
below 128 with the program's shardings widened to every chip
(:func:`lowering_devices`, :mod:`torch_xla_ext.tpu._widen`). Each path is lowered in a child process
of its own: the device count is fixed when torch_xla starts, and a program
over placeholders must never be executed (torch_xla 2.9 crashes on it). A
second child compiles the program the first wrote, once the first has exited,
before it imports torch (:mod:`torch_xla_ext.tpu._compile_child`): the TPU
compiler's own host memory, most of a sizing's, is not added to torch's.

The step is the steady one: the moments exist (as placeholders sharded like
their parameters), and every parameter and moment the step updates reuses
its buffer (donated, as torch_xla's ``sync`` does). What the figures are:
the TPU compiler's memory statistics of that program, per chip. What they
are not: no step time (nothing runs), no host memory of the real job, no
data loading, no KV cache (``prepare`` turns it off for training).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from ._fit_request import (ATTENTIONS, DEFAULT_PATHS, PATHS, PHASE_MARK, PHASES_ENV, FitReport, Path,
                           load_config, lowering_devices, parse_path, split_hbm)
from ._fit_step import compile_step
from ._parent import PARENT_KEY

__all__ = ["FitReport", "Path", "PATHS", "DEFAULT_PATHS", "ATTENTIONS", "fit", "compile_step", "load_config",
           "parse_path", "lowering_devices", "split_hbm"]


#: The second child of each path, run by its path: ``-m`` would import the package, and so torch, first.
_COMPILE_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_compile_child.py")

#: ``progress(path, phase, seconds)``: the path being sized, the phase its child is in ("starting", "building
#: the model", "lowering the step", "compiling for ...", then "done" or "failed"), seconds since it started.
Progress = Callable[[str, str, float], None]


def fit(config: Any, topology: str, *, batch: int, seq: int, paths: Sequence[str] = DEFAULT_PATHS,
        timeout: float = 1800.0, max_host_bytes: int | None = None,
        progress: Progress | None = None, attention: str | None = None) -> list[FitReport]:
    """Lower and compile one training step per path for ``topology``; a :class:`FitReport` each.

    ``batch`` sequences of ``seq`` tokens per step (the whole slice's batch,
    sharded over the chips). Every argument is checked before any child
    starts: an unknown path or topology, a config transformers cannot build,
    or a batch or sequence length below 1 raises ``ValueError``
    (``TpuUnavailable`` without ``.[tpu]``). A path is stopped, and its
    report has ``error`` set, when one of its two children (one lowers, then
    one compiles) fails or holds more than ``max_host_bytes`` of host memory
    (default: 3/4 of this machine's), or when the path runs past ``timeout``
    seconds; a step whose temporaries exceed HBM gives ``fits=False``
    with the compiler's message. ``progress`` is called about five times a
    second while a path runs (:data:`Progress`). ``attention``: the model's
    attention (``"sdpa"``, ``"eager"``; None: the config's own), or
    ``"flash"``: torch_xla's Pallas flash attention kernel, lowered for the
    TPU (causal attention over unpadded batches, as the step's are).
    """
    from ._client import topology_devices

    if not paths or isinstance(paths, str):
        raise ValueError(f"tpu_fit: paths must be a non-empty sequence of path names, got {paths!r}")
    for p in paths:
        parse_path(p)
    if attention is not None and attention not in ATTENTIONS:
        raise ValueError(f"tpu_fit: attention must be one of {', '.join(ATTENTIONS)} or None, got {attention!r}")
    for name, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"tpu_fit: {name} must be a positive int, got {value!r}")
    cfg = load_config(config)
    from transformers import AutoModelForCausalLM

    if type(cfg) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(f"tpu_fit: {type(cfg).__name__} ({cfg.model_type!r}) has no causal language model class "
                         f"in transformers; tpu-fit trains AutoModelForCausalLM models")
    chips = len(topology_devices(topology))
    if attention == "flash" and lowering_devices(chips) != chips:
        raise ValueError(f"tpu_fit: attention='flash' needs a slice of fewer than 128 chips, got {chips}: a larger "
                         f"one is lowered on {lowering_devices(chips)} devices and widened, and the kernel's manual "
                         f"sharding cannot be widened")
    limit = max_host_bytes if max_host_bytes is not None else _machine_bytes() * 3 // 4
    reports = []
    for path in paths:
        tick = (lambda phase, seconds, path=path: progress(path, phase, seconds)) if progress else None
        started = time.monotonic()
        reports.append(_fit_path(cfg, topology, chips, batch, seq, path, attention, timeout, limit, tick, started))
        if progress:
            progress(path, "failed" if reports[-1].error else "done", time.monotonic() - started)
    return reports


def _fit_path(cfg: Any, topology: str, chips: int, batch: int, seq: int, path: str, attention: str | None,
              timeout: float, limit: int, tick: Callable[[str, float], None] | None, started: float) -> FitReport:
    """One path: a child lowers the step and writes its program, then a second child compiles it (the
    lowering process has exited by then: :mod:`._compile_child`). ``timeout`` holds for both together,
    counted from ``started`` as ``tick``'s seconds are; ``limit`` for each."""
    devices = lowering_devices(chips)
    quiet = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    with tempfile.TemporaryDirectory(prefix="txe_fit_") as work:
        program = os.path.join(work, "step.hlo.pb")
        request = {"config": cfg.to_dict(), "topology": topology, "batch": batch, "seq": seq, "path": path,
                   "attention": attention, "hlo_to": program, PARENT_KEY: os.getpid()}
        env = {**quiet, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), PHASES_ENV: "1"}
        answer, error = _child([sys.executable, "-m", "torch_xla_ext.tpu._fit_step"], request, env,
                               started + timeout, limit, tick, started, "starting")
        if answer is None:
            return FitReport(path, topology, chips, batch, seq, None, 0, 0.0, 0, devices, error=error,
                             attention=attention)
        lowered = FitReport(**answer)
        answer, error = _child([sys.executable, "-P", _COMPILE_CHILD],
                               {"hlo": program, "topology": topology, PARENT_KEY: os.getpid()},
                               quiet, started + timeout, limit, tick, started, f"compiling for {topology}")
    if answer is None:
        return dataclasses.replace(lowered, error=error)
    return dataclasses.replace(lowered, compiled=answer["compiled"],
                               host_rss_bytes=max(lowered.host_rss_bytes, answer["host_rss_bytes"]))


def _child(command: list[str], request: dict, env: dict, deadline: float, limit: int,
           tick: Callable[[str, float], None] | None, started: float, phase: str) -> tuple[dict | None, str | None]:
    """Run one child to its JSON answer: (the answer, None) or (None, why it failed or was stopped)."""
    returncode, out, err, stopped = _run_child(command, json.dumps(request), env, deadline, limit, tick, started,
                                               phase)
    answer = _last_json_line(out)
    if stopped is None and returncode == 0 and answer is not None:
        return answer, None
    return None, stopped or "the step did not lower or compile: " + _failure(returncode, err)


def _failure(returncode: int, err: str) -> str:
    """Why a child that ended on its own gave no answer: the signal that killed it, and its last line of stderr."""
    lines = err.strip().splitlines()
    last = lines[-1][:300] if lines else None
    if returncode >= 0:
        return last or f"exit status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    if name == "SIGKILL":  # its stderr says nothing about it: whatever it printed last came before
        return ("killed by SIGKILL, as the kernel's out-of-memory killer does when the machine runs out of "
                "memory before the path's host-memory limit stops it")
    return f"killed by {name}" + (f": {last}" if last else "")


def _machine_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _run_child(command: list[str], request: str, env: dict, deadline: float, limit: int,
               tick: Callable[[str, float], None] | None, started: float,
               phase: str) -> tuple[int, str, str, str | None]:
    """Run one child until it exits, is past ``deadline`` (``time.monotonic()``) or holds more than ``limit``
    bytes: (exit status, stdout, stderr, why it was stopped or None). ``tick(phase, seconds since started)``
    at each poll, with the last phase the child printed (``phase`` until it prints one)."""
    with (tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err,
          open(f"/proc/self/fd/{out.fileno()}") as watch):  # its own file offset: the child writes at out's
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env, text=True)
        try:
            stopped = _watch(proc, request, watch, deadline, limit, tick, started, phase)
        finally:  # stopped, or an interrupt (a notebook's KeyboardInterrupt) or a raising tick: it must not go on
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), stopped


def _watch(proc: subprocess.Popen, request: str, watch: Any, deadline: float, limit: int,
           tick: Callable[[str, float], None] | None, started: float, phase: str) -> str | None:
    """Hand ``proc`` its request and poll it until it exits (None) or must be stopped (why; the caller kills it)."""
    try:
        proc.stdin.write(request)
        proc.stdin.close()
    except BrokenPipeError:  # it exited before reading: its exit status and stderr say why
        with contextlib.suppress(BrokenPipeError):  # closed all the same, its unsent buffer dropped
            proc.stdin.close()
    partial = ""
    while proc.poll() is None:
        if tick is not None:  # the phase lines the child wrote since the last poll, whole lines only
            lines = (partial + watch.read()).split("\n")
            partial = lines.pop()
            marks = [line for line in lines if line.startswith(PHASE_MARK)]
            if marks:
                phase = marks[-1][len(PHASE_MARK):].strip()
            tick(phase, time.monotonic() - started)
        if time.monotonic() > deadline:
            return f"stopped after {deadline - started:.0f} s"
        if _rss_bytes(proc.pid) > limit:
            return f"stopped at {limit / 2**30:.1f} GiB of host memory, {time.monotonic() - started:.0f} s in"
        time.sleep(0.2)
    return None


def _last_json_line(out: str) -> dict | None:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None
