"""Whether layers can share one traced step: same members, and the same Python attributes or the same trace.

``scan_layers`` stacks the layers' parameters and buffers and runs
``layers[0]``'s forward with each layer's slice. That is the loop only if
every layer computes the same function of its members:

* :func:`check_members`: the same class, parameter and buffer names, shapes,
  dtypes, shardings and ``requires_grad`` flags (the first difference is
  reported, in words close to torch_xla's so code checking them keeps
  working);
* :func:`attribute_groups`: the Python attributes of every submodule
  (``training``, a scale, an attention kind, an index). Layers whose
  attributes equal ``layers[0]``'s need nothing more; the others are traced
  once per distinct attribute set and must give ``layers[0]``'s trace (an
  index read only by a KV cache passes, a per-layer scale does not).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._scan.errors import ScanInputError
from .._scan.guard import describe_callable
from .._scan.keys import attribute_key, by_contents, readable_attributes, value_key
from .._scan.sharding import _canonical_specs
from .idle_hooks import is_idle_hook


def layer_state(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The layer's parameters, then its buffers, by qualified name."""
    state = dict(torch.nn.Module.named_parameters(layer))  # (a stacked layer's own method refuses)
    state.update(dict(layer.named_buffers()))
    return state


def check_members(layers: Sequence[torch.nn.Module], states: list[dict[str, torch.Tensor]]) -> list[str]:
    """The member names of ``layers`` (``states`` are their :func:`layer_state`); raise at the first difference."""
    first = layers[0]
    ref = states[0]
    names = list(ref)
    for i, state in enumerate(states):
        for name, t in state.items():
            if t.device.type != "xla":
                raise TypeError(f"scan_layers: layers[{i}].{name} is on {t.device}; move the layers to the XLA "
                                f"device first (layers.to(torch_xla.device()))")
    ref_specs = _canonical_specs(list(ref.values()))
    for i, (layer, state) in enumerate(zip(layers[1:], states[1:]), start=1):
        # Keys first, as torch_xla's scan_layers checks them (its tests match "mismatched keys").
        if list(state) != names:
            missing, extra = set(names) - set(state), set(state) - set(names)
            raise ScanInputError(
                f"scan_layers: Layer {i} has mismatched keys." + (f" Missing keys: {sorted(missing)}." if missing
                                                                  else "")
                + (f" Extra keys: {sorted(extra)}." if extra else "")
                + ("" if missing or extra else f" Same keys in another order: {list(state)} vs {names}.")
                + " Scanned layers must have the same parameters and buffers."
            )
        if type(layer) is not type(first):
            raise ScanInputError(_other_class(type(first), type(layer), i))
        specs = _canonical_specs(list(state.values()))
        for (name, t), spec, ref_spec in zip(state.items(), specs, ref_specs):
            r = ref[name]
            if tuple(t.shape) != tuple(r.shape):
                raise ScanInputError(f"scan_layers: Shape mismatch for '{name}' in layer {i}: expected "
                                     f"{tuple(r.shape)}, got {tuple(t.shape)} (layers[{i}].{name} has shape "
                                     f"{tuple(t.shape)} but layers[0].{name} has {tuple(r.shape)})")
            for what, a, b in (("dtype", t.dtype, r.dtype), ("sharding", spec, ref_spec),
                               ("requires_grad", t.requires_grad, r.requires_grad)):
                if a != b:
                    raise ScanInputError(f"scan_layers: layers[{i}].{name} has {what} {a} but layers[0].{name} "
                                         f"has {b}; scanned layers must be homogeneous")
    return names


def _other_class(first: type, other: type, index: int) -> str:
    """Why ``layers[index]`` (of class ``other``) cannot be scanned with ``layers[0]`` (of class ``first``)."""
    message = f"scan_layers: layers[{index}] is a {other.__name__} but layers[0] is a {first.__name__}"
    if other.__qualname__ != first.__qualname__ or other.__module__ != first.__module__:
        return message + "; all layers must be of one class"
    # Two class objects that print alike: a wrapper's subclass that keeps the name (fully_shard's) and its base.
    bases = {cls: ", ".join(b.__name__ for b in cls.__bases__) for cls in (first, other)}
    if bases[first] == bases[other]:
        message += ", two classes of one name defined twice (a module reloaded?); all layers must be of one class"
    else:
        message += (f", two classes of one name (layers[0]'s derives from {bases[first]}, layers[{index}]'s from "
                    f"{bases[other]}); all layers must be of one class")
    if issubclass(first, other) or issubclass(other, first):
        wrapped, plain = (0, index) if issubclass(first, other) else (index, 0)
        message += (f". layers[{wrapped}]'s class is a subclass of layers[{plain}]'s made by wrapping the layer "
                    f"(fully_shard keeps the name): ")
        message += ("a layer put in after fully_shard or hf.prepare must be fully sharded like the others "
                    "(fully_shard(layer, mesh=..., with their options)) before it is scanned" if wrapped == 0 else
                    "fully shard every layer or none")
    return message


