"""Hugging Face decoder stacks through ``scan_layers``, without copying the model's forward.

``scan_decoder_layers(model)`` keeps the model as it is (same modules, same
parameters, same state-dict keys) and changes one thing: while the module
that owns the decoder layer list runs its forward (``LlamaModel``,
``GPT2Model``), its loop over the layers

    for decoder_layer in self.layers[: self.config.num_hidden_layers]:
        hidden_states = decoder_layer(hidden_states, attention_mask=..., ...)

runs once, and that one call applies every layer with
:func:`torch_xla_ext.scan_layers`, passing the arguments the model gave the
first layer (the mask, the rotary ``position_embeddings``, ...) to all of them.
Everywhere else (``fully_shard`` per layer, ``model.model.layers[3]``, an
optimizer, a checkpoint) the list is the usual ``nn.ModuleList``.

``model.activation_checkpointing_enable()`` (``gradient_checkpointing_enable``
before transformers 5) makes the scan recompute each layer in the backward
from its input (``remat.nothing_saveable``, unless ``partition_fn`` chose
another policy; with ``every_n_layers > 1`` every scanned layer is
recomputed, since one loop has one policy, and ``offload`` is not applied).
Hugging Face's own checkpointing, ``torch.utils.checkpoint``, fails on the XLA
device with or without scan (it looks up a ``torch.xla`` device module that
torch_xla 2.9 does not register).

Refused with a clear error rather than computed differently: a KV cache
(``use_cache=True``, ``past_key_values``), requests for every layer's output
(``output_hidden_states``, ``output_attentions``), and models whose layers get
different arguments without a period (``config.layer_types`` mixing attention
kinds irregularly). Kinds that repeat with a period p (Gemma 2's sliding /
full alternation) are scanned in groups of p layers (``scan_layers``'
``group_size``), each position with the arguments the model gives it.
``transformers`` is imported only by the functions that need it.
"""

from __future__ import annotations

import copy
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._masks import check_mask_window, model_window
from .._scan.errors import ScanInputError
from .._scan_layers.groups import POSITIONS, layer_groups
from .._scan_layers.idle_hooks import capturing_outputs
from .._scan_layers.layers import _scan_layers
from .._scan_layers.stored_contract import container_base, rebased
from ..remat import nothing_saveable

__all__ = ["ScannedLayers", "argument_position", "call_argument", "find_stack", "scan_decoder_layers"]


def argument_position(module: torch.nn.Module, name: str) -> int | None:
    """``name``'s position among ``module.forward``'s arguments: -1 keyword-only, None not an argument."""
    params = list(inspect.signature(module.forward).parameters.values())  # bound method: no self
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if name in positional:
        return positional.index(name)
    return -1 if any(p.name == name and p.kind == p.KEYWORD_ONLY for p in params) else None


def call_argument(args: tuple, kwargs: dict, name: str, position: int | None) -> Any:
    """The argument ``name`` of a forward call (``position``: :func:`argument_position`), None if not passed."""
    if name in kwargs:
        return kwargs[name]
    if position is not None and 0 <= position < len(args):
        return args[position]
    return None


class _Options:
    """What a scanned stack passes to ``scan_layers``, and the forward hooks on its owner that mark its forward.

    A deep copy of the model copies it consistently (the copy's hooks and its
    stack share one new instance, through the copy's memo) with a fresh
    per-thread record.
    """

    def __init__(self, partition_fn: Callable | None, is_layer_pure: bool, owner: torch.nn.Module,
                 window: int | None = None, group_size: int = 1) -> None:
        self.partition_fn = partition_fn
        self.is_layer_pure = is_layer_pure
        self.owner = owner  # the module whose forward loops over the stack; its hooks are _Enter and _Leave
        self.hook_ids: tuple[int, int] = (-1, -1)  # (pre-hook, hook) ids in owner's hook dicts
        self.window = window  # the model's sliding window (see torch_xla_ext.hf._masks.model_window)
        self.group_size = group_size  # the period of config.layer_types (1: every layer alike)
        self.local = threading.local()  # .depth: the owner's forwards running; .masks: their attention_mask

    def active(self) -> bool:
        return getattr(self.local, "depth", 0) > 0

    def remove_hooks(self) -> None:
        pre, post = self.hook_ids
        owner = self.owner
        for hooks, key in ((owner._forward_pre_hooks, pre), (owner._forward_pre_hooks_with_kwargs, pre),
                           (owner._forward_hooks, post), (owner._forward_hooks_always_called, post)):
            hooks.pop(key, None)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Options:
        new = _Options.__new__(_Options)
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name != "local":
                setattr(new, name, copy.deepcopy(value, memo))
        new.local = threading.local()
        return new


