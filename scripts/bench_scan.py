#!/usr/bin/env python
"""Benchmark: a stack of L decoder blocks as an unrolled loop vs scans.

One process, 8 virtual CPU devices, FSDP-style SPMD sharding. Side by side,
for each L:

  unrolled   a Python for-loop over the blocks (the baseline of every ratio)
  ours       torch_xla_ext.scan_layers(layers, x)
  ours_stacked
             ours over blocks stored stacked by torch_xla_ext.stack_layers
             (one [L, ...] parameter per name, as JAX's weights are: no
             per-step stacking of the weights or unstacking of the grads)
  torch_xla  torch_xla.experimental.scan_layers.scan_layers(..., is_layer_pure=True)
             (its SPMD backward needs torchax, which needs flax; skipped with
             a note when they are missing)
  jax        the same model in JAX with jax.lax.scan over stacked weights
  ours_nothing, ours_dots
             ours with the remat policies torch_xla_ext.remat.nothing_saveable
             (the forward stacks only each layer's input) and dots_saveable
             (it also keeps matmul outputs)

Per (method, L) it measures

  compile   XLA compile time of the training step: the delta of torch_xla's
            ``CompileTime`` metric summed over every step the method ran,
            with the number of compilations (a method whose second step
            recompiles pays twice; JAX: ``.compile()``)
  first     wall time of the first step (tracing + lowering + compile + run)
  step      steady step time: forward + backward + ``torch_xla.sync()`` and
            waiting for the device, median of ``--steps`` steps after warm-up;
            the timed steps of all methods are interleaved round robin, so
            load from elsewhere on the host hits every method alike
  trace     host time per steady step until the lazy graph is built (from
            step start to just before ``torch_xla.sync()``). JAX has no
            per-step tracing once jitted; its column shows the one-off
            ``jit(...).trace()`` + ``.lower()`` time instead.
  memory    with ``--memory``: device memory of the compiled training step,
            per device, from XLA's buffer assignment (see
            ``scripts/xla_memory.py``; the same for torch_xla and JAX). Dumping
            slows compiles, so that run's compile column is not comparable.

and prints a table with absolute numbers and ratios vs the unrolled loop of
the same run, the target checks, a numerics check (outputs and gradients of
each method vs the unrolled loop), and writes a PNG plot. Each torch method
runs on its own fresh device copy of the same weights.

Usage::

    python scripts/bench_scan.py                 # L = 4 8 16 32
    python scripts/bench_scan.py --quick         # smoke run: L = 2 4, 2 steps
    python scripts/bench_scan.py --layers 4 8 --steps 3 --out bench_out/x.png
    python scripts/bench_scan.py --tpu v5e:2x4   # each step compiled for a TPU topology (tpu_bench.py)
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# The runtime reads these once, when torch_xla is imported.
os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# JAX's CPU client reads this when its backend starts. torch_xla's PJRT CPU
# client ignores it (it uses CPU_NUM_DEVICES), so both run in this process.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Importing torchax (torch_xla's scan_layers column needs it) logs through absl that TensorFlow is
# missing: noise the tables do not need.
logging.getLogger("absl").setLevel(logging.ERROR)
import xla_memory  # noqa: E402

# XLA reads its dump flags when it starts: decide before importing torch_xla or JAX.
MEMORY_DIR = xla_memory.enable("bench_out/xla_dump") if "--memory" in sys.argv else None

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

xr.use_spmd()
torch.zeros(1, device=torch_xla.device())  # size autograd's device queues before any backward

NUM_DEVICES = 8
METHODS = ("unrolled", "ours", "ours_stacked", "ours_nothing", "ours_dots", "torch_xla", "jax")


# --------------------------------------------------------------------------- #
# The model.
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class Config:
    """Sizes of torch_xla_ext.testing.models.CausalBlock and of the batch."""

    dim: int = 128
    heads: int = 4
    seq: int = 64
    batch: int = 8
    mlp: int = 4  # hidden = mlp * dim


def host_weights(layers: nn.ModuleList) -> list[dict[str, np.ndarray]]:
    """Numpy copies of each layer's state, keyed like its state_dict (what JAX stacks)."""
    return [{k: v.detach().numpy().copy() for k, v in layer.state_dict().items()} for layer in layers]


def build(cfg: Config, num_layers: int, seed: int = 0):
    """Host blocks (torch_xla_ext.testing.models.CausalBlock), a host input, and numpy copies of the weights (for JAX)."""
    from torch_xla_ext.testing.models import CausalBlock  # imported late: main() reports a missing package

    torch.manual_seed(seed)
    cpu_layers = nn.ModuleList(CausalBlock(cfg.dim, cfg.heads, cfg.mlp) for _ in range(num_layers))
    x_cpu = torch.randn(cfg.batch, cfg.seq, cfg.dim)
    host = host_weights(cpu_layers)
    return cpu_layers, x_cpu, host


def llama_config(cfg: Config, num_layers: int):
    """The Hugging Face ``LlamaConfig`` of the benchmarked layers: the blocks' width, GQA with heads // 2 KV heads."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=cfg.dim, intermediate_size=cfg.mlp * cfg.dim, num_attention_heads=cfg.heads,
                       num_key_value_heads=max(1, cfg.heads // 2), num_hidden_layers=num_layers, vocab_size=128,
                       max_position_embeddings=cfg.seq, attn_implementation="sdpa")


def build_llama(cfg: Config, num_layers: int, seed: int = 0):
    """Hugging Face Llama decoder layers of the same width (GQA, RMSNorm, rotary embeddings, SwiGLU), a host input,
    numpy copies of the weights (for JAX), and the rotary embedding module whose (cos, sin) every layer receives
    as ``position_embeddings``."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = llama_config(cfg, num_layers)
    torch.manual_seed(seed)
    cpu_layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(num_layers))
    x_cpu = torch.randn(cfg.batch, cfg.seq, cfg.dim)
    host = host_weights(cpu_layers)
    return cpu_layers, x_cpu, host, LlamaRotaryEmbedding(config)


