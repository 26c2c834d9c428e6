"""The three autograd functions that make backward hooks reliable.

[Note: gates]
Module backward hooks fire too early (before every ``.grad`` exists, and
before anything if an input needs no grad). Instead, before a unit's forward
its weight buffer and its grad-requiring inputs pass through ``GateGradFlow``
(an identity), and its parameters are re-created as views of the gated buffer
through ``Narrow``. In backward, ``Narrow.backward`` writes each parameter's
grad straight into the unit's grad buffer; ``GateGradFlow.backward`` runs only
after all of them (they all consume its output) and before any grad flows to
earlier units (it produces their input grads). It is therefore the unit's
post-backward point, where the reduce_scatter is issued.

``PreBackwardGate`` wraps the unit's outputs; its backward runs before any of
the unit's own backward, which is where the unit's weights are (re)gathered
and its grad buffer is claimed.

None of these functions saves tensors, so activation checkpointing sees the
same saved-tensor count in the original forward and in recomputation.

Recomputation in backward must not read the views made in forward: under a
reentrant checkpoint its nested backward would run through ``GateGradFlow``
into the earlier units. Units install fresh views at pre-backward ([Note:
fresh views for recomputation] in ``unit.py``).
"""

from __future__ import annotations

from typing import Any

import torch


class GateGradFlow(torch.autograd.Function):
    """Identity over (weight buffer, *inputs); its backward is the unit's post-backward hook."""

    @staticmethod
    def forward(ctx: Any, owner: Any, weight_buffer: torch.Tensor, *inputs: torch.Tensor):
        ctx.owner = owner
        # Unused params produce no grad; never materialise unit-sized zeros.
        ctx.set_materialize_grads(False)
        return (weight_buffer.view_as(weight_buffer), *(x.view_as(x) for x in inputs))

    @staticmethod
    def backward(ctx: Any, _buffer_grad: torch.Tensor | None, *input_grads: torch.Tensor | None):
        ctx.owner.post_backward()
        return (None, None, *input_grads)


class Narrow(torch.autograd.Function):
    """A parameter as a view into a weight buffer; its grad goes to the owner's grad buffer."""

    @staticmethod
    def forward(
        ctx: Any, buffer: torch.Tensor, owner: Any, index: int, offset: int, shape: torch.Size
    ):
        ctx.owner = owner
        ctx.index = index
        ctx.set_materialize_grads(False)
        return buffer.narrow(0, offset, shape.numel()).view(shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None):
        if grad is not None:
            ctx.owner.accumulate_param_grad(ctx.index, grad)
        return None, None, None, None, None


class PreBackwardGate(torch.autograd.Function):
    """Identity over a unit's outputs; its backward is the unit's pre-backward hook."""

    @staticmethod
    def forward(ctx: Any, owner: Any, *outputs: torch.Tensor):
        ctx.owner = owner
        ctx.set_materialize_grads(False)
        return tuple(x.view_as(x) for x in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None):
        ctx.owner.pre_backward()
        return (None, *grads)
