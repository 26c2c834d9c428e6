"""A group of parameters stored as one flat, sharded tensor.

Shared by the two kinds of groups: a ``ShardedUnit`` (a transformer block,
gathered around its forward and backward) and a ``ResidentGroup`` (the norm
group and the root remainder, gathered once per optimizer step). This class
knows where each parameter lives, how to expose parameters as views of a
gathered buffer, and how to write their gradients into a grad buffer.

[Note: frozen shards]
A unit's frozen parameters (``requires_grad=False`` when the model is sharded:
a LoRA base, a frozen embedding) are sharded too, in a layout of their own: the
engine's ``frozen_store`` holds every unit's frozen shard, in the compute dtype
(they are never updated, so no master copy; under bf16-mixed an fp32 frozen
weight is rounded to bf16 once, as every forward would round it). A unit's
gather writes its trainable part and then its frozen part into the same weight
buffer (two all_gathers, waited as one); frozen views are plain views, so
autograd gives them no grad, and the grad buffers, grad shards and optimizer
state cover the trainable part only. A unit may have no trainable parameter at
all (its trainable layout is padding only). Frozen norms, tensors tied across
groups and integer tensors stay plain, replicated parameters. A frozen
parameter unfrozen after sharding is refused at the next forward: it has no
grad path and would silently never train.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_yafsdp.core.comm.buffers import GradBuffer
from lightning_yafsdp.core.comm.step_timing import timed_hook
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor, ShardPlacement
from lightning_yafsdp.core.runtime.autograd import Narrow
from lightning_yafsdp.core.runtime.layout import FlatLayout
from lightning_yafsdp.core.runtime.placeholder import UngatheredWeight


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
        frozen_layout / frozen_owners / frozen_shard: a unit's frozen parameters:
            their flat layout, owners, and this rank's part of the frozen store (in
            the compute dtype). They are gathered after the trainable part of the
            weight buffer and get no grads ([Note: frozen shards]).
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
        frozen_layout: FlatLayout | None = None,
        frozen_owners: list[list[ParamOwner]] = (),
        frozen_shard: torch.Tensor | None = None,
    ) -> None:
        self.name = name
        self.layout = layout
        self.owners = owners
        self.master_shard = master_shard
        self.compute_shard = compute_shard
        self.grad_range = grad_range
        self.frozen_layout = frozen_layout
        self.frozen_owners = list(frozen_owners)
        self.frozen_shard = frozen_shard
        self.frozen_params: list[nn.Parameter] = []
        self._grad_buffer: GradBuffer | None = None
        self._grad_target: torch.Tensor | None = None
        self._written = [False] * len(owners)
        # Per parameter: did this backward pass write a grad for it on this rank?
        self.used_in_backward = [False] * len(owners)
        # Filled by ``make_sharded_params``: what the modules and the optimizer hold.
        self.sharded_params: list[nn.Parameter] = []
        self.master_ranges: list[tuple[int, int]] = []
        self._ungathered: list | None = None  # built at first use

    @property
    def param_group(self) -> FlatParamGroup:
        """The group holding this group's parameters: itself (a row chunk: its parent)."""
        return self

    def grad_ranges(self, rank: int) -> list[tuple[int, int]]:
        """``grad_range`` as the pieces its grads are added in (one, but for row chunks)."""
        return [self.grad_range]

    def remove_hooks(self) -> None:
        """Remove what this group installed on its modules (units: hooks)."""

    def __deepcopy__(self, memo: dict) -> FlatParamGroup:
        # A deep copy of a sharded model (an EMA's AveragedModel) copies the modules'
        # hooks, which are bound to their groups: the copy's hooks must stay bound to
        # THIS group (one engine, one process group), which refuses a copy's forward.
        return self

    # -- the parameters users see ----------------------------------------------

    def make_sharded_params(self, rank: int, process_group) -> None:
        """One RangeShardedTensor parameter per span: this rank's piece of the master shard.

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
            placement = _placement(span, owners, start, end)
            local = self.master_shard[offset : offset + end - start]
            self.sharded_params.append(
                nn.Parameter(RangeShardedTensor(local, placement, process_group))
            )
            self.master_ranges.append((base + offset, base + offset + end - start))

    def make_frozen_params(self, rank: int, process_group) -> None:
        """One frozen RangeShardedTensor parameter (requires_grad False) per frozen span."""
        if self.frozen_layout is None:
            return
        for index, (span, owners) in enumerate(
            zip(self.frozen_layout.spans, self.frozen_owners, strict=True)
        ):
            piece = self.frozen_layout.shard_slice(index, rank)
            start, end, offset = (
                (piece.param_start, piece.param_end, piece.shard_offset) if piece else (0, 0, 0)
            )
            placement = _placement(span, owners, start, end)
            local = self.frozen_shard[offset : offset + end - start]
            sharded = RangeShardedTensor(local, placement, process_group)
            self.frozen_params.append(nn.Parameter(sharded, requires_grad=False))

    def _all_params(self):
        """``(param, owners)`` of every sharded parameter, trainable then frozen."""
        return [
            *zip(self.sharded_params, self.owners, strict=True),
            *zip(self.frozen_params, self.frozen_owners, strict=True),
        ]

    def _all_owners(self) -> list[list[ParamOwner]]:
        return [*self.owners, *self.frozen_owners]

    def register_sharded_params(self) -> None:
        """Put the sharded parameters into the modules, under every original name."""
        for param, owners in self._all_params():
            for owner in owners:
                owner.module._parameters[owner.attr] = param

    def register_full_params(self, flat: torch.Tensor, frozen_flat: torch.Tensor | None) -> None:
        """Put full plain parameters, views of the gathered flats, into the modules."""
        placed = [(self.layout, flat, self.sharded_params, self.owners)]
        if self.frozen_layout is not None:
            placed.append((self.frozen_layout, frozen_flat, self.frozen_params, self.frozen_owners))
        for layout, source, params, owners_list in placed:
            for span, param, owners in zip(layout.spans, params, owners_list, strict=True):
                view = source[span.offset : span.end].view(span.shape)
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
        if self.frozen_layout is None:
            return
        # [Note: frozen shards] The frozen part follows the trainable part in the buffer.
        frozen = buffer.detach().narrow(
            0, self.layout.padded_numel, self.frozen_layout.padded_numel
        )
        for span, owners in zip(self.frozen_layout.spans, self.frozen_owners, strict=True):
            view = frozen.narrow(0, span.offset, span.numel).view(span.shape)
            for owner in owners:
                owner.module.__dict__[owner.attr] = view

    def install_placeholders(self) -> None:
        """Shadow every parameter with an empty tensor (see ``shard_model``'s late init).

        Init code run after sharding (``reset_parameters`` of a module that also owns a
        frozen meta parameter) then writes nothing into the already initialized shards.
        """
        empty = self.master_shard.new_empty(0)
        for owners in self._all_owners():
            for owner in owners:
                owner.module.__dict__[owner.attr] = empty

    def expose_ungathered(self, dtype: torch.dtype, device: torch.device) -> None:
        """Shadow every parameter with an ``UngatheredWeight`` of the gathered shape,
        ``dtype`` and ``device`` ([Note: ungathered weights]); ``uninstall_views`` removes them.

        An attribute that holds a view already keeps it.
        """
        if self._ungathered is None:
            placed = [(self.layout, self.owners)]
            if self.frozen_layout is not None:
                placed.append((self.frozen_layout, self.frozen_owners))
            self._ungathered = [
                (owner, UngatheredWeight(span.name, self.name, span.shape, dtype, device))
                for layout, owners_list in placed
                for span, owners in zip(layout.spans, owners_list, strict=True)
                for owner in owners
            ]
        for owner, placeholder in self._ungathered:
            owner.module.__dict__.setdefault(owner.attr, placeholder)

    def uninstall_views(self) -> None:
        """Drop the gathered views: module attributes are the sharded parameters again."""
        for owners in self._all_owners():
            for owner in owners:
                owner.module.__dict__.pop(owner.attr, None)

    def refuse_unfrozen(self) -> None:
        """Raise if a frozen sharded parameter was given ``requires_grad=True`` after sharding.

        Its views carry no grad path, so it would silently never train.
        """
        for param in self.frozen_params:
            if param.requires_grad:
                raise RuntimeError(
                    f"parameter '{param._placement.name}' was frozen (requires_grad=False) when "
                    "the model was sharded and has been unfrozen since: frozen parameters are "
                    "sharded without gradient buffers, so it would never receive a gradient. "
                    "Set requires_grad=True before the model is sharded (in configure_model, or "
                    "before shard_model), or keep it frozen."
                )

    # -- gradients into the grad buffer ----------------------------------------

    def begin_grad_writes(self, grad_buffer: GradBuffer) -> None:
        """Start a backward: grads of this group go to ``grad_buffer`` (first write copies)."""
        self._grad_buffer = grad_buffer
        self._grad_target = grad_buffer.tensor
        self._written = [False] * len(self.owners)

    @timed_hook
    def accumulate_param_grad(self, index: int, grad: torch.Tensor) -> None:
        """Write (first time) or add the grad of parameter ``index`` into the grad buffer."""
        span = self.layout.spans[index]
        region = self._grad_target.narrow(0, span.offset, span.numel).view(span.shape)
        self.used_in_backward[index] = True
        if grad.layout != torch.strided:
            # [Note: sparse gradients] nn.Embedding(sparse=True) gives a sparse COO grad;
            # the reduce of the flat buffer is dense anyway, so its rows are added into the
            # zeroed region (no dense copy of the table is made).
            if not self._written[index]:
                region.zero_()
            region.add_(grad)
        elif self._written[index]:
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


def _placement(span, owners: list[ParamOwner], start: int, end: int) -> ShardPlacement:
    """Where this rank's piece ``[start, end)`` of the parameter at ``span`` lies."""
    return ShardPlacement(
        name=span.name,
        aliases=tuple(owner.name for owner in owners),
        shape=span.shape,
        start=start,
        end=end,
    )