def build_model(model: str, cfg: Config, num_layers: int, fwds: dict[str, Callable], partition_fns: dict,
                methods: list[str]):
    """``build`` or ``build_llama`` for ``model``; for Llama, ``fwds`` gets the forwards over this rotary embedding."""
    if model != "llama":
        return build(cfg, num_layers)
    cpu_layers, x_cpu, host, rotary = build_llama(cfg, num_layers)
    fwds.update(llama_forwards(rotary, {m: partition_fns[m] for m in methods if m in partition_fns}))
    return cpu_layers, x_cpu, host


def llama_forwards(rotary: nn.Module, partition_fns: dict[str, Callable | None]) -> dict[str, Callable]:
    """The loop and scan_layers over Llama layers, each computing (cos, sin) from ``rotary`` in the step's graph."""
    import torch_xla_ext

    rotary = rotary.to(torch_xla.device())

    def rope(x):
        positions = torch.arange(x.shape[1], device=x.device)[None]
        return rotary(x, positions)

    def unrolled(layers, x):
        pe = rope(x)
        for layer in layers:
            x = layer(x, position_embeddings=pe)
        return x

    def scanned(partition_fn):
        return lambda layers, x: torch_xla_ext.scan_layers(layers, x, partition_fn, position_embeddings=rope(x))

    return {"unrolled": unrolled, **{m: scanned(fn) for m, fn in partition_fns.items()}}


def place(cpu_layers: nn.ModuleList, x_cpu: torch.Tensor, mesh: xs.Mesh, stacked: bool = False):
    """A fresh device copy of the blocks (2-D weights sharded on dim 0 over
    'fsdp', the rest left unannotated) and the batch-sharded input; with
    ``stacked``, the copy stored stacked (``stack_layers``, synced: as device
    data, as after a first step).

    Each method gets its own copy, so first-use effects of a method (e.g. a
    recompile once unannotated tensors have come back from a sharded run)
    are charged to that method, not hidden by the method that ran before."""
    layers = copy.deepcopy(cpu_layers).to(torch_xla.device())
    for layer in layers:
        for p in layer.parameters():
            if p.dim() == 2:
                xs.mark_sharding(p, mesh, ("fsdp", None))
    x = x_cpu.to(torch_xla.device())
    xs.mark_sharding(x, mesh, ("fsdp", None, None))
    if stacked:
        from torch_xla_ext import stack_layers

        stack_layers(layers)
        torch_xla.sync()
    return layers, x


# --------------------------------------------------------------------------- #
# Measurement helpers.
# --------------------------------------------------------------------------- #


def metric(name: str) -> tuple[int, float]:
    """(count, total) of a torch_xla metric; (0, 0) before it first fires."""
    data = met.metric_data(name)
    return (0, 0.0) if data is None else (int(data[0]), float(data[1]))


def last_sample(name: str) -> float | None:
    data = met.metric_data(name)
    return None if not data or not data[2] else float(data[2][-1][1])


def d2h_events() -> int:
    return metric("TransferFromDeviceTime")[0] + (met.counter_value("ReplicateShardedData") or 0)


@dataclass
class Result:
    method: str
    layers: int
    compile_s: float = float("nan")  # all compilations of the method's run
    compiles: int | None = None      # how many
    first_s: float = float("nan")
    step_ms: float = float("nan")
    trace_ms: float = float("nan")
    nodes: int | None = None        # IR nodes of the synced graph
    d2h: int | None = None          # device->host transfers during steady steps
    mem_bytes: int | None = None    # --memory: the compiled step's buffer assignment, per device
    mem_mib: float = float("nan")
    note: str = ""
    samples: dict = field(default_factory=dict)


class TorchRunner:
    """One torch method on its own copy of the blocks.

    ``first()`` runs the compiling step and the warm-up steps; ``timed()`` runs
    one timed step. The driver interleaves the timed steps of all methods, so
    that load from elsewhere on the host spreads over all of them evenly.
    Metric deltas are taken around this runner's own steps only."""

    def __init__(self, method: str, forward: Callable, layers: nn.ModuleList, x: torch.Tensor) -> None:
        self.forward, self.layers, self.x = forward, layers, x
        self.params = list(layers.parameters())
        self.res = Result(method, len(layers))
        self.compiles, self.compile_ns, self.d2h = 0, 0.0, 0
        self.traces: list[float] = []
        self.totals: list[float] = []

    def _step(self) -> tuple[float, float]:
        c0, d0 = metric("CompileTime"), d2h_events()
        for p in self.params:
            p.grad = None
        t0 = time.perf_counter()
        loss = self.forward(self.layers, self.x).square().mean()
        loss.backward()
        t1 = time.perf_counter()
        torch_xla.sync(wait=True)
        xm.wait_device_ops()
        t2 = time.perf_counter()
        c1 = metric("CompileTime")
        self.compiles += c1[0] - c0[0]
        self.compile_ns += c1[1] - c0[1]
        self.last_d2h = d2h_events() - d0
        self.res.nodes = int(last_sample("TensorsGraphSize") or 0)
        return t1 - t0, t2 - t0

    def first(self, warmup: int) -> None:
        programs = xla_memory.Programs(MEMORY_DIR) if MEMORY_DIR else None
        _, self.res.first_s = self._step()
        if programs is not None:
            self.res.mem_bytes = programs.largest()
        for _ in range(warmup):
            self._step()

    def timed(self) -> None:
        trace, total = self._step()
        self.traces.append(trace)
        self.totals.append(total)
        self.d2h += self.last_d2h

    def result(self) -> Result:
        r = self.res
        r.compiles, r.compile_s, r.d2h = self.compiles, self.compile_ns / 1e9, self.d2h
        if self.totals:
            r.trace_ms = statistics.median(self.traces) * 1e3
            r.step_ms = statistics.median(self.totals) * 1e3
        r.samples = {"trace_ms": [t * 1e3 for t in self.traces], "step_ms": [t * 1e3 for t in self.totals]}
        for p in self.params:
            p.grad = None
        return r


