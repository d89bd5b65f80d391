"""Stacked parameter storage: a layer stack's parameters held as one ``[L, ...]`` parameter per name.

``scan_layers`` over ordinary layers stacks each parameter name's ``L``
tensors into one ``[L, ...]`` operand at every call, and splits the stacked
gradient back into ``L`` gradients. On the TPU compiler that is a second copy
of every layer's parameter shard and of its gradient at the step's peak, and
a few instructions per layer and parameter in the step's entry, so the
compile time grows with ``L`` (``scripts/README.md``, *On the TPU compiler*).

:func:`stack_layers` stores them stacked once instead, as JAX programs hold
a scanned stack: each name becomes one parameter of shape ``[L, *shape]``,
registered on the ``nn.ModuleList`` (as ``"<name with '/' for '.'>"``), and
each layer reads its slice of it:

- ``layers[i].mlp.up_proj.weight`` is ``stacked[i]``, a view made at each
  access (so it follows the optimizer's in-place updates, and its gradient
  lands in the stacked parameter); the layer's ``_parameters`` entry is
  ``None``, so ``parameters()`` yields each stacked parameter once and no
  per-layer tensor;
- ``scan_layers`` hands the stacked parameters to the loop as they are and
  gets their gradient stacked, with no copy either way;
- ``state_dict()`` keys and values are the unstacked model's (``layers.3.
  mlp.up_proj.weight``, in the same order) and ``load_state_dict`` takes
  them, so checkpoints do not change.

Each module inside a stacked layer, and the ``ModuleList``, becomes a
subclass of its class (same name) that keeps PyTorch's per-parameter
contract or refuses where the user writes the operation
(:mod:`.stored_contract`). Nothing moves to the host.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from .._contract import LAYER as _LAYER, MEMBER, SLOTS as _SLOTS, STACKED_NAMES as _NAMES, applied_spec
from .._scan.errors import ScanInputError
from .stored_contract import container_class, mark_replaced, member_class, refuse_outside_holders, register_stacked

__all__ = ["stack_layers", "stored_slices", "refuse_nested_storage"]

# Container -> each per-layer key its load pre-hook handled in the load under way, with the holder module
# whose own hook must then stand aside. Keys, not a flag: a load that raised between the list's pre- and
# post-hook leaves an entry behind, and a later load of a layer or holder alone names that holder by a
# shorter key (relative to where that load started), so it still writes its slices.
# The holders are held weakly: they refer to the container, which must stay collectable.
_loads: weakref.WeakKeyDictionary[nn.Module, dict[str, weakref.ref]] = weakref.WeakKeyDictionary()


def _key(name: str) -> str:
    return name.replace(".", "/")


def _stacked_value(members: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(members)`` on the device, sharded like each member on its dims and not over the layers.

    Members that are shape-only placeholders (``tpu_fit``'s, never sharded
    before ``fully_shard``) give a placeholder of the stacked shape: the
    stacked parameter is then the program's argument, as a real stacked
    parameter's device data is.
    """
    from .._annotate import _annotated_copy
    from .._placeholders import is_placeholder, placeholder
    from .stacking import _stacked_sharding, _tiling

    if is_placeholder(members[0]):
        return placeholder((len(members), *members[0].shape), members[0].dtype)
    with torch.no_grad():
        value = torch.stack([m.detach() for m in members])
    tiling = _tiling(members[0])
    if tiling is None:
        raise ScanInputError(f"stack_layers: a parameter's sharding is neither tiled nor replicated "
                             f"({members[0].shape}); stack the layers before sharding them this way")
    tiles, devices_text, _ = tiling
    if devices_text:
        dims = tiles[:members[0].dim()]
        value = _annotated_copy(value, _stacked_sharding(dims + tiles[members[0].dim():], devices_text,
                                                         members[0].dim()))
    return value


