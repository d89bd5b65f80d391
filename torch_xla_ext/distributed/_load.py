"""``load_state_dict`` into fully sharded and replicated modules: keep the sharding, ties and bookkeeping.

Every module holding a managed or replicated registration gets a pre- and a
post-hook (:func:`hook_loads`). The outermost hooked module a call reaches
opens a session: the pre-hook checks (``assign=True``) or stages host values
(``assign=False``) before torch changes anything, the post-hook hands the
parameters torch assigned to their states (:meth:`._state.FSDPState.adopt`).

``assign=False`` uploads host values once, already sharded; ``assign=True``
uploads assigned host tensors and reshards XLA tensors on the device. Nothing
moves from the device to the host.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
import torch.nn as nn

from . import _traversal
from .._annotate import mark_sharding
from .._xla import torch_xla_device, xlac
from .._contract import applied_spec
from ._param import move_to
from ._registry import holder_record
from ._state import FSDPState

__all__ = ["hook_loads"]

_load_local = threading.local()


@dataclasses.dataclass
class _LoadSession:
    """One ``load_state_dict`` call, opened by the outermost hooked module it reaches.

    torch passes the same ``missing_keys`` list to every module of one call
    (and to the post-hooks, in ``incompatible_keys``), so that list identifies
    the call; a session left open by a call that raised is never mistaken for
    a later one.
    """

    owner: nn.Module
    missing_keys: list
    registrations: list[tuple[nn.Module, str]]
    replicas: list[tuple[nn.Module, str]]


def hook_loads(module: nn.Module) -> None:
    """Register the load_state_dict hooks on ``module`` (once)."""
    record = holder_record(module, create=True)
    if not record.load_hooks:
        module.register_load_state_dict_pre_hook(_load_pre_hook)
        module.register_load_state_dict_post_hook(_load_post_hook)
        record.load_hooks = True


Registration = tuple[nn.Module, str, str]  # (holder, local name, key relative to the loaded module)


def _registrations_under(module: nn.Module) -> tuple[list[Registration], list[Registration]]:
    """The managed and the replicated registrations under ``module``, from one walk of its tree."""
    tree = _traversal.module_tree(module)
    owned: list[Registration] = []
    replicas: list[Registration] = []
    for i, holder in enumerate(tree.modules):
        record = holder_record(holder)
        if record is None:
            continue
        for names, found in ((record.owned, owned), (record.replicas, replicas)):
            if names:
                base = tree.fqn(i)
                found.extend((holder, name, f"{base}.{name}" if base else name) for name in names)
    return owned, replicas


def _same_data(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two state dict tensors certainly hold the same values, without a device-to-host transfer."""
    if a is b:
        return True
    if a.device != b.device or a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.device.type == "xla":
        try:  # the same device buffer (state_dict() of a tied model gives that)
            ha, hb = xlac()._get_tensors_handle([a, b])
        except RuntimeError:  # a pending computation: unknown without running it
            return False
        return ha == hb
    if (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
            and a.storage_offset() == b.storage_offset() and a.stride() == b.stride()):
        return True
    return bool(torch.equal(a, b))  # host memory only


def _check_assignable(registrations: list[Registration], state_dict: dict, prefix: str) -> None:
    """Raise, before anything is assigned, what ``load_state_dict(assign=True)`` could not keep sharded."""
    tied: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for holder, name, key in registrations:
        key = prefix + key
        value = state_dict.get(key)
        param = holder._parameters.get(name)
        if value is None or param is None or not isinstance(value, torch.Tensor) or value.shape != param.shape:
            continue  # torch reports missing keys, non-tensors and shape mismatches itself
        _, slot = holder_record(holder).owned[name]
        if value.device.type not in ("cpu", "xla"):
            raise ValueError(
                f"load_state_dict(assign=True) cannot assign '{key}': the tensor is on {value.device}, and a fully "
                f"sharded parameter lives on the XLA device. Pass CPU or XLA tensors (CPU tensors are uploaded and "
                f"sharded like the parameter they replace), or load with assign=False (the default), which copies "
                f"into the existing sharded parameter.")
        applied = applied_spec(value)
        if applied is not None and applied != slot.spec:
            raise ValueError(
                f"load_state_dict(assign=True) cannot assign '{key}': it is a parameter fully_shard already sharded "
                f"as {applied} for another module, and this module shards it as {slot.spec}. Load with "
                f"assign=False (the default), which copies its values into this module's own parameter.")
        tied.setdefault(id(slot.param), []).append((key, value))
    for entries in tied.values():
        first_key, first = entries[0]
        for key, value in entries[1:]:
            if not _same_data(first, value):
                raise ValueError(
                    f"load_state_dict(assign=True): '{first_key}' and '{key}' are one tied parameter, but the state "
                    f"dict holds different tensors for them (values that differ, or separate XLA tensors that cannot "
                    f"be compared without a device-to-host transfer); assigning both would untie them. Pass the same "
                    f"tensor under both keys, or load with assign=False (the default), which copies into the tied "
                    f"parameter in place.")


