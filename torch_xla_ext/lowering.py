"""Lower XLA tensors to an HLO module and get at its parameters without host transfers.

Lowering a piece of a lazy PyTorch/XLA graph hoists every device-resident tensor
it reads (inputs, module weights, cached Python scalars, the RNG seed) into an
HLO *parameter*. :class:`LoweringContext` lowers the graph and returns those
parameters as **device-resident tensor references** that keep their sharding:
nothing is copied to the host and nothing sharded is gathered.

Data movement, per method:

===============================================  =====================================
``build``, ``hlo``, ``hlo_text``, ``module``     none (host-side lowering only)
``device_parameter_id_tensor_mapping``            none (references to device buffers)
``tensor_parameter_id(s)``, ``parameters``        none
``parameter_id_tensor_mapping``                   **every parameter is gathered
                                                  (``ReplicateShardedData``) and copied
                                                  to the host**
===============================================  =====================================
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from ._annotate import is_replicated_spec
from ._xla import wait_for_executions_in_flight, xlac
from .hlo import HloModule, HloParameter, read_hlo

__all__ = ["LoweringContext", "DEVICE_MAPPING_ENV"]

#: Environment variable choosing how device parameter mappings are computed:
#: ``auto`` (torch_xla's native method when it exists), ``native`` or ``fallback``.
DEVICE_MAPPING_ENV = "TORCH_XLA_EXT_DEVICE_MAPPING"
_MAPPING_IMPLS = ("auto", "native", "fallback")



def _has_native_device_mapping() -> bool:
    return hasattr(xlac().lowering.LoweringContext, "device_parameter_id_tensor_mapping")


def _require_xla_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor on the XLA device, got {type(t).__name__}")
    if t.device.type != "xla":
        raise TypeError(
            f"{what} must be on the XLA device, got a tensor on {t.device}; "
            f"move it with .to(torch_xla.device()) first"
        )
    return t


def _require_tensor_sequence(value: object, what: str, example: str) -> None:
    """Reject a single tensor (iterating it would walk its rows) and non-iterables, with a fix."""
    if isinstance(value, torch.Tensor):
        raise TypeError(
            f"{what} expects a list or tuple of XLA tensors, got a single Tensor of shape "
            f"{tuple(value.shape)} (iterating it would walk its rows); wrap it in a list: {example}"
        )
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{what} expects a list or tuple of XLA tensors, got {type(value).__name__}; "
                        f"for example {example}")


def _same_sharding(tensor_spec: str | None, hlo_spec: str | None) -> bool:
    a = tensor_spec or ""
    b = hlo_spec or ""
    return a == b or (is_replicated_spec(a) and is_replicated_spec(b))


class LoweringContext:
    """Lower XLA tensors to HLO and map its parameters to device-resident tensors.

    Example::

        ctx = LoweringContext("layer")
        ctx.build([y])                                  # y: a lazy XLA tensor
        params = ctx.device_parameter_id_tensor_mapping()   # {param number: device tensor}
        for p in ctx.parameters(inputs=[x]):
            print(p.number, p.shape, p.sharding, p.kind)

    Args:
      name: name of the lowered HLO module.
      device_mapping: how :meth:`device_parameter_id_tensor_mapping` is
        computed: ``"native"`` uses torch_xla's own method (torch_xla >= 2.6),
        ``"fallback"`` walks the output graph's device-data nodes
        (``torch_xla._XLAC._get_tensors_xla_device_data_node``); ``"auto"``
        (default, or the value of ``TORCH_XLA_EXT_DEVICE_MAPPING``) picks native
        when available. Both move zero bytes and return identical mappings.
    """

    def __init__(
        self,
        name: str = "torch_xla_ext",
        *,
        device_mapping: Literal["auto", "native", "fallback"] | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        choice = device_mapping if device_mapping is not None else os.environ.get(DEVICE_MAPPING_ENV, "auto")
        if choice not in _MAPPING_IMPLS:
            source = "device_mapping" if device_mapping is not None else DEVICE_MAPPING_ENV
            raise ValueError(f"{source} must be one of {', '.join(_MAPPING_IMPLS)}, got {choice!r}")
        native = _has_native_device_mapping()
        if choice == "native" and not native:
            raise RuntimeError(
                "device_mapping='native' needs torch_xla >= 2.6 "
                "(LoweringContext.device_parameter_id_tensor_mapping); use 'auto' or 'fallback'"
            )
        self._impl: str = "native" if choice == "native" or (choice == "auto" and native) else "fallback"
        self._name = name
        self._ctx = xlac().lowering.LoweringContext(name)
        self._built = False
        self._graph_data: list[torch.Tensor] = []
        self._seed_data: list[torch.Tensor] = []
        self._hlo: bytes | None = None
        self._module: HloModule | None = None
        self._mapping: dict[int, torch.Tensor] | None = None
        self._handle_to_param: dict[int, int] | None = None

    # ------------------------------------------------------------------ build
    @property
    def name(self) -> str:
        """The name given to the lowered module."""
        return self._name

    @property
    def device_mapping_impl(self) -> str:
        """``"native"`` or ``"fallback"``: how device mappings are computed."""
        return self._impl

    def build(self, outputs: Sequence[torch.Tensor]) -> None:
        """Lower the graphs of ``outputs`` (XLA tensors) into one HLO module.

        Host-side: nothing is executed and no data moves. May be called once.
        It first waits for the executions still in flight (``torch_xla.sync()``
        runs asynchronously): torch_xla 2.9 crashes reading a result whose
        execution has not finished (measured under SPMD: 3 of 5 runs of a
        build right after a sync crashed before this wait).
        """
        if self._built:
            raise RuntimeError("this LoweringContext was already built; create a new one for another graph")
        if isinstance(outputs, torch.Tensor) or not isinstance(outputs, (list, tuple)):
            raise TypeError(f"outputs must be a list or tuple of XLA tensors, got {type(outputs).__name__}")
        if not outputs:
            raise ValueError("outputs must contain at least one XLA tensor")
        tensors = [_require_xla_tensor(t, f"outputs[{i}]") for i, t in enumerate(outputs)]
        X = xlac()
        wait_for_executions_in_flight()
        # References to the device data the graph reads (no copies), taken now
        # so that later in-place updates of the outputs cannot change answers.
        # torch_xla tags the RNG seed's device data with a reserved id.
        ids, data = X._get_tensors_xla_device_data_node(tensors)
        self._ctx.build(tensors)
        seed_id = X._get_seed_info_id()
        self._seed_data = [t for i, t in zip(ids, data) if i == seed_id]
        if self._impl == "fallback":
            self._graph_data = list(data)
        self._built = True

    def _require_built(self) -> None:
        if not self._built:
            raise RuntimeError("call LoweringContext.build(outputs) first")

    # -------------------------------------------------------------------- HLO
    def hlo(self) -> bytes:
        """The serialized ``xla.HloModuleProto`` of the lowered graph."""
        self._require_built()
        if self._hlo is None:
            self._hlo = bytes(self._ctx.hlo())
        return self._hlo

    def hlo_text(self) -> str:
        """The HloModuleProto in protobuf text format."""
        self._require_built()
        return self._ctx.hlo_text()

    def hlo_json(self) -> str:
        """The HloModuleProto as protobuf JSON (what the C++ reader is tested against)."""
        self._require_built()
        return self._ctx.hlo_json()

    @property
    def module(self) -> HloModule:
        """The C++ reader's view of :meth:`hlo` (parsed once)."""
        if self._module is None:
            self._module = read_hlo(self.hlo())
        return self._module

    # ----------------------------------------------------------- the mappings
    def device_parameter_id_tensor_mapping(self) -> dict[int, torch.Tensor]:
        """``{HLO parameter number: device tensor}`` for every device-data parameter.

        The tensors reference the same device buffers as the graph's inputs
        (zero copies, zero host transfers, no ``ReplicateShardedData``) and keep
        the source tensor's sharding. Parameters that are not backed by device
        data are absent. Returns a new dict on each call; the tensors are shared.
        """
        self._require_built()
        if self._mapping is None:
            if self._impl == "native":
                mapping = dict(self._ctx.device_parameter_id_tensor_mapping())
            else:
                mapping = {}
                for t in self._graph_data:
                    number = self._ctx.tensor_parameter_id(t)
                    if number >= 0:
                        mapping.setdefault(number, t)
            self._mapping = dict(sorted(mapping.items()))
        return dict(self._mapping)

    def parameter_id_tensor_mapping(self) -> dict[int, torch.Tensor]:
        """``{HLO parameter number: host tensor}`` -- the slow path.

        Every parameter is gathered to one device (``ReplicateShardedData`` for
        sharded data) and **copied to the host**: a synchronous stall that grows
        with model size. Prefer :meth:`device_parameter_id_tensor_mapping`.
        """
        self._require_built()
        return dict(sorted(self._ctx.parameter_id_tensor_mapping().items()))

    def _handles(self) -> dict[int, int]:
        if self._handle_to_param is None:
            mapping = self.device_parameter_id_tensor_mapping()
            handles = xlac()._get_tensors_handle(list(mapping.values())) if mapping else []
            self._handle_to_param = dict(zip(handles, mapping.keys()))
        return self._handle_to_param

    def tensor_parameter_id(self, tensor: torch.Tensor) -> int:
        """The HLO parameter number backed by ``tensor``'s device data, or -1.

        -1 when the tensor is not a parameter of this module: it is not part of
        the graph, or it holds a pending computation rather than device data.
        O(1) after the first call on this context; no data moves.
        """
        _require_xla_tensor(tensor, "tensor")
        return self.tensor_parameter_ids([tensor])[0]

    def tensor_parameter_ids(self, tensors: Iterable[torch.Tensor]) -> list[int]:
        """:meth:`tensor_parameter_id` for many tensors in one pass, O(len(tensors) + P).

        ``tensors`` is a sequence (or other iterable) of XLA tensors; a single
        tensor raises ``TypeError`` (use :meth:`tensor_parameter_id`).
        """
        _require_tensor_sequence(tensors, "tensor_parameter_ids(tensors)",
                                 "ctx.tensor_parameter_ids([t]), or ctx.tensor_parameter_id(t)")
        self._require_built()
        ts = [_require_xla_tensor(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
        if not ts:
            return []
        X = xlac()
        wait_for_executions_in_flight()  # the handles of results in flight are not readable yet
        table = self._handles()
        try:
            handles: list[int | None] = list(X._get_tensors_handle(ts))
        except RuntimeError:
            # Some tensor holds a pending computation (no device data); find which.
            handles = [_handle_or_none(X, t) for t in ts]
        return [-1 if h is None else table.get(h, -1) for h in handles]

    # ------------------------------------------------------------- parameters
    def parameters(self, inputs: Iterable[torch.Tensor] | None = None) -> list[HloParameter]:
        """The entry computation's parameters, joined with their device tensors.

        Each :class:`HloParameter` carries number, name, shape, dtype and
        sharding from the HLO (C++ reader), ``tensor`` (the device tensor, or
        None when the parameter is not backed by device data) and ``kind``:
        ``"input"`` for tensors listed in ``inputs``, ``"seed"`` for the RNG
        seed, ``"hoisted"`` for everything else the graph read. Raises
        ``RuntimeError`` when a mapped tensor's shape, dtype or sharding
        disagrees with the HLO. ``inputs`` is a list or tuple (or other
        iterable) of XLA tensors; a single tensor raises ``TypeError``. No data
        moves.
        """
        if inputs is not None:
            _require_tensor_sequence(inputs, "parameters(inputs=...)", "ctx.parameters(inputs=[x])")
        self._require_built()
        input_ids = {i for i in self.tensor_parameter_ids(() if inputs is None else inputs) if i >= 0}
        mapping = self.device_parameter_id_tensor_mapping()
        specs = dict(zip(mapping.keys(), xlac()._get_xla_sharding_specs(list(mapping.values())))) if mapping else {}
        seeds = {i for i in self.tensor_parameter_ids(self._seed_data) if i >= 0}
        result = []
        for p in self.module.entry_parameters:
            t = mapping.get(p.number)
            if t is not None:
                self._check_agreement(p, t, specs[p.number])
            kind = "input" if p.number in input_ids else "seed" if p.number in seeds else "hoisted"
            result.append(dataclasses.replace(p, tensor=t, kind=kind))
        return result

    def _check_agreement(self, p: HloParameter, t: torch.Tensor, spec: str) -> None:
        problems = []
        if tuple(t.shape) != tuple(p.shape):
            problems.append(f"shape {tuple(t.shape)} vs HLO {tuple(p.shape)}")
        if p.dtype is not None and t.dtype != p.dtype:
            problems.append(f"dtype {t.dtype} vs HLO {p.dtype}")
        if not _same_sharding(spec, p.sharding):
            problems.append(f"sharding {spec or '{replicated}'} vs HLO {p.sharding}")
        if problems:
            raise RuntimeError(
                f"HLO parameter {p.number} ({p.name}) of module {self._name!r} disagrees with its "
                f"device tensor: {'; '.join(problems)}. The tensor was modified (resharded or "
                f"replaced) after build(); lower the graph again."
            )

    def __repr__(self) -> str:
        state = "built" if self._built else "not built"
        return f"LoweringContext(name={self._name!r}, {state}, device_mapping={self._impl!r})"


def _handle_or_none(X, t: torch.Tensor) -> int | None:
    try:
        return X._get_tensors_handle([t])[0]
    except RuntimeError:
        return None
