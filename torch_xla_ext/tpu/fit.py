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
second child, which never imports torch, compiles the program the first
wrote, once the first has exited, and hands back the compiled program for
this process to describe (:mod:`torch_xla_ext.tpu._compile_child`): the TPU
compiler's own host memory, most of a sizing's, is not added to torch's.
Each child is started before its work is known and imports meanwhile (the
first while this process reads the config, the second, libtpu only, while
the first lowers): the imports are seconds of a sizing that need not wait.

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

from . import _described
from ._compile_child import read_answer
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
    sharded over the chips). Every argument is checked before any child is
    handed work: an unknown path or topology, a config transformers cannot
    build, or a batch or sequence length below 1 raises ``ValueError``
    (``TpuUnavailable`` without ``.[tpu]``). The config is read while the
    first path's child imports torch_xla and transformers; a config refused
    kills that child, which has done nothing else. A path is stopped, and its
    report has ``error`` set, when one of its two children (one lowers, then
    one compiles) fails or holds more than ``max_host_bytes`` of host memory
    (default: 3/4 of this machine's), or when the path runs past ``timeout``
    seconds; a step whose temporaries exceed HBM gives ``fits=False``
    with the compiler's message. ``progress`` is called about five times a
    second while a path runs, with every phase it enters however short
    (:data:`Progress`). ``attention``: the model's
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
    chips = len(topology_devices(topology))
    devices = lowering_devices(chips)
    if attention == "flash" and devices != chips:
        raise ValueError(f"tpu_fit: attention='flash' needs a slice of fewer than 128 chips, got {chips}: a larger "
                         f"one is lowered on {devices} devices and widened, and the kernel's manual "
                         f"sharding cannot be widened")
    limit = max_host_bytes if max_host_bytes is not None else _machine_bytes() * 3 // 4
    reports = []
    lowering = _lowering_child(devices)  # it imports torch_xla and transformers while this process reads the config
    with lowering:
        if progress:
            progress(paths[0], "starting", 0.0)
        cfg = load_config(config)
        from transformers import AutoModelForCausalLM

        if type(cfg) not in AutoModelForCausalLM._model_mapping:
            raise ValueError(f"tpu_fit: {type(cfg).__name__} ({cfg.model_type!r}) has no causal language model "
                             f"class in transformers; tpu-fit trains AutoModelForCausalLM models")
        for index, path in enumerate(paths):
            tick = (lambda phase, seconds, path=path: progress(path, phase, seconds)) if progress else None
            if index:
                lowering = _lowering_child(devices)
            reports.append(_fit_path(cfg, topology, chips, devices, batch, seq, path, attention, timeout, limit,
                                     tick, lowering))
            if progress:
                progress(path, "failed" if reports[-1].error else "done", time.monotonic() - lowering.started)
    return reports


def _quiet_env() -> dict[str, str]:
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}