def stack_layers(layers: nn.ModuleList) -> None:
    """Store the parameters of homogeneous ``layers`` stacked: one ``[L, ...]`` parameter per name, in place.

    The layers must be of one class with the same parameter names, shapes,
    dtypes, shardings and ``requires_grad`` flags (as :func:`scan_layers`
    needs), on the XLA device, with no parameter shared between two places.
    Call it before ``fully_shard`` and before the optimizer is created: the
    per-layer parameters it replaces are no longer the model's (an optimizer
    built earlier would update tensors nothing reads). ``fully_shard`` shards
    a stacked parameter on one of a layer's dimensions, never over the layers.

    After it, ``scan_layers(layers, x)`` reads the stacked parameters with no
    copy and the loop ``for layer in layers: x = layer(x)`` still works (each
    access to ``layer.weight`` is a slice). Buffers stay per layer. Nothing
    moves to the host. Raises :class:`ScanInputError` before changing
    anything when the layers cannot be stored stacked.
    """
    from .._placeholders import is_placeholder
    from .homogeneous import check_members

    if not isinstance(layers, nn.ModuleList):
        raise ScanInputError(f"stack_layers: layers must be an nn.ModuleList (the stacked parameters are "
                             f"registered on it), got {type(layers).__name__}")
    members_of = list(layers._modules.values())
    if not members_of:
        raise ScanInputError("stack_layers: the ModuleList is empty")
    if _NAMES in layers.__dict__ or any(m.__dict__.get(_SLOTS) or m.__dict__.get(_LAYER)
                                        for layer in members_of for m in layer.modules()):
        raise ScanInputError("stack_layers: these layers are already stored stacked")
    states = [dict(layer.named_parameters(remove_duplicate=False)) for layer in members_of]
    if not states[0]:
        raise ScanInputError(f"stack_layers: {type(members_of[0]).__name__} has no parameters to stack")
    check_members(members_of, states)
    seen: dict[int, str] = {}
    for i, state in enumerate(states):
        for name, p in state.items():
            where = f"layers[{i}].{name}"
            if id(p) in seen:
                raise ScanInputError(f"stack_layers: {where} is the same tensor as {seen[id(p)]}; a parameter "
                                     f"shared between layers or names cannot be stored stacked (untie it first)")
            seen[id(p)] = where
            if applied_spec(p) is not None:
                raise ScanInputError(f"stack_layers: {where} is already placed by fully_shard; call "
                                     f"stack_layers before fully_shard")
            if p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None):
                raise ScanInputError(f"stack_layers: {where} has a gradient hook, which a stacked parameter "
                                     f"would not keep; register hooks on the stacked parameter instead")
    names = list(states[0])
    for name in names:
        if hasattr(layers, _key(name)):
            raise ScanInputError(f"stack_layers: the ModuleList already has an attribute '{_key(name)}'")
    refuse_outside_holders(layers, seen)
    shapes_only = [is_placeholder(p) for state in states for p in state.values()]
    if any(shapes_only) and not all(shapes_only):
        raise ScanInputError("stack_layers: some of these layers' parameters are shape-only placeholders and some "
                             "hold data; stack layers of one kind (tpu_fit's placeholders, or real tensors)")

    stacked = {name: nn.Parameter(_stacked_value([state[name] for state in states]),
                                  requires_grad=states[0][name].requires_grad) for name in names}
    # Nothing is changed above this line.
    for name, p in stacked.items():
        layers.register_parameter(_key(name), p)
    layers.__dict__[_NAMES] = {name: _key(name) for name in names}
    for i, (layer, state) in enumerate(zip(members_of, states)):
        layer.__dict__[_LAYER] = (layers, i)
        for path, m in layer.named_modules():
            m.__dict__[MEMBER] = (layers, i, path)
        for name in names:
            holder_name, _, local = name.rpartition(".")
            holder = layer.get_submodule(holder_name)
            holder._parameters[local] = None
            holder.__dict__.setdefault(_SLOTS, {})[local] = (layers, _key(name), i)
            mark_replaced(state[name], f"layers[{i}].{name}", _key(name))
        for m in layer.modules():
            m.__class__ = member_class(type(m))
    layers.__class__ = container_class(type(layers))
    register_stacked(layers)
    layers.register_state_dict_post_hook(_unstacked_state_dict)
    layers._register_load_state_dict_pre_hook(_stack_loaded, with_module=True)
    layers.register_load_state_dict_post_hook(_name_missing_layers)
    for holder in {id(h): h for h in (layers[i].get_submodule(n.rpartition(".")[0]) for i in range(len(members_of))
                                      for n in names)}.values():
        holder.register_state_dict_post_hook(_holder_state_dict)
        holder._register_load_state_dict_pre_hook(_holder_loaded, with_module=True)


