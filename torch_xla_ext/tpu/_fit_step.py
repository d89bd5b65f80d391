"""One path of ``tpu_fit``, in its own child process: the training step lowered from shapes (and compiled for a slice).

The child reads a request (JSON, :mod:`._fit_request`) on stdin and prints
its :class:`~._fit_request.FitReport` as one JSON line; given ``hlo_to``, it
writes the lowered program there and leaves compiling it to a second child
(:mod:`._compile_child`). torch_xla starts here with as many virtual
devices as the parent chose (:func:`~._fit_request.lowering_devices`); a
program over placeholders must never be executed, so the child leaves with
``os._exit``.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib
import json
import os
import resource
import sys
import time
import traceback
import warnings
from typing import Any

from ._fit_request import PHASE_MARK, PHASES_ENV, FitReport, Path, load_config, parse_path
from ._parent import PARENT_KEY, exit_with_parent

__all__ = ["compile_step"]


def compile_step(config: Any, topology: str, *, batch: int, seq: int, path: str,
                 from_shapes: bool = True, attention: str | None = None, hlo_to: str | None = None) -> FitReport:
    """This process's part of :func:`fit`: needs torch_xla started with ``lowering_devices(chips)`` devices.

    ``from_shapes=False`` builds the same step from real tensors instead
    (random weights and tokens, one step executed first so the moments
    exist): what the test compares the shape-only program with, on a model
    small enough to hold.

    ``attention``: the model's attention implementation (``"eager"``,
    ``"sdpa"``; None: the config's own), or ``"flash"``: torch_xla's Pallas
    flash attention lowered for the TPU (:mod:`._flash`), shape-only.

    ``hlo_to``: a file to write the lowered program to (a serialized
    HloModuleProto, ready for the TPU compiler) instead of compiling it; the
    report's ``compiled`` is then None. ``fit`` compiles it in a second
    process (:mod:`._compile_child`), so that the compiler's peak of host
    memory does not sit on top of torch_xla's.

    The shape-only step's pending graph reads placeholders, and a sync that
    executed it would crash the process; it goes with the model, whose
    reference cycles are collected before this returns or raises, so the
    process may go on to execute other work.
    """
    try:
        return _compile_step(config, topology, batch=batch, seq=seq, path=path, from_shapes=from_shapes,
                             attention=attention, hlo_to=hlo_to)
    except BaseException as error:
        if from_shapes:  # the error's traceback would keep the failed step's locals, and its graph, alive
            traceback.clear_frames(error.__traceback__)
        raise
    finally:
        if from_shapes:
            gc.collect()


def _compile_step(config: Any, topology: str, *, batch: int, seq: int, path: str, from_shapes: bool,
                  attention: str | None, hlo_to: str | None) -> FitReport:
    """The phases, in order: mesh, model, prepared model, steady optimizer, batch, lowered step, compiled step."""
    from .. import tpu
    from ._client import topology_devices

    options = parse_path(path)
    cfg = load_config(config)
    chips = len(topology_devices(topology))
    start = time.perf_counter()
    _phase("building the model")
    mesh, devices = _mesh()
    implementation, lowering = _attention(attention, mesh, from_shapes)
    built_with = None if attention == "flash" else attention  # prepare takes sdpa or eager
    with lowering:
        model, count = _model(cfg, from_shapes, built_with)
        _prepare(model, mesh, options)
        if implementation != built_with:  # the layers read the name at each call
            model.set_attn_implementation(implementation)
        if devices != chips:
            _check_placements(model, devices, chips)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = _steady_optimizer(params, mesh, from_shapes)
        step = _training_step(model, optimizer)
        _phase("lowering the step")
        tokens = _batch(cfg, batch, seq, mesh, from_shapes, step)
        loss, donated = _lowered(step, tokens, params, optimizer)
    hlo = tpu._lower([loss], topology, donated, widen=True)
    lowered = time.perf_counter() - start
    if hlo_to is not None:
        with open(hlo_to, "wb") as f:
            f.write(hlo)
        compiled = None
    else:
        _phase(f"compiling for {topology}")
        compiled = dataclasses.asdict(tpu._compile_lowered(hlo, topology))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return FitReport(path, topology, chips, batch, seq, compiled, rss, lowered, count, devices, attention=attention)


def _attention(attention: str | None, mesh: Any, from_shapes: bool) -> tuple[str | None, Any]:
    """The attention implementation to build the model with, and the block to build and lower it in."""
    import contextlib

    if attention != "flash":
        return attention, contextlib.nullcontext()
    if not from_shapes:
        raise ValueError("tpu_fit: attention='flash' is shape-only (its TPU kernels cannot run here)")
    from ._flash import ATTENTION_NAME, flash_lowered_for_tpu

    return ATTENTION_NAME, flash_lowered_for_tpu(mesh, "fsdp")


def _phase(name: str) -> None:
    """Tell the parent (``fit``, which sets :data:`PHASES_ENV`) which phase starts: one line on stdout."""
    if os.environ.get(PHASES_ENV) == "1":
        print(f"{PHASE_MARK} {name}", flush=True)


def _mesh() -> tuple[Any, int]:
    """A 1-D ``fsdp`` mesh over every device this process started with, and their count."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    xr.use_spmd()
    devices = xr.global_runtime_device_count()
    return xs.Mesh(np.arange(devices), (devices,), ("fsdp",)), devices


