"""``python -m torch_xla_ext tpu-fit``: :func:`torch_xla_ext.tpu.fit.fit` from the command line, a table and a PNG."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from .._format import format_bytes

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``tpu-fit`` on the command line's subcommands."""
    from ..tpu.fit import ATTENTIONS, DEFAULT_PATHS, PATHS

    p = sub.add_parser(
        "tpu-fit", help="does a transformers model's training step fit a TPU slice (compiled here, from shapes)",
        description="Lower one training step (forward, backward, AdamW) of a transformers model from shapes, "
                    "fully sharded over the slice's chips, compile it for the slice with libtpu's compile-only "
                    "client and print the TPU compiler's per-chip memory figures. No TPU and no weights needed; "
                    "no step time is measured.")
    p.add_argument("--config", required=True,
                   help="a model type transformers ships a config for ('llama') or a config.json file")
    p.add_argument("--topology", required=True, help="the TPU slice, e.g. v5p:4x4x4 (64 chips) or v5e:2x4")
    p.add_argument("--batch", type=int, required=True, help="sequences per step, the whole slice's")
    p.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    p.add_argument("--paths", default=",".join(DEFAULT_PATHS),
                   help=f"comma-separated, of: {', '.join(PATHS)} (default: %(default)s)")
    p.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="the model's attention (default: the config's own); flash: torch_xla's Pallas flash "
                        "attention kernel, lowered for the TPU")
    p.add_argument("--png", default=None, help="write a bar chart of each path's HBM per chip to this file")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per path (default: %(default)s)")
    p.add_argument("--max-host-gb", type=float, default=None,
                   help="stop a path whose process holds more host memory (default: 3/4 of this machine's)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run ``tpu-fit``; 0 when every path compiled (fitting or not), 1 when one failed, 2 for bad arguments."""
    import os

    from ..tpu._client import TpuUnavailable
    from ..tpu.fit import fit

    # This process only reads the config and the topology; the children lower and compile. transformers
    # imports torch_xla where it is installed, which would warn that it picks the CPU itself.
    os.environ.setdefault("PJRT_DEVICE", "CPU")

    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    limit = None if args.max_host_gb is None else int(args.max_host_gb * 2**30)
    try:
        reports = fit(args.config, args.topology, batch=args.batch, seq=args.seq, paths=paths,
                      timeout=args.timeout, max_host_bytes=limit, progress=Progress(paths, sys.stderr),
                      attention=args.attention)
    except (ValueError, TypeError, TpuUnavailable) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(report_table(reports))
    if args.png:
        write_png(reports, args.png)
        print(f"wrote {args.png}")
    return 0 if all(r.error is None for r in reports) else 1


class Progress:
    """``fit``'s progress on ``stream``: on a terminal one line rewritten in place (path, phase, seconds), else a
    line each time a path enters a phase."""

    def __init__(self, paths: Sequence[str], stream) -> None:
        self.paths, self.stream = list(paths), stream
        self.live = stream.isatty()
        self.last: tuple[str, str] | None = None
        self.shown = -1.0

    def __call__(self, path: str, phase: str, seconds: float) -> None:
        where = f"[{self.paths.index(path) + 1}/{len(self.paths)}] {path}: {phase}"
        finished = phase in ("done", "failed")
        if self.live:
            if (path, phase) == self.last and seconds - self.shown < 1.0 and not finished:
                return
            self.stream.write(f"\r\033[K{where} ({seconds:.0f} s)" + ("\n" if finished else ""))
        elif (path, phase) != self.last:
            self.stream.write(f"{where} ({seconds:.0f} s)\n")
        self.stream.flush()
        self.last, self.shown = (path, phase), seconds


def report_table(reports: Sequence) -> str:
    """The reports as a table with a heading line: what was measured, and what was not."""
    from ..tpu._client import links

    first = reports[0]
    hbm = next((r.compiled["hbm_bytes"] for r in reports if r.compiled), None)
    lines = [f"{first.topology} ({links(first.topology)}): {first.chips} chips"
             + (f" x {format_bytes(hbm)} HBM" if hbm else "")
             + f"; batch {first.batch} x {first.seq} tokens"
             + (f"; {_count(count)} parameters" if (count := max(r.parameters for r in reports)) else "")
             + (f"; lowered on {first.lowered_on} virtual devices" if first.lowered_on != first.chips else "")
             + (f"; {first.attention} attention" if first.attention else ""),
             "TPU compiler's figures per chip (AdamW step, parameters and moments in fp32, donated); "
             "no step time, no host memory of the real job"]
    head = ("path", "fits", "needs/chip", "of HBM", "headroom", "params+moments+temps+code GiB", "compile s",
            "host RSS", "collectives, or why not compiled")
    rows = []
    for r in reports:
        c = r.compiled
        if c is None:
            rows.append((r.path, "-", "", "", "", "", "", "", r.error))
            continue
        needs = r.required_bytes
        if c["error"] is not None:  # the compiler's refusal: over HBM by what it says
            rows.append((r.path, "NO", "" if needs is None else format_bytes(needs),
                         "" if needs is None else f"{100 * needs / c['hbm_bytes']:.1f}%",
                         "" if needs is None else format_bytes(c["hbm_bytes"] - needs), "",
                         f"{c['compile_seconds']:.0f}", format_bytes(r.host_rss_bytes), c["error"]))
            continue
        split = split_text(r.breakdown()) or ""
        colls = ", ".join(f"{kind} {count}x {format_bytes(size)}" for kind, (count, size) in sorted(c["collectives"].items()))
        rows.append((r.path, "yes" if r.fits else "NO", format_bytes(needs), f"{100 * needs / c['hbm_bytes']:.1f}%",
                     format_bytes(c["hbm_bytes"] - needs), split,
                     f"{c['compile_seconds']:.0f}", format_bytes(r.host_rss_bytes), colls))
    widths = [max(len(str(row[k])) for row in [head, *rows]) for k in range(len(head) - 1)]
    for row in [head, *rows]:
        cells = [str(v).ljust(w) for v, w in zip(row, widths)] + [str(row[-1])]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def split_text(parts: dict[str, int] | None) -> str | None:
    """A step's HBM split (:func:`~torch_xla_ext.tpu.fit.split_hbm`) as ``params+moments+temps+code`` GiB."""
    if parts is None:
        return None
    return "+".join(f"{parts[k] / 2**30:.2f}" for k in ("parameters", "optimizer moments",
                                                         "temporaries (gradients, activations)", "code"))


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def write_png(reports: Sequence, path: str) -> None:
    """A bar per path: HBM needed per chip, split by kind where the buffer assignment allows (parameters,
    optimizer moments, token batch, temporaries, code), against the chip's HBM (a line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = reports[0]
    names = [r.path for r in reports]
    needs = [(r.required_bytes or 0) / 2**30 for r in reports]
    hbm = next((r.compiled["hbm_bytes"] / 2**30 for r in reports if r.compiled), None)
    fig, ax = plt.subplots(figsize=(3.2 + 1.3 * len(reports), 4))
    colors = ["tab:green" if r.fits else ("tab:gray" if r.required_bytes is None else "tab:red") for r in reports]
    parts = [r.breakdown() for r in reports]
    kinds = next((list(p) for p in parts if p is not None), [])
    bottom = [0.0] * len(reports)
    for kind, color in zip(kinds, ("tab:blue", "tab:cyan", "tab:olive", "tab:orange", "tab:purple")):
        heights = [0.0 if p is None else p[kind] / 2**30 for p in parts]
        ax.bar(names, heights, bottom=bottom, color=color, label=kind)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.bar(names, [0.0 if p is not None else v for p, v in zip(parts, needs)], color=colors)  # no split known
    if kinds:
        ax.legend(fontsize=7, loc="upper left")
    for k, (r, v) in enumerate(zip(reports, needs)):
        ax.text(k, v, "not compiled" if r.required_bytes is None else format_bytes(r.required_bytes), ha="center",
                va="bottom", fontsize=8)
    if hbm is not None:
        ax.axhline(hbm, color="black", linestyle="--", linewidth=1)
        ax.text(len(reports) - 0.5, hbm, f"HBM {hbm:.0f} GiB", ha="right", va="bottom", fontsize=8)
    ax.set_ylabel("GiB per chip (TPU compiler)")
    ax.set_title(f"{_count(max(r.parameters for r in reports))} parameters on {first.topology}, "
                 f"batch {first.batch} x {first.seq}", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
