"""Reusable buffers with an explicit owner.

[Note: buffer ownership]
All gathered weights and all full-size gradients live in buffers allocated
once, when the model is sharded. Unit ``i`` uses weight buffer
``i % num_weight_buffers`` and grad buffer ``i % 2``. ZeRO-3 has two weight
buffers (odd and even units alternate, so memory is constant in depth);
ZeRO-2 has one per unit (gathered weights stay from forward to backward).

Each buffer records who holds it (``holder``: the group object) and the
collective in flight on it. Whether it is in use is not stored beside that: it
is the holder's state ([Note: unit state machine]): a weight buffer is in use
while its holder computes, a grad buffer while its holder's backward holds it.
A buffer is handed to a new holder only when the old holder is not computing
(condition 2) and, for grads, after the old holder's reduce_scatter is complete
(condition 3). The torch allocator never sees a per-layer allocation.

[Note: reduce into the gradient window]
A grad buffer has no reduced-shard twin. A reduction writes its result where it
is used: straight into the master-dtype gradient window (``ShardGrads``) when it
is that range's first write of a fresh window in the same dtype (divided in
place once final), which is every reduction of a step without accumulation
under ``32-true`` / ``bf16-mixed`` with fp32 reduces. Otherwise (a later
micro-batch of an accumulation window adds, a bf16 reduce widens into an fp32
window, the second use of a tied weight adds) the result stays in the grad
buffer itself: the reduce_scatter is in place (this rank's shard of the input,
which NCCL and gloo allow) and a row chunk's reduce to its owner is in place
anyway; it is added into the window before the buffer is written again
(``wait_scatter`` then completes the whole reduction). So the only staging left
is the grad buffer, which exists anyway; what the staged path costs is overlap,
not memory: the next user of the buffer waits for the add, and under hybrid
sharding for the replicate all_reduce, instead of only for the reduce_scatter.
Reductions complete in issue order (``ReduceQueue``): a range's direct write is
divided before a later reduction of the same range adds into it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from lightning_yafsdp.core.comm.streams import PendingCollective, PendingReduce


class WeightBuffer:
    """A flat buffer that gathered unit weights are written into.

    Attributes:
        index: position in the pool.
        tensor: flat leaf tensor in the compute dtype. It requires grad only so
            that the gate (``GateGradFlow``) enters the autograd graph; its
            ``.grad`` is never populated.
        holder: the group (unit or resident group) whose weights it holds or
            is receiving; its ``is_computing`` says whether the buffer is in use.
        version: the compute-shard version those weights were gathered from
            (-1: contents invalid).
        gather: the all_gather writing it, until waited.
        release_event: compute event after the holder's last use (CUDA).
    """

    def __init__(self, index: int, numel: int, *, dtype: torch.dtype, device: torch.device) -> None:
        self.index = index
        self.tensor = torch.zeros(numel, dtype=dtype, device=device).requires_grad_(True)
        self.holder: Any = None
        self.version = -1
        self.gather: PendingCollective | None = None
        self.release_event = None

    def holds(self, group: Any, version: int) -> bool:
        return self.holder is group and self.version == version

    @property
    def in_use(self) -> bool:
        """True while the holder's forward or backward runs (derived from its state)."""
        return self.holder is not None and self.holder.is_computing

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()


class ReduceQueue:
    """The grad buffers whose reduction is in flight, in issue order (shared by a pool)."""

    def __init__(self) -> None:
        self.buffers: list[GradBuffer] = []

    def complete_through(self, buffer: GradBuffer) -> None:
        """Complete every reduction issued before ``buffer``'s, then ``buffer``'s."""
        while buffer in self.buffers:
            self.buffers.pop(0)._complete()

    def complete_all(self) -> None:
        while self.buffers:
            self.buffers.pop(0)._complete()


