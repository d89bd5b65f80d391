#!/usr/bin/env python
"""Benchmark: fetching the parameters of a lowered SPMD graph.

Side by side, in one run, on 8 virtual CPU devices:

  host      torch_xla's ``parameter_id_tensor_mapping()``: gathers every sharded
            tensor (ReplicateShardedData) and copies it to the host
  native    torch_xla's ``device_parameter_id_tensor_mapping()`` (raw binding)
  ours      ``torch_xla_ext.LoweringContext.device_parameter_id_tensor_mapping()``
  fallback  the same through ``_get_tensors_xla_device_data_node`` (it walks
            the graph's device data in ``build()``, outside the timed call)

and ``LoweringContext.tensor_parameter_ids(ts)`` against calling torch_xla's
``tensor_parameter_id`` once per tensor (a linear search each).

Two sweeps: the number of parameters P at fixed total bytes, and the total
sharded bytes at fixed P. Every timing is the median over fresh lowerings
(a new LoweringContext per repetition, so nothing is cached). Peak RSS
growth is sampled while each call runs. Prints a table of absolute numbers and
ratios, checks the targets, and writes a PNG plot.

    python scripts/bench_param_mapping.py [--quick] [--out bench_out/param_mapping.png]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")

import numpy as np  # noqa: E402
import psutil  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.spmd as xs  # noqa: E402
import torch_xla.runtime as xr  # noqa: E402

import torch_xla_ext as txe  # noqa: E402
from torch_xla_ext.testing import measure_transfers  # noqa: E402

MiB = 1 << 20


class PeakRSS:
    """Samples the process RSS in a thread; ``growth`` is peak minus the starting RSS."""

    def __init__(self, interval: float = 0.0005) -> None:
        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.start = self.peak = 0

    def __enter__(self) -> PeakRSS:
        self.start = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            time.sleep(self._interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)

    @property
    def growth(self) -> int:
        return self.peak - self.start


def make_params(num: int, total_bytes: int, mesh) -> list[torch.Tensor]:
    """``num`` float32 tensors of ``total_bytes`` together, each sharded on dim 0 over 8 devices."""
    per = max(total_bytes // num // 4, 8 * 8)
    cols = 64
    rows = max(8, (per // cols) // 8 * 8)
    device = torch_xla.device()
    params = []
    for _ in range(num):
        t = torch.randn(rows, cols).to(device)
        xs.mark_sharding(t, mesh, ("fsdp", None))
        params.append(t)
    torch_xla.sync()
    return params


def graph_of(params: list[torch.Tensor]) -> torch.Tensor:
    out = params[0].sum()
    for t in params[1:]:
        out = out + t.sum()
    return out


def timed(fn: Callable[[], object], reps: int, build: Callable[[], object]) -> tuple[float, int, int]:
    """Median seconds over ``reps`` fresh contexts, max RSS growth, bytes moved to host in the last rep."""
    times, growth, moved = [], 0, 0
    for _ in range(reps):
        ctx = build()
        with PeakRSS() as rss, measure_transfers() as m:
            t0 = time.perf_counter()
            result = fn(ctx)
            times.append(time.perf_counter() - t0)
        growth = max(growth, rss.growth)
        moved = m.d2h_bytes
        del result
    return statistics.median(times), growth, moved


def run_config(num: int, total_bytes: int, mesh, reps: int, host_reps: int) -> dict:
    params = make_params(num, total_bytes, mesh)
    actual = sum(t.numel() * 4 for t in params)
    out = graph_of(params)

    def raw_ctx():
        ctx = torch_xla._XLAC.lowering.LoweringContext("bench")
        ctx.build([out])
        return ctx

    def ours_ctx(impl="native"):
        def build():
            ctx = txe.LoweringContext("bench", device_mapping=impl)
            ctx.build([out])
            return ctx

        return build

    row = {"P": num, "MiB": actual / MiB}
    row["native"], row["native_rss"], _ = timed(lambda c: c.device_parameter_id_tensor_mapping(), reps, raw_ctx)
    row["ours"], row["ours_rss"], row["ours_moved"] = timed(
        lambda c: c.device_parameter_id_tensor_mapping(), reps, ours_ctx())
    row["fallback"], row["fallback_rss"], row["fallback_moved"] = timed(
        lambda c: c.device_parameter_id_tensor_mapping(), reps, ours_ctx("fallback"))
    row["host"], row["host_rss"], row["host_moved"] = timed(
        lambda c: c.parameter_id_tensor_mapping(), host_reps, raw_ctx)

    def ours_ids_ctx():
        ctx = ours_ctx()()
        return ctx

    row["ids_batch"], _, _ = timed(lambda c: c.tensor_parameter_ids(params), reps, ours_ids_ctx)
    row["ids_native"], _, _ = timed(lambda c: [c.tensor_parameter_id(t) for t in params], reps, raw_ctx)
    # correctness, outside the timed region
    ctx = ours_ctx()()
    raw = raw_ctx()
    assert ctx.tensor_parameter_ids(params) == [raw.tensor_parameter_id(t) for t in params]
    assert sorted(ctx.device_parameter_id_tensor_mapping()) == sorted(raw.device_parameter_id_tensor_mapping())
    # (params and out are released when this returns)
    torch_xla.sync()
    return row


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:9.2f}"


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    header = (f"{'P':>5} {'MiB':>7} | {'host ms':>9} {'native ms':>9} {'ours ms':>9} {'fallbk ms':>9} | "
              f"{'ours/nat':>8} {'host/ours':>9} {'fb/nat':>7} | {'ids 1-pass':>10} {'ids loop':>9} {'speedup':>7} | "
              f"{'RSS+ ours':>9} {'RSS+ host':>9} | {'host moved':>10} {'ours moved':>10}")
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['P']:>5} {r['MiB']:>7.1f} | {fmt_ms(r['host'])} {fmt_ms(r['native'])} {fmt_ms(r['ours'])} "
              f"{fmt_ms(r['fallback'])} | {r['ours'] / r['native']:>8.2f} {r['host'] / r['ours']:>9.0f} "
              f"{r['fallback'] / r['native']:>7.2f} | {fmt_ms(r['ids_batch']):>10} {fmt_ms(r['ids_native'])} "
              f"{r['ids_native'] / r['ids_batch']:>7.1f} | {r['ours_rss'] / MiB:>8.1f}M {r['host_rss'] / MiB:>8.1f}M | "
              f"{r['host_moved'] / MiB:>9.1f}M {r['ours_moved'] / MiB:>9.1f}M")


def check_targets(p_rows: list[dict], b_rows: list[dict]) -> bool:
    ok = True

    def verdict(name: str, passed: bool, detail: str) -> None:
        nonlocal ok
        ok &= passed
        print(f"  [{'PASS' if passed else 'FAIL'}] {name}: {detail}")

    print("\nTargets")
    rows = p_rows + b_rows
    worst = max(r["ours"] / r["native"] for r in rows)
    verdict("ours within 1.2x of native device mapping", worst <= 1.2, f"worst ratio {worst:.2f}")
    times = [r["ours"] for r in b_rows]
    spread = max(times) / min(times)
    verdict("ours flat in bytes (fixed P)", spread <= 1.5,
            f"max/min over {b_rows[0]['MiB']:.0f}..{b_rows[-1]['MiB']:.0f} MiB = {spread:.2f}")
    big = [r for r in rows if r["MiB"] >= 255]
    if big:
        low = min(r["host"] / r["ours"] for r in big)
        verdict("host/ours >= 100x at >= 256 MiB", low >= 100, f"lowest {low:.0f}x")
    else:
        print("  [SKIP] host/ours at >= 256 MiB: no configuration that large in this run (--quick)")
    rss = max(r["ours_rss"] for r in rows)
    verdict("RSS growth of ours ~ 0", rss <= 16 * MiB, f"max {rss / MiB:.1f} MiB (host path: "
            f"{max(r['host_rss'] for r in rows) / MiB:.0f} MiB)")
    moved = max(r["ours_moved"] + r["fallback_moved"] for r in rows)
    verdict("ours and fallback move 0 bytes to host", moved == 0, f"{moved} bytes")
    return ok


def plot(p_rows: list[dict], b_rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, rows, key, label in ((axes[0], p_rows, "P", "parameters P"), (axes[1], b_rows, "MiB", "total MiB")):
        xsv = [r[key] for r in rows]
        for name, style in (("host", "o-"), ("native", "s-"), ("ours", "^-"), ("fallback", "v--"),
                            ("ids_native", "x:"), ("ids_batch", "+:")):
            ax.plot(xsv, [r[name] * 1e3 for r in rows], style, label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("ms (median)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_title(f"fixed {p_rows[0]['MiB']:.0f} MiB")
    axes[1].set_title(f"fixed P={b_rows[0]['P']}")
    axes[1].legend(fontsize=8)
    fig.suptitle("Fetching HLO parameters of a lowered graph, 8 CPU devices, sharded float32")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot written to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--quick", action="store_true", help="small sweep for a smoke run")
    parser.add_argument("--reps", type=int, default=5, help="repetitions of the fast paths")
    parser.add_argument("--out", default="bench_out/param_mapping.png")
    args = parser.parse_args(argv)

    xr.use_spmd()
    torch.zeros(1, device=torch_xla.device())
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n,), ("fsdp",))
    if args.quick:
        p_sweep, p_bytes = [64, 256], 16 * MiB
        b_sweep, b_num = [16 * MiB, 64 * MiB], 64
    else:
        p_sweep, p_bytes = [64, 256, 1024, 4096], 64 * MiB
        b_sweep, b_num = [16 * MiB, 64 * MiB, 256 * MiB, 1024 * MiB], 256
    print(f"{n} devices; torch {torch.__version__}, torch_xla {torch_xla.__version__}; "
          f"median of {args.reps} fresh lowerings (host path: 2)")
    p_rows = [run_config(p, p_bytes, mesh, args.reps, 2) for p in p_sweep]
    print_table(f"Sweep over P at {p_bytes / MiB:.0f} MiB total", p_rows)
    b_rows = [run_config(b_num, b, mesh, args.reps, 2) for b in b_sweep]
    print_table(f"Sweep over total bytes at P={b_num}", b_rows)
    ok = check_targets(p_rows, b_rows)
    plot(p_rows, b_rows, args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