def _rows(module: nn.ModuleList) -> dict[int, str]:
    """Each stacked row still held by a layer of ``module``: row index -> that layer's key in the list.

    The layers' own records, not their positions, name the rows, so a list
    edited after stacking (a layer deleted or reordered) still maps each
    layer to its own values.
    """
    rows = {}
    for child, layer in module._modules.items():
        record = layer.__dict__.get(_LAYER) if layer is not None else None
        if record is not None and record[0] is module:
            rows[record[1]] = child
    return rows


def _unstacked_state_dict(module: nn.ModuleList, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook: the stacked parameters only as each layer's own keys.

    The holders' hooks (:func:`_holder_state_dict`) have already written
    each layer's slices at their places; this drops the list's stacked keys
    and, under ``keep_vars``, puts the undetached slices in their stead.
    """
    stacked = {name: state_dict.pop(prefix + key) for name, key in module.__dict__[_NAMES].items()}
    for row, child in _rows(module).items():
        for name, value in stacked.items():
            key = f"{prefix}{child}.{name}"
            if key in state_dict:
                state_dict[key] = value[row]  # same key: its place is kept


def _holder_state_dict(holder: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """State-dict hook on a module holding stacked names: each as its own key (its slice), where it was.

    What a ``state_dict()`` of a layer or of the holder alone needs; one of
    the ModuleList or above rewrites these entries again
    (:func:`_unstacked_state_dict`, which also honours ``keep_vars``).
    """
    slots = holder.__dict__[_SLOTS]
    mine = [k for k in state_dict if k.startswith(prefix)]
    saved = OrderedDict((k, state_dict.pop(k)) for k in mine)
    for local, param in holder._parameters.items():  # registration order; a stacked name's entry is None
        key = prefix + local
        if param is None and local in slots:
            container, ckey, index = slots[local]
            state_dict[key] = container._parameters[ckey].detach()[index]
        elif key in saved:
            state_dict[key] = saved.pop(key)
    state_dict.update(saved)


def _size_mismatch(key: str, value: torch.Tensor, stacked: torch.Tensor) -> str:
    """``load_state_dict``'s message for a per-layer value whose shape is not a row of ``stacked``."""
    return (f"size mismatch for {key}: copying a param with shape {tuple(value.shape)} from checkpoint, "
            f"the shape in current model is {tuple(stacked.shape[1:])}.")


def _holder_loaded(holder: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                   missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Load pre-hook on a holder: a ``load_state_dict`` of a layer or holder alone writes its slices in place.

    Under a load of the ModuleList or above, the list's own hook has taken
    these keys already (and reports what is missing).
    """
    for local, (container, ckey, index) in holder.__dict__[_SLOTS].items():
        handled = _loads.get(container, {}).get(prefix + local)
        if holder._parameters.get(local) is not None or (handled is not None and handled() is holder):
            continue
        key = prefix + local
        if key not in state_dict:
            missing_keys.append(key)
            continue
        value = state_dict.pop(key)
        p = container._parameters[ckey]
        if tuple(value.shape) != tuple(p.shape[1:]):
            error_msgs.append(_size_mismatch(key, value, p))
            continue
        with torch.no_grad():
            p[index].copy_(value.detach())


def _stack_loaded(module: nn.ModuleList, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                  missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """Load pre-hook: each stacked name's per-layer values, stacked on the device like its parameter."""
    from .._scan.sharding import _sharding_of

    missing: list[str] = module.__dict__.setdefault("_txe_stacked_missing", [])
    missing.clear()
    module.__dict__["_txe_stacked_prefix"] = prefix
    handled = _loads[module] = {}  # the holders' own hooks stand aside for these keys (until the post hook)
    rows = _rows(module)
    for name, key in module.__dict__[_NAMES].items():
        p = module._parameters[key]
        count = p.shape[0]
        keys = {row: f"{prefix}{child}.{name}" for row, child in rows.items()}
        holder_name = name.rpartition(".")[0]
        for row, child in rows.items():
            handled[keys[row]] = weakref.ref(module._modules[child].get_submodule(holder_name))
        have = {row: k for row, k in keys.items() if k in state_dict}
        if not have:
            if prefix + key not in state_dict:  # (the stacked key itself loads as any parameter does)
                missing.extend(keys.values())
            continue
        if prefix + key in state_dict:
            error_msgs.append(f"{prefix + key} and {have[next(iter(have))]} both given: a stacked parameter "
                              f"is loaded from its per-layer keys or from its own, not both.")
            continue
        values = {i: state_dict.pop(k) for i, k in have.items()}
        bad = [(have[i], v) for i, v in values.items() if tuple(v.shape) != tuple(p.shape[1:])]
        if bad:
            error_msgs.append(_size_mismatch(*bad[0], p))
            continue
        with torch.no_grad():
            if set(values) == set(range(count)):
                value = torch.stack([values[i].detach().to(device=p.device, dtype=p.dtype) for i in range(count)])
            else:  # a partial checkpoint: the layers it has, the others as they are (and reported missing)
                missing.extend(k for row, k in keys.items() if row not in have)
                value = p.detach().clone()
                for i, v in values.items():
                    value[i] = v.detach().to(device=p.device, dtype=p.dtype)
        sharding = _sharding_of(p) if p.device.type == "xla" else None
        if sharding is not None:
            from .._annotate import _annotated_copy

            value = _annotated_copy(value, sharding)
        state_dict[prefix + key] = value


def _name_missing_layers(module: nn.ModuleList, incompatible: Any) -> None:
    """Load post-hook: report a stacked name missing from a checkpoint by its per-layer keys, not its own."""
    _loads.pop(module, None)
    missing: list[str] = module.__dict__.get("_txe_stacked_missing", [])
    prefix = module.__dict__.get("_txe_stacked_prefix", "")
    # Exactly this list's stacked keys: other modules' keys may end in the same name ('weight' for a list of Linear).
    stacked_keys = {prefix + key for key in module.__dict__[_NAMES].values()}
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if k not in stacked_keys] + missing
    missing.clear()


def stored_slices(layers: list[nn.Module]) -> dict[str, torch.Tensor] | None:
    """For layers :func:`stack_layers` stored, each stacked name's parameter over exactly these layers.

    None for ordinary layers. Raises :class:`ScanInputError` for a mix, for
    layers not in their stacked order, and for a layer whose stacked
    parameter was replaced by an assignment after stacking.
    """
    records = [layer.__dict__.get(_LAYER) for layer in layers]
    if all(r is None for r in records):
        refuse_nested_storage(layers)
        return None
    if any(r is None for r in records) or any(r[0] is not records[0][0] for r in records):
        raise ScanInputError("scan_layers: these layers mix ones stored stacked (stack_layers) with others; "
                             "scan the layers of one stacked ModuleList")
    container = records[0][0]
    first = records[0][1]
    indices = [r[1] for r in records]
    if indices != list(range(first, first + len(indices))):
        raise ScanInputError(f"scan_layers: layers stored stacked must be scanned in their stacked order "
                             f"(consecutive, ascending); got stacked indices {indices}")
    names: dict[str, str] = container.__dict__[_NAMES]
    for name in names:
        holder_name, _, local = name.rpartition(".")
        for layer, index in zip(layers, indices):
            if layer.get_submodule(holder_name)._parameters.get(local) is not None:
                raise ScanInputError(
                    f"scan_layers: layers[{index}].{name} was assigned a tensor of its own after stack_layers; "
                    f"the stacked parameter holds this layer's value (write into it: "
                    f"layers.get_parameter('{names[name]}')[{index}].copy_(...))"
                )
    out = {}
    for name, key in names.items():
        p = container._parameters[key]
        out[name] = p if (first, len(indices)) == (0, p.shape[0]) else p[first:first + len(indices)]
    return out


def refuse_nested_storage(layers: list[nn.Module]) -> None:
    """Refuse modules that contain stored-stacked layers without being them (a group of such layers)."""
    for layer in layers:
        for m in layer.modules():
            if m.__dict__.get(_LAYER) is not None:
                raise ScanInputError(
                    f"scan_layers: {type(layer).__name__} contains layers stored stacked (stack_layers); "
                    f"scan that stacked ModuleList itself (group_size > 1 does not read stacked storage)"
                )
