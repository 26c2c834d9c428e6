"""A group of parameters stored as one flat, sharded tensor.

Shared by the two kinds of groups: a ``ShardedUnit`` (a transformer block,
gathered around its forward and backward) and a ``ResidentGroup`` (the norm
group and the root remainder, gathered once per optimizer step). This class
knows where each parameter lives, how to expose parameters as views of a
gathered buffer, and how to write their gradients into a grad buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_yafsdp.core.autograd import Narrow
from lightning_yafsdp.core.buffers import GradBuffer
from lightning_yafsdp.core.layout import FlatLayout


@dataclass(frozen=True)
class ParamOwner:
    """A place a parameter is reachable from: ``getattr(module, attr)`` under ``name``."""

    module: nn.Module
    attr: str
    name: str


class FlatParamGroup:
    """Layout, shards and view/grad plumbing of one flat group.

    Args:
        name: the group's name (a module path, ``<norms>`` or ``<root>``).
        layout: the flat layout of its parameters.
        owners: per parameter (layout order), every place it is reachable
            from; more than one for tied parameters.
        master_shard: this rank's part of the flat group in the master dtype
            (a view into the master shard parameter).
        compute_shard: the same part in the compute dtype (the gather source;
            the same tensor as ``master_shard`` when the dtypes agree).
        grad_range: ``[start, end)`` of ``master_shard`` inside its parameter.
    """

    # Resident groups never compute as a whole; units override this with their state.
    is_computing = False

    def __init__(
        self,
        name: str,
        layout: FlatLayout,
        owners: list[list[ParamOwner]],
        *,
        master_shard: torch.Tensor,
        compute_shard: torch.Tensor,
        grad_range: tuple[int, int],
    ) -> None:
        self.name = name
        self.layout = layout
        self.owners = owners
        self.master_shard = master_shard
        self.compute_shard = compute_shard
        self.grad_range = grad_range
        self.requires_grad = [True] * len(owners)
        self._grad_buffer: GradBuffer | None = None
        self._grad_target: torch.Tensor | None = None
        self._written = [False] * len(owners)
        self._placeholder = torch.empty(0, dtype=compute_shard.dtype, device=compute_shard.device)

    # -- parameters as views --------------------------------------------------

    def install_views(self, buffer: torch.Tensor, *, differentiable: bool) -> None:
        """Make every parameter a view of its place in the gathered ``buffer``.

        With ``differentiable`` the views come from ``Narrow`` so that their
        grads land in this group's grad buffer; otherwise they are plain views.
        """
        for index, span in enumerate(self.layout.spans):
            if differentiable:
                view = Narrow.apply(buffer, self, index, span.offset, span.shape)
            else:
                view = buffer.detach().narrow(0, span.offset, span.numel).view(span.shape)
            for owner in self.owners[index]:
                setattr(owner.module, owner.attr, view)

    def install_placeholders(self) -> None:
        """Replace parameters by an empty tensor: outside forward they are sharded."""
        for owners in self.owners:
            for owner in owners:
                setattr(owner.module, owner.attr, self._placeholder)

    # -- gradients into the grad buffer ----------------------------------------

    def begin_grad_writes(self, grad_buffer: GradBuffer) -> None:
        """Start a backward: grads of this group go to ``grad_buffer`` (first write copies)."""
        self._grad_buffer = grad_buffer
        self._grad_target = grad_buffer.tensor
        self._written = [False] * len(self.owners)

    def accumulate_param_grad(self, index: int, grad: torch.Tensor) -> None:
        """Write (first time) or add the grad of parameter ``index`` into the grad buffer."""
        span = self.layout.spans[index]
        region = self._grad_target.narrow(0, span.offset, span.numel).view(span.shape)
        if self._written[index]:
            region.add_(grad)
        else:
            region.copy_(grad)
            self._written[index] = True

    def finish_grad_writes(self) -> None:
        """Zero what no grad was written to (unused params, padding): the buffer is shared."""
        target = self._grad_target
        for index, span in enumerate(self.layout.spans):
            if not self._written[index]:
                target.narrow(0, span.offset, span.numel).zero_()
        # Padding is never written by a grad; it only needs zeroing when the
        # buffer last held a group with a different layout.
        if self._grad_buffer.zero_padding_of != self.layout.signature:
            for start, end in self.layout.padding_ranges():
                target[start:end].zero_()
            self._grad_buffer.zero_padding_of = self.layout.signature
        self._grad_target = None

    def abandon_grad_writes(self) -> None:
        """A backward raised: whatever it wrote into the grad buffer is dropped."""
        self._grad_target = None

    @property
    def has_grad_target(self) -> bool:
        return self._grad_target is not None
