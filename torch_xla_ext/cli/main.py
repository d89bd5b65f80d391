"""Command line: ``python -m torch_xla_ext {demo,audit,tpu-fit}``.

``demo``   lowers a sharded MLP on an SPMD mesh, prints the HLO parameter table
           read by the C++ reader, and compares torch_xla's host parameter
           mapping with the device mapping (time, bytes moved, gathers); then
           runs ``scan_layers`` and a ``fully_shard`` training loop.
``audit``  prints the same report for any saved ``xla.HloModuleProto`` file.
``tpu-fit`` compiles a transformers model's training step for a TPU slice from
           shapes and prints whether it fits (:mod:`torch_xla_ext.tpu.fit`).

This module only parses commands; the demo lives in :mod:`torch_xla_ext.cli.demo`.
Nothing here imports ``torch_xla``: the demo chooses the PJRT device first, and
every command hides XLA's C++ warnings (``TF_CPP_MIN_LOG_LEVEL=2``) unless
``TF_CPP_MIN_LOG_LEVEL`` is already set.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(layers=args.layers, width=args.width, steps=args.steps)


def _audit(args: argparse.Namespace) -> int:
    """Print the C++ reader's summary of a saved module; 2 when it cannot be read or parsed."""
    from ..hlo import read_hlo

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
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit status."""
    from .demo import QUIET_XLA_LOG_LEVEL, default_xla_log_level

    default_xla_log_level()  # before anything imports torch_xla
    parser = argparse.ArgumentParser(
        prog="python -m torch_xla_ext", description=__doc__.splitlines()[0],
        epilog=f"XLA's C++ warnings are hidden (TF_CPP_MIN_LOG_LEVEL={QUIET_XLA_LOG_LEVEL}) unless "
        "TF_CPP_MIN_LOG_LEVEL is set; TF_CPP_MIN_LOG_LEVEL=0 shows everything.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="lower a sharded MLP and compare host vs device parameter mapping")
    demo.add_argument("--layers", type=int, default=8, help="MLP blocks (default 8)")
    demo.add_argument("--width", type=int, default=256, help="model width (default 256)")
    demo.add_argument("--steps", type=int, default=5, help="training steps of the fully sharded decoder")
    demo.set_defaults(run=_demo)
    audit = sub.add_parser("audit", help="report on a saved serialized HloModuleProto")
    audit.add_argument("file", help="path to the .pb file")
    audit.set_defaults(run=_audit)
    from .tpu_fit import add_parser

    add_parser(sub)
    args = parser.parse_args(argv)
    return args.run(args)
