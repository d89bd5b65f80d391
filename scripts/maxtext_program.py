"""MaxText's own training step compiled by this package's TPU compiler: the anchor's program on our libtpu.

MaxText's figures (``../shared/ANCHORS.md``) come from its own environment
and compiler (jax 0.12, libtpu 0.0.50.1); ``tpu-fit`` compiles with the
libtpu torch_xla 2.9 pins (0.0.21). To compare programs rather than
compilers, this runs MaxText 0.2.5's ``train_compile`` (``--maxtext-python``,
its own environment: an anchor, never a dependency) with XLA dumping its
step's HloModuleProto, rewrites the program's shardings into the form libtpu
0.0.21 reads, and compiles that program for the same slice with
``torch_xla_ext.tpu``'s compile-only client, the one ``tpu-fit`` uses.

Per row it prints HBM used per chip (the compiler's HBM buffer assignment
plus code, as ``tpu-fit`` reports it): MaxText's step compiled by its own
compiler, the same program compiled by ours, and ``tpu-fit``'s stacked
full-remat step of the same model, batch and slice (``sdpa`` and, below 128
chips, flash attention) with its ratio to MaxText's program on the same
compiler; and draws the four side by side (``--png``).

MaxText is run with ``shardy=False``: its program then carries its
shardings on the instructions, as mesh-axis ("named") shardings, which
libtpu 0.0.21 does not read (it would compile the program unsharded). Each
is rewritten as the tile assignment it denotes: a dimension split over mesh
axes ``(a, b)`` gets ``size(a) * size(b)`` tiles, the devices of the mesh
(in id order) transposed so that the listed axes come first and the unused
ones last, as a replicated trailing dimension. A sharding this does not
know how to read (explicit mesh device ids, sub-axes, unreduced or manual
axes) stops the script with its field named, never a guess.

``--libtpu-args`` gives our compiler alone flags (``LIBTPU_INIT_ARGS``, set
after MaxText's runs, so MaxText's own figure is unchanged; tpu-fit's child
processes inherit it): with ``--xla_tpu_enable_latency_hiding_scheduler=false``
the two programs are compared without the scheduler's overlap of
collectives with compute, which can cost memory.

    python scripts/maxtext_program.py --maxtext-python /path/to/maxtext-venv/bin/python --rows 8b-fp32 8b-bf16
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import math
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

os.environ.setdefault("PJRT_DEVICE", "CPU")  # torch_xla's own default, said without its warning
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_fit_time import maxtext_command  # noqa: E402  (the step's settings, kept in one place)
from proto_wire import fields, hlo_module_of, int_field, message_field  # noqa: E402

@dataclasses.dataclass(frozen=True)
class Row:
    maxtext: dict[str, str]  # MaxText settings replaced (``../shared/ANCHORS.md``)
    topology: str            # the same slice, in tpu-fit's spelling
    config: str              # tpu-fit's config file, under scripts/configs
    batch: int
    path: str                # tpu-fit's path: stacked, full remat, the same dtype


ROWS = {
    "8b-fp32": Row({}, "v5p:4x4x4", "llama3_8b.json", 64, "scan+nothing_saveable+stacked"),
    "8b-bf16": Row({"dtype": "bfloat16"}, "v5p:4x4x4", "llama3_8b.json", 64, "scan+nothing_saveable+bf16+stacked"),
    "70b-fp32": Row({"model_name": "llama3-70b", "compile_topology": "v5p-512"}, "v5p:8x8x4", "llama3_70b.json", 256,
                    "scan+nothing_saveable+stacked"),
    # 70B on the 8B rows' 64 chips, one sequence a chip as on 256: tpu-fit lowers it on the slice's own
    # devices, so flash attention is sized too (on 256 chips the kernel's per-shard shapes do not widen).
    "70b-fp32-64": Row({"model_name": "llama3-70b"}, "v5p:4x4x4", "llama3_70b.json", 64,
                       "scan+nothing_saveable+stacked"),
}

# ------------------------------------------------------------------ protobuf wire format
# The script reads and writes these messages of XLA's hlo.proto / xla_data.proto by
# field number, so that it needs no generated protobuf classes:
#   HloProto.hlo_module = 1; HloModuleProto.computations = 3; HloComputationProto.instructions = 2;
#   HloInstructionProto.sharding = 40; OpSharding: type = 1, tile_assignment_dimensions = 3,
#   tile_assignment_devices = 4, tuple_shardings = 5, replicate_on_last_tile_dim = 6,
#   named_sharding = 14 (mesh = 2 {axes = 1 {name = 1, size = 2}}, dim_shardings = 3
#   {axes = 1 {index = 1}, is_closed = 2}).
_OTHER = 3  # OpSharding.Type.OTHER: a tile assignment


def _refuse(what: str) -> None:
    raise SystemExit(f"maxtext_program: a sharding with {what} cannot be rewritten for libtpu 0.0.21")


def _mesh_axes(mesh: bytes) -> list[int]:
    sizes = []
    for number, axis, _ in fields(mesh):
        if number != 1:
            _refuse(f"mesh field {number} (explicit device ids?)")
        sizes.append(dict((n, v) for n, v, _ in fields(axis)).get(2, 1))
    return sizes


def tile_assignment(named: bytes) -> tuple[list[int], np.ndarray | None, bool]:
    """The tile dimensions and devices a named sharding denotes, and whether the last dimension replicates.

    Devices None when the sharding is replicated.
    """
    sizes: list[int] = []
    dims: list[list[int]] = []
    for number, value, _ in fields(named):
        if number == 2:
            sizes = _mesh_axes(value)
        elif number == 3:
            axes = []
            for field, axis, _ in fields(value):
                if field == 1:
                    parts = dict((n, v) for n, v, _ in fields(axis))
                    if set(parts) - {1}:
                        _refuse("a sub-axis")
                    axes.append(parts.get(1, 0))
                elif field != 2:  # 2: is_closed, no bearing on the partitioning
                    _refuse(f"dimension-sharding field {field}")
            dims.append(axes)
        else:
            _refuse(f"named-sharding field {number} (replicated, unreduced or manual axes)")
    tiles = [math.prod(sizes[a] for a in axes) for axes in dims]
    if math.prod(tiles) == 1:
        return tiles, None, False
    used = [a for axes in dims for a in axes]
    unused = [a for a in range(len(sizes)) if a not in used]
    devices = np.arange(math.prod(sizes)).reshape(sizes).transpose(used + unused)
    rest = math.prod(sizes[a] for a in unused)
    return tiles + ([rest] if rest > 1 else []), devices.reshape(-1), rest > 1


def rewrite_sharding(sharding: bytes) -> bytes:
    """An OpSharding with its named sharding (and its tuple elements') as a tile assignment."""
    parts = list(fields(sharding))
    named = [value for number, value, _ in parts if number == 14]
    if not named:
        return b"".join(message_field(5, rewrite_sharding(v)) if n == 5 else raw for n, v, raw in parts)
    kept = b"".join(raw for number, _, raw in parts if number not in (1, 14))
    tiles, devices, replicate_last = tile_assignment(named[0])
    if devices is None:
        return kept  # type REPLICATED, the default
    out = int_field(1, _OTHER) + b"".join(int_field(3, t) for t in tiles)
    out += b"".join(int_field(4, int(d)) for d in devices)
    if replicate_last:
        out += int_field(6, 1)
    return out + kept


def rewrite_module(dumped: bytes) -> bytes:
    """The HloModuleProto of an ``xla_dump_hlo_as_proto`` dump (an HloProto), its shardings rewritten."""
    module = hlo_module_of(dumped)

    def instruction(buf: bytes) -> bytes:
        return b"".join(message_field(40, rewrite_sharding(v)) if n == 40 else raw for n, v, raw in fields(buf))

    def computation(buf: bytes) -> bytes:
        return b"".join(message_field(2, instruction(v)) if n == 2 else raw for n, v, raw in fields(buf))

    return b"".join(message_field(3, computation(v)) if n == 3 else raw for n, v, raw in fields(module))


# ------------------------------------------------------------------ the two compiles
def maxtext_dump(python: str, replaced: dict[str, str], out_dir: str) -> tuple[str, int]:
    """Run MaxText's train_compile dumping its step: (the dump directory, its own HBM used in bytes)."""
    os.makedirs(out_dir)
    dump = os.path.join(out_dir, "dump")
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_proto --xla_dump_hlo_as_text "
                                      "--xla_dump_hlo_module_re=jit_train_step"}
    log = os.path.join(out_dir, "maxtext.log")
    with open(log, "w") as f:
        rc = subprocess.call(maxtext_command(python, out_dir, {**replaced, "shardy": "False"}),
                             stdout=f, stderr=subprocess.STDOUT, env=env)
    if rc != 0:
        with open(log) as f:
            tail = "".join(f.readlines()[-8:])
        raise SystemExit(f"MaxText's train_compile exited with status {rc}; the end of its output:\n{tail}")
    with open(log) as f:
        code = re.findall(r"generated_code_size_in_bytes=(\d+)", f.read())
    from torch_xla_ext.tpu._client import hbm_buffer_bytes
    own = hbm_buffer_bytes(dump)
    if not code or own is None:
        raise SystemExit("MaxText's run printed no memory analysis or wrote no buffer assignment")
    return dump, own + int(code[-1])


