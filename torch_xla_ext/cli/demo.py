"""``python -m torch_xla_ext demo``: four short sections on an SPMD mesh.

1. Lower a sharded MLP, print the HLO parameter table read by the C++ reader,
   and compare torch_xla's host parameter mapping with the device mapping
   (time, bytes moved to the host, gathers).
2. Run a stack of blocks unrolled and through ``scan_layers`` (forward and
   backward), compare the results and the lowered while loops.
3. Train a small decoder (embedding tied to the head) under ``fully_shard``
   and show that the steps move nothing to the host.
4. Compile the same training step for a TPU v5p slice with libtpu's
   compile-only client (``torch_xla_ext.tpu``): peak HBM per chip, fits.

Measurements are kept as numbers and formatted only when printed.
``run_demo`` must be called before ``torch_xla`` is imported: it picks the
PJRT device and XLA's C++ log level first.
"""

from __future__ import annotations

import glob
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._cpu_threads import widen_cpu_client_threads
from .._format import format_bytes, parse_tiled_spec

__all__ = ["run_demo"]


def _default_to_cpu_devices(num_devices: int) -> str:
    """Use PJRT's CPU client with virtual devices unless the user chose a device or a TPU is attached."""
    if "PJRT_DEVICE" in os.environ:
        return f"PJRT_DEVICE={os.environ['PJRT_DEVICE']} (set by the user)"
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return "TPU detected; PJRT_DEVICE left to torch_xla"
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ.setdefault("CPU_NUM_DEVICES", str(num_devices))
    threads = widen_cpu_client_threads()
    more = f", PJRT_NPROC={threads}" if threads else ""
    return f"PJRT_DEVICE=CPU, CPU_NUM_DEVICES={os.environ['CPU_NUM_DEVICES']}{more} (no device chosen, no TPU found)"


# XLA's C++ logging: 2 hides INFO and WARNING lines and keeps ERROR ones. Left
# alone, every SPMD compilation prints "GSPMD sharding propagation is going to be
# deprecated", dozens of times in one demo run.
QUIET_XLA_LOG_LEVEL = "2"


def default_xla_log_level() -> None:
    """Hide XLA's C++ warnings unless the user set ``TF_CPP_MIN_LOG_LEVEL``.

    Must run before ``torch_xla`` is imported: its import sets the variable to
    1 (warnings shown) when it is unset, and XLA's logging reads it only once.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", QUIET_XLA_LOG_LEVEL)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A left-aligned text table with a dashed rule under the header."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _sharding_spec(t: torch.Tensor) -> str:
    """The XLA sharding string of ``t`` (``""`` when it has none); reads no data."""
    from .._xla import xlac

    return xlac()._get_xla_sharding_spec(t)


def _per_device_bytes(t: torch.Tensor) -> int:
    """Bytes one device holds of ``t``, from its sharding string."""
    tiled = parse_tiled_spec(_sharding_spec(t))
    shards = 1
    if tiled:
        dims, _, replicated_last = tiled
        for d in dims[:-1] if replicated_last else dims:
            shards *= d
    return t.numel() * t.element_size() // shards


@dataclass(frozen=True)
class _Fetch:
    """One way of fetching a lowering's parameters, as measured."""

    label: str
    params: int
    seconds: float
    d2h_bytes: int
    d2h_transfers: int
    replicate_sharded_data: int


