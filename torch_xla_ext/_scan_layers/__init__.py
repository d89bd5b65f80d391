"""``scan_layers`` and ``stack_layers``: homogeneous layers applied in sequence as one scan of :mod:`.._scan`.

Built on the loop's stages (``torch_xla_ext._scan.stages``), with its own
checks between them. Each module holds one idea:

``homogeneous``     whether layers can share one traced step (members, hooks,
                    attributes).
``idle_hooks``      the module hooks that do nothing per layer, accepted on
                    scanned layers (a fixed set).
``groups``          a repeating group of consecutive layers scanned as one
                    (``group_size``), Hugging Face's interleaved stacks.
``stacking``        stacking the layers' members per call, and handing the
                    stacked gradient back to each layer.
``stored``          ``stack_layers``: a stack's parameters stored as one
                    ``[L, ...]`` parameter per name, read with no copy.
``stored_contract`` what a stacked layer answers per parameter: PyTorch's
                    numbers, or ``StackedLayerError`` where the user wrote it.
``layers``          ``scan_layers`` itself.
"""

from __future__ import annotations

from .layers import scan_layers
from .stored import stack_layers

__all__ = ["scan_layers", "stack_layers"]