def fwd_unrolled(layers, x):
    for layer in layers:
        x = layer(x)
    return x


def make_fwd_ours(partition_fn=None):
    import torch_xla_ext

    return lambda layers, x: torch_xla_ext.scan_layers(layers, x, partition_fn)


def make_fwd_torch_xla():
    from torch_xla.experimental.scan_layers import scan_layers

    return lambda layers, x: scan_layers(layers, x, is_layer_pure=True)


# --------------------------------------------------------------------------- #
# JAX.
# --------------------------------------------------------------------------- #


def jax_setup(cfg: Config, model: str = "block", devices=None):
    """JAX's forward, loss and placement for ``model``: the CausalBlock, or a Llama decoder layer written from
    Hugging Face's ``LlamaDecoderLayer`` (RMSNorm, rotary embeddings, GQA, causal softmax attention, SwiGLU).

    ``devices``: the mesh's devices (default: JAX's CPU devices; ``--tpu``: a topology's compile-only ones)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.devices("cpu") if devices is None else list(devices)
    if len(devices) != NUM_DEVICES:
        raise RuntimeError(f"JAX sees {len(devices)} CPU devices, expected {NUM_DEVICES}")
    mesh = Mesh(np.array(devices), ("fsdp",))

    def layer_norm(x, w, b):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + 1e-5) * w + b

    def linear(x, p, name):
        return x @ p[name + ".weight"].T + p[name + ".bias"]

    def block(p, x):
        b, s, d = x.shape
        h, hd = cfg.heads, d // cfg.heads
        qkv = linear(layer_norm(x, p["attn_norm.weight"], p["attn_norm.bias"]), p, "qkv")
        qkv = qkv.reshape(b, s, 3, h, hd).transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = (q @ k.swapaxes(-1, -2)) * (hd ** -0.5)
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))
        att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
        o = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, d)
        x = x + linear(o, p, "proj")
        hid = jax.nn.gelu(linear(layer_norm(x, p["mlp_norm.weight"], p["mlp_norm.bias"]), p, "up"), approximate=False)
        return x + linear(hid, p, "down")

    if model == "llama":
        config = llama_config(cfg, 1)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        hd, eps = cfg.dim // heads, config.rms_norm_eps
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        # The (cos, sin) HF's rotary embedding gives positions 0..seq-1: [seq, head_dim] constants here.
        cos_t, sin_t = LlamaRotaryEmbedding(config)(torch.zeros(1), torch.arange(cfg.seq)[None])
        cos, sin = jnp.asarray(cos_t[0].numpy()), jnp.asarray(sin_t[0].numpy())

        def rms_norm(x, w):
            return w * (x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + eps))

        def rotate(t):  # t: [b, heads, s, hd]; x * cos + rotate_half(x) * sin
            half = hd // 2
            return t * cos + jnp.concatenate([-t[..., half:], t[..., :half]], axis=-1) * sin

        def block(p, x):
            b, s, d = x.shape
            h = rms_norm(x, p["input_layernorm.weight"])
            q = (h @ p["self_attn.q_proj.weight"].T).reshape(b, s, heads, hd).transpose(0, 2, 1, 3)
            k = (h @ p["self_attn.k_proj.weight"].T).reshape(b, s, kv_heads, hd).transpose(0, 2, 1, 3)
            v = (h @ p["self_attn.v_proj.weight"].T).reshape(b, s, kv_heads, hd).transpose(0, 2, 1, 3)
            q, k = rotate(q), rotate(k)
            k, v = jnp.repeat(k, heads // kv_heads, axis=1), jnp.repeat(v, heads // kv_heads, axis=1)
            att = (q @ k.swapaxes(-1, -2)) * (hd ** -0.5)
            causal = jnp.tril(jnp.ones((s, s), dtype=bool))
            att = jax.nn.softmax(jnp.where(causal, att, -jnp.inf), axis=-1)
            o = (att @ v).transpose(0, 2, 1, 3).reshape(b, s, heads * hd)
            x = x + o @ p["self_attn.o_proj.weight"].T
            h = rms_norm(x, p["post_attention_layernorm.weight"])
            gated = jax.nn.silu(h @ p["mlp.gate_proj.weight"].T) * (h @ p["mlp.up_proj.weight"].T)
            return x + gated @ p["mlp.down_proj.weight"].T

    def forward(stacked, x):
        out, _ = jax.lax.scan(lambda h, p: (block(p, h), None), x, stacked)
        return out

    def loss(stacked, x):
        return jnp.mean(forward(stacked, x) ** 2)

    def place(host_layers, x_np, abstract: bool = False):
        """Stacked weights and the batch on the mesh; ``abstract``: their shapes and shardings only."""
        stacked = {k: np.stack([h[k] for h in host_layers]) for k in host_layers[0]}
        shardings = {k: NamedSharding(mesh, P(None, "fsdp", None) if v.ndim == 3 else P())
                     for k, v in stacked.items()}
        x_sharding = NamedSharding(mesh, P("fsdp", None, None))
        if abstract:
            params = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in stacked.items()}
            xj = jax.ShapeDtypeStruct(x_np.shape, x_np.dtype, sharding=x_sharding)
        else:
            params = {k: jax.device_put(v, shardings[k]) for k, v in stacked.items()}
            xj = jax.device_put(x_np, x_sharding)
        return params, xj, shardings, NamedSharding(mesh, P())

    return jax, forward, loss, place


class JaxRunner:
    """The JAX model: one jitted value_and_grad step over lax.scan, compiled ahead of time."""

    def __init__(self, jx, host_layers, x_np) -> None:
        jax, _forward, loss, place = jx
        self.jax = jax
        self.params, self.x, shardings, replicated = place(host_layers, x_np)
        self.step = jax.jit(jax.value_and_grad(loss), out_shardings=(replicated, shardings))
        self.res = Result("jax", len(host_layers), note="trace = one-off jit(...).trace()+lower()")
        self.totals: list[float] = []

    def first(self, warmup: int) -> None:
        jax = self.jax
        programs = xla_memory.Programs(MEMORY_DIR) if MEMORY_DIR else None
        t0 = time.perf_counter()
        lowered = self.step.trace(self.params, self.x).lower()
        t1 = time.perf_counter()
        self.compiled = lowered.compile()
        t2 = time.perf_counter()
        if programs is not None:
            self.res.mem_bytes = programs.largest()
        jax.block_until_ready(self.compiled(self.params, self.x))
        t3 = time.perf_counter()
        self.res.trace_ms, self.res.compile_s, self.res.compiles = (t1 - t0) * 1e3, t2 - t1, 1
        self.res.first_s = t3 - t0
        for _ in range(warmup):
            jax.block_until_ready(self.compiled(self.params, self.x))

    def timed(self) -> None:
        t0 = time.perf_counter()
        self.jax.block_until_ready(self.compiled(self.params, self.x))
        self.totals.append(time.perf_counter() - t0)

    def result(self) -> Result:
        if self.totals:
            self.res.step_ms = statistics.median(self.totals) * 1e3
        self.res.samples = {"step_ms": [t * 1e3 for t in self.totals]}
        return self.res


# --------------------------------------------------------------------------- #
# --tpu: each method's step compiled for a TPU topology.
# --------------------------------------------------------------------------- #


def run_tpu(args, cfg: Config, methods: list[str], fwds: dict[str, Callable], partition_fns: dict,
            layer_counts: list[int], notes: list[str]) -> int:
    """Compile each method's forward + backward for ``args.tpu``; print the TPU compiler's figures and the goals."""
    import tpu_bench
    from torch_xla_ext.tpu import _client as _tpu_client

    devices = _tpu_client.topology_devices(args.tpu)
    jx = jax_setup(cfg, args.model, devices=devices) if "jax" in methods else None
    mesh = xs.Mesh(np.arange(NUM_DEVICES), (NUM_DEVICES,), ("fsdp",))
    print(f"--tpu {args.tpu}: {len(devices)} x {devices[0].device_kind}; model {args.model} dim={cfg.dim} "
          f"heads={cfg.heads} mlp={cfg.mlp}x seq={cfg.seq} batch={cfg.batch}, fp32; forward + backward of "
          f"mean(out**2), 2-D weights sharded ('fsdp', None), batch on 'fsdp'; compiled with libtpu's compile-only "
          f"client, nothing runs; methods {methods}")
    for note in notes:
        print(note)
    rows: dict[tuple[str, int], tpu_bench.TpuRow] = {}
    for n in layer_counts:
        cpu_layers, x_cpu, host = build_model(args.model, cfg, n, fwds, partition_fns, methods)
        for m in methods:
            try:
                if m == "jax":
                    jax, _forward, loss, place_jax = jx
                    params, xj, shardings, replicated = place_jax(host, x_cpu.numpy(), abstract=True)
                    jitted = jax.jit(jax.value_and_grad(loss), out_shardings=(replicated, shardings))
                    result = tpu_bench.compile_jax(jitted, (params, xj), args.tpu)
                else:
                    layers, x = place(cpu_layers, x_cpu, mesh, stacked=m == "ours_stacked")

                    def step(fwd=fwds[m], layers=layers, x=x):
                        loss = fwd(layers, x).square().mean()
                        loss.backward()
                        return [loss, *(p.grad for p in layers.parameters())]

                    result = tpu_bench.compile_torch(step, args.tpu)
                    del layers, x
                rows[(m, n)] = tpu_bench.TpuRow(m, n, result)
                print(f"  L={n:<3} {m:<13} HBM used {tpu_bench._fmt(tpu_bench.hbm_mib(result), 2):>8} MiB per chip, "
                      f"TPU compile {result.compile_seconds:6.2f} s", flush=True)
            except Exception as e:  # a method the compiler rejects is a row of the table, not the end of the run
                rows[(m, n)] = tpu_bench.TpuRow(m, n, None, f"error: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                print(f"  L={n:<3} {m:<13} {rows[(m, n)].note}", flush=True)
    print()
    tpu_bench.print_table(rows, layer_counts, methods, baseline="unrolled")
    print("\ngoals:")
    for verdict, text in tpu_goals(rows, layer_counts):
        print(f"  {verdict:<4}  {text}")
    tpu_bench.plot(rows, layer_counts, methods, args.out, f"{args.model} on {args.tpu}")
    return 0


def tpu_goals(rows, layer_counts: list[int]) -> list[tuple[str, str]]:
    """Each scan's HBM used at or under the unrolled loop's and JAX's; its compile time flat in L and <= 0.25x
    the loop's."""
    def res(m, n):
        row = rows.get((m, n))
        return row.result if row else None

    out = []
    for scan in ("ours", "ours_stacked"):
        for n in layer_counts:
            ours = res(scan, n)
            if ours is None or ours.hbm_used_bytes is None:
                continue
            for name in ("unrolled", "jax"):
                other = res(name, n)
                if other is not None and other.hbm_used_bytes:
                    a, b = ours.hbm_used_bytes, other.hbm_used_bytes
                    out.append(("PASS" if a <= b else "FAIL",
                                f"L={n}: {scan}'s HBM used {a / 2**20:.2f} MiB <= {name}'s {b / 2**20:.2f} "
                                f"({a / b:.2f}x)"))
        lo, hi = (8 if 8 in layer_counts else min(layer_counts)), max(layer_counts)
        if res(scan, lo) and res(scan, hi) and hi > lo:
            growth = res(scan, hi).compile_seconds / res(scan, lo).compile_seconds
            out.append(("PASS" if growth <= 1.2 else "FAIL",
                        f"{scan}'s TPU compile L={hi} within 1.2x of L={lo}: {growth:.2f}x"))
        if res(scan, hi) and res("unrolled", hi):
            share = res(scan, hi).compile_seconds / res("unrolled", hi).compile_seconds
            out.append(("PASS" if share <= 0.25 else "FAIL",
                        f"{scan}'s TPU compile <= 0.25x the loop's at L={hi}: {share:.2f}x"))
    return out


