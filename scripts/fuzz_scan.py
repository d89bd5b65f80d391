#!/usr/bin/env python
"""Differential fuzzing of scan and scan_layers against the Python loop.

Runs the random step programs of ``test/scan_programs.py`` for a range of
seeds (each cold, cached and with changed context values; values and
gradients against the Python loop on the CPU; see that module) and prints one
line per failure and a summary: examples run, failures, plans built and served
from the cache, and how many programs used each feature. A failing seed
reproduces with ``--start SEED --count 1``. Programs are drawn with every
hazard, those that used to kill the process included (a host read, a nested
scan, a kept intermediate): each must be refused and the process must survive.

Usage::

    python scripts/fuzz_scan.py --count 500             # seeds 0..499
    python scripts/fuzz_scan.py --start 10000 --count 50
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--count", type=int, default=500, help="number of seeds (default 500)")
    args = parser.parse_args(argv)

    import torch
    import torch_xla
    import torch_xla.runtime as xr

    xr.use_spmd()
    device = torch_xla.device()
    torch.zeros(1, device=device)  # before any CPU backward (see DESIGN.md)
    from scan_program_checks import check
    from scan_programs import draw

    features: collections.Counter[str] = collections.Counter()
    totals: collections.Counter[str] = collections.Counter()
    failures = []
    start = time.perf_counter()
    for seed in range(args.start, args.start + args.count):
        program = draw(seed, crashy=True)
        for name in ("reverse", "xs_none", "pytree_carry", "grad", "iadd_carry", "layers", "buffers"):
            features[name] += bool(getattr(program, name))
        features[str(program.dtype).replace("torch.", "")] += 1
        features[f"hazard={program.hazard}"] += 1
        features[f"y={program.y_kind}"] += 1
        for op in {op[0] for op in program.ops}:
            features[op] += 1
        try:
            totals.update(check(program, device))
        except Exception as error:  # noqa: BLE001 - every failure is reported, none stops the run
            failures.append(seed)
            message = " | ".join(str(error).splitlines())[:600]
            print(f"FAIL seed {seed}: {type(error).__name__}: {message}\n  {program.describe()}", flush=True)
        done = seed - args.start + 1
        if done % 50 == 0:
            print(f"... {done}/{args.count} examples, {len(failures)} failures, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    elapsed = time.perf_counter() - start
    print(f"\n{args.count} examples (seeds {args.start}..{args.start + args.count - 1}) in {elapsed:.0f} s: "
          f"{args.count - len(failures)} passed, {len(failures)} failed")
    print(f"scan plans built {totals['scan_traces']}, served from the cache {totals['scan_hits']}")
    print("programs using each feature: " + ", ".join(f"{k} {v}" for k, v in sorted(features.items())))
    if failures:
        print("failing seeds: " + " ".join(map(str, failures)))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