def _model(cfg: Any, from_shapes: bool, attention: str | None) -> tuple[Any, int]:
    """The causal LM of ``cfg`` in fp32 with ``attention`` (None: the config's) and its parameter count; from
    shapes, its parameters are placeholders."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    from .._placeholders import replace_parameters

    chosen = {} if attention is None else {"attn_implementation": attention}
    if from_shapes:
        with init_empty_weights():  # parameters on the meta device; buffers (rotary frequencies) real and small
            model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **chosen)
    else:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, **chosen)
    count = sum(p.numel() for p in model.parameters())
    if from_shapes:
        replace_parameters(model.modules())
    return model, count


def _prepare(model: Any, mesh: Any, path: Path) -> None:
    """``hf.prepare`` as the path names it: scanned or looped, its remat policy, bf16 compute, stacked storage."""
    import torch

    from .. import remat as remat_policies
    from ..distributed import MixedPrecisionPolicy
    from ..hf import prepare

    prepare(model, mesh, scan=path.scan, remat=None if path.remat is None else getattr(remat_policies, path.remat),
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16) if path.bf16 else None, stacked=path.stacked)


def _steady_optimizer(params: list, mesh: Any, from_shapes: bool) -> Any:
    """AdamW over ``params``; from shapes, with the steady step's moments as placeholders sharded like each
    parameter (from real tensors, the first executed step makes them: :func:`_batch`)."""
    import torch

    from .._annotate import mark_sharding
    from .._placeholders import placeholder

    optimizer = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    if from_shapes:
        for p in params:
            moments = {}
            for name in ("exp_avg", "exp_avg_sq"):
                moments[name] = placeholder(p.shape, p.dtype)
                spec = _spec_of(p)
                if spec is not None:
                    mark_sharding(moments[name], mesh, spec)
            optimizer.state[p] = {"step": torch.tensor(1.0), **moments}
    return optimizer


def _training_step(model: Any, optimizer: Any) -> Any:
    """One step: forward with labels, backward, the optimizer's update; returns the loss."""
    def step(tokens: Any) -> Any:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def _batch(cfg: Any, batch: int, seq: int, mesh: Any, from_shapes: bool, step: Any) -> Any:
    """The step's tokens, sharded on the batch; from real tensors, after one executed step (the moments)."""
    import torch

    from .._annotate import mark_sharding
    from .._placeholders import placeholder

    if from_shapes:
        tokens = placeholder((batch, seq), torch.int64)
        mark_sharding(tokens, mesh, ("fsdp", None))
        return tokens
    import torch_xla

    step(_sharded_tokens(cfg, batch, seq, mesh))
    torch_xla.sync(wait=True)
    return _sharded_tokens(cfg, batch, seq, mesh)


def _lowered(step: Any, tokens: Any, params: list, optimizer: Any) -> tuple[Any, list]:
    """The step's loss, pending, lowered as on a TPU; and each updated tensor paired with its old buffer."""
    from .. import tpu
    from .._placeholders import before_step

    state = params + [m for s in optimizer.state.values() for k, m in s.items() if k != "step"]
    before = [before_step(t) for t in state]
    with tpu.lowering():
        loss = step(tokens)
    return loss, list(zip(before, state))


def _check_placements(model: Any, devices: int, chips: int) -> None:
    """Refuse a model fully_shard would place otherwise on ``chips`` than on the ``devices`` it was lowered on."""
    from .._contract import applied_spec, is_stacked
    from ..distributed._param import default_placement
    from ..hf._prepare import embeddings_on_hidden

    rule = embeddings_on_hidden(model, chips)  # prepare's placement, for the slice's chips
    for name, p in model.named_parameters():
        spec = applied_spec(p)
        if spec is None:
            continue
        here = next((d for d, s in enumerate(spec) if s is not None), None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "stays replicated": the answer compared below
            holder_name, _, local = name.rpartition(".")
            there = default_placement(p, name, chips, rule, stacked=is_stacked(model.get_submodule(holder_name), local))
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


#: What lowering any step imports (the model's own module comes with its config), imported ahead of the request.
_AHEAD = ("accelerate", "torch_xla.distributed.spmd", "transformers.modeling_utils",
          "transformers.models.auto.modeling_auto", "torch_xla_ext.distributed", "torch_xla_ext.hf",
          "torch_xla_ext.remat")  # torch_xla_ext.tpu: imported already, as this module's package


def _import_ahead() -> None:
    """Import :data:`_AHEAD` and libtpu: ``fit`` starts this process before it has read the config, and hands
    the request over once it has (:class:`.fit._Child`)."""
    from ._client import _jax

    for name in _AHEAD:
        importlib.import_module(name)
    _jax()


def _main() -> int:
    """Child process: import, then read a request (JSON) from stdin, print the report as one JSON line."""
    exit_with_parent(None)  # killed with the process that started it, while it waits for the request too
    _import_ahead()
    request = json.loads(sys.stdin.read())
    exit_with_parent(request.get(PARENT_KEY))
    report = compile_step(request["config"], request["topology"], batch=request["batch"], seq=request["seq"],
                          path=request["path"], from_shapes=request.get("from_shapes", True),
                          attention=request.get("attention"), hlo_to=request.get("hlo_to"))
    print(json.dumps(dataclasses.asdict(report)))
    sys.stdout.flush()
    os._exit(0)  # placeholders are still alive: nothing may sync them at exit


if __name__ == "__main__":
    sys.exit(_main())
