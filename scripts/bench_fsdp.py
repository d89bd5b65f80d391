#!/usr/bin/env python
"""Benchmark: our ``fully_shard`` vs torch_xla's FSDPv2 on a small tied decoder or Hugging Face Llama.

One process, 8 virtual CPU devices, SPMD. For each number of layers L the
same model is trained from the same initial weights (deep copies of one CPU
model) on the same batches (sharded over 'fsdp') four ways. The model is
``--model decoder`` (token embedding tied to the LM head, L pre-norm attention
+ MLP blocks, final LayerNorm; ``torch_xla_ext.testing.models``) or ``--model
llama`` (``transformers.LlamaForCausalLM`` of the same width: GQA, RMSNorm,
rotary embeddings, SwiGLU; sdpa attention with a 4-D causal mask built on the
device, ``torch_xla_ext.hf.causal_mask``):

  ours+scan  torch_xla_ext.distributed.fully_shard on every block, then on the
             root; the blocks run through torch_xla_ext.scan_layers (Llama:
             torch_xla_ext.hf.scan_decoder_layers)
  ours+loop  the same, the blocks run in a Python for-loop
  ours+keep  ours+loop with ``reshard_after_forward=False``: each block's
             weights are gathered once per step and kept for the backward; the
             default (``True``) runs each block on its sharded weights and the
             partitioner gathers them at every use, forward and backward
  ours+compile (only with --methods) ours+keep with its loss (model and
             cross-entropy) under ``torch.compile(backend="openxla")``, the
             backward seeded with a device-resident 1.0 made once (a lazy
             seed or a lazily computed loss gradient makes torch_xla's
             bridge sync the compiled backward's inputs and wait for the
             forward to run, inside the trace column)
  fsdpv2     torch_xla.experimental.spmd_fully_sharded_data_parallel
             .SpmdFullyShardedDataParallel around every block and the root,
             global mesh set with xs.set_global_mesh (the baseline of every
             ratio)

Each step is forward + backward + SGD (foreach=False) + ``torch_xla.sync()``
and waits for the devices. Per method and L it reports

  compile   delta of torch_xla's ``CompileTime`` metric over the first step,
            (n) = how many compilations that was
  first     wall time of the first step (trace + compile + run)
  step      steady step time: median of the steps after the first two. The
            steady steps of the methods are interleaved (step i of
            every method before step i+1 of any), so drift of a shared
            machine hits all of them alike
  trace     host time of a steady step until ``torch_xla.sync()`` (Python,
            autograd, lazy tracing); exec: its ``ExecuteReplicatedTime``;
            both also as ratios to FSDPv2's
  colls     with ``--hlo``: collectives in XLA's optimized step program
            (all-gather / all-reduce / all-to-all, read from XLA's dump with
            torch_xla_ext's HLO reader), the evidence for where exec time goes:
            on XLA:CPU each collective is a rendezvous of all device threads
  recomp    compilations after the first step (0 expected)
  bytes/dev per-device bytes of parameters + gradients, computed from each
            tensor's sharding string; "total/8" is what a perfect 8-way shard
            of the parameters whose shapes divide over 8 would hold
  hlo/dev   cross-check from the lowered HLO (torch_xla_ext.LoweringContext,
            the C++ reader's entry parameters): per-device bytes of the HLO
            parameters that are model parameters, vs the same from shardings
  d2h       bytes moved device->host by one training step
            (torch_xla_ext.testing.measure_transfers)

plus loss trajectories (read with ``.item()`` after each step, outside the
timed region), whether they agree across the methods, the target checks
(PASS/FAIL), and a PNG plot.

Usage::

    python scripts/bench_fsdp.py                    # L = 4 8 16 32, 12 steps
    python scripts/bench_fsdp.py --model llama --hlo
    python scripts/bench_fsdp.py --quick            # smoke run: tiny model, 3 steps
    python scripts/bench_fsdp.py --layers 4 --steps 6 --out bench_out/x.png
    python scripts/bench_fsdp.py --tpu v5e:2x4      # each step compiled for a TPU topology (tpu_bench.py)
"""

from __future__ import annotations

import argparse
import collections
import copy
import functools
import logging
import math
import os
import re
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

# The runtime reads these once, when torch_xla is imported.
os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "8"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Third-party noise the tables do not need: importing torchax (torch_xla's mark_sharding does where
# flax is installed) logs through absl that TensorFlow is missing, and FSDPv2's backward optimization
# barrier, a full backward hook, warns on every model whose inputs need no gradient and on a root whose
# output is a Hugging Face ModelOutput.
logging.getLogger("absl").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message="Full backward hook is firing")
warnings.filterwarnings("ignore", message="For backward hooks to be called")
import xla_memory  # noqa: E402

