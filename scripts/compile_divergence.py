#!/usr/bin/env python
"""Reproduce: torch_xla 2.9's ``openxla`` backend gives wrong gradients from a compiled model's second call.

A plain model (no torch_xla_ext involved): an embedding, a linear head and a
cross entropy, on 8 virtual CPU devices under SPMD, trained with SGD. The
same model runs eagerly (lazy tensors) and under
``torch.compile(backend="openxla", fullgraph=True)``; each step prints the
largest gradient difference between the two, and the eager run against the
CPU. The first call agrees; from the second call on the compiled gradient of
the embedding differs (the linear head's agrees), while the eager lazy run
matches the CPU. With ``--same-tokens`` every call reads the token ids of the
first (targets still change) and the compiled gradients agree at every call:
the compiled backward computes the embedding's gradient with the first
call's token ids.

With ``--taken`` another compiled copy of the model first runs a forward on
every device batch. The bridge then finds no argument for the batch in the
graph compiled later and keeps the first call's batch as a constant: from the
second call on every gradient differs, the linear head's too, by far more
than the embedding's alone without the flag (docs/limitations.md).

Usage::

    python scripts/compile_divergence.py [--steps 4] [--same-tokens] [--taken]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--same-tokens", action="store_true", help="every call reads the first call's token ids")
    ap.add_argument("--taken", action="store_true",
                    help="another compiled graph takes every device batch before the compared run")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        xr.use_spmd()
    device = torch_xla.device()
    mesh = xs.Mesh(np.arange(8), (8,), ("fsdp",))
    vocab, width, batch, seq = 256, 128, 16, 32

    torch.manual_seed(0)
    cpu = torch.nn.Sequential(torch.nn.Embedding(vocab, width), torch.nn.Linear(width, vocab))
    batches = []
    first = torch.randint(0, vocab, (batch, seq))
    for _ in range(args.steps):
        tokens = first.clone() if args.same_tokens else torch.randint(0, vocab, (batch, seq))
        targets = torch.randint(0, vocab, (batch, seq))
        on_device = tokens.to(device), targets.to(device)
        xs.mark_sharding(on_device[0], mesh, ("fsdp", None))
        batches.append((tokens, targets, *on_device))

    if args.taken:
        torch._dynamo.reset()
        other = torch.compile(copy.deepcopy(cpu).to(device), backend="openxla", fullgraph=True)
        for _, _, tokens_d, _ in batches:
            other(tokens_d)
            torch_xla.sync()

    eager = copy.deepcopy(cpu).to(device)
    model = copy.deepcopy(cpu).to(device)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="openxla", fullgraph=True)
    runs = [(cpu, cpu, False), (eager, eager, True), (model, compiled, True)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m, _, _ in runs]
    worst = 0.0
    for step, (tokens, targets, tokens_d, targets_d) in enumerate(batches):
        grads = []
        for (module, run, on_xla), opt in zip(runs, opts):
            opt.zero_grad(set_to_none=True)
            ids, tgt = (tokens_d, targets_d) if on_xla else (tokens, targets)
            F.cross_entropy(run(ids).flatten(0, 1), tgt.flatten()).backward()
            if on_xla:
                torch_xla.sync()
            grads.append([p.grad.cpu() for p in module.parameters()])
            opt.step()
            if on_xla:
                torch_xla.sync()
        eager_vs_cpu = max(float((a - b).abs().max()) for a, b in zip(grads[1], grads[0]))
        per_param = [float((a - b).abs().max()) for a, b in zip(grads[2], grads[1])]
        compiled_vs_eager = max(per_param)
        worst = max(worst, compiled_vs_eager)
        names = [name for name, _ in model.named_parameters()]
        print(f"call {step + 1}: gradient max |diff| eager vs CPU {eager_vs_cpu:.1e}, "
              f"compiled vs eager {compiled_vs_eager:.1e} ("
              + ", ".join(f"{n} {d:.1e}" for n, d in zip(names, per_param)) + ")", flush=True)
    print(f"worst compiled vs eager: {worst:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
