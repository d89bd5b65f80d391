"""torch_xla's Pallas flash attention in a step sized for a TPU from this machine.

torch_xla's ``flash_attention`` traces its Pallas kernels with jax and puts
the TPU's custom call (the kernel's Mosaic module) in the lazy graph. It
lowers them for jax's default backend, which on a host with no TPU is the
CPU, and Pallas refuses there ("Only interpret mode is supported on CPU
backend"). Inside :func:`flash_lowered_for_tpu` the kernels are lowered for
the TPU platform instead: the graph then holds the custom call a TPU job's
graph holds, and ``tpu.compile`` sizes it with the kernel's real footprint.
Such a graph can only be compiled for a TPU, never executed here.

:func:`flash_attention_forward` is a Hugging Face attention function over
that kernel, for the causal, unpadded batches ``tpu-fit`` lowers: Hugging
Face gives an attention function it does not know no mask at all, so it
refuses what it cannot honour (a mask, dropout, a sliding window, soft
capping, a non-causal module) instead of computing something else.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["ATTENTION_NAME", "flash_attention_forward", "flash_lowered_for_tpu"]

#: The name :func:`flash_lowered_for_tpu` registers :func:`flash_attention_forward` under in transformers.
ATTENTION_NAME = "torch_xla_ext_tpu_pallas"  # transformers takes a name with "flash" in it for flash-attn's

_active = threading.local()
_lock = threading.Lock()
_payloads: dict[tuple, str] = {}


def _trace_for_tpu(kernel: Callable, *args: Any, static_argnums: Any = None, static_argnames: Any = None,
                   use_cache: bool = False, **kwargs: Any) -> tuple[str, list[torch.Tensor]]:
    """What torch_xla's ``trace_pallas`` returns (the kernel's backend config, the tensor arguments), with
    the kernel lowered for the TPU platform. Always cached (``use_cache`` is taken and not needed: the key
    holds every argument)."""
    import jax
    from torch_xla.experimental.custom_kernel import _extract_backend_config, to_jax_shape_dtype_struct

    specs = [to_jax_shape_dtype_struct(a) if torch.is_tensor(a) else a for a in args]
    tensors = [a for a in args if torch.is_tensor(a)]
    names = None if static_argnames is None else tuple(static_argnames)
    nums = None if static_argnums is None else tuple(static_argnums)
    key = (kernel, nums, names, tuple(specs), repr(sorted(kwargs.items())))
    payload = _payloads.get(key)
    if payload is None:
        from jax._src.interpreters import mlir

        jitted = jax.jit(kernel, static_argnums=nums, static_argnames=names)
        # In jax's forward-compatible form: with no TPU attached jax cannot read the compiler's build date,
        # and its newest Mosaic serialization (8 for jax 0.7.1) is newer than libtpu 0.0.21 reads (7).
        module = jitted.trace(*specs, **kwargs).lower(
            lowering_platforms=("tpu",), _private_parameters=mlir.LoweringParameters(for_export=True)).compiler_ir()
        payload = _extract_backend_config(module)
        if payload is None:
            raise RuntimeError(f"flash attention for TPU: lowering {getattr(kernel, '__name__', kernel)!r} for "
                               f"the TPU gave no kernel (no tpu_custom_call in its module)")
        _payloads[key] = payload
    return payload, tensors


@contextlib.contextmanager
def flash_lowered_for_tpu(mesh: Any, batch_axis: str) -> Iterator[None]:
    """Lower torch_xla's Pallas kernels for the TPU while inside, and let :func:`flash_attention_forward`
    shard the batch over ``mesh``'s ``batch_axis``; registers it in transformers as :data:`ATTENTION_NAME`.

    Process-wide: torch_xla looks its tracing function up in its module, so
    one block at a time may be entered (a second raises RuntimeError).
    """
    from torch_xla.experimental import custom_kernel
    from transformers import AttentionInterface

    if batch_axis not in mesh.axis_names:
        raise ValueError(f"flash_lowered_for_tpu: the mesh has no axis {batch_axis!r} (its axes: "
                         f"{tuple(mesh.axis_names)})")
    if not _lock.acquire(blocking=False):
        raise RuntimeError("flash_lowered_for_tpu: already entered, here or in another thread; it swaps a "
                           "torch_xla function for the whole process, so one block at a time may be")
    original = custom_kernel.trace_pallas
    try:
        AttentionInterface.register(ATTENTION_NAME, flash_attention_forward)
        custom_kernel.trace_pallas = _trace_for_tpu
        _active.sharding = (mesh, batch_axis)
        yield
    finally:
        _active.sharding = None
        custom_kernel.trace_pallas = original
        _lock.release()


def flash_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention through torch_xla's flash kernel: ``query`` ``[b, heads, s, d]``, ``key``/``value``
    ``[b, kv_heads, s, d]``; returns ``([b, s, heads, d], None)`` as Hugging Face's attention functions do.

    Only inside :func:`flash_lowered_for_tpu`; raises ValueError for
    anything the kernel would not compute as the model's own attention.
    """
    from torch_xla.experimental.custom_kernel import flash_attention

    sharding = getattr(_active, "sharding", None)
    if sharding is None:
        raise RuntimeError(f"{ATTENTION_NAME}: only for a step lowered inside tpu._flash.flash_lowered_for_tpu "
                           f"(its graph holds TPU kernels, which this machine cannot run)")
    refused = [why for why, bad in (
        ("an attention mask (padding or a custom mask)", attention_mask is not None),
        ("dropout", module.training and dropout > 0.0),
        ("a sliding window", kwargs.get("sliding_window") is not None),
        ("soft capping", kwargs.get("softcap") is not None),
        ("a non-causal module", not getattr(module, "is_causal", True)),
        ("query and key of other lengths", query.shape[2] != key.shape[2]),
    ) if bad]
    if refused:
        raise ValueError(f"{ATTENTION_NAME}: computes causal attention over unpadded batches only; this call "
                         f"has {', '.join(refused)}")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # each key/value head serves `groups` query heads, as the model's own attention does
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    mesh, axis = sharding
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = flash_attention(query, key, value, causal=True, sm_scale=scale,
                          partition_spec=(axis, None, None, None), mesh=mesh)
    return out.transpose(1, 2).contiguous(), None
