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
(:func:`lowering_devices`, :mod:`torch_xla_ext.tpu._widen`). Each path runs in a child process
of its own: the device count is fixed when torch_xla starts, and a program
over placeholders must never be executed (torch_xla 2.9 crashes on it).

The step is the steady one: the moments exist (as placeholders sharded like
their parameters), and every parameter and moment the step updates reuses
its buffer (donated, as torch_xla's ``sync`` does). What the figures are:
the TPU compiler's memory statistics of that program, per chip. What they
are not: no step time (nothing runs), no host memory of the real job, no
data loading, no KV cache (``prepare`` turns it off for training).
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import resource
import subprocess
import sys
import time
import traceback
import warnings
from collections.abc import Sequence
from typing import Any

__all__ = ["FitReport", "PATHS", "DEFAULT_PATHS", "fit", "compile_step", "load_config", "parse_path", "lowering_devices"]

#: The paths ``fit`` knows: ``loop`` (the layers run one after another) or
#: ``scan`` (one ``scan_layers`` loop), a scan's remat policy after ``+``,
#: and ``+bf16`` for bf16 compute over fp32 parameters and optimizer state
#: (``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``).
PATHS = ("loop", "scan", "scan+nothing_saveable", "scan+dots_saveable", "loop+bf16", "scan+bf16",
         "scan+nothing_saveable+bf16", "scan+dots_saveable+bf16")
DEFAULT_PATHS = ("loop", "scan", "scan+nothing_saveable")
_REMAT = ("nothing_saveable", "dots_saveable")


@dataclasses.dataclass(frozen=True)
class FitReport:
    """One path's answer; byte counts are per chip (the TPU compiler's), ``host_rss_bytes`` this machine's."""

    path: str
    topology: str
    chips: int
    batch: int
    seq: int
    #: The TPU compiler's figures (``tpu.CompiledForTpu`` as a dict), or None when the step failed to lower.
    compiled: dict[str, Any] | None
    #: Peak resident memory of the child process that lowered and compiled the step.
    host_rss_bytes: int
    lower_seconds: float
    parameters: int
    #: Virtual devices the step was lowered on: the chips, or for 128 chips and more a divisor of them
    #: (the program is then annotated for every chip: :mod:`torch_xla_ext.tpu._widen`).
    lowered_on: int = 0
    error: str | None = None

    @property
    def fits(self) -> bool:
        return self.compiled is not None and bool(self.compiled["fits"])

    @property
    def required_bytes(self) -> int | None:
        """What the step needs per chip (``CompiledForTpu.required_bytes``; for a step the compiler refused
        for HBM, the bytes its message says it used), None when it did not compile."""
        c = self.compiled
        if c is None:
            return None
        if c["error"] is not None:
            return _exhausted_bytes(c["error"])
        from ._client import required_bytes  # torch-free, like this module's parent side

        return required_bytes(c["peak_bytes"], c["argument_bytes"], c["output_bytes"], c["alias_bytes"],
                              c["temp_bytes"], c["generated_code_bytes"])


def _exhausted_bytes(message: str) -> int | None:
    """The bytes the TPU compiler's RESOURCE_EXHAUSTED message says the program needs ("Used 223.23G of
    95.74G hbm", or "(16.00G) exceeds available HBM"; XLA's units are powers of 1024), or None."""
    import re

    found = (re.search(r"Used ([\d.]+)([KMGT]?)i?B? of ", message)
             or re.search(r"\(([\d.]+)([KMGT]?)i?B?\) exceeds available", message))
    if found is None:
        return None
    return int(float(found.group(1)) * 1024 ** " KMGT".index(found.group(2) or " "))


def parse_path(path: str) -> tuple[bool, str | None, bool]:
    """``(scan, remat policy name or None, bf16)`` of a path name; ValueError naming the known ones."""
    if not isinstance(path, str) or path not in PATHS:
        raise ValueError(f"tpu_fit: unknown path {path!r}; known: {', '.join(PATHS)}")
    parts = path.split("+")
    return parts[0] == "scan", next((p for p in parts if p in _REMAT), None), parts[-1] == "bf16"


def load_config(config: Any) -> Any:
    """A transformers config from a config (or its ``to_dict()``), a model type transformers ships (``"llama"``),
    a JSON file or a folder holding ``config.json``.

    The JSON file is a ``config.json`` as on the Hub: its ``model_type``
    picks the class, the other keys override that class's defaults.
    ValueError for an unknown model type or a file that is not such a JSON.
    """
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, PretrainedConfig):
        return config
    if isinstance(config, dict):  # a config's to_dict(): how fit() hands it to its children
        values = dict(config)
        return AutoConfig.for_model(values.pop("model_type"), **values)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(f"tpu_fit: config must be a transformers config, a model type or a JSON file, got "
                        f"{type(config).__name__}")
    text = os.fspath(config)
    if os.path.isdir(text):  # a downloaded model's folder
        text = os.path.join(text, "config.json")
    if text.endswith(".json") or os.path.sep in text:
        try:
            with open(text) as f:
                values = json.load(f)
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"tpu_fit: cannot read the config file {text!r}: {error}") from None
        if not isinstance(values, dict) or "model_type" not in values:
            raise ValueError(f"tpu_fit: {text!r} is not a transformers config.json (no model_type)")
        model_type = values.pop("model_type")
    else:
        model_type, values = text, {}
    try:
        return AutoConfig.for_model(model_type, **values)
    except ValueError as error:
        raise ValueError(f"tpu_fit: transformers ships no config for {model_type!r} ({error})") from None


