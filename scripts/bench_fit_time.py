"""``tpu-fit`` of Llama-3 8B beside MaxText's ``train_compile`` of the same step: seconds and host memory, end to end.

Both size the same step for the same slice from this machine, with no TPU:
Llama-3 8B, fp32 parameters and AdamW moments, full remat, 64 sequences of
2,048 tokens over ``v5p:4x4x4`` (64 chips; MaxText calls it ``v5p-128``).
Ours is ``python -m torch_xla_ext tpu-fit --paths
scan+nothing_saveable+stacked`` (libtpu 0.0.21); MaxText's is
``maxtext.trainers.pre_train.train_compile`` with the settings
``../shared/ANCHORS.md`` lists, run by the interpreter of its own
environment (``--maxtext-python``: MaxText needs Python 3.12 and jax 0.12;
it is an anchor, never a dependency). The two commands alternate, so a
slow stretch of a shared machine falls on both.

Each run: wall seconds from start to exit, and the peak resident memory of
the largest process of its tree (each side runs its compile in one
process; ours lowers in another before it), sampled every 0.1 s.

    python scripts/bench_fit_time.py --maxtext-python /path/to/maxtext-venv/bin/python --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))

OURS = [sys.executable, "-m", "torch_xla_ext", "tpu-fit", "--config", os.path.join(HERE, "configs", "llama3_8b.json"),
        "--topology", "v5p:4x4x4", "--batch", "64", "--seq", "2048", "--paths", "scan+nothing_saveable+stacked"]

#: MaxText's settings for the same step (``../shared/ANCHORS.md``); no persistent compile cache.
MAXTEXT_SETTINGS = ["compile_topology=v5p-128", "compile_topology_num_slices=1", "per_device_batch_size=1",
                    "max_target_length=2048", "weight_dtype=float32", "attention=dot_product", "scan_layers=True",
                    "ici_fsdp_parallelism=-1", "gradient_accumulation_steps=1", "dataset_type=synthetic",
                    "enable_checkpointing=False", "gradient_clipping_threshold=0", "adam_b1=0.9", "adam_b2=0.999",
                    "adam_weight_decay=0.01", "model_name=llama3-8b", "remat_policy=full", "dtype=float32",
                    "jax_cache_dir="]


def maxtext_command(python: str, out_dir: str, replaced: dict[str, str] | None = None) -> list[str]:
    """MaxText's ``train_compile`` of the step, run by ``python``; ``replaced``: settings given other values."""
    replaced = replaced or {}
    settings = [s for s in MAXTEXT_SETTINGS if s.split("=", 1)[0] not in replaced]
    settings += [f"{key}={value}" for key, value in replaced.items()]
    source = ("import os, sys, maxtext\n"
              "from maxtext.trainers.pre_train import train_compile\n"
              "base = os.path.join(os.path.dirname(maxtext.__file__), 'configs', 'base.yml')\n"
              "train_compile.main(['train_compile', base] + sys.argv[1:])\n")
    return [python, "-c", source, *settings, f"base_output_directory={out_dir}", "run_name=bench"]


def timed(command: list[str], log: str) -> tuple[float, int]:
    """Run ``command`` to its exit (output to ``log``): (wall seconds, peak RSS of its largest process)."""
    start = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        root, peak = psutil.Process(proc.pid), 0
        while proc.poll() is None:
            try:
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                break
            for p in tree:
                try:
                    peak = max(peak, p.memory_info().rss)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.1)
        proc.wait()
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"{command[:4]} exited with status {proc.returncode}; see {log}")
    return seconds, peak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--maxtext-python", required=True, help="the python of an environment with maxtext[tpu]==0.2.5")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--png", default="bench_out/fit_time.png")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    os.makedirs(a.out, exist_ok=True)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    runs: dict[str, list[tuple[float, int]]] = {"tpu-fit": [], "MaxText": []}
    for k in range(a.rounds):
        for name, command in (("tpu-fit", OURS), ("MaxText", maxtext_command(a.maxtext_python, a.out))):
            seconds, peak = timed(command, os.path.join(a.out, f"fit_time_{name}_{k}.log"))
            runs[name].append((seconds, peak))
            print(f"round {k + 1}/{a.rounds} {name:8s} {seconds:6.1f} s  {peak / 2**30:.2f} GiB", flush=True)
    print(f"\n{'':8s}  {'seconds (mean, range)':24s}  host memory (largest process)")
    for name, rs in runs.items():
        s = [r[0] for r in rs]
        m = [r[1] / 2**30 for r in rs]
        print(f"{name:8s}  {statistics.mean(s):5.1f} ({min(s):.1f}-{max(s):.1f})        "
              f"{min(m):.2f}-{max(m):.2f} GiB")
    ratio = statistics.mean(r[0] for r in runs["tpu-fit"]) / statistics.mean(r[0] for r in runs["MaxText"])
    print(f"tpu-fit / MaxText, mean seconds: {ratio:.2f}x  (target <= 1.00; on 2 shared cores ~5% is parity)")
    _plot(runs, a.png)
    print(f"wrote {a.png}")
    return 0


def _plot(runs: dict[str, list[tuple[float, int]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    for x, (name, rs) in enumerate(runs.items()):
        left.scatter([x] * len(rs), [r[0] for r in rs], label=name)
        right.scatter([x] * len(rs), [r[1] / 2**30 for r in rs])
    for ax, what in ((left, "seconds, start to exit"), (right, "GiB, largest process's peak RSS")):
        ax.set_xticks(range(len(runs)), list(runs))
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
    fig.suptitle("Llama-3 8B fp32 full-remat step sized for v5p:4x4x4, alternating runs")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