# --------------------------------------------------------------------------- #
# Numerics.
# --------------------------------------------------------------------------- #


def check_numerics(fwds: dict[str, Callable], fresh: Callable[[bool], tuple], host, x_np,
                   jx) -> list[tuple[str, bool, str]]:
    """Outputs and gradients of every method (JAX's too) vs the unrolled loop.

    ``fresh(stacked)`` places a new device copy of the blocks and input for
    each method (stored stacked for ``ours_stacked``, whose ``[L, ...]``
    gradients are compared row by row). Copies results to the host (outside
    every timed region)."""
    def run(name: str, fwd: Callable) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        stacked = name == "ours_stacked"
        layers, x = fresh(stacked)
        out = fwd(layers, x)
        out.square().mean().backward()
        torch_xla.sync()
        grads = {key: p.grad.cpu() for key, p in layers.named_parameters()}
        if stacked:  # "attn_norm/weight" [L, ...] -> "i.attn_norm.weight"
            grads = {f"{i}.{key.replace('/', '.')}": g[i] for key, g in grads.items() for i in range(len(g))}
        return out.detach().cpu(), grads

    def compare(name: str, out: torch.Tensor, grads: dict[str, torch.Tensor], out_atol: float) -> tuple:
        if grads.keys() != ref_grads.keys():
            return (name, False, f"gradients named {sorted(grads)[:3]}... where the loop's are "
                                 f"{sorted(ref_grads)[:3]}...")
        ok_out = torch.allclose(out, ref_out, rtol=1e-4, atol=out_atol)
        ok_grad = all(torch.allclose(grads[k], r, rtol=1e-3, atol=1e-5) for k, r in ref_grads.items())
        gdiff = max(float((grads[k] - r).abs().max()) for k, r in ref_grads.items())
        return (name, ok_out and ok_grad,
                f"output allclose={ok_out} (max |diff| {float((out - ref_out).abs().max()):.2e}), "
                f"grads allclose={ok_grad} (max |diff| {gdiff:.2e})")

    ref_out, ref_grads = run("unrolled", fwds["unrolled"])
    lines = []
    for name, fwd in fwds.items():
        if name == "unrolled":
            continue
        try:
            out, grads = run(name, fwd)
        except Exception as e:
            lines.append((name, False, f"error: {type(e).__name__}: {str(e).splitlines()[0][:200]}"))
            continue
        lines.append(compare(name, out, grads, 1e-5))
    if jx is not None:
        jax, forward, loss, place = jx
        params, xj, _, _ = place(host, x_np)
        out = torch.from_numpy(np.array(jax.jit(forward)(params, xj)))
        # JAX's gradients of the same loss, stacked per weight: layer i's slice against the loop's "i.<key>".
        stacked = jax.jit(jax.grad(loss))(params, xj)
        grads = {name: torch.from_numpy(np.array(stacked[key][int(i)]))
                 for name, (i, key) in ((name, name.split(".", 1)) for name in ref_grads)}
        lines.append(compare("jax", out, grads, 1e-4))
    return lines