class GradBuffer:
    """A flat buffer that a unit's full-size gradients are written into.

    Attributes:
        index: position in the pool.
        tensor: flat tensor in the reduce dtype (fp32 by default, so that the
            reduce_scatter sums in fp32 without a separate staging copy).
        holder: the unit whose grads it holds (or last held).
        reduce: the reduction reading ``tensor`` (and writing the gradient window or,
            when staged, this rank's part of ``tensor``), until completed.
        on_reduced: what to do with the reduced shard once it is final (divide it in
            the window, or add it from ``tensor`` into the window).
        result_in_buffer: the reduction in flight leaves its result in ``tensor``
            ([Note: reduce into the gradient window]).
    """

    def __init__(
        self,
        index: int,
        numel: int,
        *,
        dtype: torch.dtype,
        device: torch.device,
        queue: ReduceQueue | None = None,
    ) -> None:
        self.index = index
        self.tensor = torch.zeros(numel, dtype=dtype, device=device)
        self.holder: Any = None
        self.reduce: PendingReduce | None = None
        self.on_reduced = None
        self.result_in_buffer = False
        self._queue = queue if queue is not None else ReduceQueue()
        # Layout signature whose padding ranges are known to be zero here.
        self.zero_padding_of: tuple | None = None

    @property
    def in_use(self) -> bool:
        """True while the holder's backward holds it (derived from the holder's state)."""
        return self.holder is not None and self.holder.life.holds_grad_buffer

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def start_reduce(self, pending: PendingReduce, on_reduced, *, result_in_buffer: bool) -> None:
        """A reduction of ``tensor`` is in flight; ``on_reduced`` runs once it is final."""
        self.reduce, self.on_reduced = pending, on_reduced
        self.result_in_buffer = result_in_buffer
        self._queue.buffers.append(self)

    def wait_scatter(self) -> None:
        """Condition 3: ``tensor`` may be rewritten once the reduce_scatter has read it,
        and once a result staged in it has been added into the window."""
        if self.reduce is None:
            return
        if self.result_in_buffer:
            self.complete_reduce()
        else:
            self.reduce.scatter_done()

    def complete_reduce(self) -> None:
        """Wait for the whole reduction in flight (and every one issued before it) and
        hand the reduced shard on.

        Runs before the next reduction of this buffer is issued and at the end of backward.
        """
        if self.reduce is not None:
            self._queue.complete_through(self)

    def drop_reduce(self) -> None:
        """A backward raised: wait for the reduction (every rank issued it), drop its result."""
        if self.reduce is not None:
            self.reduce.wait()
        self.reduce, self.on_reduced, self.result_in_buffer = None, None, False
        if self in self._queue.buffers:
            self._queue.buffers.remove(self)

    def _complete(self) -> None:
        if self.reduce is None:
            return
        self.reduce.wait()
        self.reduce = None
        on_reduced, self.on_reduced = self.on_reduced, None
        self.result_in_buffer = False
        on_reduced()


class GatherStaging:
    """Two shard-sized tensors in the compute dtype, the all_gather source of a cast.

    [Note: cast on gather]
    Under mixed precision (fp32 masters, bf16 compute) a unit's gather needs its
    shard in bf16. Keeping a bf16 twin of every master shard costs 2 bytes per
    parameter per rank (2.2 GB per GPU at Llama-3-70B on 64 GPUs); instead the
    shard is cast into one of two staging tensors right before its gather
    (unit ``i`` uses staging ``i % 2``, as it uses grad buffer ``i % 2``), the
    way FSDP2 casts in its copy-in. A staging tensor is rewritten only after the
    gather that read it is waited. The norm group keeps its (tiny) twin.

    Attributes:
        tensors: the two staging tensors (sized to the largest shard of their units).
        readers: per tensor, the gather still reading it (None once waited).
    """

    def __init__(self, numels: list[int], *, dtype: torch.dtype, device: torch.device) -> None:
        self.tensors = [torch.empty(n, dtype=dtype, device=device) for n in numels]
        self.readers: list[PendingCollective | None] = [None] * len(numels)

    def stage(self, slot: int, shard: torch.Tensor) -> torch.Tensor:
        """``shard`` cast into staging ``slot`` (after the gather that read it last)."""
        reader = self.readers[slot]
        if reader is not None:
            reader.wait()
            self.readers[slot] = None
        staged = self.tensors[slot][: shard.numel()]
        with torch.no_grad():
            staged.copy_(shard)
        return staged

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)
