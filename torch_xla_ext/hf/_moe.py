"""Mixture-of-experts layers of Hugging Face models on XLA: every expert on every token, weighted on the device.

transformers' expert implementations pick each expert's tokens by value:
``grouped_mm`` (its default) counts them with ``torch.histc``, ``eager``
loops over ``nonzero()``'s experts. On XLA each is a device->host read inside
every layer (``histc`` on integers is not even implemented), and a scanned
stack refuses the read. :func:`dense_experts_forward` computes the same sum
with shapes that never depend on values: each expert's MLP runs on every
token, and the ``[tokens, experts]`` routing weights (the router's top-k
weights where it chose an expert, zero elsewhere) combine them. The result
is the routed sum (an expert not chosen for a token adds zero to it, and gets
zero gradient from it); what it costs is ``experts / top_k`` times the MLP's
flops, the price of static shapes (a capacity-limited dispatch would drop
tokens, which the eager model never does).

:func:`use_dense_experts` registers it in transformers' experts interface
(``experts_implementation="xla_dense"``, once per process) and selects it
for a model; ``hf.prepare`` does this for every model with such layers.
"""

from __future__ import annotations

import torch

__all__ = ["DENSE", "check_dense_experts", "dense_experts_forward", "expert_modules", "use_dense_experts"]

#: The name the implementation is registered under in transformers' ``ALL_EXPERTS_FUNCTIONS``.
DENSE = "xla_dense"
#: Implementations that select tokens by value (host reads on XLA); prepare replaces them with :data:`DENSE`.
_BY_VALUE = (None, "eager", "grouped_mm")


def dense_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """``[tokens, hidden]``: the sum over each token's chosen experts of the expert's MLP times its weight."""
    experts = self.num_experts
    routing = (torch.nn.functional.one_hot(top_k_index, experts).to(top_k_weights.dtype)
               * top_k_weights.unsqueeze(-1)).sum(dim=1)  # [tokens, experts]
    up = self.gate_up_proj if self.has_gate else self.up_proj
    projected = torch.einsum("th,eho->teo" if self.is_transposed else "th,eoh->teo", hidden_states, up)
    if self.has_bias:
        projected = projected + (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)
    projected = self._apply_gate(projected) if self.has_gate else self.act_fn(projected)
    out = torch.einsum("tei,eih->teh" if self.is_transposed else "tei,ehi->teh", projected, self.down_proj)
    if self.has_bias:
        out = out + self.down_proj_bias
    out = (out * routing.unsqueeze(-1).to(out.dtype)).sum(dim=1)
    return out.to(hidden_states.dtype)


def expert_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The modules of ``model`` that dispatch through transformers' experts interface."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "_is_expert_parallel") and hasattr(m, "has_gate") and hasattr(m, "num_experts")]


def check_dense_experts(model: torch.nn.Module) -> None:
    """``ValueError`` naming an experts module that :func:`dense_experts_forward` cannot compute as its own
    forward does, or whose chosen implementation cannot run on XLA. Changes nothing."""
    for name, m in expert_modules(model):
        chosen = getattr(getattr(m, "config", None), "_experts_implementation", None)
        why = ("its experts are split over devices (expert parallelism)" if m._is_expert_parallel
               else "it normalizes each expert's output (post_expert_norm)" if m.has_post_expert_norm
               else None if chosen in _BY_VALUE + (DENSE, "batched_mm")
               else f"experts_implementation={chosen!r} runs kernels XLA does not have; leave it unset (prepare "
                    f"picks {DENSE!r}) or pass 'batched_mm'")
        if why is not None:
            raise ValueError(f"prepare: {name} ({type(m).__name__}) cannot run its experts on the XLA device: {why}")


def use_dense_experts(model: torch.nn.Module) -> bool:
    """Select :data:`DENSE` for every experts module of ``model`` that would select tokens by value (after
    :func:`check_dense_experts`); True if any."""
    chosen = [m.config for _, m in expert_modules(model) if m.config._experts_implementation in _BY_VALUE]
    if not chosen:
        return False
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if DENSE not in ALL_EXPERTS_FUNCTIONS.keys():
        ALL_EXPERTS_FUNCTIONS.register(DENSE, dense_experts_forward)
    for config in chosen:
        config._experts_implementation = DENSE
    return True