# --------------------------------------------------------------------------- #
# Report.
# --------------------------------------------------------------------------- #


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or v != v else format(v, spec)


def ratio(a: float, b: float) -> float:
    return a / b if b and a == a and b == b else float("nan")


def print_table(results: dict[tuple[str, int], Result], layer_counts: list[int], methods: list[str]) -> None:
    head = (f"{'method':<12} {'L':>3} | {'compile s':>9} {'x unrl':>6} {'#':>2} | {'first s':>7} | {'step ms':>8} "
            f"{'x unrl':>6} | {'trace ms':>8} {'x unrl':>6} | {'IR nodes':>8} {'d2h':>4} | {'mem MiB':>7} {'x unrl':>6}")
    print(head)
    print("-" * len(head))
    for n in layer_counts:
        base = results.get(("unrolled", n))
        for m in methods:
            r = results.get((m, n))
            if r is None:
                continue
            if r.note.startswith("error"):
                print(f"{m:<12} {n:>3} | {r.note}")
                continue
            rc = ratio(r.compile_s, base.compile_s) if base else float("nan")
            rs = ratio(r.step_ms, base.step_ms) if base else float("nan")
            rt = ratio(r.trace_ms, base.trace_ms) if base and m != "jax" else float("nan")
            mem = r.mem_bytes / 2**20 if r.mem_bytes else float("nan")
            rm = ratio(r.mem_bytes or float("nan"), base.mem_bytes or float("nan")) if base else float("nan")
            trace = fmt(r.trace_ms, "8.2f") + ("*" if m == "jax" else " ")
            print(f"{m:<12} {n:>3} | {fmt(r.compile_s, '9.3f')} {fmt(rc, '6.2f')} {fmt(r.compiles, '2d')} | "
                  f"{fmt(r.first_s, '7.2f')} | {fmt(r.step_ms, '8.2f')} {fmt(rs, '6.2f')} | {trace:>9}{fmt(rt, '6.2f')} | "
                  f"{fmt(r.nodes, '8d')} {fmt(r.d2h, '4d')} | {fmt(mem, '7.2f')} {fmt(rm, '6.2f')}")
        print()
    print("compile: CompileTime metric delta over all steps of the run (jax: .compile()), #: number of")
    print("compilations (1 = only the first step compiled); first: wall time of step 1;")
    print("step: median fwd+bwd+sync+wait; trace: median host time until the lazy graph is built, before sync;")
    print("* jax: one-off jit(...).trace()+lower() time (no per-step tracing once compiled);")
    print("IR nodes: TensorsGraphSize of the steady step's graph; d2h: device->host transfers in steady steps;")
    print("mem (--memory): the compiled step's buffer assignment per device, from XLA's dump (scripts/xla_memory.py).")


