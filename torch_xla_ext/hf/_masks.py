"""The 4-D attention masks of Hugging Face models, built on the device from a ``[batch, seq]`` padding mask.

Hugging Face's mask code reads a 2-D mask's values on the host (to decide
whether it may skip the mask); a 4-D mask is used as given. :func:`causal_mask`
builds that 4-D mask on the mask's device, in the form the model's attention
implementation uses, and remembers the sliding window it was built with so
that :func:`torch_xla_ext.hf.scan_decoder_layers` can refuse one that would
drop or add a window (:func:`check_mask_window`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .._scan.errors import ScanInputError

__all__ = ["causal_mask", "check_mask_window", "model_window", "packed_segments"]


#: Masks causal_mask built: id -> (weak reference, the sliding window it was built for; None: full causal).
#: (Not a WeakKeyDictionary: its lookups compare tensors with ==, elementwise.)
_mask_windows: dict[int, tuple[weakref.ref, int | None]] = {}


def _remember_window(mask: torch.Tensor, window: int | None) -> None:
    key = id(mask)
    _mask_windows[key] = (weakref.ref(mask, lambda _ref: _mask_windows.pop(key, None)), window)


def _window_of(mask: torch.Tensor) -> int | None | str:
    """The window causal_mask built ``mask`` with, or ``"unknown"``."""
    entry = _mask_windows.get(id(mask))
    return entry[1] if entry is not None and entry[0]() is mask else "unknown"


def causal_mask(attention_mask: torch.Tensor, sliding_window: int | None = None,
                dtype: torch.dtype | None = None, *, model: Any = None,
                _segments: torch.Tensor | None = None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The causal ``[batch, 1, seq, seq]`` attention mask of a ``[batch, seq]`` padding mask, built on its device.

    Pass it as ``model(..., attention_mask=causal_mask(mask, model=model))``:
    Hugging Face models use a 4-D mask as given, so no attention
    implementation reads the mask on the host (with a 2-D mask ``sdpa`` does,
    with no mask both do, to detect packed sequences). Nothing is transferred
    to the host.

    With ``model`` (a ``transformers`` model, or its config) the mask takes
    the form that model's own mask code gives its attention implementation,
    so the result equals the model's with the 2-D mask, padded rows
    included (left padding with ``labels=input_ids`` puts a padded row's
    prediction into the loss):

    * ``sdpa`` (transformers' default): a boolean mask, True where a query
      may attend. A query row with nothing to attend to (left padding) is
      all False, and attention gives it zeros, as the model's own mask does;
    * ``eager``: an additive mask in ``dtype`` (default: the model's), 0 where
      a query may attend, ``torch.finfo(dtype).min`` where not (eager
      attention adds the mask to its scores: a boolean one would mask
      nothing there);
    * the model's sliding window (``config.sliding_window``) unless
      ``sliding_window`` is given; a model that interleaves sliding and full
      layers (Gemma 2 and 3) gets the dict Hugging Face takes for them,
      ``{"full_attention": ..., "sliding_attention": ...}``.

    Other attention implementations are refused (pass them the 2-D mask).
    Without ``model`` the mask is the additive one in ``dtype`` (default
    float32), which both ``sdpa`` and ``eager`` read, but ``sdpa`` then gives
    a padded row uniform attention over every key instead of zeros: its
    logits differ at padded positions.

    ``sliding_window``: query ``i`` attends to keys ``j`` with
    ``i - sliding_window < j <= i``, as the model's own mask does (positions
    counted in the padded sequence). Under :func:`scan_decoder_layers`, a
    sliding-window model given a 4-D mask not built here with its window is
    refused.
    """
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        raise ScanInputError("causal_mask: attention_mask must be a [batch, seq] tensor of 0/1 (1: a real token), "
                             f"got {getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int)
                                       or sliding_window < 1):
        raise ScanInputError(f"causal_mask: sliding_window must be a positive int or None, got {sliding_window!r}")
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ScanInputError(f"causal_mask: dtype must be a floating-point torch.dtype, got {dtype!r}")
    if model is None:
        return _built(attention_mask, sliding_window, dtype or torch.float32, True, _segments)
    config = model if not isinstance(model, torch.nn.Module) else getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        raise ScanInputError(
            f"causal_mask: model= uses attention implementation {implementation!r}; causal_mask builds the masks "
            f"of 'sdpa' and 'eager' attention. Pass that model the 2-D padding mask, or load it with "
            f"attn_implementation='sdpa' or 'eager'."
        )
    additive = implementation == "eager"
    if dtype is None:
        dtype = getattr(model, "dtype", None) if isinstance(model, torch.nn.Module) else None
        dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else torch.float32
    window = sliding_window if sliding_window is not None else _config_window(config)
    if window is not None and _interleaved(config):
        return {"full_attention": _built(attention_mask, None, dtype, additive, _segments),
                "sliding_attention": _built(attention_mask, window, dtype, additive, _segments)}
    return _built(attention_mask, window, dtype, additive, _segments)