def run_demo(layers: int, width: int, steps: int) -> int:
    """Run the four sections; returns the process exit status (0)."""
    where = _default_to_cpu_devices(8)
    default_xla_log_level()
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    from .._xla import torch_xla_device

    xr.use_spmd()
    torch_xla_device()  # the runtime starts here, in SPMD mode
    n = xr.global_runtime_device_count()
    print(f"torch_xla_ext demo: {n} devices ({where})")
    shape = (n, 1) if n % 2 else (n // 2, 2)
    mesh = xs.Mesh(np.arange(n), shape, ("fsdp", "tensor"))
    print(f"mesh {dict(zip(mesh.axis_names, mesh.mesh_shape))}\n")
    _demo_parameter_mapping(mesh, layers, width)
    _demo_scan_layers(mesh, layers, width)
    _demo_fsdp(layers, width, steps)
    _demo_tpu(layers, width)
    return 0


def _demo_parameter_mapping(mesh: Any, layers: int, width: int) -> None:
    """Section 1: the parameter table, then host vs device parameter mapping."""
    import torch_xla
    import torch_xla.distributed.spmd as xs

    import torch_xla_ext as txe

    from ..testing import measure_transfers

    device = torch_xla.device()
    torch.manual_seed(0)
    hidden, batch = 4 * width, 16

    def sharded(t: torch.Tensor, spec: tuple) -> torch.Tensor:
        t = t.to(device)
        xs.mark_sharding(t, mesh, spec)
        return t

    weights = [(sharded(torch.randn(hidden, width) / width**0.5, ("tensor", "fsdp")),
                sharded(torch.zeros(hidden), ("tensor",)),
                sharded(torch.randn(width, hidden) / hidden**0.5, ("fsdp", "tensor")))
               for _ in range(layers)]
    x = sharded(torch.randn(batch, width), ("fsdp", None))
    torch_xla.sync()

    h = x
    for w1, b1, w2 in weights:
        h = h + torch.nn.functional.gelu(h @ w1.T + b1) @ w2.T * 0.5
    y = h + 1e-3 * torch.randn_like(h)  # a random op: the graph reads the RNG seed

    ctx = txe.LoweringContext("sharded_mlp")
    ctx.build([y])
    params = ctx.parameters(inputs=[x])
    module = ctx.module
    print(f"HLO module {module.name!r}: {module.num_instructions} instructions, "
          f"{len(module.entry_parameters)} parameters, constants {format_bytes(module.constants_bytes)}, "
          f"host-transfer instructions {len(module.host_transfers())}, while loops {len(module.while_loops())}")
    print(_table(
        ["#", "name", "shape", "dtype", "sharding", "kind"],
        [(p.number, p.name, p.hlo_shape, str(p.dtype).replace("torch.", ""), p.sharding or "-", p.kind)
         for p in params],
    ))

    print("\nFetching the parameters (fresh lowering for each, so nothing is cached):")
    fetches: list[_Fetch] = []
    ways: tuple[tuple[str, Callable[[Any], dict]], ...] = (
        ("host mapping   (parameter_id_tensor_mapping)", lambda c: c.parameter_id_tensor_mapping()),
        ("device mapping (device_parameter_id_tensor_mapping)", lambda c: c.device_parameter_id_tensor_mapping()),
    )
    for label, fetch in ways:
        c = txe.LoweringContext("sharded_mlp")
        c.build([y])
        with measure_transfers() as m:
            t0 = time.perf_counter()
            mapping = fetch(c)
            elapsed = time.perf_counter() - t0
        fetches.append(_Fetch(label, len(mapping), elapsed, int(m.d2h_bytes), m.d2h_transfers,
                              m.replicate_sharded_data))
    print(_table(["path", "params", "time", "bytes to host", "transfers", "ReplicateShardedData"],
                 [(f.label, f.params, f"{f.seconds * 1e3:.2f} ms", format_bytes(f.d2h_bytes), f.d2h_transfers,
                   f.replicate_sharded_data) for f in fetches]))
    host, dev = fetches
    print(f"\ndevice mapping is {host.seconds / max(dev.seconds, 1e-9):.0f}x faster and moved "
          f"{format_bytes(dev.d2h_bytes)} to the host (host mapping: {format_bytes(host.d2h_bytes)}).")

    with txe.no_host_transfers():
        same = ctx.device_parameter_id_tensor_mapping()
        reused = sum(t.sum() for t in same.values() if t.is_floating_point())
        torch_xla.sync()
    print("device-mapped tensors reused in a new computation under no_host_transfers(): ok")
    del reused


def _unrolled(layers: torch.nn.ModuleList, h: torch.Tensor) -> torch.Tensor:
    """The blocks applied one after the other in Python."""
    for layer in layers:
        h = layer(h)
    return h


def _demo_scan_layers(mesh: Any, num_layers: int, width: int) -> None:
    """Section 2: unrolled loop vs ``scan_layers``, forward and backward."""
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.spmd as xs

    import torch_xla_ext as txe

    from ..testing import measure_transfers
    from ..testing.models import MLPBlock

    print("\nscan_layers: the same blocks as one XLA while loop (forward) and one in reverse (backward)")
    device = torch_xla.device()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(MLPBlock(width, 4 * width) for _ in range(num_layers)).to(device)
    for layer in layers:  # FSDP-style: weights sharded on dim 0 over the mesh's first axis
        xs.mark_sharding(layer.up.weight, mesh, (mesh.axis_names[0], None))
        xs.mark_sharding(layer.down.weight, mesh, (mesh.axis_names[0], None))
    x = torch.randn(16, width).to(device)
    xs.mark_sharding(x, mesh, (mesh.axis_names[0], None))
    torch_xla.sync()

    rows = []
    outputs = {}
    runs: tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...] = (
        ("unrolled loop", lambda h: _unrolled(layers, h)),
        ("txe.scan_layers", lambda h: txe.scan_layers(layers, h)),
    )
    for label, run in runs:
        layers.zero_grad(set_to_none=True)
        compiles = met.metric_data("CompileTime") or (0, 0)
        with measure_transfers() as m:
            with txe.no_host_transfers():
                t0 = time.perf_counter()
                out = run(x)
                out.square().mean().backward()
                traced = time.perf_counter() - t0
                torch_xla.sync()
                first = time.perf_counter() - t0
        after = met.metric_data("CompileTime") or (0, 0)
        outputs[label] = (out, [p.grad for p in layers.parameters()])
        rows.append((label, f"{traced * 1e3:.1f} ms", f"{(after[1] - compiles[1]) / 1e9:.2f} s",
                     f"{first:.2f} s", format_bytes(m.d2h_bytes)))
    print(_table(["forward+backward", "tracing", "XLA compile", "first step", "bytes to host"], rows))

    (out_u, grads_u), (out_s, grads_s) = outputs["unrolled loop"], outputs["txe.scan_layers"]
    same = torch.allclose(out_u.cpu(), out_s.cpu(), atol=1e-4, rtol=1e-4) and all(
        torch.allclose(a.cpu(), b.cpu(), atol=1e-4, rtol=1e-4) for a, b in zip(grads_u, grads_s))
    sharded = all(_sharding_spec(layer.up.weight.grad) == _sharding_spec(layer.up.weight) for layer in layers)
    print(f"outputs and gradients equal the unrolled loop: {same}; "
          f"gradients sharded like their weights: {sharded}")

    layers.zero_grad(set_to_none=True)
    loss = txe.scan_layers(layers, x).square().mean()
    loss.backward()
    ctx = txe.LoweringContext("scan_layers_step")
    ctx.build([loss] + [p.grad for p in layers.parameters()])
    loops = ctx.module.while_loops()
    print(f"lowered step: {len(loops)} while loops, {ctx.module.num_instructions} instructions, "
          f"{len(ctx.module.host_transfers())} host-transfer instructions")
    torch_xla.sync()