def targets(results, layer_counts: list[int]) -> list[tuple[str, str, str]]:
    def ok(m: str, n: int) -> Result | None:
        r = results.get((m, n))
        return r if r is not None and not r.note.startswith("error") else None

    out = []
    ours = {n: ok("ours", n) for n in layer_counts if ok("ours", n)}
    unr = {n: ok("unrolled", n) for n in layer_counts if ok("unrolled", n)}
    tx = {n: ok("torch_xla", n) for n in layer_counts if ok("torch_xla", n)}
    missing = "n/a: ours did not run" if not ours else ""
    # 1a. our compile time flat in L.
    name = "ours compile time flat in L (max/min over L <= 1.5)"
    if len(ours) >= 2:
        c = {n: r.compile_s for n, r in ours.items()}
        spread = max(c.values()) / min(c.values())
        out.append((name, "PASS" if spread <= 1.5 else "FAIL",
                    f"max/min = {spread:.2f}; " + ", ".join(f"L={n}: {v:.2f}s" for n, v in c.items())))
    else:
        out.append((name, "FAIL" if missing else "n/a", missing or "needs two or more L"))
    # 1b. <= 0.5x unrolled at L=16.
    at = 16 if 16 in layer_counts else max(layer_counts)
    name = f"ours compile <= 0.5x unrolled at L={at}" + ("" if at == 16 else " (L=16 not run)")
    if at in ours and at in unr:
        rc = ratio(ours[at].compile_s, unr[at].compile_s)
        out.append((name, "PASS" if rc <= 0.5 else "FAIL",
                    f"{rc:.2f}x ({ours[at].compile_s:.2f}s vs {unr[at].compile_s:.2f}s)"))
    else:
        out.append((name, "FAIL", missing or "not measured"))
    def every_l(name: str, ratios: dict[int, float], limit: float, other: dict, other_name: str) -> None:
        """A ratio target checked at every L measured; SKIP when the other method did not run."""
        if ratios:
            out.append((name, "PASS" if all(v <= limit for v in ratios.values()) else "FAIL",
                        ", ".join(f"L={n}: {v:.2f}x" for n, v in ratios.items())))
        elif not other:
            out.append((name, "SKIP", f"{other_name} not measured"))
        else:
            out.append((name, "FAIL", missing))

    # 2. step time <= 1.15x unrolled at every L.
    every_l("ours step time <= 1.15x unrolled (every L)",
            {n: ratio(r.step_ms, unr[n].step_ms) for n, r in ours.items() if n in unr}, 1.15, unr, "unrolled")
    # 2b. step time <= 1.1x JAX lax.scan on the same model at every L.
    jx = {n: ok("jax", n) for n in layer_counts if ok("jax", n)}
    every_l("ours step time <= 1.1x jax lax.scan (every L)",
            {n: ratio(r.step_ms, jx[n].step_ms) for n, r in ours.items() if n in jx}, 1.1, jx, "jax")
    # 2c. the same with the weights stored stacked, as JAX's are (no per-step stacking): when it ran.
    stacked = {n: ok("ours_stacked", n) for n in layer_counts if ok("ours_stacked", n)}
    if stacked:
        every_l("ours_stacked step time <= 1.1x jax lax.scan (every L)",
                {n: ratio(r.step_ms, jx[n].step_ms) for n, r in stacked.items() if n in jx}, 1.1, jx, "jax")
    # 3. tracing per step <= torch_xla scan_layers (cache on) at every L.
    every_l("ours trace/step <= torch_xla scan_layers with its cache (every L)",
            {n: ratio(r.trace_ms, tx[n].trace_ms) for n, r in ours.items() if n in tx}, 1.0, tx,
            "torch_xla scan_layers")
    return out


