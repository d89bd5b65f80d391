#!/usr/bin/env python
"""Benchmark: what moving scan's capture onto TorchDynamo's guards would save, per L and model.

``scan`` decides whether a lowered loop may be reused by tracing ``fn`` again
on every call (lazily, on placeholders) and comparing the trace with the
cached one. TorchDynamo answers the same question with guards. Side by side
in one process (8 virtual CPU devices, the blocks of ``bench_scan.py``,
steady steps interleaved round robin), for ``scan_layers`` over L layers:

  step trace  host time of one steady training step until the lazy graph is
              built (forward, loss, backward), as ``bench_scan.py``'s trace
              column: ours, and torch_xla's ``scan_layers`` with its cache
  re-trace    the part of ours' step trace spent re-tracing the layer (the
              capture), measured inside the same steps
  guard hit   the same layer step captured by dynamo (``torch.compile``,
              ``fullgraph=True``, ``dynamic=False``, a backend that only
              records): host time of a call whose guards pass, up to the
              moment its graph would run
  floor       ours' step trace minus its re-trace: what a capture costing
              nothing would leave (stacking the members, the checks, the
              backward's gradient accumulation)

It prints each as a ratio to torch_xla's cached ``scan_layers`` (ours, ours
with the guard hit in place of the re-trace, the floor) and writes a PNG.

Usage::

    python scripts/bench_capture.py                    # block and llama, L = 4 8 16 32
    python scripts/bench_capture.py --model llama --layers 4 16 --steps 5
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_scan as bs  # noqa: E402  (sets up the runtime: 8 CPU devices, SPMD)

import torch  # noqa: E402
import torch_xla  # noqa: E402


class _GuardsPassed(Exception):
    """Raised by the recording backend's graph: the guards passed and the graph would run now."""


def _recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    def run(*args):
        raise _GuardsPassed

    return run


def guard_hit_ms(layer: torch.nn.Module, x: torch.Tensor, kwargs: dict, calls: int) -> float:
    """Median host time of a guard-passing call of ``layer``'s step captured by dynamo (ms)."""
    from torch.func import functional_call

    names = [name for name, _ in layer.named_parameters()]

    def step(h, params):
        return functional_call(layer, dict(zip(names, params)), (h,), kwargs)

    captured = torch.compile(step, backend=_recording_backend, fullgraph=True, dynamic=False)
    params = [p.detach() for p in layer.parameters()]
    times = []
    for i in range(calls + 1):
        t0 = time.perf_counter()
        try:
            captured(x, params)
        except _GuardsPassed:
            pass
        if i:  # the first call captures
            times.append(time.perf_counter() - t0)
    torch._dynamo.reset()
    return statistics.median(times) * 1e3


class _RetraceClock:
    """Accumulates the wall time scan spends re-tracing fn (its ``_trace``)."""

    def __init__(self) -> None:
        from torch_xla_ext._scan import stages

        self.total = 0.0
        inner = stages._trace

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0

        stages._trace = timed