# XLA reads its dump flags when it starts: decide before importing torch_xla.
DUMP_DIR = xla_memory.enable("bench_out/xla_dump_fsdp") if "--hlo" in sys.argv else None

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()
torch.zeros(1, device=torch_xla.device())  # size autograd's device queues before any backward

import torch_xla_ext as txe  # noqa: E402
from torch_xla.experimental.spmd_fully_sharded_data_parallel import (  # noqa: E402
    SpmdFullyShardedDataParallel as FSDPv2,
)
from torch_xla_ext._xla import xlac  # noqa: E402
from torch_xla_ext.distributed import fully_shard, get_fully_sharded_modules  # noqa: E402
from torch_xla_ext.testing import measure_transfers  # noqa: E402
from torch_xla_ext.testing.models import CausalBlock, Decoder  # noqa: E402

NUM_DEVICES = 8
METHODS = ("ours+scan", "ours+loop", "ours+keep", "ours+compile", "fsdpv2")
DEFAULT_METHODS = ("ours+scan", "ours+loop", "ours+keep", "fsdpv2")
# The collectives --hlo counts, with the short names the table prints.
SHORT = {"all-gather": "AG", "all-reduce": "AR", "reduce-scatter": "RS", "all-to-all": "A2A",
         "collective-permute": "CP"}
BASELINE = "fsdpv2"
LR = 0.5
STEP_TARGET = 1.0  # ours' steady step, trace and execute times <= 1.0x FSDPv2's


# --------------------------------------------------------------------------- #
# The model.
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Config:
    """Sizes of the decoder and of a batch."""

    vocab: int = 256
    dim: int = 128
    heads: int = 4
    seq: int = 32
    batch: int = 16
    mlp: int = 4  # MLP hidden size = mlp * dim


def make_decoder(cfg: Config, layers: int) -> Decoder:
    """The benchmarked model on the host: CausalBlocks, a final LayerNorm, tied embedding init std dim**-0.5."""
    return Decoder(cfg.vocab, cfg.dim, layers, lambda: CausalBlock(cfg.dim, cfg.heads, cfg.mlp),
                   final_norm=True, embed_std=cfg.dim ** -0.5)


