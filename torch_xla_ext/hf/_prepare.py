"""``prepare(model, mesh)``: the whole recipe for a Hugging Face decoder model in one call.

``fully_shard`` on every decoder layer and on the model, the decoder layers
through ``scan_layers`` (:func:`~torch_xla_ext.hf.scan_decoder_layers`), and
the attention mask built on the device: the prepared model takes the
``[batch, seq]`` padding mask every data collator gives (or none) and hands
its decoder the 4-D mask in the form the model's own mask code would build,
so Hugging Face never reads a mask on the host.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from ._masks import causal_mask, packed_segments
from ._moe import check_dense_experts, use_dense_experts
from ..distributed import FSDPModule, MixedPrecisionPolicy, fully_shard
from ..distributed._registry import is_fully_sharded, is_replicated
from ._scan_stack import ScannedLayers, argument_position, call_argument, find_stack, scan_decoder_layers

__all__ = ["PreparedOptions", "prepare", "prepared_options"]

_ATTRIBUTE = "_txe_prepared"


@dataclass(frozen=True)
class PreparedOptions:
    """What :func:`prepare` was called with (``model._txe_prepared``); a second call must ask for the same."""

    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    mesh_devices: tuple[int, ...]
    scan: bool
    remat: Callable | None
    reshard_after_forward: bool
    mp_policy: MixedPrecisionPolicy
    stacked: bool = False


def prepared_options(model: torch.nn.Module) -> PreparedOptions | None:
    """The options :func:`prepare` applied to ``model``, or None if it was not prepared."""
    return getattr(model, _ATTRIBUTE, None)


def _mesh_key(mesh: Any) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...]]:
    import numpy as np

    return (tuple(int(n) for n in mesh.mesh_shape), tuple(str(a) for a in mesh.axis_names),
            tuple(int(d) for d in np.asarray(mesh.device_ids).reshape(-1)))


def prepare(model: torch.nn.Module, mesh: Any = None, *, scan: bool = True, remat: Callable | None = None,
            reshard_after_forward: bool = True, mp_policy: MixedPrecisionPolicy | None = None,
            stacked: bool = False) -> torch.nn.Module:
    """Fully shard, scan and mask-proof a ``transformers`` decoder model, in place; returns ``model``.

    Args:
      model: a ``transformers`` model whose forward loops over one
        ``nn.ModuleList`` of ``config.num_hidden_layers`` decoder layers
        (``LlamaForCausalLM``, ``Gemma2ForCausalLM``, ``GPT2LMHeadModel``, ...),
        on the CPU (``fully_shard`` moves it) or already on the XLA device,
        with ``sdpa`` or ``eager`` attention.
      mesh: a torch_xla ``Mesh`` with an ``fsdp`` axis, or a 1-D mesh (default:
        a 1-D ``('fsdp',)`` mesh over every device, as ``fully_shard``).
      scan: run the decoder layers as one ``scan_layers`` loop
        (:func:`scan_decoder_layers`). Sets ``config.use_cache = False``: a
        scanned stack cannot write a KV cache (generation with
        ``use_cache=True`` is refused with an error, never computed otherwise).
      remat: a :mod:`torch_xla_ext.remat` policy for the scanned layers'
        backward (``remat.nothing_saveable`` recomputes each layer from its
        input). Needs ``scan=True``.
      reshard_after_forward, mp_policy: passed to every ``fully_shard`` call
        (the output head's without ``output_dtype`` and input casting).
      stacked: store the decoder layers' parameters stacked
        (:func:`torch_xla_ext.stack_layers`: one ``[L, ...]`` parameter per
        name, each layer reading its row), so the scan reads them with no
        per-step stacking copy of the weights and gradients (Llama-3-8B's
        full-remat fp32 step on 64 v5p chips: 6.05 GiB of HBM per chip
        instead of 6.25).
        Needs ``scan=True``. State-dict keys stay per layer; the optimizer,
        gradient clipping and per-parameter options see the stacked
        parameters (``model.model.layers.get_parameter("mlp/up_proj/weight")``),
        and what stack_layers cannot keep per layer (a module replaced
        inside a layer, as PEFT's adapters do, or a hook on one layer's
        parameter) is refused there with an error. The stacked layers are
        moved to the XLA device first.

    What changes: each decoder layer, the output head (unless it is tied to
    the input embedding) and the model become fully sharded (``fully_shard``;
    the token embedding and the output head on their hidden dimension, so a
    lookup stays on each chip: 1.57 GiB less HBM per chip in Llama-3-8B's
    step on 64 v5p chips; the head as a unit of its own, so its weight's
    gradient is reduced to its shard before the decoder's backward starts,
    :func:`_untied_head`; it takes ``mp_policy``'s parameter and gradient
    dtypes, while the input and output casts stay the model's), the layer
    list scans (``scan=True``), and the module
    owning the layer list gets a forward pre-hook that replaces a 2-D
    ``attention_mask`` (or none) with :func:`causal_mask` built on the device
    in the model's own form (sliding windows, Gemma 2's per-kind dict; with
    no mask and ``position_ids`` that restart, sequences packed in a row
    attend within themselves, as Hugging Face's packed-sequence detection
    does). A 4-D mask or a dict of them is passed on as given. Mixture-of-
    experts layers (Mixtral, Qwen3-MoE, ...) run every expert on every token,
    weighted by the router on the device (``experts_implementation=
    "xla_dense"``, :mod:`._moe`): transformers' own pick each expert's tokens
    on the host. Modules,
    parameters, state-dict keys, class names and ``forward`` signatures stay.

    Idempotent: preparing a prepared model with the same arguments returns it
    unchanged; different arguments raise ``ValueError``. Every check runs
    before anything changes: a model that is already partly fully sharded or
    replicated, one whose decoder stack cannot be found, or one with another
    attention implementation raises and stays as it was.
    """
    from .._scan.errors import ScanInputError
    from ..distributed._param import axis_size, resolve_mesh

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare expects a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(scan, bool):
        raise TypeError(f"prepare: scan must be a bool, got {type(scan).__name__}")
    if remat is not None and not callable(remat):
        raise TypeError(f"prepare: remat must be a torch_xla_ext.remat policy or None, got {type(remat).__name__}")
    if remat is not None and not scan:
        raise ValueError("prepare: remat applies to the scanned layers' backward; pass scan=True (without scan, "
                         "wrap layers in torch_xla.utils.checkpoint.checkpoint yourself)")
    if not isinstance(stacked, bool):
        raise TypeError(f"prepare: stacked must be a bool, got {type(stacked).__name__}")
    if stacked and not scan:
        raise ValueError("prepare: stacked=True stores the layers for the scan to read; pass scan=True")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"prepare: reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}")
    mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"prepare: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    mesh, axis = resolve_mesh(mesh)
    options = PreparedOptions(*_mesh_key(mesh), scan, remat, reshard_after_forward, mp_policy, stacked)
    done = prepared_options(model)
    if done is not None:
        if done != options:
            raise ValueError(f"prepare: this {type(model).__name__} was prepared with {done}; it cannot be prepared "
                             f"again with {options} (build a new model)")
        return model
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        raise ValueError(
            f"prepare: {type(model).__name__} uses attention implementation {implementation!r}; prepare builds the "
            f"masks of 'sdpa' and 'eager' attention on the device. Load the model with attn_implementation='sdpa'.")
    touched = [name or type(model).__name__ for name, m in model.named_modules()
               if is_fully_sharded(m) or is_replicated(m)]
    if touched:
        raise ValueError(f"prepare: {touched[0]} is already fully sharded or replicated; prepare applies fully_shard "
                         f"itself: pass the model as built")
    try:
        stack_name = find_stack(model)
    except ScanInputError as e:
        raise ValueError(f"prepare: {e}") from None
    stack = model.get_submodule(stack_name)
    if isinstance(stack, ScannedLayers):
        raise ValueError(f"prepare: {stack_name} is already scanned; prepare scans it itself: pass the model as built")
    owner = model.get_submodule(stack_name.rpartition(".")[0])
    if getattr(owner, "config", None) is None:
        raise ValueError(f"prepare: {type(owner).__name__}, which runs the decoder layers, has no config; prepare "
                         f"takes a transformers model")
    if argument_position(owner, "attention_mask") is None:
        raise ValueError(f"prepare: {type(owner).__name__}.forward takes no attention_mask argument; prepare builds "
                         f"the decoder's mask, so it needs one")
    check_dense_experts(model)

    if stacked:  # stack_layers' own checks, before anything else changes; a refusal moves the layers back
        _stack_in_place(stack, stack_name)

    # Every check passed: from here on the model changes.
    use_dense_experts(model)
    placement = embeddings_on_hidden(model, axis_size(mesh, axis))
    for layer in stack:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    head = _untied_head(model)
    if head is not None:
        # Its own unit, computing exactly as inside the model's: its input and its logits are not cast.
        fully_shard(head, mesh=mesh, reshard_after_forward=reshard_after_forward, shard_placement_fn=placement,
                    mp_policy=replace(mp_policy, output_dtype=None, cast_forward_inputs=False))
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
                shard_placement_fn=placement)
    if scan:
        scan_decoder_layers(model, stack, partition_fn=remat)
        config.use_cache = False
    positions = {name: argument_position(owner, name)
                 for name in ("attention_mask", "input_ids", "inputs_embeds", "position_ids", "past_key_values")}
    owner.register_forward_pre_hook(_MaskOnDevice(positions), with_kwargs=True, prepend=True)
    setattr(model, _ATTRIBUTE, options)
    assert isinstance(model, FSDPModule)
    return model


def _stack_in_place(stack: torch.nn.ModuleList, name: str) -> None:
    """``stack_layers(stack)`` on the XLA device; on a refusal the layers go back where they were (ValueError)."""
    import torch_xla

    from .._scan.errors import ScanInputError
    from .._scan_layers import stack_layers

    first = next(stack.parameters(), None)
    stack.to(torch_xla.device())
    try:
        stack_layers(stack)
    except ScanInputError as error:
        if first is not None:
            stack.to(first.device)
        raise ValueError(f"prepare: stacked=True cannot store {name} stacked: {error}") from None


def _untied_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model's output head when it is a fully sharded unit of its own: a module with a weight whose
    parameters no other module of the model registers, as a tied input embedding does (else None).

    The head's weight gradient contracts over the tokens, which are sharded,
    so each chip first holds a full-size partial sum (``[vocab, hidden]``:
    2 GiB in fp32 for Llama-3-8B) that the partitioner then reduces to the
    chip's shard. Inside the model's own unit nothing says when: the TPU
    compiler computed the sum before the decoder layers' backward loop and
    sliced it to the shard only in the optimizer's update, so a full-size
    buffer was live through the whole backward (MaxText's program on the
    same compiler does the same). As a unit of its own the head gets
    ``fully_shard``'s backward barrier: the gradient it passes back to the
    decoder waits for its weight's gradient to be reduced to the shard, and
    its mixed-precision cast is made in its own forward, so autograd reaches
    that gradient first. A head sharing a parameter with another module (a
    tied input embedding) stays in the model's unit: that parameter's
    gradient is complete only after the other module's backward.
    """
    head = getattr(model, "get_output_embeddings", lambda: None)()
    if not isinstance(head, torch.nn.Module) or not isinstance(getattr(head, "weight", None), torch.nn.Parameter):
        return None
    inside = Counter(id(p) for _, p in head.named_parameters(remove_duplicate=False))
    everywhere = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return None if any(everywhere[k] > n for k, n in inside.items()) else head


def embeddings_on_hidden(model: torch.nn.Module, size: int) -> Callable[[torch.nn.Parameter], int | None]:
    """``fully_shard``'s placement for the model's root: the token embedding and the output head sharded on
    their hidden dimension (dim 1), where it divides; every other parameter by the default rule.

    Sharded on the vocabulary (the default rule's dim 0), a lookup reads rows
    that live on every chip: the partitioner gathers the whole table for it,
    and the table's gradient is dense and full-size before its reduce-scatter.
    On the hidden dimension each chip looks up its slice of every row
    locally, as MaxText shards its embedding; the head is sharded the same
    way (its product contracts over the hidden dimension).
    """
    tables = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, get, lambda: None)()
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and weight.shape[1] % size == 0:
            tables.add(id(weight))

    def placement(param: torch.nn.Parameter) -> int | None:
        return 1 if id(param) in tables else None

    return placement