def plot(results, layer_counts: list[int], methods: list[str], path: str, title: str = "decoder blocks") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("compile_s", "XLA compile time (s)"), ("step_ms", "steady step time (ms)"),
              ("trace_ms", "host tracing per step (ms)")]
    if any(r.mem_bytes for r in results.values()):
        panels.append(("mem_mib", "compiled step memory per device (MiB)"))
        for r in results.values():
            r.mem_mib = r.mem_bytes / 2**20 if r.mem_bytes else float("nan")
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.8 * (len(panels) + 1), 4.4))
    styles = {"unrolled": "o-", "ours": "s-", "ours_stacked": "s:", "ours_nothing": "s--", "ours_dots": "s-.", "torch_xla": "^-",
              "jax": "d--"}
    colors = {"unrolled": "C0", "ours": "C1", "ours_stacked": "C6", "ours_nothing": "C4", "ours_dots": "C5", "torch_xla": "C2",
              "jax": "C3"}
    for ax, (attr, panel_title) in zip(axes, panels):
        for m in methods:
            if attr == "trace_ms" and m == "jax":
                continue
            pts = [(n, getattr(results[(m, n)], attr)) for n in layer_counts
                   if (m, n) in results and getattr(results[(m, n)], attr) == getattr(results[(m, n)], attr)]
            if pts:
                ax.plot(*zip(*pts), styles[m], color=colors[m], label=m)
        ax.set_title(panel_title)
    ax = axes[-1]
    for m in methods:
        if m == "unrolled":
            continue
        for attr, ls in (("compile_s", "-"), ("step_ms", ":")):
            pts = [(n, ratio(getattr(results[(m, n)], attr), getattr(results[("unrolled", n)], attr)))
                   for n in layer_counts if (m, n) in results and ("unrolled", n) in results]
            pts = [p for p in pts if p[1] == p[1]]
            if pts:
                ax.plot(*zip(*pts), styles[m][0] + ls, color=colors[m], label=f"{m} {attr.split('_')[0]}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_title("ratio vs unrolled (solid: compile, dotted: step)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(layer_counts, [str(n) for n in layer_counts])
        ax.set_xlabel("layers L")
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"scan_layers vs unrolled loop: {title}, FSDP sharding over 8 virtual CPU devices")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