def make_llama(cfg: Config, layers: int) -> nn.Module:
    """Hugging Face ``LlamaForCausalLM`` of the same sizes (GQA with heads // 2 key-value heads), sdpa attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=cfg.dim, intermediate_size=cfg.mlp * cfg.dim, num_attention_heads=cfg.heads,
                         num_key_value_heads=max(1, cfg.heads // 2), num_hidden_layers=layers,
                         vocab_size=cfg.vocab, max_position_embeddings=cfg.seq, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def blocks_of(model: nn.Module) -> nn.ModuleList:
    return model.layers if isinstance(model, Decoder) else model.model.layers


def unique_params(model: nn.Module) -> list[nn.Parameter]:
    return list(model.parameters())  # nn.Module.parameters() yields a tied parameter once


# --------------------------------------------------------------------------- #
# The ways to shard it.
# --------------------------------------------------------------------------- #


def make_ours(cpu_model: nn.Module, mesh: xs.Mesh, mode: str, reshard_after_forward: bool = True,
              partition_fn: Callable | None = None, stacked: bool = False) -> nn.Module:
    """``mode`` "scan" or "loop"; ``partition_fn``: the scan's remat policy; ``stacked``: the blocks'
    parameters stored stacked (``txe.stack_layers``) before ``fully_shard``."""
    from torch_xla_ext.hf import scan_decoder_layers

    model = copy.deepcopy(cpu_model)
    if stacked:  # (model.to() would untie the embedding and the head: move the blocks only)
        txe.stack_layers(blocks_of(model).to(torch_xla.device()))
    for layer in blocks_of(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    if isinstance(model, Decoder):
        model.use_scan = mode == "scan"
        model.partition_fn = partition_fn
        assert model.head.weight is model.embed.weight, "fully_shard untied the embedding and the LM head"
    elif mode == "scan":
        scan_decoder_layers(model, partition_fn=partition_fn)
    assert len(get_fully_sharded_modules(model)) == len(blocks_of(model)) + 1
    if stacked:  # the stacked parameters as device data, as after a first step (not the stacking's program)
        torch_xla.sync()
    return model


def make_compiled(cpu_model: nn.Module, mesh: xs.Mesh) -> tuple[nn.Module, Callable[..., torch.Tensor]]:
    """ours+loop kept gathered (what the compiled backward keeps anyway) and its loss under ``torch.compile``.

    The loss is compiled with the model so that the compiled backward's only
    input from outside its graphs is the seed of ``loss.backward``.
    """
    torch._dynamo.reset()
    model = make_ours(cpu_model, mesh, "loop", reshard_after_forward=False)
    return model, torch.compile(functools.partial(loss_of, model), backend="openxla")


def make_fsdpv2(cpu_model: nn.Module, mesh: xs.Mesh) -> nn.Module:
    model = copy.deepcopy(cpu_model)
    model.to(torch_xla.device())
    if isinstance(model, Decoder):
        model.use_scan = False
        # nn.Module.to() gives each registration of a tied parameter its own copy
        # when moving CPU -> XLA, so move first and tie again before wrapping.
        model.head.weight = model.embed.weight
    blocks = blocks_of(model)
    for i, layer in enumerate(blocks):
        blocks[i] = FSDPv2(layer, mesh=mesh)  # default shard_output: batch dim over 'fsdp'

    def shard_logits(output, mesh: xs.Mesh) -> None:
        logits = output if isinstance(output, torch.Tensor) else output.logits
        xs.mark_sharding(logits, mesh, ("fsdp",) + (None,) * (logits.dim() - 1))

    wrapped = FSDPv2(model, mesh=mesh, shard_output=shard_logits)
    if isinstance(model, Decoder):
        assert model.head.weight is model.embed.weight, "the embedding and the LM head came untied"
    return wrapped


# --------------------------------------------------------------------------- #
# Shardings -> per-device bytes.
# --------------------------------------------------------------------------- #

_DEVICES = re.compile(r"devices=\[([0-9,]+)\]")
_LAST_TILE_DIMS = re.compile(r"last_tile_dims=\{([^}]*)\}")


def tiles_of(spec: str | None, rank: int) -> tuple[int, ...]:
    """Tile counts of the ``rank`` data dimensions from an XLA sharding string.

    ``""``, ``{replicated}`` and ``{maximal ...}`` hold the whole tensor on a
    device; with ``last_tile_dim_replicate`` (or ``last_tile_dims={...}``) the
    trailing tile dimensions are replication/subgroups, not data shards.
    """
    ones = (1,) * rank
    if not spec or "devices=[" not in spec or spec.startswith("{{"):
        return ones
    dims = [int(v) for v in _DEVICES.search(spec).group(1).split(",")]
    if "last_tile_dim_replicate" in spec:
        dims = dims[:-1]
    extra = _LAST_TILE_DIMS.search(spec)
    if extra:
        dims = dims[: len(dims) - len(extra.group(1).split(","))]
    if len(dims) != rank:
        raise ValueError(f"sharding {spec} has {len(dims)} data tile dims for a rank-{rank} tensor")
    return tuple(dims)


def per_device_bytes(shape: tuple[int, ...], itemsize: int, spec: str | None) -> int:
    """Bytes of the largest shard (exactly bytes / shards when every dim divides)."""
    tiles = tiles_of(spec, len(shape))
    return itemsize * math.prod(-(-n // t) for n, t in zip(shape, tiles))


def spec_of(t: torch.Tensor) -> str:
    return xlac()._get_xla_sharding_spec(t)


def divides(p: torch.Tensor) -> bool:
    return any(n % NUM_DEVICES == 0 for n in p.shape)


@dataclass
class Bytes:
    total: int = 0            # unsharded bytes of params + grads
    per_device: int = 0       # from the tensors' shardings
    div_total: int = 0        # the same two over params whose shapes divide over 8
    div_per_device: int = 0
    grads_missing: int = 0
    unsharded: list[str] = field(default_factory=list)


def sharded_bytes(model: nn.Module) -> Bytes:
    out = Bytes()
    names = {id(p): n for n, p in model.named_parameters()}
    for p in unique_params(model):
        for t in (p, p.grad):
            if t is None:
                out.grads_missing += 1
                continue
            full = t.numel() * t.element_size()
            dev = per_device_bytes(tuple(t.shape), t.element_size(), spec_of(t))
            out.total += full
            out.per_device += dev
            if divides(p):
                out.div_total += full
                out.div_per_device += dev
                if dev * NUM_DEVICES != full:
                    out.unsharded.append(f"{names[id(p)]}{'' if t is p else '.grad'} {spec_of(t) or '(none)'}")
    return out


# --------------------------------------------------------------------------- #
# Training.
# --------------------------------------------------------------------------- #


def metric(name: str) -> tuple[int, float]:
    """(count, total) of a torch_xla metric; (0, 0) before it first fires."""
    data = met.metric_data(name)
    return (0, 0.0) if data is None else (int(data[0]), float(data[1]))


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None
            ) -> torch.Tensor:
    if mask is None:  # the decoder
        logits = model(tokens)
    else:  # Hugging Face: a 4-D mask, so attention reads nothing on the host
        logits = model(input_ids=tokens, attention_mask=mask, use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass
class Run:
    method: str
    layers: int
    model: nn.Module
    opt: torch.optim.Optimizer
    loss_fn: Callable[..., torch.Tensor]  # (tokens, targets, mask) -> loss of ``model``
    seed: torch.Tensor | None = None     # the backward's seed (None: autograd's own ones_like)
    compile_s: float = float("nan")
    compiles_first: int = 0
    first_s: float = float("nan")
    recompiles: int = 0
    input_syncs: int = 0  # steady steps: torch_xla's dynamo bridge syncing (and waiting for) lazy graph inputs
    times: list[float] = field(default_factory=list)  # seconds per step, step 0 included
    trace_times: list[float] = field(default_factory=list)  # host time until torch_xla.sync()
    exec_times: list[float] = field(default_factory=list)   # ExecuteReplicatedTime delta
    losses: list[float] = field(default_factory=list)
    bytes: Bytes | None = None
    hlo_param_dev: int | None = None     # HLO params that are model params, per device
    shard_param_dev: int | None = None   # the same tensors, per device from their shardings
    hlo_all_dev: int | None = None       # every HLO entry parameter, per device
    hlo_nparams: int | None = None
    hlo_matched: int | None = None
    d2h_bytes: int | None = None
    d2h_report: str = ""
    mem_bytes: int | None = None         # --hlo: the compiled step's buffer assignment per device
    collectives: dict[str, int] | None = None  # --hlo: collectives of the optimized step program
    error: str = ""

    @staticmethod
    def _steady_ms(values: list[float]) -> float:
        steady = values[2:] or values[1:] or values
        return statistics.median(steady) * 1e3 if steady else float("nan")

    @property
    def step_ms(self) -> float:
        return self._steady_ms(self.times)

    @property
    def trace_ms(self) -> float:
        return self._steady_ms(self.trace_times)

    @property
    def exec_ms(self) -> float:
        return self._steady_ms(self.exec_times)


def train_step(run: Run, tokens: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, float, float, float]:
    """One step; returns (loss, total s, trace s, execute s)."""
    e0 = metric("ExecuteReplicatedTime")[1]
    t0 = time.perf_counter()
    run.opt.zero_grad(set_to_none=True)
    loss = run.loss_fn(tokens, targets, mask)
    loss.backward(run.seed)
    run.opt.step()
    t1 = time.perf_counter()
    torch_xla.sync()
    xm.wait_device_ops()
    t2 = time.perf_counter()
    return loss, t2 - t0, t1 - t0, (metric("ExecuteReplicatedTime")[1] - e0) / 1e9


def timed_step(run: Run, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    loss, total, trace, execute = train_step(run, *batch)
    run.times.append(total)
    run.trace_times.append(trace)
    run.exec_times.append(execute)
    run.losses.append(loss.item())  # after the sync, outside the timed region


def lowering_check(run: Run, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Lower (not run) one forward+backward; sum per-device bytes of the HLO's parameters."""
    params = unique_params(run.model)
    run.opt.zero_grad(set_to_none=True)
    loss = loss_of(run.model, *batch)
    loss.backward()
    ctx = txe.LoweringContext(f"{run.method}_L{run.layers}_step")
    ctx.build([loss] + [p.grad for p in params])
    entry = ctx.module.entry_parameters
    by_number = {p.number: p for p in entry}

    def hlo_dev(hp) -> int:
        if hp.hlo_shape.is_tuple or not hp.shape and hp.hlo_shape.num_elements == 0:
            return 0
        itemsize = hp.hlo_shape.byte_size // max(hp.hlo_shape.num_elements, 1)
        return per_device_bytes(tuple(hp.shape), itemsize, hp.sharding)

    ids = ctx.tensor_parameter_ids(params)
    matched = [(p, by_number[i]) for p, i in zip(params, ids) if i >= 0]
    run.hlo_nparams = len(entry)
    run.hlo_matched = len(matched)
    run.hlo_all_dev = sum(hlo_dev(hp) for hp in entry)
    run.hlo_param_dev = sum(hlo_dev(hp) for _, hp in matched)
    run.shard_param_dev = sum(per_device_bytes(tuple(p.shape), p.element_size(), spec_of(p)) for p, _ in matched)
    # Drop the pending graph unexecuted: nothing of it is compiled or run.
    run.opt.zero_grad(set_to_none=True)
    del loss, ctx