def _demo_fsdp(num_layers: int, width: int, steps: int) -> None:
    """Section 3: a fully sharded decoder with a tied embedding, trained with ``scan_layers``."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import torch_xla_ext as txe

    from ..distributed import get_fully_sharded_modules
    from ..testing import measure_transfers

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    vocab = 256
    print(f"\nfully_shard: a {num_layers}-layer decoder (embedding tied to the head), each layer and the root "
          f"sharded over {n} devices, trained with scan_layers")
    model = _sharded_decoder(mesh, vocab, num_layers, width)
    params = list(model.parameters())
    total = sum(p.numel() * p.element_size() for p in params)
    per_device = sum(_per_device_bytes(p) for p in params)
    print(f"{len(get_fully_sharded_modules(model))} fully sharded modules; tied weight kept: "
          f"{model.embed.weight is model.head.weight}; parameters {format_bytes(total)} total, "
          f"{format_bytes(per_device)} per device")
    device = torch_xla.device()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (16, 32), generator=g).to(device)
    targets = torch.roll(tokens, -1, dims=1)
    xs.mark_sharding(tokens, mesh, ("fsdp", None))
    xs.mark_sharding(targets, mesh, ("fsdp", None))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, foreach=False)
    moved = 0
    losses: list[float] = []
    terminal = sys.stdout.isatty()
    for step in range(steps):
        t0 = time.perf_counter()
        with measure_transfers() as m, txe.no_host_transfers():
            optimizer.zero_grad(set_to_none=True)
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
            torch_xla.sync()
        moved += int(m.d2h_bytes)
        losses.append(loss.item())  # read after the guarded step
        done = (step + 1) * 30 // steps
        line = (f"  [{'#' * done}{'.' * (30 - done)}] step {step + 1}/{steps}  loss {losses[-1]:.4f}  "
                f"{time.perf_counter() - t0:.2f} s")
        # A progress bar redrawn in place on a terminal; one line per step in a log file or CI.
        print("\r" + line if terminal else line, end="" if terminal else "\n", flush=True)
    if terminal:
        print()
    sharded = all(_sharding_spec(p.grad) == _sharding_spec(p) for p in params)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; bytes moved device->host inside the training steps: "
          f"{moved}; every gradient sharded like its parameter: {sharded}")


def _sharded_decoder(mesh: Any, vocab: int, num_layers: int, width: int) -> torch.nn.Module:
    """The demo's decoder (seeded), ``fully_shard`` on each layer and on the root."""
    from ..distributed import fully_shard
    from ..testing.models import Decoder

    torch.manual_seed(0)
    model = Decoder(vocab, width, num_layers, embed_std=width**-0.5)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


TPU_TOPOLOGY = "v5p:2x2x2"


def _demo_tpu(num_layers: int, width: int) -> None:
    """Section 4: the fully sharded training step compiled for a TPU slice, here, with no TPU."""
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    from .. import tpu
    from ..tpu._client import topology_devices

    n = xr.global_runtime_device_count()
    print(f"\nTPU fit check: the same fully sharded step compiled for a TPU {TPU_TOPOLOGY} slice by libtpu's "
          f"compile-only client (nothing runs)")
    try:
        topology_devices(TPU_TOPOLOGY)
    except tpu.TpuUnavailable as error:
        print(f"skipped: {error}")
        return
    if n != 8:
        print(f"skipped: {TPU_TOPOLOGY} has 8 chips and this run has {n} devices")
        return
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    vocab, device = 256, torch_xla.device()
    with tpu.lowering():
        model = _sharded_decoder(mesh, vocab, num_layers, width)
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, vocab, (16, 32), generator=g).to(device)
        xs.mark_sharding(tokens, mesh, ("fsdp", None))
        params = list(model.parameters())
        optimizer = torch.optim.SGD(params, lr=0.2, foreach=False)
        before = [p.clone() for p in params]  # the parameters' buffers, which the step reuses (donates)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), torch.roll(tokens, -1, dims=1).flatten())
        loss.backward()
        optimizer.step()
    r = tpu.compile([loss], topology=TPU_TOPOLOGY, donated=list(zip(before, params)))
    print(r)
