"""Command line: ``python -m torch_xla_ext {demo,audit}``.

``demo``   lowers a sharded MLP on an SPMD mesh, prints the HLO parameter table
           read by the C++ reader, and compares torch_xla's host parameter
           mapping with the device mapping (time, bytes moved, gathers).
``audit``  prints the same report for any saved ``xla.HloModuleProto`` file.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import time
from collections.abc import Sequence

import torch  # importing torch (not torch_xla) before the device is chosen is fine

from ._format import format_bytes, parse_tiled_spec


def _default_to_cpu_devices(num_devices: int) -> str:
    """Use PJRT's CPU client with virtual devices unless the user chose a device or a TPU is attached."""
    if "PJRT_DEVICE" in os.environ:
        return f"PJRT_DEVICE={os.environ['PJRT_DEVICE']} (set by the user)"
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return "TPU detected; PJRT_DEVICE left to torch_xla"
    os.environ["PJRT_DEVICE"] = "CPU"
    os.environ.setdefault("CPU_NUM_DEVICES", str(num_devices))
    return f"PJRT_DEVICE=CPU, CPU_NUM_DEVICES={os.environ['CPU_NUM_DEVICES']} (no device chosen, no TPU found)"


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _demo(args: argparse.Namespace) -> int:
    where = _default_to_cpu_devices(8)
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import torch_xla_ext as txe

    xr.use_spmd()
    device = torch_xla.device()
    n = xr.global_runtime_device_count()
    print(f"torch_xla_ext demo: {n} devices ({where})")
    if n % 2:
        mesh = xs.Mesh(np.arange(n), (n, 1), ("fsdp", "tensor"))
    else:
        mesh = xs.Mesh(np.arange(n), (n // 2, 2), ("fsdp", "tensor"))
    print(f"mesh {dict(zip(mesh.axis_names, mesh.mesh_shape))}\n")

    torch.manual_seed(0)
    width, hidden, batch = args.width, 4 * args.width, 16

    def sharded(t: torch.Tensor, spec: tuple) -> torch.Tensor:
        t = t.to(device)
        xs.mark_sharding(t, mesh, spec)
        return t

    layers = []
    for _ in range(args.layers):
        layers.append((
            sharded(torch.randn(hidden, width) / width**0.5, ("tensor", "fsdp")),
            sharded(torch.zeros(hidden), ("tensor",)),
            sharded(torch.randn(width, hidden) / hidden**0.5, ("fsdp", "tensor")),
        ))
    x = sharded(torch.randn(batch, width), ("fsdp", None))
    torch_xla.sync()

    h = x
    for w1, b1, w2 in layers:
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

    from torch_xla_ext.testing import measure_transfers

    print("\nFetching the parameters (fresh lowering for each, so nothing is cached):")
    rows = []
    for label, fetch in (
        ("host mapping   (parameter_id_tensor_mapping)", lambda c: c.parameter_id_tensor_mapping()),
        ("device mapping (device_parameter_id_tensor_mapping)", lambda c: c.device_parameter_id_tensor_mapping()),
    ):
        c = txe.LoweringContext("sharded_mlp")
        c.build([y])
        with measure_transfers() as m:
            t0 = time.perf_counter()
            mapping = fetch(c)
            elapsed = time.perf_counter() - t0
        rows.append((label, len(mapping), f"{elapsed * 1e3:.2f} ms", format_bytes(m.d2h_bytes),
                     m.d2h_transfers, m.replicate_sharded_data))
    print(_table(["path", "params", "time", "bytes to host", "transfers", "ReplicateShardedData"], rows))
    host_ms = float(rows[0][2].split()[0])
    dev_ms = float(rows[1][2].split()[0])
    print(f"\ndevice mapping is {host_ms / max(dev_ms, 1e-6):.0f}x faster and moved "
          f"{rows[1][3]} to the host (host mapping: {rows[0][3]}).")

    with txe.no_host_transfers():
        same = ctx.device_parameter_id_tensor_mapping()
        reused = sum(t.sum() for t in same.values() if t.is_floating_point())
        torch_xla.sync()
    print("device-mapped tensors reused in a new computation under no_host_transfers(): ok")
    del reused
    _demo_scan_layers(mesh, args)
    _demo_fsdp(args)
    return 0


class _Block(torch.nn.Module):
    """The demo's residual MLP block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


def _demo_scan_layers(mesh, args: argparse.Namespace) -> None:
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.spmd as xs

    import torch_xla_ext as txe
    from torch_xla_ext.testing import measure_transfers

    print("\nscan_layers: the same blocks as one XLA while loop (forward) and one in reverse (backward)")
    device = torch_xla.device()
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(_Block(args.width) for _ in range(args.layers)).to(device)
    for layer in layers:  # FSDP-style: weights sharded on dim 0 over the mesh's first axis
        xs.mark_sharding(layer.up.weight, mesh, (mesh.axis_names[0], None))
        xs.mark_sharding(layer.down.weight, mesh, (mesh.axis_names[0], None))
    x = torch.randn(16, args.width).to(device)
    xs.mark_sharding(x, mesh, (mesh.axis_names[0], None))
    torch_xla.sync()

    rows = []
    outputs = {}
    for label, run in (("unrolled loop", lambda h: _unrolled(layers, h)),
                       ("txe.scan_layers", lambda h: txe.scan_layers(layers, h))):
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
    spec = torch_xla._XLAC._get_xla_sharding_spec
    sharded = all(spec(layer.up.weight.grad) == spec(layer.up.weight) for layer in layers)
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


class _Decoder(torch.nn.Module):
    """A small decoder whose token embedding is tied to the LM head."""

    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(_Block(width) for _ in range(layers))
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        torch.nn.init.normal_(self.embed.weight, std=width**-0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        import torch_xla_ext as txe

        return self.head(txe.scan_layers(self.layers, self.embed(tokens)))


def _demo_fsdp(args: argparse.Namespace) -> None:
    import numpy as np
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import torch_xla_ext as txe
    from torch_xla_ext.distributed import fully_shard, get_fully_sharded_modules
    from torch_xla_ext.testing import measure_transfers

    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    vocab = 256
    print(f"\nfully_shard: a {args.layers}-layer decoder (embedding tied to the head), each layer and the root "
          f"sharded over {n} devices, trained with scan_layers")
    torch.manual_seed(0)
    model = _Decoder(vocab, args.width, args.layers)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
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
    losses = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        with measure_transfers() as m, txe.no_host_transfers():
            optimizer.zero_grad(set_to_none=True)
            logits = model(tokens)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            loss.backward()
            optimizer.step()
            torch_xla.sync()
        moved += m.d2h_bytes
        losses.append(loss.item())  # read after the guarded step
        done = (step + 1) * 30 // args.steps
        print(f"\r  [{'#' * done}{'.' * (30 - done)}] step {step + 1}/{args.steps}  loss {losses[-1]:.4f}  "
              f"{time.perf_counter() - t0:.2f} s", end="", flush=True)
    print()
    spec = torch_xla._XLAC._get_xla_sharding_spec
    sharded = all(spec(p.grad) == spec(p) for p in params)
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; bytes moved device->host inside the training steps: "
          f"{moved}; every gradient sharded like its parameter: {sharded}")


def _per_device_bytes(t: torch.Tensor) -> int:
    """Bytes one device holds of ``t``, from its sharding string."""
    import torch_xla

    tiled = parse_tiled_spec(torch_xla._XLAC._get_xla_sharding_spec(t))
    shards = 1
    if tiled:
        dims, _, replicated_last = tiled
        for d in dims[:-1] if replicated_last else dims:
            shards *= d
    return t.numel() * t.element_size() // shards


def _unrolled(layers, h):
    for layer in layers:
        h = layer(h)
    return h


def _audit(args: argparse.Namespace) -> int:
    from torch_xla_ext.hlo import read_hlo

    try:
        with open(args.file, "rb") as f:
            data = f.read()
    except OSError as e:
        print(f"error: cannot read {args.file}: {e.strerror}", file=sys.stderr)
        return 2
    try:
        module = read_hlo(data)
    except ValueError as e:
        print(f"error: {args.file} is not a valid serialized HloModuleProto: {e}", file=sys.stderr)
        return 2
    print(module.summary())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_xla_ext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="lower a sharded MLP and compare host vs device parameter mapping")
    demo.add_argument("--layers", type=int, default=8, help="MLP blocks (default 8)")
    demo.add_argument("--width", type=int, default=256, help="model width (default 256)")
    demo.add_argument("--steps", type=int, default=5, help="training steps of the fully sharded decoder")
    demo.set_defaults(run=_demo)
    audit = sub.add_parser("audit", help="report on a saved serialized HloModuleProto")
    audit.add_argument("file", help="path to the .pb file")
    audit.set_defaults(run=_audit)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