def _stage_host_values(registrations: list[Registration], state_dict: dict, prefix: str) -> None:
    """Upload the host values ``assign=False`` will copy, already sharded like their parameters.

    ``param.copy_(host_tensor)`` would upload the whole tensor to every device
    and reshard it there (8x the bytes, and a full copy in each device's
    memory); a sharded upload sends each shard once. ``state_dict`` is
    torch's per-call copy, so the caller's dict is not modified. The keys of
    a tied parameter that hold the same values are uploaded once.
    """
    import torch_xla

    staged: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}  # id(parameter) -> [(host value, upload)]
    for holder, name, key in registrations:
        key = prefix + key
        value = state_dict.get(key)
        param = holder._parameters.get(name)
        if (not isinstance(value, torch.Tensor) or value.device.type != "cpu" or param is None
                or param.device.type != "xla" or value.shape != param.shape):
            continue  # left to torch: it reports what does not fit
        state, slot = holder_record(holder).owned[name]
        uploads = staged.setdefault(id(slot.param), [])
        upload = next((up for host, up in uploads if _same_data(host, value)), None)
        if upload is None:
            upload = value.detach().to(torch_xla.device())
            if any(s is not None for s in slot.spec):
                mark_sharding(upload, state.mesh, slot.spec)
            uploads.append((value, upload))
        state_dict[key] = upload


def _load_pre_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict, strict: bool,
                   missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    session = getattr(_load_local, "session", None)
    if session is not None and session.missing_keys is missing_keys:
        return  # an enclosing module of this call opened the session
    if torch.__future__.get_swap_module_params_on_conversion():
        raise RuntimeError(
            "load_state_dict into a fully sharded module does not support "
            "torch.__future__.set_swap_module_params_on_conversion(True): swapping would drop the parameters' "
            "sharding and gradient hooks. Set it to False around load_state_dict; assign=False and assign=True "
            "both keep the sharding without it.")
    registrations, replicas = _registrations_under(module)
    if local_metadata.get("assign_to_params_buffers", False):
        _check_assignable(registrations, state_dict, prefix)
        for _, _, key in replicas:
            value = state_dict.get(prefix + key)
            if isinstance(value, torch.Tensor) and value.device.type not in ("cpu", "xla"):
                raise ValueError(
                    f"load_state_dict(assign=True) cannot assign '{prefix + key}': the tensor is on {value.device}, "
                    f"and a parameter of a replicate()-d module lives on the XLA device. Pass CPU or XLA tensors "
                    f"(CPU tensors are uploaded), or load with assign=False (the default), which copies in place.")
    else:
        _stage_host_values(registrations, state_dict, prefix)
    _load_local.session = _LoadSession(module, missing_keys, [(h, n) for h, n, _ in registrations],
                                       [(h, n) for h, n, _ in replicas])


def _load_post_hook(module: nn.Module, incompatible_keys: Any) -> None:
    session = getattr(_load_local, "session", None)
    if session is None or session.owner is not module or session.missing_keys is not incompatible_keys.missing_keys:
        return
    _load_local.session = None
    # Per state: {id(old managed parameter): its replacement, or None}; the first registration that changed wins
    # (tied registrations were checked to hold the same data).
    replaced: dict[int, tuple[FSDPState, dict[int, nn.Parameter | None]]] = {}
    for holder, name in session.registrations:
        state, slot = holder_record(holder).owned[name]
        current = holder._parameters.get(name)
        per_state = replaced.setdefault(id(state), (state, {}))[1]
        if per_state.get(id(slot.param)) is None:
            per_state[id(slot.param)] = current if current is not None and current is not slot.param else None
    for state, per_state in replaced.values():
        state.adopt(per_state)
    if session.replicas:
        for holder, name in session.replicas:  # assign=True put host tensors there
            p = holder._parameters.get(name)
            if p is not None and p.device.type == "cpu":
                move_to(p, torch_xla_device())
