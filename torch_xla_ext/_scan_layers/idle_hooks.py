"""Module hooks that do nothing per layer, which ``scan_layers`` accepts on scanned layers.

The set is fixed: importing a module of this package never changes what a
scan accepts. Each predicate reads only its hook and the state it depends on.
"""

from __future__ import annotations

import sys

__all__ = ["capturing_outputs", "is_idle_hook"]


def capturing_outputs() -> bool:
    """Whether a Hugging Face forward is collecting per-layer outputs (output_hidden_states, ...) right now."""
    capturing = sys.modules.get("transformers.utils.output_capturing")
    collector = getattr(capturing, "_active_collector", None)
    try:
        return collector is not None and bool(collector.get())
    except LookupError:
        return False


def _idle_output_capturing_hook(hook: object) -> bool:
    """Hugging Face's output-capturing forward hook while nothing is captured: it does nothing.

    transformers installs it on every decoder layer at the model's first
    forward and keeps it; it records outputs only while a collector is active
    (then the hook is refused like any other, and ``hf``'s scanned stack
    refuses the forward first, naming the option).
    """
    return (getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
            and not capturing_outputs())


def _partitionable_layer_norm_hook(hook: object) -> bool:
    """The LayerNorm hooks ``fully_shard`` installs: the same on every layer, reading no module state."""
    from .._partitionable import is_partitionable_hook

    return is_partitionable_hook(hook)


_IDLE = (_partitionable_layer_norm_hook, _idle_output_capturing_hook)


def is_idle_hook(hook: object) -> bool:
    """Whether ``hook`` does nothing that differs per layer (see the module docstring)."""
    return any(idle(hook) for idle in _IDLE)