def packed_segments(position_ids: torch.Tensor, batch: int) -> torch.Tensor:
    """``[batch, seq]`` segment numbers of sequences packed in a row, computed on the device.

    A new segment starts wherever the position ids do not step by one, as
    Hugging Face's mask code finds packed sequences when it is given position
    ids and no attention mask (it then lets a query attend only within its
    own segment). ``position_ids`` may be ``[1, seq]`` for a whole batch.
    """
    position_ids = position_ids.expand(batch, -1)
    steps = position_ids[:, 1:] - position_ids[:, :-1]
    starts = torch.cat([torch.zeros_like(position_ids[:, :1]), (steps != 1).to(position_ids.dtype)], dim=1)
    return starts.cumsum(-1)


def _built(attention_mask: torch.Tensor, window: int | None, dtype: torch.dtype, additive: bool,
           segments: torch.Tensor | None = None) -> torch.Tensor:
    """The boolean (True: may attend) or additive mask of ``attention_mask``, causal, within ``window``.

    With ``segments`` (:func:`packed_segments`) a query attends only to keys of its own segment.
    """
    seq = attention_mask.shape[1]
    allowed = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).tril()
    if window is not None:
        allowed = allowed.triu(-(window - 1))  # keys within the window: i - j < window
    mask = allowed[None, None] & attention_mask.bool()[:, None, None, :]
    if segments is not None:
        mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
    if additive:
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    _remember_window(mask, window)
    return mask


def _interleaved(config: Any) -> bool:
    """Whether the model mixes sliding-window and full-attention layers."""
    layer_types = getattr(config, "layer_types", None)
    return isinstance(layer_types, (list, tuple)) and {"sliding_attention", "full_attention"} <= set(layer_types)


def model_window(model: torch.nn.Module) -> int | None:
    """The sliding window the model's own masks apply to its sliding layers (None: none)."""
    return _config_window(getattr(model, "config", None))


def _config_window(config: Any) -> int | None:
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None  # Qwen2 keeps a window in its config but uses it only with this switch
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and "sliding_attention" not in layer_types:
        return None
    return window


def check_mask_window(mask: object, window: int | None, interleaved: bool = False) -> None:
    """Refuse a 4-D mask that would drop the model's sliding window (see :func:`causal_mask`).

    A model whose every layer slides needs a 4-D mask built with its window.
    An interleaved model (sliding and full layers) needs one mask per kind,
    as the dict Hugging Face accepts: ``{"full_attention": causal_mask(m),
    "sliding_attention": causal_mask(m, sliding_window=W)}``.
    """
    if window is None:
        return
    if interleaved:
        if isinstance(mask, torch.Tensor) and mask.dim() == 4:
            raise ScanInputError(
                f"scan_decoder_layers: the model alternates sliding-window (config.sliding_window = {window}) "
                f"and full-attention layers, and a 4-D attention mask is used as given by every layer: one mask "
                f"cannot be right for both. Pass {{'full_attention': causal_mask(mask), 'sliding_attention': "
                f"causal_mask(mask, sliding_window={window})}}, or the 2-D padding mask."
            )
        if isinstance(mask, dict):
            for kind, built_for in (("full_attention", None), ("sliding_attention", window)):
                entry = mask.get(kind)
                if isinstance(entry, torch.Tensor) and entry.dim() == 4 and _window_of(entry) != built_for:
                    raise ScanInputError(
                        f"scan_decoder_layers: attention_mask[{kind!r}] was not built by causal_mask with "
                        f"sliding_window={built_for}; the {kind} layers would attend "
                        f"{'outside their window' if built_for else 'inside a window they do not have'}"
                    )
        return
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4:
        return  # a 2-D mask or none: the model builds its own (windowed) masks
    built_for = _window_of(mask)
    if built_for != window:
        how = ("was not built by causal_mask" if built_for == "unknown"
               else f"was built with sliding_window={built_for}")
        raise ScanInputError(
            f"scan_decoder_layers: the model has a sliding window (config.sliding_window = {window}) and uses a "
            f"4-D attention mask as given, but this mask {how}: the layers would attend outside the window, "
            f"a different result from the model's own mask. Pass causal_mask(mask, sliding_window={window}), or "
            f"the 2-D padding mask."
        )