def fit(config: Any, topology: str, *, batch: int, seq: int, paths: Sequence[str] = DEFAULT_PATHS,
        timeout: float = 1800.0, max_host_bytes: int | None = None) -> list[FitReport]:
    """Lower and compile one training step per path for ``topology``; a :class:`FitReport` each.

    ``batch`` sequences of ``seq`` tokens per step (the whole slice's batch,
    sharded over the chips). Every argument is checked before any child
    starts: an unknown path or topology, a config transformers cannot build,
    or a batch or sequence length below 1 raises ``ValueError``
    (``TpuUnavailable`` without ``.[tpu]``). A child that fails, runs past
    ``timeout`` seconds or holds more than ``max_host_bytes`` of host memory
    (default: 3/4 of this machine's) is stopped and gives a report with
    ``error`` set; a step whose temporaries exceed HBM gives ``fits=False``
    with the compiler's message.
    """
    from ._client import topology_devices

    if not paths or isinstance(paths, str):
        raise ValueError(f"tpu_fit: paths must be a non-empty sequence of path names, got {paths!r}")
    for p in paths:
        parse_path(p)
    for name, value in (("batch", batch), ("seq", seq)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"tpu_fit: {name} must be a positive int, got {value!r}")
    cfg = load_config(config)
    from transformers import AutoModelForCausalLM

    if type(cfg) not in AutoModelForCausalLM._model_mapping:
        raise ValueError(f"tpu_fit: {type(cfg).__name__} ({cfg.model_type!r}) has no causal language model class "
                         f"in transformers; tpu-fit trains AutoModelForCausalLM models")
    chips = len(topology_devices(topology))
    limit = max_host_bytes if max_host_bytes is not None else _machine_bytes() * 3 // 4
    reports = []
    for path in paths:
        request = {"config": cfg.to_dict(), "topology": topology, "batch": batch, "seq": seq, "path": path}
        env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": str(lowering_devices(chips)),
               "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
        returncode, out, err, stopped = _run_child(json.dumps(request), env, timeout, limit)
        answer = _last_json_line(out)
        if stopped is not None or returncode != 0 or answer is None:
            tail = stopped or "the step did not lower or compile: " + (
                err.strip().splitlines() or [f"exit status {returncode}"])[-1][:300]
            reports.append(FitReport(path, topology, chips, batch, seq, None, 0, 0.0, 0,
                                     lowering_devices(chips), error=tail))
            continue
        reports.append(FitReport(**answer))
    return reports


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


