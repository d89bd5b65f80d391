"""``scan_layers``: homogeneous modules applied in sequence as one scan, buffers written back."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.utils._pytree as pytree

from .._annotate import is_fake_tensor
from .._contract import as_whole
from .._scan import stages
from .._scan.cache import on_clear
from .._scan.dynamo import refused_under_compile
from .._scan.errors import ScanInputError
from .groups import layer_groups
from .._scan.guard import describe_callable, one_call_at_a_time, refuse_nested
from .homogeneous import attribute_groups, check_hooks, check_members, describe_difference, layer_state
from .._scan.keys import attribute_key, attribute_values, by_contents, value_key
from .._scan.lift import ValueIdentity
from .stacking import _Stack, _unstack
from .stored import stored_slices
from .._scan.trace import refuse_kept_intermediates, same_trace


class _Call(NamedTuple):
    """What every layer of one scan_layers call receives besides its slice of the stacked members."""

    single: bool                # the carried input is one tensor (not a tuple)
    args: tuple                 # positional arguments after the carried inputs
    kwargs: dict[str, Any]      # keyword arguments


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (tuple, list)):
        return f"{type(value).__name__} of {len(value)} ({', '.join(_describe(v) for v in value[:4])}" \
               f"{', ...' if len(value) > 4 else ''})"
    return type(value).__name__


class _DtypeChanged(ScanInputError):
    """A layer returned what it takes except for dtypes (autocast): the loop's first layer then differs."""


def _check_output(template: torch.nn.Module, carry: tuple, out: object, single: bool) -> tuple:
    """``out`` as a tuple of tensors matching ``carry``; raise naming the layer class and what came back."""
    # A tensor for a tensor, a tuple for a tuple: the loop passes the output on as the next input.
    if single:
        got = (out,) if isinstance(out, torch.Tensor) else None
    else:
        got = tuple(out) if isinstance(out, (tuple, list)) else None
    ok = (got is not None and len(got) == len(carry)
          and all(isinstance(o, torch.Tensor) and o.shape == c.shape and o.dtype == c.dtype
                  for o, c in zip(got, carry)))
    if not ok:
        given = _describe(carry[0]) if single else _describe(tuple(carry))
        only_dtypes = (got is not None and len(got) == len(carry)
                       and all(isinstance(o, torch.Tensor) and o.shape == c.shape for o, c in zip(got, carry)))
        raise (_DtypeChanged if only_dtypes else ScanInputError)(
            f"scan_layers: {type(template).__name__}.forward returned {_describe(out)} for the input {given}; "
            f"each layer must return what it takes (the same structure, shapes and dtypes), as the loop "
            f"h = layer(h) needs"
        )
    return tuple(got)


# Attribute sets of layers other than the template whose trace was found equal
# to the template's: per template, {(attribute key, template fingerprint): the
# attribute values}. The values are held so that the identities the key names
# for non-plain values cannot be reused by other objects while it is cached.
_verified: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_VERIFIED_PER_TEMPLATE = 256


_verified_lock = threading.Lock()


@on_clear
def _clear_verified() -> None:
    with _verified_lock:
        _verified.clear()


