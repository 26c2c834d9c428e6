"""A vocabulary-sized embedding or head run chunk by chunk ([Note: row chunks]).

``ChunkedParams`` holds the module's parameters (its flat layout, shards and
sharded parameters, exactly as a unit would) and replaces the module's forward
by one over its chunks; each ``RowChunkUnit`` is a unit of the schedule that
gathers, computes and reduces one chunk's rows, with a unit's state machine.

[Note: tied row chunks]
A weight tied between an embedding and a head (GPT-2, Gemma, Llama 3.2 1B/3B) is
one parameter with two uses. Each use runs as chunks of its own, at its own place
in the schedule (the embedding's chunks first, the head's last): the same rows,
gathered once per use. Each use's chunk gradient is reduced as soon as that use's
backward of the chunk is done, and the owner adds it into the sharded gradient,
where the two uses meet; so no vocabulary-sized gradient is alive through the
backward (a whole tied unit holds one from the head's backward to the embedding's).
The cost is traffic: the table's gradient is reduced twice per backward (once
per use) instead of once, +1 x vocab x dim x reduce-dtype bytes per rank per
micro-batch. Gathers: ZeRO-3 gathers the rows once per use in forward and the
head's again for backward (but its last two chunks; the embedding's backward reads no
weights); ZeRO-2, which keeps gathered rows until backward, gives a head chunk the
slot of its embedding chunk: the rows are gathered once per step and held once.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lightning_yafsdp.core.comm.collectives import (
    broadcast_into,
    reduce_into,
)
from lightning_yafsdp.core.comm.work_list import WorkList
from lightning_yafsdp.core.runtime.chunk_rules import embedding_post_op, is_embedding_use
from lightning_yafsdp.core.runtime.context import StepContext
from lightning_yafsdp.core.runtime.flat_group import FlatParamGroup, ParamOwner
from lightning_yafsdp.core.runtime.layout import FlatLayout
from lightning_yafsdp.core.runtime.row_chunks import RowChunk
from lightning_yafsdp.core.runtime.unit import ShardedUnit


class _LinearRows(nn.Module):
    """Output features ``[start, end)`` of a head: its weight (and bias) are chunk views."""

    def __init__(self, has_bias: bool) -> None:
        super().__init__()
        self.has_bias = has_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.has_bias else None)


class _EmbeddingRows(nn.Module):
    """Rows ``[start, end)`` of an embedding table: tokens outside them keep ``previous``."""

    def __init__(self, source: nn.Embedding, start: int, end: int) -> None:
        super().__init__()
        self.start, self.rows, self.vocab = start, end - start, source.num_embeddings
        pad = source.padding_idx
        self.padding_idx = pad - start if pad is not None and start <= pad < end else None

    def forward(self, ids: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        local = ids - self.start
        inside = ((local >= 0) & (local < self.rows)).unsqueeze(-1)
        # Another chunk's token reads row 0 or the last row (masked out below); an id no
        # chunk holds keeps its out-of-range index, so F.embedding raises as the whole
        # table would ("index out of range"), without a host sync.
        invalid = (ids < 0) | (ids >= self.vocab)
        index = torch.where(invalid, local, local.clamp(0, self.rows - 1))
        rows = F.embedding(index, self.weight, self.padding_idx)
        if previous is None:
            previous = rows.new_zeros(())
        return torch.where(inside, rows, previous)


class ChunkedParams(FlatParamGroup):
    """The parameters of a module run in row chunks, and its chunked forward.

    A flat group like a unit's (same layout, shards and sharded parameters), but
    never gathered whole: its ``chunks`` are the units that run, one run of chunks
    per use (per module: two for a tied embedding and head, [Note: tied row chunks]).

    Args:
        modules: the modules using the parameters (one, or the users of a tied weight).
        row_chunks: the chunks every use runs in.
    """

    def __init__(
        self, modules: list[nn.Module], row_chunks: tuple[RowChunk, ...], **group_kwargs: Any
    ) -> None:
        super().__init__(**group_kwargs)
        self.modules = modules
        self.row_chunks = row_chunks
        # Every parameter frozen (a LoRA base's embedding or head): the chunks are rows of
        # the frozen layout, gathered from the frozen store ([Note: frozen shards]).
        self.frozen_rows = not self.layout.spans
        self.chunks: list[RowChunkUnit] = []
        self._hooks: list = []

    def install_forward(self, module: nn.Module, units: list[RowChunkUnit]) -> None:
        """Replace ``module``'s forward by the loop over ``units``, its use's chunks."""
        self.chunks += units
        chunk_modules = [unit.module for unit in units]
        # Callers may pass the input by keyword, under the name the module's forward
        # gives it (``input`` for nn.Embedding / nn.Linear, ``input_ids`` for HF's).
        name = next(iter(inspect.signature(module.forward).parameters))
        if is_embedding_use(module):
            post_op = embedding_post_op(module)  # a scaled embedding's scale

            def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
                ids = args[0] if args else kwargs[name]
                out = None
                for chunk in chunk_modules:
                    out = chunk(ids, out)
                return out if post_op is None else post_op(out)
        else:
            out_features = module.out_features

            def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
                x = args[0] if args else kwargs[name]
                # Written into one logits tensor chunk by chunk, so at most one chunk's
                # logits exist beside it (torch.cat would hold every chunk's as well).
                first = chunk_modules[0](x)
                out = first.new_empty(*first.shape[:-1], out_features)
                out[..., : first.shape[-1]] = first
                start = first.shape[-1]
                del first
                for chunk in chunk_modules[1:]:
                    part = chunk(x)
                    out[..., start : start + part.shape[-1]] = part
                    start += part.shape[-1]
                return out

        module.forward = forward
        self._hooks.append(module.register_forward_pre_hook(self._refuse_copies))

    def _refuse_copies(self, module: nn.Module, args: tuple) -> None:
        if all(module is not own for own in self.modules):
            raise RuntimeError(
                f"the forward of a deep copy of the sharded module '{self.name}' was called: "
                "a copy of a sharded model (copy.deepcopy, an EMA's AveragedModel) holds this "
                "rank's shards only and cannot compute. Average, save or load it, or run the "
                "original model (swap weights into it, as WeightAveraging does)."
            )

    def grad_ranges(self, rank: int) -> list[tuple[int, int]]:
        """This rank's grad range, split at every chunk part it owns (the rest: gaps)."""
        if self.frozen_rows:
            return [self.grad_range]
        base, end = self.grad_range
        parts = sorted(
            (base + t.shard_offset, base + t.shard_offset + t.numel)
            for chunk in self.row_chunks  # each use's chunks add into the same ranges
            for t in chunk.owned_by(rank)
        )
        ranges, cursor = [], base
        for start, stop in parts:
            if start > cursor:
                ranges.append((cursor, start))
            ranges.append((start, stop))
            cursor = stop
        if end > cursor:
            ranges.append((cursor, end))
        return ranges

    def remove_hooks(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


class RowChunkUnit(ShardedUnit):
    """One row chunk of a ``ChunkedParams``: a unit of the schedule over borrowed storage.

    Its buffer layout is the chunk's rows; its parameters' views go on a private
    chunk module. The gather broadcasts each owner's part; the reduce sums each
    part into its owner, who adds it into the parent's grad shard (under hybrid
    sharding after an all_reduce of the owned parts across the replicas).

    Args:
        source: the module whose use this chunk computes (the embedding or the head).
        use_name: its name (the chunk is named ``use_name[start:end]``).
    """

    def __init__(
        self,
        context: StepContext,
        index: int,
        parent: ChunkedParams,
        chunk: RowChunk,
        *,
        source: nn.Module,
        use_name: str,
    ) -> None:
        if is_embedding_use(source):
            module: nn.Module = _EmbeddingRows(source, chunk.start, chunk.end)
        else:
            module = _LinearRows(source.bias is not None)
        frozen = parent.frozen_rows
        spans = parent.frozen_layout.spans if frozen else parent.layout.spans
        attrs = [owners[0].attr for owners in (parent.frozen_owners if frozen else parent.owners)]
        owners = [
            [ParamOwner(module, attr, span.name)] for attr, span in zip(attrs, spans, strict=True)
        ]
        # [Note: frozen shards] Frozen rows follow an empty trainable part in the buffer.
        rows = dict(layout=chunk.layout, owners=owners)
        if frozen:
            rows = dict(
                layout=FlatLayout([], [], world_size=1), owners=[], frozen_layout=chunk.layout,
                frozen_owners=owners, frozen_shard=parent.frozen_shard,
            )  # fmt: skip
        super().__init__(
            context,
            index,
            [module],
            is_block=False,
            name=f"{use_name}[{chunk.start}:{chunk.end}]",
            master_shard=parent.master_shard,
            compute_shard=parent.compute_shard,
            grad_range=parent.grad_range,
            **rows,
        )
        self.parent, self.chunk = parent, chunk
        # One list each with the parent's: filled when the parameters are made.
        self.sharded_params, self.frozen_params = parent.sharded_params, parent.frozen_params
        # [Note: weightless backward] an embedding's rows are not read by its backward.
        self.backward_reads_weights = not is_embedding_use(source)
        # Frozen rows get no grads: nothing to reduce, nothing owned.
        self._reduced_parts = () if frozen else chunk.transfers
        self._owned = [] if frozen else chunk.owned_by(context.shard_rank)

    @property
    def param_group(self) -> FlatParamGroup:
        return self.parent

    def _holds_weights(self, buffer) -> bool:
        """Also when the buffer holds the same rows for another use of the same weight
        (ZeRO-2 tied: the head's chunk reads its embedding chunk's slot, [Note: tied row
        chunks]); this chunk then becomes the holder, so the buffer is in use while it
        computes."""
        if super()._holds_weights(buffer):
            return True
        holder = buffer.holder
        twin = (
            isinstance(holder, RowChunkUnit)
            and holder.parent is self.parent
            and holder.chunk is self.chunk
            and buffer.version == self.context.compute_version
            and not holder.is_computing
        )
        if twin:
            buffer.holder = self
        return twin

    def end_iteration(self) -> None:
        super().end_iteration()
        self.parent.uninstall_views()  # its placeholders

    def abandon_iteration(self) -> None:
        super().abandon_iteration()
        self.parent.uninstall_views()

    def accumulate_param_grad(self, index: int, grad: torch.Tensor) -> None:
        super().accumulate_param_grad(index, grad)
        self.parent.used_in_backward[index] = True

    def _gather_launch(self, buffer) -> tuple:
        """One broadcast per owning rank's part; no staging ([Note: row chunks])."""
        ctx = self.context
        # Mixed precision: the owner's part is cast as it is copied in ([Note: cast on gather]).
        source = self.compute_shard if self.compute_shard is not None else self.master_shard
        out, me = buffer.tensor.data, ctx.shard_rank
        if self.parent.frozen_rows:  # after the (empty) trainable part, from the frozen store
            source, out = self.frozen_shard, out[self.layout.padded_numel :]

        def launch(async_op: bool, exchange):
            works = []
            for index, part in enumerate(self.chunk.transfers):
                region = out[part.chunk_offset : part.chunk_offset + part.numel]
                if part.rank == me:
                    region.copy_(source[part.shard_offset : part.shard_offset + part.numel])
                on = exchange.part(index)
                works.append(
                    broadcast_into(
                        region, part.rank, on.group, async_op=async_op, stats=ctx.comm_stats,
                        key=on.key,
                    )  # fmt: skip
                )
            return WorkList(works) if async_op else None

        return launch, buffer.release_event, False  # condition 2

    def _issue_reduction(self, grad_buffer) -> tuple:
        """One reduce per owning rank's part, in place in the grad buffer; the owner copies
        its parts straight into the gradient window (divided once final) or, for a later
        write, adds them from the buffer ([Note: reduce into the gradient window])."""
        ctx, full, base = self.context, grad_buffer.tensor, self.grad_range[0]
        ranges = [(base + p.shard_offset, base + p.shard_offset + p.numel) for p in self._owned]
        in_buffer = [full[p.chunk_offset : p.chunk_offset + p.numel] for p in self._owned]
        window = ctx.unit_grads.first_writes(ranges, full.dtype)

        def copy_out() -> None:  # the grad buffer is free once the owned parts are copied
            for target, source in zip(window, in_buffer, strict=True):
                target.copy_(source)

        def launch(async_op: bool, exchange):
            works = []
            for index, part in enumerate(self._reduced_parts):
                on = exchange.part(index)
                region = full[part.chunk_offset : part.chunk_offset + part.numel]
                works.append(
                    reduce_into(
                        region, part.rank, on.group, async_op=async_op, stats=ctx.comm_stats,
                        key=on.key,
                    )  # fmt: skip
                )
            then = copy_out if window is not None else None
            if async_op:
                return WorkList(works, then=then)
            if then is not None:
                then()
            return None

        pending = ctx.issue_reduction(
            unit=self.name,
            slot=grad_buffer.index,
            tag=(self.index, self.layout.padded_numel),
            scatter=launch,
            replicate=self._replicate_launch(window if window is not None else in_buffer),
        )
        if window is not None:

            def divide() -> None:
                for part in window:
                    ctx.divide(part)

            return pending, divide, False

        def add() -> None:
            for (start, end), part in zip(ranges, in_buffer, strict=True):
                ctx.add_reduced(ctx.unit_grads, start, end, part)

        return pending, add, True

    def _replicate_launch(self, owned: list[torch.Tensor]):
        """Hybrid sharding: the all_reduce of the owned parts across the replicas, which own
        the same parts ([Note: hybrid sharding]); None with one shard group."""
        if self.context.replicate_group is None:
            return None
        launches = [self.context.replicate(part) for part in owned]
        # No part: this shard rank owns none of the chunk, nor do its replicas.
        return lambda async_op, exchange: WorkList(
            [launch(async_op, exchange) for launch in launches]
        )