def _run_child(request: str, env: dict, timeout: float, limit: int) -> tuple[int, str, str, str | None]:
    """Run one path's child: (exit status, stdout, stderr, why it was stopped or None)."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", "torch_xla_ext.tpu.fit"], stdin=subprocess.PIPE,
                                stdout=out, stderr=err, env=env, text=True)
        proc.stdin.write(request)
        proc.stdin.close()
        stopped = None
        started = time.monotonic()
        while proc.poll() is None:
            if time.monotonic() - started > timeout:
                stopped = f"stopped after {timeout:.0f} s"
            elif _rss_bytes(proc.pid) > limit:
                stopped = (f"stopped at {limit / 2**30:.1f} GiB of host memory, "
                           f"{time.monotonic() - started:.0f} s in")
            if stopped is not None:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.2)
        out.seek(0)
        err.seek(0)
        return proc.returncode, out.read(), err.read(), stopped


def _last_json_line(out: str) -> dict | None:
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                return None
    return None


def compile_step(config: Any, topology: str, *, batch: int, seq: int, path: str,
                 from_shapes: bool = True) -> FitReport:
    """This process's part of :func:`fit`: needs torch_xla started with ``lowering_devices(chips)`` devices.

    ``from_shapes=False`` builds the same step from real tensors instead
    (random weights and tokens, one step executed first so the moments
    exist): what the test compares the shape-only program with, on a model
    small enough to hold.

    The shape-only step's pending graph reads placeholders, and a sync that
    executed it would crash the process; it goes with the model, whose
    reference cycles are collected before this returns or raises, so the
    process may go on to execute other work.
    """
    try:
        return _compile_step(config, topology, batch=batch, seq=seq, path=path, from_shapes=from_shapes)
    except BaseException as error:
        if from_shapes:  # the error's traceback would keep the failed step's locals, and its graph, alive
            traceback.clear_frames(error.__traceback__)
        raise
    finally:
        if from_shapes:
            gc.collect()


def _compile_step(config: Any, topology: str, *, batch: int, seq: int, path: str, from_shapes: bool) -> FitReport:
    import numpy as np
    import torch
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from .. import remat as remat_policies
    from .. import tpu
    from .._annotate import mark_sharding
    from .._placeholders import before_step, placeholder, replace_parameters
    from ._client import topology_devices
    from ..distributed import MixedPrecisionPolicy
    from ..hf import prepare

    scan, remat, bf16 = parse_path(path)
    cfg = load_config(config)
    chips = len(topology_devices(topology))
    start = time.perf_counter()
    xr.use_spmd()
    devices = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(devices), (devices,), ("fsdp",))
    if from_shapes:
        with init_empty_weights():  # parameters on the meta device; buffers (rotary frequencies) real and small
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    count = sum(p.numel() for p in model.parameters())
    if from_shapes:
        replace_parameters(model.modules())
    prepare(model, mesh, scan=scan, remat=None if remat is None else getattr(remat_policies, remat),
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None)
    if devices != chips:
        _check_placements(model, devices, chips)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=False)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    if from_shapes:
        for p in params:  # the steady step's moments: sharded like their parameter
            moments = {}
            for name in ("exp_avg", "exp_avg_sq"):
                moments[name] = placeholder(p.shape, p.dtype)
                spec = _spec_of(p)
                if spec is not None:
                    mark_sharding(moments[name], mesh, spec)
            optimizer.state[p] = {"step": torch.tensor(1.0), **moments}
        tokens = placeholder((batch, seq), torch.int64)
        mark_sharding(tokens, mesh, ("fsdp", None))
    else:
        import torch_xla

        step(_sharded_tokens(cfg, batch, seq, mesh))
        torch_xla.sync(wait=True)
        tokens = _sharded_tokens(cfg, batch, seq, mesh)
    state = params + [m for s in optimizer.state.values() for k, m in s.items() if k != "step"]
    before = [before_step(t) for t in state]
    with tpu.lowering():
        loss = step(tokens)
    lowered = time.perf_counter() - start
    result = tpu._compile([loss], topology, list(zip(before, state)), widen=True)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return FitReport(path, topology, chips, batch, seq, dataclasses.asdict(result), rss, lowered, count, devices)


def lowering_devices(chips: int) -> int:
    """How many virtual devices a slice of ``chips`` is lowered on: all of them below 128, else the largest
    divisor below 128 (autograd's 8-bit device count: :mod:`torch_xla_ext.tpu._widen`)."""
    return chips if chips < 128 else max(d for d in range(1, 128) if chips % d == 0)


def _check_placements(model: Any, devices: int, chips: int) -> None:
    """Refuse a model fully_shard would place otherwise on ``chips`` than on the ``devices`` it was lowered on."""
    from .._contract import applied_spec, is_stacked
    from ..distributed._param import default_placement

    for name, p in model.named_parameters():
        spec = applied_spec(p)
        if spec is None:
            continue
        here = next((d for d, s in enumerate(spec) if s is not None), None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "stays replicated": the answer compared below
            holder_name, _, local = name.rpartition(".")
            there = default_placement(p, name, chips, None, stacked=is_stacked(model.get_submodule(holder_name), local))
        if here != there:
            raise ValueError(
                f"tpu_fit: {name} {tuple(p.shape)} is sharded on dim {here} over {devices} devices but would be "
                f"{'replicated' if there is None else f'sharded on dim {there}'} over {chips}; a slice of "
                f"{chips} chips is lowered on {devices} virtual devices (autograd counts at most 127), which "
                f"needs the same placement on both"
            )


def _sharded_tokens(cfg: Any, batch: int, seq: int, mesh: Any) -> Any:
    import torch
    import torch_xla

    from .._annotate import mark_sharding

    tokens = torch.randint(0, cfg.vocab_size, (batch, seq)).to(torch_xla.device())
    mark_sharding(tokens, mesh, ("fsdp", None))
    return tokens


def _spec_of(p: Any) -> tuple | None:
    """The partition spec fully_shard gave ``p`` (None: replicated)."""
    from .._contract import applied_spec

    spec = applied_spec(p)
    return None if spec is None or all(s is None for s in spec) else spec


def _main() -> int:
    """Child process: read a request (JSON) from stdin, print the report as one JSON line."""
    request = json.loads(sys.stdin.read())
    report = compile_step(request["config"], request["topology"], batch=request["batch"], seq=request["seq"],
                          path=request["path"], from_shapes=request.get("from_shapes", True))
    print(json.dumps(dataclasses.asdict(report)))
    sys.stdout.flush()
    os._exit(0)  # placeholders are still alive: nothing may sync them at exit


if __name__ == "__main__":
    sys.exit(_main())
