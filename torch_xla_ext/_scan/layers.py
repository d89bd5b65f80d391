"""``scan_layers``: homogeneous modules applied in sequence as one scan, buffers written back."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

import torch
import torch.utils._pytree as pytree

from .api import _scan_flat
from .cache import on_clear
from .lift import ValueIdentity
from .sharding import _canonical_specs
from .stacking import _Stack, _unstack


def _is_fake(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor of an AOTAutograd trace (fake or functional) rather than a lazy XLA tensor."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def _layer_state(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = dict(layer.named_parameters())
    state.update(dict(layer.named_buffers()))
    return state


def _check_homogeneous(layers: Sequence[torch.nn.Module], states: list[dict[str, torch.Tensor]]) -> list[str]:
    """The member names of ``layers`` (``states`` are their :func:`_layer_state`); raise at the first difference."""
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
        if type(layer) is not type(first):
            raise TypeError(f"scan_layers: layers[{i}] is a {type(layer).__name__} but layers[0] is a "
                            f"{type(first).__name__}; all layers must be of one class")
        if list(state) != names:
            missing = sorted(set(names) ^ set(state))
            raise ValueError(f"scan_layers: layers[{i}] has parameters/buffers {list(state)} but layers[0] has "
                             f"{names} (first difference: {missing[0] if missing else 'order'})")
        specs = _canonical_specs(list(state.values()))
        for (name, t), spec, ref_spec in zip(state.items(), specs, ref_specs):
            r = ref[name]
            for what, a, b in (("shape", tuple(t.shape), tuple(r.shape)), ("dtype", t.dtype, r.dtype),
                               ("device", t.device.type, r.device.type), ("sharding", spec, ref_spec),
                               ("requires_grad", t.requires_grad, r.requires_grad)):
                if a != b:
                    raise ValueError(f"scan_layers: layers[{i}].{name} has {what} {a} but layers[0].{name} "
                                     f"has {b}; scanned layers must be homogeneous")
    return names


_layer_steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_layer_steps_lock = threading.Lock()


@on_clear
def _clear_layer_steps() -> None:
    with _layer_steps_lock:
        _layer_steps.clear()


def _layer_step(template: torch.nn.Module, names: list[str], shapes: list[tuple[int, ...]]) -> Callable:
    """One step function per template layer, so repeated calls hit scan's cache.

    The stacked members may be reshaped (:func:`_stacked_layout`); the step
    gives each slice its parameter's shape back. It holds the template
    weakly: the cache is keyed by the template and must not keep it alive.
    """
    key = (tuple(names), tuple(shapes))
    with _layer_steps_lock:
        step = _layer_steps.get(template, {}).get(key)
    if step is None:
        from torch.func import functional_call

        template_ref = weakref.ref(template)

        def layer_step(h, state):
            params = {name: t if tuple(t.shape) == shape else t.reshape(shape)
                      for name, shape, t in zip(names, shapes, state)}
            # A write into a reshaped member reaches its slice through the view,
            # except from ops that update an argument from C++ in lazy mode
            # (batch_norm's running stats): copy those back so scan sees them.
            views = [(t, params[name]) for name, t in zip(names, state)
                     if params[name] is not t and not _is_fake(params[name])]
            identity = ValueIdentity([v for _, v in views])
            out = functional_call(template_ref(), params, (h,))
            for (t, v), changed in zip(views, identity.changed([v for _, v in views])):
                if changed:
                    t.copy_(v.reshape(t.shape))
            return out, None

        with _layer_steps_lock:
            step = _layer_steps.setdefault(template, {}).setdefault(key, layer_step)
    return step


def scan_layers(
    layers: Sequence[torch.nn.Module],
    x: torch.Tensor,
    *,
    partition_fn: Callable | None = None,
    is_layer_pure: bool = True,
) -> torch.Tensor:
    """Apply homogeneous layers in sequence as one :func:`scan`: ``x = layer(x)`` for each.

    The layers must be of one class with the same parameter and buffer names,
    shapes, dtypes, shardings and ``requires_grad`` flags; the first
    difference is reported. Their parameters are stacked along a new leading
    dimension (sharded like each layer's own parameter on the other
    dimensions, which may be merged where that moves no data between
    devices) and ``layers[0]`` is called with each slice through
    ``torch.func.functional_call``. Gradients land on each layer's own
    parameters, sharded like them. Nothing moves to the host.

    Buffers a layer updates in place (BatchNorm's running statistics, a step
    counter) are written back to each layer's own buffers, as the loop
    writes them. A forward that writes into a parameter is refused before
    anything runs. Layers may read tensors and Python values from outside
    (a shared dict holding the attention mask, a config): every call reads
    them as they are then (see ``is_fn_pure`` of :func:`scan`).

    Args:
      layers: a sequence (e.g. ``nn.ModuleList``) of modules mapping a tensor
        to a tensor of the same shape and dtype.
      x: the input, an XLA tensor.
      partition_fn: see :func:`scan`.
      is_layer_pure: reuse the lowered loop on later calls with the same
        layers and input signature when the forward's trace matches; the
        contract of ``is_fn_pure`` in :func:`scan`.
    """
    layers = list(layers)
    if not all(isinstance(layer, torch.nn.Module) for layer in layers):
        raise TypeError("scan_layers: layers must be a sequence of torch.nn.Module")
    if not isinstance(x, torch.Tensor) or x.device.type != "xla":
        raise TypeError("scan_layers: x must be a torch.Tensor on the XLA device")
    if not layers:
        return x
    states = [_layer_state(layer) for layer in layers]
    names = _check_homogeneous(layers, states)
    stacked = []
    for name in names:
        members = [state[name] for state in states]
        if any(m.requires_grad for m in members) and torch.is_grad_enabled():
            stacked.append(_Stack.apply(*members))
        else:
            with torch.no_grad():
                stacked.append(_Stack.apply(*members))
    shapes = [tuple(states[0][name].shape) for name in names]
    step = _layer_step(layers[0], names, shapes)
    _, x_spec = pytree.tree_flatten(stacked)
    params = {name for name, _ in layers[0].named_parameters()}

    def only_buffers(written: list[int]) -> None:
        # A write into a parameter would bypass autograd and the optimizer.
        for j in written:
            if names[j] in params:
                raise RuntimeError(
                    f"scan_layers: {type(layers[0]).__name__}.forward writes into its parameter '{names[j]}' "
                    f"in place; scan_layers cannot keep that write. Update parameters outside the forward (an "
                    f"optimizer step), or keep the value in a buffer."
                )

    (out,), _, updated = _scan_flat(step, pytree.tree_flatten(x)[1], x_spec, [x], stacked, len(layers), False,
                                    partition_fn, is_layer_pure, check_written=only_buffers)
    if updated:
        _write_back_buffers(states, names, shapes, updated)
    return out


def _write_back_buffers(states: list[dict[str, torch.Tensor]], names: list[str], shapes: list[tuple[int, ...]],
                        updated: dict[int, torch.Tensor]) -> None:
    """Copy the buffer values each layer's iteration left behind into that layer's buffers, as the loop would."""
    with torch.no_grad():
        for j, stacked_value in updated.items():
            for state, value in zip(states, _unstack(stacked_value, shapes[j])):
                state[names[j]].copy_(value)