def compiled_here(dump: str, topology: str) -> int:
    """HBM used per chip by the dumped program compiled with this package's client (libtpu 0.0.21)."""
    from torch_xla_ext.tpu import _client

    found = glob.glob(os.path.join(dump, "*jit_train_step*.before_optimizations.hlo.pb"))
    if len(found) != 1:
        raise SystemExit(f"expected one jit_train_step program in {dump}, found {len(found)}")
    with open(found[0], "rb") as f:
        hlo = rewrite_module(f.read())
    sized = _client.compile_sized(hlo, _client.topology_devices(topology))
    if sized.program is None or sized.hbm_buffer_bytes is None:
        raise SystemExit(f"libtpu 0.0.21 did not compile MaxText's program: {sized.refusal}")
    return sized.hbm_buffer_bytes + sized.program.memory["generated_code_size_in_bytes"]


def ours(row: Row, attention: str) -> int | None:
    """HBM used per chip by tpu-fit's step for ``row`` (None: tpu-fit cannot size it with ``attention``)."""
    from torch_xla_ext.tpu import CompiledForTpu
    from torch_xla_ext.tpu._client import topology_devices
    from torch_xla_ext.tpu.fit import fit, lowering_devices

    chips = len(topology_devices(row.topology))
    if attention == "flash" and lowering_devices(chips) != chips:
        return None  # tpu-fit refuses it: the kernel's per-shard shapes do not widen (README, Sizing)
    (report,) = fit(os.path.join(HERE, "configs", row.config), row.topology, batch=row.batch, seq=2048,
                    paths=[row.path], attention=attention)
    used = None if report.compiled is None else CompiledForTpu(**report.compiled).hbm_used_bytes
    if used is None:
        raise SystemExit(f"tpu-fit did not size {row.path} ({attention}): {report.error}")
    return used


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--maxtext-python", required=True, help="the python of an environment with maxtext[tpu]==0.2.5")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--png", default="bench_out/maxtext_program.png")
    ap.add_argument("--libtpu-args", default=None,
                    help="flags for our compiler only (LIBTPU_INIT_ARGS, set after MaxText's runs), e.g. "
                         "--xla_tpu_enable_latency_hiding_scheduler=false")
    args = ap.parse_args()
    if args.libtpu_args is not None and not args.libtpu_args.startswith("--"):
        ap.error(f"--libtpu-args takes libtpu flags (--name=value ...), got {args.libtpu_args!r}")
    gib = 2 ** 30
    print("HBM used per chip, GiB. MaxText: its step on its compiler (libtpu 0.0.50.1), then on ours (0.0.21); "
          "tpu-fit: the stacked full-remat step on ours, x MaxText's program on the same compiler", flush=True)
    print("| row | slice | MaxText, its compiler | MaxText, our compiler | tpu-fit sdpa | x | tpu-fit flash | x |",
          flush=True)
    print("|---|---|---|---|---|---|---|---|", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="maxtext_program_") as out:
        # Every MaxText run first: this process loads libtpu 0.0.21 only after them, so that no run of
        # MaxText's own libtpu starts beside it (or inherits the switch that lets two load at once).
        dumps = {name: maxtext_dump(args.maxtext_python, ROWS[name].maxtext, os.path.join(out, name))
                 for name in args.rows}
        if args.libtpu_args is not None:  # read when libtpu 0.0.21 starts: here, and in tpu-fit's children
            os.environ["LIBTPU_INIT_ARGS"] = args.libtpu_args
            print(f"our compiler's flags: {args.libtpu_args}", flush=True)
        for name in args.rows:
            row = ROWS[name]
            dump, own = dumps[name]
            here = compiled_here(dump, row.topology)
            sdpa, flash = ours(row, "sdpa"), ours(row, "flash")
            results[name] = (own, here, sdpa, flash)
            cells = [f"{b / gib:.3f} | {b / here:.3f}x" if b is not None else "cannot be sized |"
                     for b in (sdpa, flash)]
            print(f"| {name} | {row.topology} | {own / gib:.3f} | {here / gib:.3f} | {cells[0]} | {cells[1]} |",
                  flush=True)
    _plot(results, args.png)
    print(f"wrote {args.png}")
    return 0


def _plot(results: dict[str, tuple[int, int, int | None, int | None]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["MaxText, its compiler", "MaxText, our compiler", "tpu-fit sdpa", "tpu-fit flash"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.2
    for k, label in enumerate(labels):
        xs = [i + (k - 1.5) * width for i, r in enumerate(results.values()) if r[k] is not None]
        ys = [r[k] / 2**30 for r in results.values() if r[k] is not None]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks(range(len(results)), list(results))
    ax.set_ylabel("GiB of HBM used per chip")
    ax.legend(fontsize=8)
    ax.set_title("Full-remat Llama-3 steps: MaxText's program and tpu-fit's on the same compiler")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