class _Enter:
    """The owner's forward pre-hook: its forward runs (the stack scans), with this ``attention_mask``."""

    def __init__(self, options: _Options, mask_position: int | None) -> None:
        self.options, self.mask_position = options, mask_position

    def __call__(self, _module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        local = self.options.local
        local.depth = getattr(local, "depth", 0) + 1
        # The mask the model was given (its layers may receive one derived from it).
        local.__dict__.setdefault("masks", []).append(
            call_argument(args, kwargs, "attention_mask", self.mask_position))


class _Leave:
    """The owner's forward hook (always called): its forward ended."""

    def __init__(self, options: _Options) -> None:
        self.options = options

    def __call__(self, *_: Any) -> None:
        self.options.local.depth -= 1
        self.options.local.masks.pop()


class ScannedLayers(torch.nn.ModuleList):
    """A decoder layer list that its owner's forward iterates as one ``scan_layers`` call.

    Made by :func:`scan_decoder_layers` (which changes the class of the
    model's own ``nn.ModuleList``, so identity, children and state-dict keys
    stay). Outside the owner's forward it is a plain ``nn.ModuleList``.
    """

    _txe_scan: _Options

    def __iter__(self) -> Iterator[Any]:
        if self._txe_scan.active():
            return iter(_scan_calls(self, list(self._modules.values()), self._txe_scan))
        return super().__iter__()

    def __getitem__(self, idx):
        if isinstance(idx, slice) and self._txe_scan.active():
            layers = list(self._modules.values())
            if len(layers[idx]) != len(layers) and self._txe_scan.group_size > 1:
                raise ScanInputError(
                    f"scan_decoder_layers: the model's loop takes layers[{idx.start}:{idx.stop}] of an interleaved "
                    f"stack ({len(layers)} layers); only the whole stack can be scanned in groups"
                )
            return _ScannedSlice(self, layers[idx], self._txe_scan)
        return super().__getitem__(idx)

    def unscan(self) -> torch.nn.ModuleList:
        """Make this list a plain ``nn.ModuleList`` again (the model loops over its layers in Python)."""
        self._txe_scan.remove_hooks()
        del self._txe_scan
        self.__class__ = rebased(type(self), torch.nn.ModuleList)  # a stacked list stays stacked
        return self


class _ScannedSlice:
    """``layers[a:b]`` inside the owner's forward: iterates as one call scanning those layers."""

    def __init__(self, stack: ScannedLayers, layers: list[torch.nn.Module], options: _Options) -> None:
        self._stack, self._layers, self._options = stack, layers, options

    def __iter__(self) -> Iterator[Any]:
        return iter(_scan_calls(self._stack, self._layers, self._options) if self._layers else [])

    def __len__(self) -> int:
        return len(self._layers)


def _scan_calls(stack: ScannedLayers, layers: list[torch.nn.Module], options: _Options) -> list[_ScanCall]:
    """What the owner's loop iterates: one call, or one per position of an interleaved group."""
    if options.group_size == 1:
        return [_ScanCall(layers, options)]
    pending: list[tuple[tuple, dict]] = []
    return [_ScanCall(layers, options, stack, k, pending) for k in range(options.group_size)]


class _ScanCall:
    """Stands for the first layer in the owner's loop; calling it applies all the layers as one scan.

    In an interleaved stack (``config.layer_types`` repeating with period p)
    the loop gets p of them: each of the first p - 1 records the arguments the
    model gives its position (the sliding-window mask, say) and hands the
    hidden states on unchanged; the last scans every group of p layers, each
    position with its own arguments.
    """

    def __init__(self, layers: list[torch.nn.Module], options: _Options, stack: ScannedLayers | None = None,
                 position: int = 0, pending: list | None = None) -> None:
        self._layers, self._options = layers, options
        self._stack, self._position, self._pending = stack, position, pending

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        _refuse_per_layer_state(args, kwargs)
        scanned: list[torch.nn.Module] = self._layers
        if self._pending is not None:  # one position of an interleaved group
            self._pending.append((args, kwargs))
            if self._position < self._options.group_size - 1:
                return hidden_states  # the layers' output comes from the scan, at the group's last position
            positions, self._pending[:] = list(self._pending), []
            scanned = layer_groups(self._stack, self._options.group_size, 1)
            args, kwargs = (), {POSITIONS: positions}
        masks = getattr(self._options.local, "masks", None)
        check_mask_window(masks[-1] if masks else None, self._options.window, self._options.group_size > 1)
        partition_fn = self._options.partition_fn
        checkpointing = [layer for layer in self._layers
                         if layer.training and getattr(layer, "gradient_checkpointing", False) is True]
        if not checkpointing:
            return _scan_layers(scanned, hidden_states, args, kwargs, partition_fn, self._options.is_layer_pure)
        # model.gradient_checkpointing_enable(): each layer recomputed in the backward from its input,
        # which is what remat.nothing_saveable does for the scanned loop (unless the user chose a
        # partition_fn). torch.utils.checkpoint itself cannot run on XLA (it looks up torch.xla).
        for layer in checkpointing:
            layer.gradient_checkpointing = False
        try:
            return _scan_layers(scanned, hidden_states, args, kwargs, partition_fn or nothing_saveable,
                                self._options.is_layer_pure)
        finally:
            for layer in checkpointing:
                layer.gradient_checkpointing = True

    def __getattr__(self, name: str) -> Any:
        # The owner's loop reads an attribute of the layer it holds (an attention
        # kind, an index) to choose that layer's arguments: every layer would get
        # the first one's. Refuse instead of guessing.
        raise AttributeError(
            f"scan_decoder_layers: the model's layer loop reads decoder_layer.{name}; in a scanned stack the loop "
            f"runs once and every layer gets the arguments chosen for the first, so per-layer arguments are not "
            f"supported. Undo with model_layers.unscan()."
        )


def _refuse_per_layer_state(args: tuple, kwargs: dict[str, Any]) -> None:
    """Refuse what a scan cannot keep exact: a KV cache written per layer, per-layer outputs requested."""
    cache_types: tuple[type, ...] = ()
    if "transformers.cache_utils" in sys.modules:
        cache_types = (sys.modules["transformers.cache_utils"].Cache,)
    values = list(args) + list(kwargs.values())
    if any(isinstance(v, cache_types) for v in values) or kwargs.get("use_cache") is True:
        raise ScanInputError(
            "scan_decoder_layers: the model passes a KV cache to its layers (use_cache=True or past_key_values); "
            "each layer writes its own entry of the cache, which a scanned stack cannot do. Call the model with "
            "use_cache=False (training), or undo with model_layers.unscan() for generation."
        )
    if capturing_outputs():
        raise ScanInputError(
            "scan_decoder_layers: the model was asked for every layer's output (output_hidden_states, "
            "output_attentions, or a mixture of experts' output_router_logits for its load-balancing loss); a "
            "scanned stack returns only the last layer's. Call it without them, or undo with model_layers.unscan() "
            "(with prepare: scan=False)."
        )


def _period(layer_types: object, num_layers: int) -> int | None:
    """The smallest p < ``num_layers`` dividing it with ``layer_types[i] == layer_types[i % p]``.

    1 when all layers are of one kind; None when no such p exists.
    """
    if not isinstance(layer_types, (list, tuple)) or len(set(layer_types)) <= 1:
        return 1
    if len(layer_types) < num_layers:
        return None
    kinds = list(layer_types)[:num_layers]
    for p in range(2, num_layers):  # p = num_layers would be one group: nothing to scan
        if num_layers % p == 0 and all(kinds[i] == kinds[i % p] for i in range(len(kinds))):
            return p
    return None


def find_stack(model: torch.nn.Module) -> str:
    """The qualified name of the model's decoder layer list: the ``nn.ModuleList`` of one class per hidden layer."""
    config = getattr(model, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    found = [name for name, module in model.named_modules()
             if container_base(type(module)) in (torch.nn.ModuleList, ScannedLayers) and len(module) > 0
             and (count is None or len(module) == count)
             and len({type(layer) for layer in module}) == 1]
    if len(found) != 1:
        raise ScanInputError(
            f"scan_decoder_layers: cannot tell which nn.ModuleList holds the decoder layers of "
            f"{type(model).__name__} (candidates: {found or 'none'}); pass it as layers=model.model.layers"
        )
    return found[0]


def scan_decoder_layers(model: torch.nn.Module, layers: torch.nn.ModuleList | None = None, *,
                        partition_fn: Callable | None = None, is_layer_pure: bool = True) -> ScannedLayers:
    """Run the decoder layers of a Hugging Face model through :func:`torch_xla_ext.scan_layers`, in place.

    Args:
      model: a ``transformers`` model (``LlamaForCausalLM``, ``GPT2LMHeadModel``,
        ...) or any module whose forward loops over an ``nn.ModuleList`` of
        identical layers as ``h = layer(h, ...)``.
      layers: that list, when the model holds more than one candidate
        (default: the one ``nn.ModuleList`` of ``config.num_hidden_layers``
        layers of one class).
      partition_fn, is_layer_pure: passed to ``scan_layers``.

    Returns:
      The same list object, now a :class:`ScannedLayers`; ``.unscan()`` undoes it.

    Parameters, state-dict keys and ``fully_shard`` (before or after this call)
    are unaffected. The layers must pass :func:`~torch_xla_ext.scan_layers`'
    checks (one class, equal members, attributes that do not change the
    computation); the model must be called with ``use_cache=False``.
    """
    if not isinstance(model, torch.nn.Module):
        raise ScanInputError(f"scan_decoder_layers: model must be a torch.nn.Module, got {type(model).__name__}")
    if partition_fn is not None and not callable(partition_fn):
        raise ScanInputError(f"scan_decoder_layers: partition_fn must be callable or None, got "
                             f"{type(partition_fn).__name__}")
    names = {id(module): name for name, module in model.named_modules()}
    if layers is None:
        name = find_stack(model)
    elif id(layers) not in names:
        raise ScanInputError("scan_decoder_layers: layers is not a submodule of model")
    else:
        name = names[id(layers)]
    stack = model.get_submodule(name)
    if isinstance(stack, ScannedLayers):
        raise ScanInputError(f"scan_decoder_layers: {name} is already scanned")
    if container_base(type(stack)) is not torch.nn.ModuleList or not name:
        raise ScanInputError(f"scan_decoder_layers: {name or 'model'} must be an nn.ModuleList inside the model, got "
                             f"{type(stack).__name__}")
    types = {type(layer).__name__ for layer in stack}
    if len(types) != 1:
        raise ScanInputError(f"scan_decoder_layers: {name} holds layers of several classes ({sorted(types)})")
    group_size = _period(getattr(getattr(model, "config", None), "layer_types", None), len(stack))
    if group_size is None:
        layer_types = model.config.layer_types
        raise ScanInputError(
            f"scan_decoder_layers: {type(model).__name__} mixes layer kinds (config.layer_types = "
            f"{sorted(set(layer_types))}) without a period that divides its {len(stack)} layers; its forward "
            f"gives each kind its own arguments (a sliding-window mask), which one scan over all layers cannot do"
        )
    owner = model.get_submodule(name.rpartition(".")[0])
    options = _Options(partition_fn, is_layer_pure, owner, model_window(model), group_size)
    pre = owner.register_forward_pre_hook(_Enter(options, argument_position(owner, "attention_mask")),
                                          with_kwargs=True)
    post = owner.register_forward_hook(_Leave(options), always_call=True)
    options.hook_ids = (pre.id, post.id)
    stack.__class__ = rebased(type(stack), ScannedLayers)  # a stacked list (stack_layers) stays stacked
    stack._txe_scan = options
    return stack
