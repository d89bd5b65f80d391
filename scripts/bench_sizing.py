"""``tpu-fit``'s step beside a pure-JAX reference of the same model, compiled for the same slice by the same compiler.

For each row (a model config, a slice, a batch, a ``tpu-fit`` scan path),
our step is what ``python -m torch_xla_ext tpu-fit`` compiles
(:func:`torch_xla_ext.tpu.fit.fit`: the transformers model through
``hf.prepare``, AdamW, lowered from shapes), and the reference is
``jax_llama.py``'s step (the same model written in JAX as a JAX trainer
writes it: stacked layers in ``lax.scan``, ``jax.checkpoint`` with the same
policy, the same placement and AdamW), each in a process of its own. Both
programs go to libtpu's compile-only client for the slice and are read the
same way (``tpu.CompiledForTpu``): HBM used per chip (the buffer
assignment's HBM plus code) split into parameters, optimizer moments, token
batch, temporaries and code; collectives per chip by kind, loop bodies once
per trip; TPU compile seconds and the process's peak host memory.

Goals printed at the end: our HBM used and our collective bytes at or under
the reference's on every row. Nothing runs on a TPU; the compiler is
deterministic (compile seconds and host memory are this machine's).

    python scripts/bench_sizing.py                 # the README's rows: Llama-3 8B (6 paths) and 70B (2)
    python scripts/bench_sizing.py --rows 8b       # one model's rows
    python scripts/bench_sizing.py --config C.json --topology v5p:4x4x4 --batch 64 --paths scan+nothing_saveable
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable

os.environ.setdefault("PJRT_DEVICE", "CPU")  # this process only reads configs and reports; nothing runs here

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 1 << 30

#: The rows of the README's sizing table: (config, topology, batch, paths); 2,048 tokens per sequence.
ROWS = {
    "8b": (os.path.join(HERE, "configs", "llama3_8b.json"), "v5p:4x4x4", 64,
           ("scan", "scan+stacked", "scan+nothing_saveable", "scan+nothing_saveable+stacked",
            "scan+nothing_saveable+bf16", "scan+nothing_saveable+bf16+stacked")),
    "70b": (os.path.join(HERE, "configs", "llama3_70b.json"), "v5p:8x8x4", 256,
            ("scan+nothing_saveable", "scan+nothing_saveable+stacked")),
}


#: ``progress(label, phase, seconds)``: the command line's progress (``tpu-fit``'s own, one line per program).
Progress = Callable[[str, str, float], None]


@dataclasses.dataclass
class Side:
    """One program's figures: ``compiled`` is ``tpu.CompiledForTpu`` as a dict (None: it did not compile)."""

    compiled: dict | None
    token_bytes: int
    host_rss_bytes: int
    error: str | None = None

    def result(self):
        """``compiled`` as the ``tpu.CompiledForTpu`` it was (None: it did not compile)."""
        from torch_xla_ext import tpu

        return None if self.compiled is None else tpu.CompiledForTpu(**self.compiled)

    def hbm_used(self) -> int | None:
        r = self.result()
        return None if r is None else r.hbm_used_bytes

    def collective_bytes(self) -> int | None:
        from tpu_bench import collective_bytes

        r = self.result()
        return None if r is None else collective_bytes(r)


@dataclasses.dataclass
class Row:
    model: str
    topology: str
    batch: int
    seq: int
    path: str
    ours: Side
    reference: Side


