#!/usr/bin/env python
"""A long run: a fully sharded tiny Hugging Face Llama, scanned, trained with AdamW for hundreds of steps.

Every layer and the root are ``fully_shard``-ed over 8 virtual devices, the
decoder layers run through ``scan_decoder_layers``, and every step gets a new
batch whose left padding changes (``causal_mask``). Each window of steps
reports host RSS, live XLA tensors (torch_xla's ``CreateXlaTensor`` minus
``DestroyXlaTensor``), programs compiled, bytes moved device->host inside the
steps, and the median step time; the run ends with a table, a verdict on
flatness, and a PNG.

Usage::

    python scripts/soak.py --steps 500 --every 50 --png bench_out/soak.png

The checks (also asserted by ``test/test_soak.py`` on a short run): no
compile after step 2 (``no_recompiles``), no device->host byte inside any step
after step 1 (``no_host_transfers``; the loss is read after each step), and no
growth of live XLA tensors or of RSS beyond noise after the first window.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from dataclasses import dataclass

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BATCH, SEQ, VOCAB = 8, 16, 128


@dataclass
class Window:
    """What one window of steps measured."""

    last_step: int
    loss: float
    step_ms: float          # median host+device time of a step in the window
    rss_mib: float          # host resident set size at the window's end
    live_tensors: int       # live XLA tensor objects at the window's end
    compiles: int           # programs compiled during the window
    d2h_bytes: int          # bytes moved device->host inside the window's steps


def _counter(name: str) -> int:
    import torch_xla.debug.metrics as met

    value = met.counter_value(name)
    return 0 if value is None else int(value)


def _compiles() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def soak(steps: int, every: int, layers: int = 2, seed: int = 0) -> list[Window]:
    """Train for ``steps`` steps; one :class:`Window` per ``every`` steps. Raises if a check fails."""
    import numpy as np
    import psutil
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr
    import transformers

    import torch_xla_ext as txe
    from torch_xla_ext.distributed import fully_shard
    from torch_xla_ext.hf import causal_mask, scan_decoder_layers

    if not xr.is_spmd():
        xr.use_spmd()
    device = torch_xla.device()
    probe = torch.ones(2).to(device).requires_grad_()
    torch.autograd.grad(probe.sum(), [probe])  # before any CPU backward (see DESIGN.md)
    mesh = xs.Mesh(np.arange(xr.global_runtime_device_count()), (xr.global_runtime_device_count(),), ("fsdp",))
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    scan_decoder_layers(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    process = psutil.Process()
    g = torch.Generator().manual_seed(seed + 1)

    windows: list[Window] = []
    times: list[float] = []
    moved = 0
    compiles_at = _compiles()
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        mask = torch.ones(BATCH, SEQ, dtype=torch.long)
        for row in range(BATCH):
            mask[row, :(step + row) % 5] = 0  # left padding, different every step
        ids_d, mask_d = ids.to(device), mask.to(device)
        start = time.perf_counter()
        with txe.measure_transfers() as m:
            with (txe.no_recompiles() if step >= 2 else contextlib.nullcontext()), \
                    (txe.no_host_transfers() if step >= 1 else contextlib.nullcontext()):
                loss = model(input_ids=ids_d, attention_mask=causal_mask(mask_d, model=model), labels=ids_d,
                             use_cache=False).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                torch_xla.sync()
        value = loss.item()  # outside the guarded step: one scalar for the report
        times.append(time.perf_counter() - start)
        moved += int(m.d2h_bytes) if step >= 1 else 0
        if (step + 1) % every == 0 or step + 1 == steps:
            compiles = _compiles()
            windows.append(Window(
                last_step=step + 1, loss=value, step_ms=statistics.median(times) * 1e3,
                rss_mib=process.memory_info().rss / 2**20,
                live_tensors=_counter("CreateXlaTensor") - _counter("DestroyXlaTensor"),
                compiles=compiles - compiles_at, d2h_bytes=moved))
            times, moved, compiles_at = [], 0, compiles
    return windows


def flatness(windows: list[Window]) -> dict[str, float]:
    """Growth after the first window (warm-up): RSS in MiB, live XLA tensors, compiles, device->host bytes."""
    steady = windows[1:] or windows
    return {
        "rss_growth_mib": steady[-1].rss_mib - steady[0].rss_mib,
        "live_tensor_growth": steady[-1].live_tensors - steady[0].live_tensors,
        "compiles_after_first_window": sum(w.compiles for w in steady) if len(windows) > 1 else 0,
        "d2h_bytes": sum(w.d2h_bytes for w in windows),
    }


def _plot(windows: list[Window], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [w.last_step for w in windows]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6))
    for ax, (title, ys) in zip(axes.flat, [
            ("host RSS (MiB)", [w.rss_mib for w in windows]),
            ("live XLA tensors", [w.live_tensors for w in windows]),
            ("median step (ms)", [w.step_ms for w in windows]),
            ("loss", [w.loss for w in windows])]):
        ax.plot(x, ys, marker="o")
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.suptitle("soak: fully sharded, scanned tiny Llama, AdamW, changing padding")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--png", default="bench_out/soak.png")
    args = parser.parse_args(argv)
    windows = soak(args.steps, args.every)
    print(f"{'steps':>6} {'loss':>8} {'step ms':>8} {'RSS MiB':>8} {'live XLA tensors':>17} "
          f"{'compiles':>9} {'d2h bytes':>10}")
    for w in windows:
        print(f"{w.last_step:>6} {w.loss:>8.4f} {w.step_ms:>8.1f} {w.rss_mib:>8.1f} {w.live_tensors:>17} "
              f"{w.compiles:>9} {w.d2h_bytes:>10}")
    flat = flatness(windows)
    print("after the first window: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                 for k, v in flat.items()))
    try:
        _plot(windows, args.png)
        print(f"plot: {args.png}")
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