def _layer_step(layer: torch.nn.Module, names: list[str], shapes: list[tuple[int, ...]], call: _Call) -> Callable:
    """``layer``'s forward as a scan step: ``(carry, slices of the stacked members) -> (carry, None)``.

    The stacked members may be reshaped (:func:`_stacked_layout`); the step
    gives each slice its parameter's shape back. ``call``'s arguments are
    read by the traced forward: tensors among them are outside tensors to
    scan (loop operands). The step is made per call; the plan cache is keyed
    by the template layer (see :func:`_scan_layers`), not by the step.
    """
    from torch.func import functional_call

    def layer_step(carry, state):
        params = {name: t if tuple(t.shape) == shape else t.reshape(shape)
                  for name, shape, t in zip(names, shapes, state)}
        # A write into a reshaped member reaches its slice through the view,
        # except from ops that update an argument from C++ in lazy mode
        # (batch_norm's running stats): copy those back so scan sees them.
        views = [(t, params[name]) for name, t in zip(names, state)
                 if params[name] is not t and not is_fake_tensor(params[name])]
        identity = ValueIdentity([v for _, v in views])
        with as_whole():  # functional_call lists the layer's parameters (a stacked layer's own method refuses)
            out = functional_call(layer, params, (*carry, *call.args), call.kwargs)
        for (t, v), changed in zip(views, identity.changed([v for _, v in views])):
            if changed:
                t.copy_(v.reshape(t.shape))
        return _check_output(layer, carry, out, call.single), None

    layer_step.describes = type(layer).forward  # what messages about the step name
    return layer_step


def _check_call_tensors(kwargs: dict[str, Any], args: tuple) -> tuple:
    """Refuse non-XLA tensors among the layers' other arguments; their non-tensor leaves as a cache key."""
    leaves, spec = pytree.tree_flatten_with_path((args, kwargs))
    key = []
    for path, leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.device.type != "xla":
                where = pytree.keystr(path)
                raise ScanInputError(
                    f"scan_layers: the layer argument {where} is a tensor on {leaf.device}; tensors passed to "
                    f"the layers become loop operands and must be on the XLA device (.to(torch_xla.device()))"
                )
            key.append(None)
        else:
            key.append(value_key(leaf))
    return (spec, tuple(key))