def transfer_check(run: Run, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    with measure_transfers() as m:
        train_step(run, *batch)  # its metric reads move nothing
    run.d2h_bytes = int(m.d2h_bytes)
    run.d2h_report = m.report() if m.device_to_host else ""


def make_batches(cfg: Config, n: int, mesh: xs.Mesh, masked: bool) -> list[tuple[torch.Tensor, ...]]:
    """Learnable targets (a fixed per-token mapping), batch dim sharded over 'fsdp'.

    ``masked``: each batch also holds the 4-D causal mask Hugging Face models
    take as given (built on the device: ``torch_xla_ext.hf.causal_mask``).
    """
    from torch_xla_ext.hf import causal_mask

    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
        targets = (tokens * 7 + 3) % cfg.vocab
        batch = []
        for t in (tokens, targets):
            x = t.to(torch_xla.device())
            xs.mark_sharding(x, mesh, ("fsdp", None))
            batch.append(x)
        if masked:
            mask = causal_mask(torch.ones(cfg.batch, cfg.seq, dtype=torch.long, device=torch_xla.device()))
            xs.mark_sharding(mask, mesh, ("fsdp", None, None, None))
            batch.append(mask)
        out.append(tuple(batch))
    torch_xla.sync()
    xm.wait_device_ops()
    return out


def bench_layers(cfg: Config, model: str, layers: int, steps: int, mesh: xs.Mesh, methods: tuple[str, ...]
                 ) -> list[Run]:
    torch.manual_seed(0)
    cpu_model = make_decoder(cfg, layers) if model == "decoder" else make_llama(cfg, layers)
    batches = make_batches(cfg, steps, mesh, masked=model != "decoder")
    builders: dict[str, Callable[[], nn.Module]] = {
        "ours+scan": lambda: make_ours(cpu_model, mesh, "scan"),
        "ours+loop": lambda: make_ours(cpu_model, mesh, "loop"),
        "ours+keep": lambda: make_ours(cpu_model, mesh, "loop", reshard_after_forward=False),
        "fsdpv2": lambda: make_fsdpv2(cpu_model, mesh),
    }
    runs = []
    for name in methods:
        seed = None
        if name == "ours+compile":
            model, loss_fn = make_compiled(cpu_model, mesh)
            seed = torch.ones((), device=torch_xla.device())
        else:
            model = builders[name]()
            loss_fn = functools.partial(loss_of, model)
        torch_xla.sync()
        xm.wait_device_ops()
        opt = torch.optim.SGD(unique_params(model), lr=LR, foreach=False)
        runs.append(Run(name, layers, model, opt, loss_fn, seed))

    # First two steps per method: compile, then one warm step.
    for run in runs:
        c0 = metric("CompileTime")
        programs = xla_memory.Programs(DUMP_DIR) if DUMP_DIR else None
        timed_step(run, batches[0])
        if programs is not None:
            run.mem_bytes = programs.largest()
            module = programs.largest_module()
            if module is not None:
                ops = collections.Counter(i.opcode.removesuffix("-start") for c in module.computations
                                          for i in c.instructions)
                run.collectives = {k: ops[k] for k in SHORT if ops[k]}
        c1 = metric("CompileTime")
        run.compile_s, run.compiles_first = (c1[1] - c0[1]) / 1e9, c1[0] - c0[0]
        run.first_s = run.times[0]
        if steps > 1:
            timed_step(run, batches[1])
            run.recompiles += metric("CompileTime")[0] - c1[0]
    # Steady steps, interleaved across methods.
    for i in range(2, steps):
        for run in runs:
            c, s = metric("CompileTime")[0], met.counter_value("DynamoSyncInputExecuteTime") or 0
            timed_step(run, batches[i])
            run.recompiles += metric("CompileTime")[0] - c
            run.input_syncs += (met.counter_value("DynamoSyncInputExecuteTime") or 0) - s
    for run in runs:
        run.bytes = sharded_bytes(run.model)  # grads of the last step are still there
        c = metric("CompileTime")[0]
        transfer_check(run, batches[0])
        run.recompiles += metric("CompileTime")[0] - c
        # Last: after a lowering, torch_xla compiles the next step's graph once more.
        try:
            lowering_check(run, batches[0])
        except Exception as e:  # report it, keep benchmarking the rest
            run.error += f"lowering: {type(e).__name__}: {e} "
    return runs


# --------------------------------------------------------------------------- #
# --tpu: each method's training step compiled for a TPU topology.
# --------------------------------------------------------------------------- #

TPU_METHODS = ("ours+scan", "ours+stacked", "ours+remat", "ours+loop", "ours+keep", "fsdpv2")


def run_tpu(cfg: Config, model_kind: str, layer_list: list[int], mesh: xs.Mesh, topology: str, out: str) -> int:
    """Compile one SGD step (forward, backward, update) of each method for ``topology``; print the figures."""
    import tpu_bench
    from torch_xla_ext import remat

    print(f"--tpu {topology}: model {model_kind}; {cfg}; one SGD step (forward, backward, update) per method, "
          f"compiled with libtpu's compile-only client, nothing runs; ours+remat = ours+scan with "
          f"remat.nothing_saveable; methods {list(TPU_METHODS)}", flush=True)
    rows: dict[tuple[str, int], tpu_bench.TpuRow] = {}
    for layers in layer_list:
        torch.manual_seed(0)
        cpu_model = make_decoder(cfg, layers) if model_kind == "decoder" else make_llama(cfg, layers)
        builders: dict[str, Callable[[], nn.Module]] = {
            "ours+scan": lambda: make_ours(cpu_model, mesh, "scan"),
            "ours+stacked": lambda: make_ours(cpu_model, mesh, "scan", stacked=True),
            "ours+remat": lambda: make_ours(cpu_model, mesh, "scan", partition_fn=remat.nothing_saveable),
            "ours+loop": lambda: make_ours(cpu_model, mesh, "loop"),
            "ours+keep": lambda: make_ours(cpu_model, mesh, "loop", reshard_after_forward=False),
            "fsdpv2": lambda: make_fsdpv2(cpu_model, mesh),
        }
        for method in TPU_METHODS:
            try:
                (batch,) = make_batches(cfg, 1, mesh, masked=model_kind != "decoder")

                def step(method=method, batch=batch):
                    model = builders[method]()
                    opt = torch.optim.SGD(unique_params(model), lr=LR, foreach=False)
                    loss = loss_of(model, *batch)
                    loss.backward()
                    opt.step()
                    return [loss, *unique_params(model)]

                result = tpu_bench.compile_torch(step, topology)
                rows[(method, layers)] = tpu_bench.TpuRow(method, layers, result)
                print(f"  L={layers:<3} {method:<11} HBM used {tpu_bench._fmt(tpu_bench.hbm_mib(result), 2):>8} MiB per chip, "
                      f"TPU compile {result.compile_seconds:6.2f} s", flush=True)
            except Exception as e:  # a method the compiler rejects is a row of the table, not the end of the run
                rows[(method, layers)] = tpu_bench.TpuRow(
                    method, layers, None, f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                print(f"  L={layers:<3} {method:<11} {rows[(method, layers)].note}", flush=True)
    print()
    tpu_bench.print_table(rows, layer_list, TPU_METHODS, baseline=BASELINE)
    print("\ngoals (per-chip HBM used at or under FSDPv2's; bytes accessed and collective bytes at or under):")
    ok = True
    for layers in layer_list:
        base = rows.get((BASELINE, layers))
        if base is None or base.result is None:
            continue
        b = base.result
        for method in TPU_METHODS[:-1]:
            row = rows.get((method, layers))
            if row is None or row.result is None:
                print(f"  FAIL  L={layers} {method}: {row.note if row else 'missing'}")
                ok = False
                continue
            r = row.result
            checks = [("HBM used", r.hbm_used_bytes, b.hbm_used_bytes),
                      ("HBM buffers", r.hbm_buffer_bytes, b.hbm_buffer_bytes),
                      ("collective bytes", tpu_bench.collective_bytes(r), tpu_bench.collective_bytes(b))]
            if r.bytes_accessed is not None and b.bytes_accessed is not None:
                checks.append(("bytes accessed", r.bytes_accessed, b.bytes_accessed))
            for name, mine, theirs in checks:
                if mine is None or theirs is None:  # no buffer assignment from the compiler
                    print(f"  ----  L={layers} {method} {name}: unknown")
                    continue
                verdict = mine <= theirs
                ok &= verdict
                print(f"  {'PASS' if verdict else 'FAIL'}  L={layers} {method} {name}: "
                      f"{mine / theirs if theirs else float('nan'):.2f}x FSDPv2's")
    tpu_bench.plot(rows, layer_list, TPU_METHODS, out, f"{model_kind} on {topology}")
    return 0 if ok else 1


# --------------------------------------------------------------------------- #
# Reporting.
# --------------------------------------------------------------------------- #


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def report(all_runs: dict[int, list[Run]]) -> tuple[str, bool]:
    rows = [["L", "method", "compile s", "(n)", "x fsdpv2", "first s", "step ms", "x fsdpv2", "trace ms", "x fsdpv2",
             "exec ms", "x fsdpv2", "recomp", "colls", "mem/dev", "param+grad/dev", "total/8", "hlo param/dev",
             "shard param/dev", "d2h/step", "final loss"]]
    checks: list[tuple[str, bool]] = []
    notes: list[str] = []
    for layers, runs in all_runs.items():
        base = next((r for r in runs if r.method == BASELINE), None)
        for r in runs:
            b = r.bytes
            rows.append([
                str(layers), r.method,
                f"{r.compile_s:.2f}", str(r.compiles_first),
                f"{r.compile_s / base.compile_s:.2f}" if base else "-",
                f"{r.first_s:.2f}",
                f"{r.step_ms:.1f}", f"{r.step_ms / base.step_ms:.2f}" if base else "-",
                f"{r.trace_ms:.1f}", f"{r.trace_ms / base.trace_ms:.2f}" if base else "-",
                f"{r.exec_ms:.1f}", f"{r.exec_ms / base.exec_ms:.2f}" if base else "-",
                str(r.recompiles),
                " ".join(f"{SHORT[k]} {v}" for k, v in r.collectives.items()) if r.collectives is not None else "-",
                fmt_bytes(r.mem_bytes),
                fmt_bytes(b.per_device), fmt_bytes(b.total // NUM_DEVICES),
                fmt_bytes(r.hlo_param_dev), fmt_bytes(r.shard_param_dev),
                fmt_bytes(r.d2h_bytes), f"{r.losses[-1]:.4f}" if r.losses else "-",
            ])
            if r.error:
                notes.append(f"L={layers} {r.method}: {r.error.strip()}")
            if b.grads_missing:
                notes.append(f"L={layers} {r.method}: {b.grads_missing} parameter(s) had no .grad after the step")
            if r.hlo_nparams is not None:
                notes.append(f"L={layers} {r.method}: HLO entry has {r.hlo_nparams} parameters, "
                             f"{r.hlo_matched} of them model parameters; all entry parameters "
                             f"{fmt_bytes(r.hlo_all_dev)}/device")
            if r.d2h_report:
                notes.append(f"L={layers} {r.method}: {r.d2h_report}")
            if r.method == BASELINE:
                continue
            ok_bytes = b.div_per_device * NUM_DEVICES == b.div_total and not b.grads_missing
            detail = f"{b.div_per_device} B/dev vs {b.div_total}/8 = {b.div_total / NUM_DEVICES:.0f}"
            if b.unsharded:
                detail += "; not 8-way: " + ", ".join(b.unsharded[:4]) + (" ..." if len(b.unsharded) > 4 else "")
            checks.append((f"L={layers} {r.method}: per-device param+grad bytes == total/8 ({detail})", ok_bytes))
            ok_hlo = r.hlo_param_dev is not None and r.hlo_param_dev == r.shard_param_dev
            checks.append((f"L={layers} {r.method}: HLO cross-check, per-device param bytes from the lowered "
                           f"HLO == from shardings ({fmt_bytes(r.hlo_param_dev)} vs {fmt_bytes(r.shard_param_dev)})",
                           ok_hlo))
            if base:
                for what, ours, theirs in (("steady step", r.step_ms, base.step_ms),
                                           ("trace", r.trace_ms, base.trace_ms),
                                           ("exec", r.exec_ms, base.exec_ms)):
                    ratio = ours / theirs
                    checks.append((f"L={layers} {r.method}: {what} <= {STEP_TARGET}x FSDPv2 "
                                   f"({ours:.1f} ms vs {theirs:.1f} ms = {ratio:.2f}x)", ratio <= STEP_TARGET))
            if r.method == "ours+compile":
                checks.append((f"L={layers} {r.method}: no blocking sync of the compiled graphs' inputs in the "
                               f"steady steps (measured {r.input_syncs})", r.input_syncs == 0))
            checks.append((f"L={layers} {r.method}: a training step moves 0 bytes device->host "
                           f"(measured {r.d2h_bytes} B)", r.d2h_bytes == 0))
        # Loss agreement across the methods.
        traj = {r.method: np.array(r.losses) for r in runs if r.losses}
        if len(traj) > 1:
            ref = traj[BASELINE] if BASELINE in traj else next(iter(traj.values()))
            n = min(len(v) for v in traj.values())
            max_diff = max(float(np.abs(v[:n] - ref[:n]).max()) for v in traj.values())
            agree = all(np.allclose(v[:n], ref[:n], rtol=1e-4, atol=1e-4) for v in traj.values())
            checks.append((f"L={layers}: loss trajectories of {', '.join(traj)} agree "
                           f"(allclose rtol=atol=1e-4; max abs diff {max_diff:.2e})", agree))
            for name, v in traj.items():
                notes.append(f"L={layers} {name} losses: " + " ".join(f"{x:.5f}" for x in v))
    lines = [table(rows), "",
             "step = steady step (forward + backward + SGD + sync, waited), median of steps 3..N; "
             "first = step 1 wall time; compile = CompileTime delta over step 1 ((n) = compilations in it); x fsdpv2 = ratio to "
             "FSDPv2 in this run; trace = host time of a steady step until torch_xla.sync(); exec = its "
             "ExecuteReplicatedTime; recomp = compilations after step 1; colls (--hlo) = all-gather (AG), "
             "all-reduce (AR), all-to-all (A2A) ... instructions of XLA's optimized step program (a loop body "
             "counted once); mem/dev (--hlo) = its buffer assignment per device.",
             "param+grad/dev from each tensor's sharding string; hlo param/dev = per-device bytes of the lowered "
             "HLO's entry parameters that are model parameters (C++ reader), shard param/dev = the same tensors "
             "from their sharding strings.", ""]
    lines += ["Notes:"] + [f"  {n}" for n in notes] + ["", "Targets:"]
    lines += [f"  {'PASS' if ok else 'FAIL'}  {text}" for text, ok in checks]
    return "\n".join(lines), all(ok for _, ok in checks)


def plot(all_runs: dict[int, list[Run]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layer_list = list(all_runs)
    methods = [r.method for r in next(iter(all_runs.values()))]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    width = 0.8 / len(methods)
    x = np.arange(len(layer_list))
    for j, m in enumerate(methods):
        runs = [next(r for r in all_runs[L] if r.method == m) for L in layer_list]
        lo = [r.step_ms - min(r.times[2:] or r.times) * 1e3 for r in runs]
        hi = [max(r.times[2:] or r.times) * 1e3 - r.step_ms for r in runs]
        axes[0].bar(x + j * width, [r.step_ms for r in runs], width, yerr=[lo, hi], capsize=3, label=m)
        axes[1].bar(x + j * width, [r.compile_s for r in runs], width, label=m)
    for ax, title, unit in ((axes[0], "steady step time (median, min..max)", "ms"), (axes[1], "compile time (first step)", "s")):
        ax.set_xticks(x + width * (len(methods) - 1) / 2, [f"L={L}" for L in layer_list])
        ax.set_title(title)
        ax.set_ylabel(unit)
        ax.legend()
    styles = ["-", "--", ":", "-."]
    for i, L in enumerate(layer_list):
        for j, r in enumerate(all_runs[L]):
            axes[2].plot(range(1, len(r.losses) + 1), r.losses, linestyle=styles[j % len(styles)],
                         marker="o", markersize=3, color=f"C{i}", label=f"L={L} {r.method}")
    axes[2].set_title("training loss")
    axes[2].set_xlabel("step")
    axes[2].legend(fontsize=7)
    fig.suptitle("fully_shard (+scan_layers / loop) vs torch_xla FSDPv2, 8 virtual CPU devices")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="numbers of decoder blocks (default 4 8 16 32)")
    ap.add_argument("--model", choices=("decoder", "llama"), default="decoder",
                    help="the tied decoder of torch_xla_ext.testing.models, or Hugging Face LlamaForCausalLM")
    ap.add_argument("--hlo", action="store_true", help="dump XLA's programs: collectives and memory of each step "
                    "(dumping slows compiles: that run's compile column is not comparable)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per method (default 12, >= 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: tiny model, L = 2, 3 steps")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=list(DEFAULT_METHODS),
                    help="default: all but ours+compile")
    ap.add_argument("--out", default="bench_out/bench_fsdp.png", help="PNG plot path")
    ap.add_argument("--tpu", metavar="TOPOLOGY", default=None,
                    help="compile each method's SGD step for a TPU topology (e.g. v5e:2x4; 8 chips) with libtpu's "
                         "compile-only client and report the TPU compiler's figures instead of timing on CPU")
    args = ap.parse_args(argv)
    if args.quick:
        cfg = Config(vocab=64, dim=32, heads=2, seq=8, batch=8)
        layer_list, steps = args.layers or [2], args.steps or 3
    else:
        cfg = Config()
        layer_list, steps = args.layers or [4, 8, 16, 32], args.steps or 12
    if steps < 3:
        ap.error("--steps must be at least 3 (the steady median skips the first two)")
    n = xr.global_runtime_device_count()
    if n != NUM_DEVICES:
        raise SystemExit(f"expected {NUM_DEVICES} virtual CPU devices, got {n}")
    mesh = xs.Mesh(np.arange(NUM_DEVICES), (NUM_DEVICES,), ("fsdp",))
    xs.set_global_mesh(mesh)
    if args.tpu:
        return run_tpu(cfg, args.model, layer_list, mesh, args.tpu, args.out)
    print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, {n} devices; model {args.model}; {cfg}; "
          f"L={layer_list}; {steps} steps; SGD lr={LR}", flush=True)
    all_runs: dict[int, list[Run]] = {}
    t0 = time.perf_counter()
    for L in layer_list:
        all_runs[L] = bench_layers(cfg, args.model, L, steps, mesh, tuple(args.methods))
        print(f"  L={L} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    text, ok = report(all_runs)
    print()
    print(text)
    plot(all_runs, args.out)
    print(f"\nplot: {args.out}  (total {time.perf_counter() - t0:.0f} s)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
