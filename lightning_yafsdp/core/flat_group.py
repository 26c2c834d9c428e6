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
from lightning_yafsdp.core.sharded_param import ShardedTensor, ShardPlacement


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
        self._grad_buffer: GradBuffer | None = None
        self._grad_target: torch.Tensor | None = None
        self._written = [False] * len(owners)
        # Per parameter: did this backward pass write a grad for it on this rank?
        self.used_in_backward = [False] * len(owners)
        # Filled by ``make_sharded_params``: what the modules and the optimizer hold.
        self.sharded_params: list[nn.Parameter] = []
        self.master_ranges: list[tuple[int, int]] = []

    def __deepcopy__(self, memo: dict) -> FlatParamGroup:
        # A deep copy of a sharded model (an EMA's AveragedModel) copies the modules'
        # hooks, which are bound to their groups: the copy's hooks must stay bound to
        # THIS group (one engine, one process group), which refuses a copy's forward.
        return self

    # -- the parameters users see ----------------------------------------------

    def make_sharded_params(self, rank: int, process_group) -> None:
        """One ShardedTensor parameter per span: this rank's piece of the master shard.

        ``master_ranges[i]`` is where parameter i's piece lies in the whole master
        shard (the grad window and per-element optimizer state use the same offsets).
        """
        base = self.grad_range[0]
        for index, (span, owners) in enumerate(zip(self.layout.spans, self.owners, strict=True)):
            piece = self.layout.shard_slice(index, rank)
            if piece is None:
                start = end = 0
                offset = 0 if index == 0 else self.master_ranges[-1][1] - base
            else:
                start, end, offset = piece.param_start, piece.param_end, piece.shard_offset
            placement = ShardPlacement(
                name=span.name,
                aliases=tuple(owner.name for owner in owners),
                shape=span.shape,
                start=start,
                end=end,
            )
            local = self.master_shard[offset : offset + end - start]
            self.sharded_params.append(nn.Parameter(ShardedTensor(local, placement, process_group)))
            self.master_ranges.append((base + offset, base + offset + end - start))

    def register_sharded_params(self) -> None:
        """Put the sharded parameters into the modules, under every original name."""
        for param, owners in zip(self.sharded_params, self.owners, strict=True):
            for owner in owners:
                owner.module._parameters[owner.attr] = param

    def register_full_params(self, flat: torch.Tensor) -> None:
        """Put full plain parameters, views of the gathered ``flat``, into the modules."""
        for span, param, owners in zip(self.layout.spans, self.sharded_params, self.owners):
            view = flat[span.offset : span.end].view(span.shape)
            full = nn.Parameter(view, requires_grad=param.requires_grad)
            for owner in owners:
                owner.module._parameters[owner.attr] = full

    # -- parameters as views --------------------------------------------------

    def install_views(self, buffer: torch.Tensor, *, differentiable: bool) -> None:
        """Make every parameter a view of its place in the gathered ``buffer``.

        With ``differentiable`` the views come from ``Narrow`` so that their
        grads land in this group's grad buffer; otherwise (and for a parameter whose
        ``requires_grad`` the user turned off) they are plain views.

        [Note: views shadow parameters] A view goes into the owner module's
        ``__dict__``, which attribute lookup reads before ``nn.Module.__getattr__``
        (where ``_parameters`` is searched): inside forward ``self.weight`` is the
        gathered view while ``_parameters["weight"]`` stays the sharded parameter,
        so ``named_parameters()`` and ``state_dict()`` yield sharded parameters at
        all times, forward included.
        """
        for index, span in enumerate(self.layout.spans):
            if differentiable and self.sharded_params[index].requires_grad:
                view = Narrow.apply(buffer, self, index, span.offset, span.shape)
            else:
                view = buffer.detach().narrow(0, span.offset, span.numel).view(span.shape)
            for owner in self.owners[index]:
                owner.module.__dict__[owner.attr] = view

    def install_placeholders(self) -> None:
        """Shadow every parameter with an empty tensor (see ``shard_model``'s late init).

        Init code run after sharding (``reset_parameters`` of a module that also owns a
        frozen meta parameter) then writes nothing into the already initialized shards.
        """
        empty = self.master_shard.new_empty(0)
        for owners in self.owners:
            for owner in owners:
                owner.module.__dict__[owner.attr] = empty

    def uninstall_views(self) -> None:
        """Drop the gathered views: module attributes are the sharded parameters again."""
        for owners in self.owners:
            for owner in owners:
                owner.module.__dict__.pop(owner.attr, None)

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
        self.used_in_backward[index] = True
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