def _attention_of(module: torch.nn.Module) -> str | None:
    return getattr(getattr(module, "config", None), "_attn_implementation", None)


class _MaskOnDevice:
    """The decoder owner's forward pre-hook: a 2-D ``attention_mask`` (or none) becomes the model's 4-D mask.

    It holds no module: the mask takes its form from the module it runs on
    (its ``config`` and ``dtype``), so a deep copy of the model builds its own.
    """

    def __init__(self, positions: dict[str, int | None]) -> None:
        self._positions = positions  # each argument's position in the owner's forward (-1, None: keyword only)

    def _get(self, args: tuple, kwargs: dict, name: str) -> Any:
        return call_argument(args, kwargs, name, self._positions[name])

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self._get(args, kwargs, "past_key_values") is not None:
            return None  # generation with a cache: the model's own mask code accounts for the cached keys
        mask = self._get(args, kwargs, "attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 2:
            built = causal_mask(mask, model=module)
        elif mask is None:
            hidden = self._get(args, kwargs, "inputs_embeds")
            shaped = hidden if isinstance(hidden, torch.Tensor) else self._get(args, kwargs, "input_ids")
            if not isinstance(shaped, torch.Tensor) or shaped.dim() < 2:
                return None
            batch, seq = shaped.shape[0], shaped.shape[1]
            ones = torch.ones(batch, seq, dtype=torch.long, device=shaped.device)
            position_ids = self._get(args, kwargs, "position_ids")
            if position_ids is None and _attention_of(module) not in ("sdpa", "eager"):
                return None  # an attention switched to after prepare (tpu-fit's flash) masks causally itself
            segments = packed_segments(position_ids, batch) if isinstance(position_ids, torch.Tensor) else None
            built = causal_mask(ones, model=module, _segments=segments)
        else:
            return None  # a 4-D mask or a dict of them: the model uses it as given
        position = self._positions["attention_mask"]
        if "attention_mask" in kwargs or position is None or not 0 <= position < len(args):
            kwargs = {**kwargs, "attention_mask": built}
        else:
            args = args[:position] + (built,) + args[position + 1:]
        return args, kwargs