def scan_layers(
    layers: Sequence[torch.nn.Module],
    input_data: torch.Tensor | tuple[torch.Tensor, ...],
    partition_fn: Callable | None = None,
    is_layer_pure: bool = True,
    *,
    group_size: int = 1,
    **layer_kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Apply homogeneous layers in sequence as one :func:`scan`: ``h = layer(h, **layer_kwargs)`` for each.

    The layers must be of one class with the same parameter and buffer names,
    shapes, dtypes, shardings and ``requires_grad`` flags; the first
    difference is reported. Their parameters are stacked along a new leading
    dimension (sharded like each layer's own parameter on the other
    dimensions, which may be merged where that moves no data between
    devices) and ``layers[0]`` is called with each slice through
    ``torch.func.functional_call``. Gradients land on each layer's own
    parameters, sharded like them. Nothing moves to the host.

    Layers whose Python attributes differ from ``layers[0]``'s (an index, a
    per-layer scale, ``training``) are traced once per distinct set of
    attributes, and accepted only if they give ``layers[0]``'s trace: an
    attribute read only by code that does not run (a KV-cache index) passes,
    one that changes the computation raises, naming it.

    Buffers a layer updates in place (BatchNorm's running statistics, a step
    counter) are written back to each layer's own buffers, as the loop
    writes them. A forward that writes into a parameter is refused before
    anything runs. Layers may read tensors and Python values from outside
    (a shared dict holding the attention mask, a config): every call reads
    them as they are then (see ``is_fn_pure`` of :func:`scan`).

    Args:
      layers: a sequence (e.g. ``nn.ModuleList``) of modules of one class.
      input_data: an XLA tensor, or a tuple of XLA tensors; then each layer
        is called as ``layer(*input_data, **layer_kwargs)`` and must return a
        tuple of the same length, shapes and dtypes (torch_xla's
        ``scan_layers`` convention).
      partition_fn: see :func:`scan` (may be given by position, as torch_xla's).
      is_layer_pure: reuse the lowered loop on later calls with the same
        layers and input signature when the forward's trace matches; the
        contract of ``is_fn_pure`` in :func:`scan`.
      **layer_kwargs: passed unchanged to every layer, as the loop
        ``h = layer(h, **layer_kwargs)`` would (an attention mask, rotary
        ``position_embeddings=(cos, sin)``). Tensors among them, in any
        pytree, must be XLA tensors: they become loop operands (never baked
        into the compiled loop), keep their sharding and receive gradients
        when they require grad. Other values are part of the cache key. (The
        names ``partition_fn``, ``is_layer_pure`` and ``group_size`` are this
        function's.)
      group_size: scan a repeating group of this many consecutive layers
        (``layers`` an ``nn.ModuleList`` whose length it divides): for stacks
        whose layers alternate kinds, e.g. ``group_size=2`` for sliding /
        global attention. Layers within a group may differ; every group must
        match the first (see :mod:`torch_xla_ext._scan_layers.groups`).

    Returns:
      The last layer's output: a tensor, or a tuple for a tuple ``input_data``.
    """
    if group_size != 1:
        num_carried = 1 if isinstance(input_data, torch.Tensor) else len(input_data)
        layers = layer_groups(layers, group_size, num_carried)
    return _scan_layers(layers, input_data, (), layer_kwargs, partition_fn, is_layer_pure)


@refused_under_compile
@one_call_at_a_time()
def _scan_layers(layers: Sequence[torch.nn.Module], input_data: torch.Tensor | tuple[torch.Tensor, ...],
                 args: tuple, kwargs: dict[str, Any], partition_fn: Callable | None,
                 is_layer_pure: bool, peel: bool = True) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """:func:`scan_layers` whose layers also receive ``args`` after the carried inputs (Hugging Face stacks).

    ``peel``: when the first layer returns its inputs' shapes in other dtypes
    (autocast), run it on its own, as the loop's first iteration, and scan
    the rest on its output (once).
    """
    refuse_nested("scan_layers")
    layers = list(layers)
    if not all(isinstance(layer, torch.nn.Module) for layer in layers):
        raise ScanInputError("scan_layers: layers must be a sequence of torch.nn.Module")
    single = isinstance(input_data, torch.Tensor)
    carry = (input_data,) if single else input_data
    if not isinstance(carry, tuple) or not carry or not all(isinstance(t, torch.Tensor) for t in carry):
        raise ScanInputError(f"scan_layers: input_data must be an XLA tensor or a non-empty tuple of XLA tensors, "
                             f"got {_describe(input_data)}")
    for i, t in enumerate(carry):
        if t.device.type != "xla":
            where = "input_data" if single else f"input_data[{i}]"
            raise ScanInputError(f"scan_layers: {where} is on {t.device}; it must be on the XLA device "
                                 f"(.to(torch_xla.device()))")
    if partition_fn is not None and not callable(partition_fn):
        raise ScanInputError(f"scan_layers: partition_fn must be callable or None, got {type(partition_fn).__name__}")
    call_key = _check_call_tensors(kwargs, args)
    if not layers:
        return input_data
    stored = stored_slices(layers)
    states = [layer_state(layer) for layer in layers]
    names = check_members(layers, states)
    check_hooks(layers)
    groups = attribute_groups(layers)
    stacked = []
    for name in names:
        members = [state[name] for state in states]
        if any(m.requires_grad for m in members) and torch.is_grad_enabled():
            stacked.append(_Stack.apply(*members))
        else:
            with torch.no_grad():
                stacked.append(_Stack.apply(*members))
    shapes = [tuple(states[0][name].shape) for name in names]
    if stored:  # parameters stored stacked (stack_layers): the loop reads them as they are
        names, shapes = names + list(stored), shapes + [tuple(t.shape[1:]) for t in stored.values()]
        stacked.extend(stored.values())
    call = _Call(single, args, kwargs)
    template = layers[0]
    carry_spec, x_spec = pytree.tree_flatten(carry)[1], pytree.tree_flatten(stacked)[1]
    carry_l, length = list(carry), len(layers)
    captured = None
    try:
        def capture(watch_state: bool = False) -> stages.Captured:
            return stages.capture(_layer_step(template, names, shapes, call), carry_spec, x_spec, carry_l, stacked,
                                  keep_written=True, iterations=None, watch_state=watch_state)

        try:
            captured = capture(watch_state=True)
        except _DtypeChanged:
            if not peel or len(layers) < 2:
                raise
            # Under autocast the first layer turns a float32 input into bfloat16, say, and
            # every later layer takes and returns bfloat16: run the first as the loop
            # does, then scan the rest on its output.
            del stacked
            first = template(*carry, *args, **kwargs)
            if single != isinstance(first, torch.Tensor):
                raise
            return _scan_layers(layers[1:], first, args, kwargs, partition_fn, is_layer_pure, peel=False)
        _check_only_buffers(template, names, captured.written, stored or {})
        _check_same_trace(layers, groups, names, shapes, call, captured)
        key = stages.cache_key(captured, carry_l, stacked, length, False, partition_fn,
                               extra=("scan_layers", tuple(names), tuple(shapes), call_key))
        chosen = stages.plan(template, key, captured, capture, carry_l, stacked, length, False, partition_fn,
                             is_layer_pure)
        captured.release(template)
        out, _, updated = stages.run(chosen, captured, carry_l, stacked, length)
    except BaseException as error:
        stages.forget(captured, error)
        captured = None
        raise
    if updated:
        _write_back_buffers(states, names, shapes, updated)
    return out[0] if single else tuple(out)


def _check_only_buffers(template: torch.nn.Module, names: list[str], written: list[int],
                        stored: dict[str, torch.Tensor]) -> None:
    """Refuse a forward that writes into a parameter: the write would bypass autograd and the optimizer."""
    params = {name for name, _ in torch.nn.Module.named_parameters(template)} | set(stored)
    for j in written:
        if names[j] in params:
            raise RuntimeError(
                f"scan_layers: {type(template).__name__}.forward writes into its parameter '{names[j]}' "
                f"in place; scan_layers cannot keep that write. Update parameters outside the forward (an "
                f"optimizer step), or keep the value in a buffer."
            )


def _check_same_trace(layers: list[torch.nn.Module], groups: list[list[int]], names: list[str],
                      shapes: list[tuple[int, ...]], call: _Call, captured: stages.Captured) -> None:
    """Trace one layer of each attribute group; refuse a group whose trace is not the template's."""
    template, traced = layers[0], captured.traced
    with _verified_lock:
        verified = _verified.setdefault(template, {})
    for group in groups:
        k = group[0]
        key = attribute_key(layers[k])
        # A key naming an object by identity cannot tell a later call that its contents are unchanged:
        # such a group is traced again at every call.
        seen = (key, traced.fingerprint) if by_contents(key) else None
        if seen is not None and seen in verified:
            continue
        other = captured.retrace(_layer_step(layers[k], names, shapes, call))
        same = same_trace(other, traced)
        made = other.made
        del other
        refuse_kept_intermediates(made, lambda k=k: describe_callable(layers[k]))
        if not same:
            raise ScanInputError(
                f"scan_layers: {describe_difference(template, layers[k], k)}, and that changes what the layer "
                f"computes (its trace differs from layers[0]'s). scan_layers runs layers[0]'s forward with each "
                f"layer's parameters, so every layer must compute the same function of its parameters and "
                f"inputs; run these layers in a Python loop, or scan each group of equal layers separately."
            )
        if seen is None:
            continue
        with _verified_lock:
            if len(verified) >= _VERIFIED_PER_TEMPLATE:
                verified.clear()
            verified[seen] = attribute_values(layers[k])


def _write_back_buffers(states: list[dict[str, torch.Tensor]], names: list[str], shapes: list[tuple[int, ...]],
                        updated: dict[int, torch.Tensor]) -> None:
    """Copy the buffer values each layer's iteration left behind into that layer's buffers, as the loop would."""
    with torch.no_grad():
        for j, stacked_value in updated.items():
            for state, value in zip(states, _unstack(stacked_value, shapes[j])):
                state[names[j]].copy_(value)