def measure(model: str, n: int, steps: int, clock: _RetraceClock) -> dict[str, float]:
    cfg = bs.Config()
    mesh = bs.xs.Mesh(list(range(bs.NUM_DEVICES)), (bs.NUM_DEVICES,), ("fsdp",))
    if model == "llama":
        # torch_xla's scan_layers passes layers nothing but the carried input, and these layers need
        # position_embeddings: no torch_xla column for them.
        cpu_layers, x_cpu, _, rotary = bs.build_llama(cfg, n)
        fwds = bs.llama_forwards(rotary, {"ours": None})
        methods = ("ours",)
    else:
        cpu_layers, x_cpu, _ = bs.build(cfg, n)
        fwds = {"ours": bs.make_fwd_ours(), "torch_xla": bs.make_fwd_torch_xla()}
        methods = ("ours", "torch_xla")
    runners = {}
    for method in methods:
        layers, x = bs.place(cpu_layers, x_cpu, mesh)
        runners[method] = bs.TorchRunner(method, fwds[method], layers, x)
        runners[method].first(warmup=2)  # torch_xla's scan_layers compiles again on its second step
    retrace = []
    for _ in range(steps):
        for method, runner in runners.items():
            before = clock.total
            runner.timed()
            if method == "ours":
                retrace.append(clock.total - before)
    res = {m: r.result() for m, r in runners.items()}
    layers, x = runners["ours"].layers, runners["ours"].x
    kwargs = {}
    if model == "llama":
        positions = torch.arange(x.shape[1], device=x.device)[None]
        kwargs = {"position_embeddings": rotary.to(x.device)(x, positions)}
    return {
        "ours": res["ours"].trace_ms,
        "torch_xla": res["torch_xla"].trace_ms if "torch_xla" in res else float("nan"),
        "retrace": statistics.median(retrace) * 1e3,
        "guard": guard_hit_ms(layers[0], x, kwargs, calls=max(20, steps)),
    }


def plot(rows: list[tuple[str, int, dict[str, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({m for m, _, _ in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [(n, r) for m, n, r in rows if m == model]
        ls = [n for n, _ in mine]
        series = [("ours (re-trace each call)", lambda r: r["ours"]),
                  ("ours, dynamo guard hit instead", lambda r: r["ours"] - r["retrace"] + r["guard"]),
                  ("floor: capture free", lambda r: r["ours"] - r["retrace"])]
        if all(r["torch_xla"] == r["torch_xla"] for _, r in mine):
            series += [("torch_xla scan_layers (cached)", lambda r: r["torch_xla"]),
                       ("0.1x torch_xla", lambda r: 0.1 * r["torch_xla"])]
        styles = {"0.1x torch_xla": ("--", "o"), "floor: capture free": (":", "s")}
        for label, f in series:
            style, marker = styles.get(label, ("-", "o"))
            ax.plot(ls, [f(r) for _, r in mine], marker=marker, label=label, linestyle=style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(ls, [str(n) for n in ls])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("layers L")
        ax.set_ylabel("host trace per training step (ms)")
        ax.set_title(f"{model}: host trace per step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("block", "llama", "both"), default="both")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--steps", type=int, default=7, help="timed steady steps per (method, L)")
    ap.add_argument("--out", default="bench_out/bench_capture.png")
    args = ap.parse_args()
    try:
        import torch_xla_ext  # noqa: F401
        from torch_xla.experimental.scan_layers import scan_layers  # noqa: F401
        import flax  # noqa: F401  (torch_xla's SPMD scan_layers backward needs it through torchax)
    except ImportError as e:
        print(f"missing package: {e.name}; pip install -e '.[test,bench]'")
        return 2
    clock = _RetraceClock()
    models = ("block", "llama") if args.model == "both" else (args.model,)
    rows = []
    print(f"{'model':6} {'L':>3} | {'torch_xla':>9} {'ours':>7} {'re-trace':>8} {'guard':>6} {'floor':>7} | "
          f"{'ours x':>6} {'w/ guard x':>10} {'floor x':>7}   (ms; x = ratio to torch_xla's cached scan_layers)")
    for model in models:
        for n in args.layers:
            r = measure(model, n, args.steps, clock)
            rows.append((model, n, r))
            floor = r["ours"] - r["retrace"]
            tx = r["torch_xla"]
            print(f"{model:6} {n:>3} | {tx:9.2f} {r['ours']:7.2f} {r['retrace']:8.2f} {r['guard']:6.3f} "
                  f"{floor:7.2f} | {r['ours'] / tx:6.2f} {(floor + r['guard']) / tx:10.2f} {floor / tx:7.2f}",
                  flush=True)
    print("re-trace: median per step of the time ours spends tracing the layer again; guard: median host time of "
          "a dynamo-captured call of the same layer step whose guards pass; floor: ours minus its re-trace")
    if rows:
        plot(rows, args.out)
        print(f"plot written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
