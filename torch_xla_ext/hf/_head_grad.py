"""The output head's gradient reduced to its shard before the backward goes on into the decoder.

The head's weight gradient, ``grad_logits^T @ hidden``, contracts over the
tokens, which are sharded over the chips: each chip computes a full-size
partial sum (``[vocab, hidden]``, 2 GiB in fp32 for Llama-3 8B, 4 GiB for
70B), and the partitioner reduces it to the chip's shard. Nothing in the
program says when: the TPU compiler was measured computing the partial sum
before the decoder layers' backward loop and slicing the reduced sum to the
shard only inside the optimizer's update after the loop, so a full-size
buffer was live for the whole backward (scripts/README.md,
``maxtext_program.py``; MaxText's own program does the same on the same
compiler).

:func:`reduce_head_gradient_first` ties the two together: when the head's
weight gradient arrives (already annotated with the weight's sharding by
``fully_shard``'s hook), it is held, and the gradient flowing from the
head into the decoder passes through one optimization barrier with it. The
decoder's backward then cannot start before the head's gradient is its
shard, and the full-size partial sum dies at once. A barrier is the identity
on values: every number is the one computed without it. Where the head's
gradient is not ready when the decoder's gradient leaves the head (a head
tied to the input embedding, whose gradient is complete only after the
embedding's backward), the decoder's gradient goes on untouched.
"""

from __future__ import annotations

import torch

from .._annotate import fresh_node, is_fake_tensor, is_replicated_spec
from .._xla import xlac
from ..distributed import MixedPrecisionPolicy

__all__ = ["reduce_head_gradient_first"]


class _HeldGradient:
    """The head weight's gradient of the backward pass now running (its autograd task), until the head's input
    gradient takes it. A gradient from another backward pass is never used: tying it in would pull a past
    step's computation into this one."""

    def __init__(self) -> None:
        self.task: int | None = None
        self.grad: torch.Tensor | None = None

    def keep(self, grad: torch.Tensor, sharded_as: str) -> None:
        # Only a gradient that already carries the weight's sharding: tying an unreduced one would keep the
        # full-size partial sum alive all the same.
        if grad.device.type == "xla" and xlac()._get_xla_sharding_spec(grad) == sharded_as:
            self.task, self.grad = torch._C._current_graph_task_id(), grad

    def take(self) -> torch.Tensor | None:
        grad, task = self.grad, self.task
        self.task = self.grad = None
        return grad if task is not None and task == torch._C._current_graph_task_id() else None


class _Tie(torch.autograd.Function):
    """Forward: the head's input, as it is. Backward: its gradient, behind one barrier with the held weight
    gradient."""

    @staticmethod
    def forward(ctx, held: _HeldGradient, hidden: torch.Tensor) -> torch.Tensor:
        ctx.held = held
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad: torch.Tensor | None):
        weight_grad = ctx.held.take()
        if grad is None or weight_grad is None or grad.device.type != "xla":
            return None, grad
        import torch_xla.core.xla_model as xm

        pair = [fresh_node(weight_grad), fresh_node(grad)]
        xm.optimization_barrier_(pair)
        return None, pair[1]


class _TieInput:
    """The head's forward pre-hook: its input through :class:`_Tie` (not while a tracer runs the forward)."""

    def __init__(self, held: _HeldGradient) -> None:
        self._held = held

    def __call__(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        if not args or not isinstance(args[0], torch.Tensor) or not torch.is_grad_enabled():
            return None
        hidden = args[0]
        if hidden.device.type != "xla" or not hidden.requires_grad or is_fake_tensor(hidden) \
                or torch.compiler.is_compiling():
            return None
        return (_Tie.apply(self._held, hidden),) + tuple(args[1:])


class _KeepGradient:
    """The head weight's gradient hook (registered after ``fully_shard``'s, so it sees the sharded gradient)."""

    def __init__(self, held: _HeldGradient, weight: torch.nn.Parameter) -> None:
        self._held = held
        self._sharded_as = xlac()._get_xla_sharding_spec(weight)

    def __call__(self, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self._held.keep(grad, self._sharded_as)


def reduce_head_gradient_first(model: torch.nn.Module, mp_policy: MixedPrecisionPolicy) -> bool:
    """Tie ``model``'s output head's weight gradient to the gradient of the head's input (module docstring).

    Call after ``fully_shard`` placed and hooked the head's weight. Returns
    whether the tie was installed: not for a head that is not a plain
    ``nn.Linear`` (a PEFT wrapper, say), a frozen or replicated weight, a
    weight shared with the input embedding, or under a mixed-precision
    policy that casts parameters or gradients. A cast puts an autograd node
    between the head and its weight, and autograd runs that node, and so the
    weight's hook, after the backward of the head's input (seen with
    ``param_dtype=torch.bfloat16``): the tie would never find the weight's
    gradient.
    """
    if mp_policy.param_dtype is not None or mp_policy.reduce_dtype is not None:
        return False
    head = getattr(model, "get_output_embeddings", lambda: None)()
    embedding = getattr(model, "get_input_embeddings", lambda: None)()
    if type(head) is not torch.nn.Linear:
        return False
    weight = head.weight
    if not weight.requires_grad or weight.device.type != "xla" \
            or (embedding is not None and getattr(embedding, "weight", None) is weight):
        return False
    if is_replicated_spec(xlac()._get_xla_sharding_spec(weight)):
        return False
    held = _HeldGradient()
    weight.register_hook(_KeepGradient(held, weight))
    head.register_forward_pre_hook(_TieInput(held))
    return True
