"""One attention's forward and backward on the TPU compiler: Hugging Face's ``sdpa`` path against JAX's.

Under full remat a layer's backward recomputes its forward, so the largest
buffers of a Llama step's backward are one attention's ``[heads, seq, seq]``
scores and their gradients. This sizes exactly that, per chip, for Llama 3's
8B and 70B head counts, one 2,048-token sequence per chip (a batch of 4 over
``v5p:2x2x1``, as ``tpu-fit``'s steps hold one sequence per chip):

* ours: what a Hugging Face Llama runs for an unpadded batch,
  transformers' ``sdpa_attention_forward`` with no mask (causal
  ``F.scaled_dot_product_attention``, PyTorch's math decomposition on XLA),
  under ``torch.autocast("xla", bfloat16)`` for the bf16 rows; ``--bf16-reduction`` sets
  ``torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)`` (PyTorch's
  default keeps the scores of bf16 inputs in float32);
* JAX: ``jax_llama.attention``, the function the JAX reference step calls:
  grouped-query attention without repeating K and V, the softmax in float32,
  bf16 inputs for the bf16 rows.

Both are compiled by ``torch_xla_ext.tpu``'s compile-only client (libtpu
0.0.21) and read the same way: HBM used per chip (the compiler's HBM buffer
assignment plus code). The query, key, value and output gradient are
arguments on both sides; the three input gradients are the outputs.

    python scripts/attention_hbm.py --png bench_out/attention_hbm.png
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ["CPU_NUM_DEVICES"] = "4"  # the slice's chips, before torch_xla starts its client
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

TOPOLOGY = "v5p:2x2x1"
BATCH, SEQ, HEAD_DIM, KV_HEADS = 4, 2048, 128, 8
HEADS = {"8B": 32, "70B": 64}


def ours(heads: int, bf16: bool) -> int:
    """HBM used per chip by the Hugging Face ``sdpa`` attention's forward and backward."""
    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tpu_bench import compile_torch

    device = torch_xla.device()
    mesh = xs.Mesh(np.arange(BATCH), (BATCH,), ("fsdp",))
    generator = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if bf16 else torch.float32

    def argument(n_heads: int) -> torch.Tensor:  # device data, sharded over the batch: an argument
        t = torch.randn(BATCH, n_heads, SEQ, HEAD_DIM, generator=generator, dtype=dtype).to(device)
        t.requires_grad_()
        xs.mark_sharding(t, mesh, ("fsdp", None, None, None))
        return t

    q, k, v = argument(heads), argument(KV_HEADS), argument(KV_HEADS)
    grad_out = argument(heads).detach()

    module = torch.nn.Module()  # what the function reads of a Llama attention module
    module.num_key_value_groups, module.is_causal, module.layer_idx = heads // KV_HEADS, True, 0

    def build() -> list[torch.Tensor]:
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=bf16):
            out, _ = sdpa_attention_forward(module, q, k, v, None, scaling=HEAD_DIM ** -0.5)
        return list(torch.autograd.grad(out.transpose(1, 2), (q, k, v), grad_out))

    result = compile_torch(build, TOPOLOGY)
    return _hbm_used(result)


def jax_reference(heads: int, bf16: bool) -> int:
    """HBM used per chip by ``jax_llama.attention``'s forward and backward (the function the reference step calls)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from jax_llama import attention
    from torch_xla_ext.tpu import _client
    from tpu_bench import compile_jax

    dtype = jnp.bfloat16 if bf16 else jnp.float32
    group = heads // KV_HEADS

    def torch_layout_attention(q, k, v):
        # The arguments in the shapes ours receives ([b, heads, s, d]), so both programs start from the same
        # arguments (given jax_llama's own layout instead, this program was 17-545 MiB larger, at 70B bf16 by a
        # layout-changing copy of the softmax gradient: scripts/README),
        # viewed in jax_llama's layout (sequence before heads) for the function, and its output back
        q = q.reshape(BATCH, KV_HEADS, group, SEQ, HEAD_DIM).transpose(0, 3, 1, 2, 4)
        out = attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3))
        return out.transpose(0, 2, 3, 1, 4).reshape(BATCH, heads, SEQ, HEAD_DIM)

    def step(q, k, v, grad_out):
        _, pullback = jax.vjp(torch_layout_attention, q, k, v)
        return pullback(grad_out)

    mesh = Mesh(np.array(_client.topology_devices(TOPOLOGY)), ("fsdp",))
    sharded = NamedSharding(mesh, PartitionSpec("fsdp"))
    spec = lambda n: jax.ShapeDtypeStruct((BATCH, n, SEQ, HEAD_DIM), dtype, sharding=sharded)  # noqa: E731
    jitted = jax.jit(step, out_shardings=(sharded, sharded, sharded))
    result = compile_jax(jitted, [spec(heads), spec(KV_HEADS), spec(KV_HEADS), spec(heads)], TOPOLOGY)
    return _hbm_used(result)


def _hbm_used(result) -> int:
    if result.hbm_used_bytes is None:
        raise RuntimeError("the TPU compiler wrote no buffer assignment: HBM used is unknown")
    return result.hbm_used_bytes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bf16-reduction", action="store_true",
                    help="torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True) for ours")
    ap.add_argument("--png", default="bench_out/attention_hbm.png")
    args = ap.parse_args()
    import torch
    import torch_xla.runtime as xr

    from torch_xla_ext._sdpa_autocast import register_sdpa_autocast

    register_sdpa_autocast()  # done by importing torch_xla_ext; said here because the bf16 rows rely on it

    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(args.bf16_reduction)
    xr.use_spmd()
    mib = 2 ** 20
    print(f"one attention, forward and backward, per chip on {TOPOLOGY} (1 x {SEQ} tokens per chip), HBM used, "
          f"MiB{'; ours with bf16 reductions allowed' if args.bf16_reduction else ''}", flush=True)
    print("| heads (model) | dtype | ours: HF sdpa | JAX | ours / JAX |\n|---|---|---|---|---|", flush=True)
    results = {}
    for model, heads in HEADS.items():
        for bf16 in (False, True):
            a, b = ours(heads, bf16), jax_reference(heads, bf16)
            label = f"{model} {'bf16' if bf16 else 'fp32'}"
            results[label] = (a, b)
            print(f"| {heads} ({model}) | {'bf16' if bf16 else 'fp32'} | {a / mib:.1f} | {b / mib:.1f} | "
                  f"{a / b:.3f}x |", flush=True)
    _plot(results, args.png)
    print(f"wrote {args.png}")
    return 0


def _plot(results: dict[str, tuple[int, int]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    xs = range(len(results))
    ax.bar([x - 0.2 for x in xs], [a / 2**20 for a, _ in results.values()], 0.4, label="ours: HF sdpa")
    ax.bar([x + 0.2 for x in xs], [b / 2**20 for _, b in results.values()], 0.4, label="JAX")
    ax.set_xticks(list(xs), list(results))
    ax.set_ylabel("MiB of HBM used per chip")
    ax.legend(fontsize=8)
    ax.set_title("One attention's forward and backward on the TPU compiler")
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