def ours(config: str, topology: str, batch: int, seq: int, path: str, progress: Progress,
         attention: str | None = None) -> Side:
    """``tpu-fit``'s step (its own child process, as the command runs it), with ``attention`` (None: the
    config's own, sdpa)."""
    from torch_xla_ext.tpu.fit import fit

    [report] = fit(config, topology, batch=batch, seq=seq, paths=[path], attention=attention,
                   progress=lambda p, phase, seconds: progress(f"ours {p}", phase, seconds))
    return Side(report.compiled, batch * seq * 8 // report.chips, report.host_rss_bytes, report.error)


def reference(config: str, topology: str, batch: int, seq: int, path: str, progress: Progress) -> Side:
    """``jax_llama.py``'s step, compiled in a child process of its own (its host memory is its own)."""
    request = json.dumps({"config": config, "topology": topology, "batch": batch, "seq": seq, "path": path})
    tick = lambda phase, seconds: progress(f"jax {path}", phase, seconds)  # noqa: E731
    start = time.monotonic()
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--reference-child", request],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    while proc.poll() is None:
        tick("compiling", time.monotonic() - start)
        time.sleep(0.2)
    out, err = proc.communicate()
    tick("done" if proc.returncode == 0 else "failed", time.monotonic() - start)
    answer = next((json.loads(line) for line in reversed(out.splitlines()) if line.startswith("{")), None)
    if proc.returncode != 0 or answer is None:
        tail = (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1][:300]
        return Side(None, 0, 0, error=tail)
    return Side(**answer)


def _reference_child(request: str) -> None:
    """In the child: compile the reference step and print its :class:`Side` as one JSON line."""
    sys.path.insert(0, HERE)
    import jax_llama
    from torch_xla_ext.tpu.fit import load_config

    r = json.loads(request)
    compiled = jax_llama.compile_for(load_config(r["config"]), r["topology"], batch=r["batch"], seq=r["seq"],
                                     path=r["path"])
    side = Side(dataclasses.asdict(compiled), r["batch"] * r["seq"] * 4 // compiled.chips,  # int32 tokens
                resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    print(json.dumps(dataclasses.asdict(side)), flush=True)


def _gib(b: int | None, digits: int = 2) -> str:
    return "-" if b is None else f"{b / GIB:.{digits}f}"


def _parts(side: Side) -> str:
    from torch_xla_ext.cli.tpu_fit import split_text
    from torch_xla_ext.tpu.fit import split_hbm

    return split_text(split_hbm(side.compiled, side.token_bytes)) or "-"


def print_tables(rows: list[Row]) -> None:
    head = ("model", "slice", "batch", "path", "ours GiB", "jax GiB", "x jax", "ours params+moments+temps+code",
            "jax params+moments+temps+code", "compile s ours/jax", "host GiB ours/jax")
    lines = [head]
    for r in rows:
        a, b = r.ours.hbm_used(), r.reference.hbm_used()
        lines.append((r.model, r.topology, str(r.batch), r.path,
                      _gib(a) if a is not None else f"- ({r.ours.error or (r.ours.compiled or {}).get('error')})"[:60],
                      _gib(b) if b is not None else "-", "-" if a is None or b is None else f"{a / b:.3f}",
                      _parts(r.ours), _parts(r.reference),
                      "/".join(f"{s.compiled['compile_seconds']:.0f}" if s.compiled else "-" for s in (r.ours, r.reference)),
                      "/".join(_gib(s.host_rss_bytes, 1) for s in (r.ours, r.reference))))
    _print(lines)
    print("\ncollectives per chip (count, GiB of operands; loop bodies once per trip):")
    lines = [("model", "path", "kind", "ours", "jax")]
    for r in rows:
        kinds = sorted(set((r.ours.compiled or {}).get("collectives", {})) | set((r.reference.compiled or {}).get("collectives", {})))
        for kind in kinds:
            cells = []
            for s in (r.ours, r.reference):
                count, size = (s.compiled or {}).get("collectives", {}).get(kind, (0, 0))
                cells.append(f"{count}x {_gib(size)}")
            lines.append((r.model, r.path, kind, *cells))
        lines.append((r.model, r.path, "all", *(_gib(s.collective_bytes()) for s in (r.ours, r.reference))))
    _print(lines)


def _print(lines: list[tuple]) -> None:
    widths = [max(len(str(line[k])) for line in lines) for k in range(len(lines[0]))]
    for line in lines:
        print("  ".join(str(v).ljust(w) for v, w in zip(line, widths)).rstrip())


def goals(rows: list[Row]) -> bool:
    print("\ngoals (ours at or under the JAX reference, same slice, batch, remat, dtype):")
    ok = True
    for r in rows:
        for what, a, b in (("HBM used", r.ours.hbm_used(), r.reference.hbm_used()),
                           ("collective bytes", r.ours.collective_bytes(), r.reference.collective_bytes())):
            if a is None or b is None:
                verdict, ok = "NOT MEASURED", False
            else:
                verdict = "PASS" if a <= b else "FAIL"
                ok = ok and a <= b
            ratio = "" if a is None or b is None else f" {a / b:.3f}x ({(a - b) / 2**20:+.1f} MiB)"
            print(f"  {r.model} {r.path} {what}:{ratio} {verdict}")
    return ok


def plot(rows: list[Row], out: str) -> None:
    """Per row, two stacked bars (ours, the reference) of HBM used per chip by kind, and collective GiB."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from torch_xla_ext.tpu.fit import split_hbm

    kinds = ("parameters", "optimizer moments", "token batch", "temporaries (gradients, activations)", "code")
    colors = ("tab:blue", "tab:cyan", "tab:olive", "tab:orange", "tab:purple")
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(4 + 2.2 * len(rows), 4.5))
    labels, x = [], 0.0
    for r in rows:
        for side, name in ((r.ours, "ours"), (r.reference, "jax")):
            parts = split_hbm(side.compiled, side.token_bytes) or {}
            bottom = 0.0
            for kind, color in zip(kinds, colors):
                h = parts.get(kind, 0) / GIB
                ax.bar(x, h, bottom=bottom, color=color, label=kind if not labels else None)
                bottom += h
            ax.text(x, bottom, _gib(side.hbm_used()), ha="center", va="bottom", fontsize=7)
            coll = side.collective_bytes()
            ax2.bar(x, 0 if coll is None else coll / GIB, color="tab:green" if name == "ours" else "tab:gray")
            labels.append((x, f"{r.model} {r.path}\n{name}"))
            x += 1
        x += 0.6
    for a, title, unit in ((ax, "HBM used per chip (TPU compiler)", "GiB"),
                           (ax2, "collective operands per chip per step", "GiB")):
        a.set_xticks([p for p, _ in labels], [t for _, t in labels], fontsize=6, rotation=60, ha="right")
        a.set_title(title, fontsize=9)
        a.set_ylabel(unit)
        a.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"wrote {out}")


def main() -> int:
    from torch_xla_ext.tpu.fit import ATTENTIONS

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    ap.add_argument("--config", help="a transformers Llama config.json (instead of --rows)")
    ap.add_argument("--topology")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--paths", default="scan+nothing_saveable", help="comma-separated tpu-fit scan paths")
    ap.add_argument("--attention", choices=ATTENTIONS, default=None,
                    help="our step's attention (tpu-fit --attention); the reference's is XLA einsums either way")
    ap.add_argument("--png", default="bench_out/sizing.png")
    ap.add_argument("--reference-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.reference_child:
        _reference_child(args.reference_child)
        return 0
    if args.config:
        if not (args.topology and args.batch):
            ap.error("--config needs --topology and --batch")
        plan = [(args.config, args.topology, args.batch, tuple(args.paths.split(",")))]
    else:
        plan = [ROWS[name] for name in args.rows]
    from torch_xla_ext.cli.tpu_fit import Progress

    # The reference stores its layers stacked: a "+stacked" path compares with the same reference program.
    runs = [(config, topology, batch, path, (config, topology, batch, path.replace("+stacked", "")))
            for config, topology, batch, paths in plan for path in paths]
    labels = list(dict.fromkeys(label for *_, path, same in runs for label in (f"jax {same[-1]}", f"ours {path}")))
    progress = Progress(labels, sys.stderr)
    rows = []
    references: dict[tuple, Side] = {}
    for config, topology, batch, path, same in runs:
        if same not in references:
            references[same] = reference(config, topology, batch, args.seq, same[-1], progress)
        rows.append(Row(os.path.splitext(os.path.basename(config))[0], topology, batch, args.seq, path,
                        ours(config, topology, batch, args.seq, path, progress, args.attention), references[same]))
    if args.attention:
        print(f"ours with {args.attention} attention; the JAX reference's attention is XLA einsums")
    print_tables(rows)
    ok = goals(rows)
    plot(rows, args.png)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
