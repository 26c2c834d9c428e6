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
(condition 3); its reduced shard is handed on (and, under hybrid sharding,
all-reduced across replicas) before the next reduce_scatter writes it. The torch
allocator never sees a per-layer allocation.
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


class GradBuffer:
    """A flat buffer that a unit's full-size gradients are written into.

    Attributes:
        index: position in the pool.
        tensor: flat tensor in the reduce dtype (fp32 by default, so that the
            reduce_scatter sums in fp32 without a separate staging copy).
        reduced: this rank's reduced shard, written by the reduce_scatter (and
            all-reduced across replicas under hybrid sharding).
        holder: the unit whose grads it holds (or last held).
        reduce: the reduction reading ``tensor`` and writing ``reduced``, until
            completed.
        on_reduced: what to do with the reduced shard once it is final.
    """

    def __init__(
        self, index: int, numel: int, shard_numel: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.index = index
        self.tensor = torch.zeros(numel, dtype=dtype, device=device)
        self.reduced = torch.zeros(shard_numel, dtype=dtype, device=device)
        self.holder: Any = None
        self.reduce: PendingReduce | None = None
        self.on_reduced = None
        # Layout signature whose padding ranges are known to be zero here.
        self.zero_padding_of: tuple | None = None

    @property
    def in_use(self) -> bool:
        """True while the holder's backward holds it (derived from the holder's state)."""
        return self.holder is not None and self.holder.life.holds_grad_buffer

    @property
    def nbytes(self) -> int:
        return (self.tensor.numel() + self.reduced.numel()) * self.tensor.element_size()

    def wait_scatter(self) -> None:
        """Condition 3: ``tensor`` may be rewritten once the reduce_scatter has read it."""
        if self.reduce is not None:
            self.reduce.scatter_done()

    def complete_reduce(self) -> None:
        """Wait for the whole reduction in flight and hand the reduced shard on.

        Runs before the next reduce_scatter writes ``reduced`` and at the end of backward.
        """
        if self.reduce is None:
            return
        self.reduce.wait()
        self.reduce = None
        on_reduced, self.on_reduced = self.on_reduced, None
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
