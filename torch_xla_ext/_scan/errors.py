"""The exceptions of ``scan``, ``scan_layers`` and ``stack_layers``."""

from __future__ import annotations

__all__ = ["ScanInputError", "ScanUnsupportedError", "StackedLayerError"]


class ScanInputError(TypeError, ValueError):
    """A bad argument to ``scan`` or ``scan_layers``, raised before anything is traced or run.

    Both a ``TypeError`` and a ``ValueError``: torch_xla's ``scan`` and
    ``scan_layers`` raise ``ValueError`` for a non-callable ``fn`` and for
    layers that differ, and code written against either keeps catching it.
    """


class ScanUnsupportedError(RuntimeError):
    """``fn`` did something one traced loop cannot do as the Python loop does; refused, nothing computed.

    Raised while ``fn`` is traced, before anything runs on the device (a host
    read of a tensor's value, a nested scan, a host random draw, a computed
    tensor kept beyond the call, an attention under autocast with gradients;
    the message names the user's line), or by the backward when asked for a
    differentiable gradient (``create_graph=True``) or run under autocast.
    """


class StackedLayerError(ScanUnsupportedError):
    """A per-layer operation on layers :func:`~torch_xla_ext.stack_layers` stored stacked; refused, nothing changed.

    A stacked layer's parameters are rows of one ``[L, ...]`` parameter per
    name on its ``nn.ModuleList``: what PyTorch would do to one layer's own
    parameter object (freeze it, give it to an optimizer, hook it, replace
    it, convert it, copy the layer alone) cannot be done to a row, so it is
    refused where it is written, naming the stacked parameter and the way
    out. Operations on the whole model or on the ``ModuleList`` work as on the
    unstacked model.
    """