def attribute_groups(layers: Sequence[torch.nn.Module]) -> list[list[int]]:
    """Indices of the layers whose attributes differ from ``layers[0]``'s, grouped by equal attributes."""
    memo: dict[int, object] = {}  # objects the layers share (a config) are keyed once
    keys = [attribute_key(layer, memo) for layer in layers]
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(keys[1:], start=1):
        if key != keys[0]:
            groups.setdefault(key, []).append(i)
    return list(groups.values())


def describe_difference(first: torch.nn.Module, other: torch.nn.Module, index: int) -> str:
    """The attributes ``layers[index]`` has that differ from ``layers[0]``'s, for an error message.

    Attributes whose values differ in what they hold come first; those that
    only are other objects (of a kind compared by identity) are listed only
    when nothing else differs.
    """
    a = {(p, n): v for p, n, v in readable_attributes(first)}
    b = {(p, n): v for p, n, v in readable_attributes(other)}
    missing = object()
    held, identity = [], []
    for p, n in sorted(set(a) | set(b)):
        va, vb = a.get((p, n), missing), b.get((p, n), missing)
        ka = None if va is missing else value_key(va)
        kb = None if vb is missing else value_key(vb)
        if va is missing or vb is missing or ka != kb:
            show = [("<missing>" if v is missing else repr(v)) for v in (vb, va)]
            line = f"{p + '.' if p else ''}{n} = {show[0]} (layers[0]: {show[1]})"
            only_identity = ka is not None and kb is not None and not (by_contents(ka) and by_contents(kb))
            (identity if only_identity else held).append(line)
    diffs = held or identity
    return f"layers[{index}] differs in " + "; ".join(diffs[:6]) + (" ..." if len(diffs) > 6 else "")


_HOOK_TABLES = (("forward pre-hook", "_forward_pre_hooks"), ("forward hook", "_forward_hooks"),
                ("backward pre-hook", "_backward_pre_hooks"), ("backward hook", "_backward_hooks"))


def check_hooks(layers: Sequence[torch.nn.Module]) -> None:
    """Refuse module hooks on any layer or its submodules, and global module hooks.

    scan_layers runs ``layers[0]``'s forward for every layer with each
    layer's weights: a hook on ``layers[1]`` would never run, one on
    ``layers[0]`` would run for every layer and see ``layers[0]`` as its
    module. Hooks that do nothing per layer are allowed (:mod:`.idle_hooks`:
    the LayerNorm hooks ``fully_shard`` installs, Hugging Face's
    output-capturing hooks while no output is being captured).
    """
    from torch.nn.modules import module as nn_module

    for kind, table in (("forward pre-hook", "_global_forward_pre_hooks"), ("forward hook", "_global_forward_hooks"),
                        ("backward pre-hook", "_global_backward_pre_hooks"),
                        ("backward hook", "_global_backward_hooks")):
        for hook in getattr(nn_module, table).values():
            raise ScanInputError(
                f"scan_layers: a global module {kind} is registered ({describe_callable(hook)}); scan_layers runs "
                f"one traced forward for all layers, so it would run once, at trace time, for layers[0] only. "
                f"Remove it while scanning, or run the layers in a Python loop."
            )
    for i, layer in enumerate(layers):
        for path, module in layer.named_modules():
            for kind, table in _HOOK_TABLES:
                for hook in getattr(module, table).values():
                    if is_idle_hook(hook):
                        continue
                    where = f"layers[{i}]" + (f".{path}" if path else "")
                    raise ScanInputError(
                        f"scan_layers: {where} has a {kind} ({describe_callable(hook)}). scan_layers runs "
                        f"layers[0]'s forward once, traced, for every layer with that layer's weights, so a hook "
                        f"would not run per layer as in the loop (one on layers[0] would run for every layer and "
                        f"see layers[0]). Remove the hook (handle.remove()) while scanning, or run these layers "
                        f"in a Python loop."
                    )