def _lowering_child(devices: int) -> _Child:
    """A path's first child, started at once: it imports while the request is not known yet (:mod:`._fit_step`)."""
    env = {**_quiet_env(), "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(devices), PHASES_ENV: "1"}
    return _Child([sys.executable, "-m", "torch_xla_ext.tpu._fit_step"], env)


def _fit_path(cfg: Any, topology: str, chips: int, devices: int, batch: int, seq: int, path: str,
              attention: str | None, timeout: float, limit: int, tick: Callable[[str, float], None] | None,
              lowering: _Child) -> FitReport:
    """One path: ``lowering`` (started, importing) lowers the step and writes its program, then a second child
    compiles it, started now to import libtpu while the first lowers; it is handed the program once the first
    has exited, and hands back the compiled program, which this process describes (:mod:`._compile_child`).
    ``timeout`` holds for both together, counted from when ``lowering`` started, as ``tick``'s seconds are;
    ``limit`` for each."""
    started = lowering.started
    with (lowering, _Child([sys.executable, "-P", _COMPILE_CHILD], _quiet_env()) as compiling,
          tempfile.TemporaryDirectory(prefix="txe_fit_") as work):
        program = os.path.join(work, "step.hlo.pb")
        request = {"config": cfg.to_dict(), "topology": topology, "batch": batch, "seq": seq, "path": path,
                   "attention": attention, "hlo_to": program, PARENT_KEY: os.getpid()}
        answer, error = lowering.answer(request, started + timeout, limit, tick, started, "starting")
        if answer is None:
            return FitReport(path, topology, chips, batch, seq, None, 0, 0.0, 0, devices, error=error,
                             attention=attention)
        lowered = FitReport(**answer)
        compiled_to = os.path.join(work, "compiled")
        answer, error = compiling.answer({"hlo": program, "topology": topology, "program_to": compiled_to,
                                          PARENT_KEY: os.getpid()},
                                         started + timeout, limit, tick, started, f"compiling for {topology}")
        if answer is None:
            return dataclasses.replace(lowered, error=error)
        try:
            with open(program, "rb") as f:
                described = _described(read_answer(answer, compiled_to), f.read(), topology)
        except Exception as error:  # noqa: BLE001 - this path's report says why; the other paths go on
            return dataclasses.replace(lowered, error=f"the compiled step could not be read: "
                                                      f"{type(error).__name__}: {error}"[:400])
    return dataclasses.replace(lowered, compiled=dataclasses.asdict(described),
                               host_rss_bytes=max(lowered.host_rss_bytes, answer["host_rss_bytes"]))


class _Child:
    """A child process started before its request is known, so that it imports while this process goes on.

    It reads its request (JSON) from stdin to the end, so it waits, having
    imported what it needs, until :meth:`answer` hands it over; then it is
    watched to its answer, one JSON line on stdout. Leaving the ``with``
    block kills it if it still runs: a request never sent (this process
    raised, was interrupted, or the path failed before it) leaves no child.
    """

    def __init__(self, command: list[str], env: dict) -> None:
        self.started = time.monotonic()
        with contextlib.ExitStack() as files:
            self._out = files.enter_context(tempfile.TemporaryFile("w+"))
            self._err = files.enter_context(tempfile.TemporaryFile("w+"))
            # The phase lines it prints, read through a file offset of their own: the child writes at out's.
            self._watch = files.enter_context(open(f"/proc/self/fd/{self._out.fileno()}"))
            self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=self._out, stderr=self._err,
                                         env=env, text=True)
            self._files = files.pop_all()

    def __enter__(self) -> _Child:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill it if it still runs, and let go of its output."""
        self._kill()
        with contextlib.suppress(OSError):  # never written to: a child that died first closed its end
            self.proc.stdin.close()
        self._files.close()

    def _kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def answer(self, request: dict, deadline: float, limit: int, tick: Callable[[str, float], None] | None,
               started: float, phase: str) -> tuple[dict | None, str | None]:
        """Hand it ``request`` and watch it to its JSON answer: (the answer, None) or (None, why it failed or was
        stopped). Stopped past ``deadline`` (``time.monotonic()``) or above ``limit`` bytes of host memory;
        ``tick(phase, seconds since started)`` at each poll, once for each phase the child printed since the
        last (``phase`` until it prints one)."""
        try:
            stopped = _watch(self.proc, json.dumps(request), self._watch, deadline, limit, tick, started, phase)
        finally:  # stopped, or an interrupt (a notebook's KeyboardInterrupt) or a raising tick: it must not go on
            self._kill()
        self._out.seek(0)
        self._err.seek(0)
        out, err = self._out.read(), self._err.read()
        answer = _last_json_line(out)
        if stopped is None and self.proc.returncode == 0 and answer is not None:
            return answer, None
        return None, stopped or "the step did not lower or compile: " + _failure(self.proc.returncode, err)


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
            entered = [line[len(PHASE_MARK):].strip() for line in lines if line.startswith(PHASE_MARK)]
            seconds = time.monotonic() - started
            for phase in entered or [phase]:  # each phase it entered, however short, in order
                tick(phase, seconds)
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
