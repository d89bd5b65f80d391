"""``scan``: XLA ``while`` loops over a traced step function (``scan_layers`` is built on it, in ``_scan_layers``).

``scan(fn, init, xs)`` has the semantics of ``jax.lax.scan``. The package is
layered; each module holds one idea and imports only the ones above it:

``draws``     host random draws of a traced step, told apart per thread.
``guard``     what may not happen while a step is traced (host reads, nested
              scans, host random draws), refused with ``ScanUnsupportedError``;
              torch_xla's execution switch, shared by reference count.
``lift``      a ``TorchFunctionMode`` that replaces the outside tensors a step
              reads with stand-ins (loop operands), fingerprints the trace and
              refuses writes into outside tensors and host reads.
``keys``      values keyed by what they hold (numbers by bits, host tensors and
              arrays by a hash, generators by their state, module attributes).
``state``     the Python state a step reaches, keyed by contents: whether a
              trace changed it (then every iteration is traced).
``trace``     runs a step lazily on placeholders under the lifter: nothing
              executes and no device memory is allocated.
``sharding``  reads and re-applies the shardings of inputs and outputs.
``backend``   lowering choices made for one backend's code generation.
``loop``      lowers one traced step into an XLA ``while`` loop with a named
              operand layout, and adds it to the lazy graph.
``autocast``  the forward captured under the caller's autocast, the backward
              without; what that capture would compute otherwise, refused.
``aot``       AOTAutograd's split of a step into forward and backward graphs,
              without its process-wide generator snapshot.
``saved``     where each saved activation comes from (stacked, an input read
              again, recomputed from one), and the primal inputs' layout.
``autograd``  the forward and backward graphs, each run as a loop.
``cache``     the one registry of lowered loops (keyed by fn and fingerprint).
``stages``    one call as four stages: ``capture`` (trace fn), ``cache_key``,
              ``plan`` (look up or lower), ``run``.
``api``       ``scan``: argument checks and flattening, then the stages.
``errors``    ``ScanInputError`` (bad arguments), ``ScanUnsupportedError``
              (what a traced loop cannot do as the Python loop does) and
              ``StackedLayerError`` (a per-layer operation on stacked layers).
``dynamo``    scans refuse to run inside ``torch.compile`` (and why).

Every call traces ``fn`` (host-side, cheap); a lowered loop is reused only for
a trace with the same fingerprint, so no call reads a stale value.
"""

from __future__ import annotations

from .api import scan
from .cache import ScanCacheInfo, clear_scan_cache, scan_cache_info
from .errors import ScanInputError, ScanUnsupportedError, StackedLayerError
__all__ = ["scan", "scan_cache_info", "clear_scan_cache", "ScanCacheInfo", "ScanInputError", "ScanUnsupportedError",
           "StackedLayerError"]