# --------------------------------------------------------------------------- #
# Main.
# --------------------------------------------------------------------------- #


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32], help="layer counts L")
    ap.add_argument("--steps", type=int, default=5, help="timed steady steps per (method, L)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (compiling) step")
    ap.add_argument("--quick", action="store_true", help="smoke run: L = 2 4, 2 steps")
    ap.add_argument("--out", default="bench_out/bench_scan.png", help="PNG plot path")
    ap.add_argument("--methods", nargs="+", choices=METHODS, default=None,
                    help="default: all")
    ap.add_argument("--model", choices=("block", "llama"), default="block",
                    help="block: torch_xla_ext.testing.models.CausalBlock (all methods); llama: Hugging Face "
                         "LlamaDecoderLayer through scan_layers' keyword arguments (every method but torch_xla)")
    ap.add_argument("--memory", action="store_true",
                    help="measure each compiled step's device memory from XLA's buffer assignment (slows compiles)")
    ap.add_argument("--check-layers", type=int, default=None,
                    help="L for the numerics check (default: the smallest L run)")
    ap.add_argument("--tpu", metavar="TOPOLOGY", default=None,
                    help="compile each method's step for a TPU topology (e.g. v5e:2x4; 8 chips) with libtpu's "
                         "compile-only client and report the TPU compiler's figures instead of timing on CPU")
    args = ap.parse_args()
    if args.quick:
        args.layers, args.steps = [2, 4], 2
    layer_counts = sorted(set(args.layers))
    cfg = Config()
    if args.methods is None:
        args.methods = list(METHODS)
    methods = [m for m in METHODS if m in args.methods]
    if "unrolled" not in methods:
        methods.insert(0, "unrolled")

    notes = []
    if args.model == "llama" and "torch_xla" in methods:
        methods.remove("torch_xla")
        notes.append("NOTE: --model llama runs no torch_xla column: torch_xla's scan_layers passes the layers no "
                     "keyword arguments (position_embeddings).")
    fwds: dict[str, Callable] = {"unrolled": fwd_unrolled}
    try:
        from torch_xla_ext import remat

        partition_fns = {"ours": None, "ours_stacked": None, "ours_nothing": remat.nothing_saveable,
                         "ours_dots": remat.dots_saveable}
        fwds.update({m: make_fwd_ours(fn) for m, fn in partition_fns.items()})
    except Exception as e:  # the subject of the benchmark: nothing to compare without it
        print(f"cannot import torch_xla_ext ({type(e).__name__}: {e}); install the package first", file=sys.stderr)
        return 2
    if "torch_xla" in methods:
        try:
            import flax  # noqa: F401  (torchax imports it)
            import torchax  # noqa: F401  (torch_xla's scan imports it for its SPMD backward)

            fwds["torch_xla"] = make_fwd_torch_xla()
        except Exception as e:
            notes.append(f"NOTE: torch_xla scan_layers column skipped: its SPMD backward imports torchax, which "
                         f"failed to import ({type(e).__name__}: {e}). Install flax==0.11.2 (with jax==0.7.1).")
            methods.remove("torch_xla")
    if args.tpu:
        return run_tpu(args, cfg, methods, fwds, partition_fns, layer_counts, notes)
    jx = None
    if "jax" in methods:
        try:
            jx = jax_setup(cfg, args.model)
            notes.append(f"NOTE: JAX runs in this same process (XLA_FLAGS={os.environ['XLA_FLAGS']!r}, "
                         f"{NUM_DEVICES} CPU devices); torch_xla's client uses CPU_NUM_DEVICES and is unaffected.")
        except Exception as e:
            notes.append(f"NOTE: jax column skipped ({type(e).__name__}: {e})")
            methods.remove("jax")

    import torch_xla_ext
    from torch_xla_ext.scan import scan_cache_info

    mesh = xs.Mesh(np.arange(NUM_DEVICES), (NUM_DEVICES,), ("fsdp",))
    kind = ("Hugging Face LlamaDecoderLayer (GQA, RMSNorm, rotary, SwiGLU)" if args.model == "llama"
            else "pre-norm decoder block")
    print(f"model: {kind} dim={cfg.dim} heads={cfg.heads} mlp={cfg.mlp}x seq={cfg.seq} "
          f"batch={cfg.batch}; fp32; 2-D weights sharded ('fsdp', None), batch sharded on 'fsdp' "
          f"over {NUM_DEVICES} virtual CPU devices")
    print(f"layers L={layer_counts}, methods={methods}; per method: 1 compiling step + {args.warmup} warm-up, "
          f"then {args.steps} timed steps interleaved round robin with the other methods; "
          f"each torch method has its own fresh copy of the same weights; host has {os.cpu_count()} CPU cores; "
          f"torch_xla's CPU client threads: PJRT_NPROC={os.environ.get('PJRT_NPROC', 'unset (XLA: one per device)')} "
          f"(torch_xla_ext sets twice the devices on a host with fewer cores: its collectives abort otherwise)")
    print(f"torch_xla_ext from {os.path.dirname(torch_xla_ext.__file__)}, torch {torch.__version__}, "
          f"torch_xla {torch_xla.__version__}" + (f", jax {jx[0].__version__}" if jx else ""))
    for n in notes:
        print(n)
    print(flush=True)

    results: dict[tuple[str, int], Result] = {}
    t_start = time.perf_counter()
    check_at = args.check_layers or layer_counts[0]
    check_lines = None
    cache_lines = []

    def failed(m: str, n: int, e: Exception) -> Result:
        return Result(m, n, note=f"error: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")

    for n in layer_counts:
        cpu_layers, x_cpu, host = build_model(args.model, cfg, n, fwds, partition_fns, methods)
        x_np = x_cpu.numpy()
        runners = {}
        for m in methods:  # compile + warm up, one method after the other
            t0 = time.perf_counter()
            try:
                if m == "jax":
                    runner = JaxRunner(jx, host, x_np)
                else:
                    runner = TorchRunner(m, fwds[m], *place(cpu_layers, x_cpu, mesh, stacked=m == "ours_stacked"))
                runner.first(args.warmup)
                runners[m] = runner
                note = runner.res.note
            except Exception as e:
                results[(m, n)] = failed(m, n, e)
                note = results[(m, n)].note
            print(f"  [{time.perf_counter() - t_start:6.1f}s] L={n:<3} {m:<9} compiled + warmed up in "
                  f"{time.perf_counter() - t0:5.1f}s  {note}", flush=True)
        before = scan_cache_info()
        t0 = time.perf_counter()
        for _ in range(args.steps):  # timed steps, round robin over the methods
            for m, runner in list(runners.items()):
                try:
                    runner.timed()
                except Exception as e:
                    results[(m, n)] = failed(m, n, e)
                    del runners[m]
        after = scan_cache_info()
        cache_lines.append(f"L={n}: +{after.traces - before.traces} traces, +{after.hits - before.hits} hits")
        for m, runner in runners.items():
            results[(m, n)] = runner.result()
        print(f"  [{time.perf_counter() - t_start:6.1f}s] L={n:<3} {args.steps} timed rounds in "
              f"{time.perf_counter() - t0:5.1f}s", flush=True)
        del runners
        if n == check_at:
            check_lines = check_numerics({m: fwds[m] for m in methods if m != "jax"},
                                         lambda stacked: place(cpu_layers, x_cpu, mesh, stacked), host, x_np,
                                         jx if "jax" in methods else None)
    print()
    print_table(results, layer_counts, methods)
    print()
    print("torch_xla_ext scan cache during the timed rounds: " + "; ".join(cache_lines))
    if check_lines is not None:
        print(f"\nnumerics at L={check_at} (vs unrolled loop):")
        for name, ok, line in check_lines:
            print(f"  {'OK  ' if ok else 'FAIL'} {name:<10} {line}")
    print("\ntargets:")
    for name, verdict, detail in targets(results, layer_counts):
        print(f"  {verdict:<4}  {name}: {detail}")
    print(f"\ntotal wall time {time.perf_counter() - t_start:.1f}s")
    plot(results, layer_counts, methods, args.out,
         "Hugging Face Llama decoder layers" if args.model == "llama" else "decoder blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
