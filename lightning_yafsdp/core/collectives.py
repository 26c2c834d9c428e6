"""The engine's collectives: pure functions over given tensors.

Every collective the engine issues goes through this file, so that the
communication volume can be counted in one place (``CommStats``) and the
torch API in use is chosen once (torch 2.13 recommends ``all_gather_single`` /
``reduce_scatter_single`` over the ``*_into_tensor`` spellings).
Streams are not handled here: the caller (``streams.CommScheduler``) decides on
which stream and with which waits a collective is issued.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from lightning_yafsdp.core import compat

if TYPE_CHECKING:
    from lightning_yafsdp.core.mesh import ShardMesh

# The torch-version shims (2.11 lacks the ``*_single`` names) live in core/compat.py.
_all_gather_single = compat.all_gather_single
_reduce_scatter_single = compat.reduce_scatter_single


@dataclass
class CommStats:
    """Running count of collectives and bytes by kind (bytes sent+received by this rank's calls).

    ``bytes`` counts the size of the larger (gathered / unreduced) tensor of
    each call, the number comparable across sharding schemes.
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain-dict copy: ``{"calls": {kind: n}, "bytes": {kind: nbytes}}``."""
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}


class WorkList:
    """Several async collectives waited as one (a unit's trainable and frozen gathers)."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def all_gather_into(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup,
    *,
    async_op: bool,
    stats: CommStats,
) -> dist.Work | None:
    """Gather every rank's ``shard`` into ``output`` (rank order, back to back).

    [Note: version-preserving gather]
    ``output`` is a weight buffer that autograd may have saved views of in an
    earlier forward (ZeRO-3 re-gathers the same values before backward). gloo
    bumps the version counter of the tensor it writes, which would fail
    backward with "modified by an inplace operation". Writing through
    ``.data`` (a fresh version counter over the same storage) keeps the saved
    views valid; the four ordering conditions, not the version counter,
    guarantee that their contents are right when read.
    """
    stats.add("all_gather", output.numel() * output.element_size())
    return _all_gather_single(output.data, shard, group=group, async_op=async_op)


def reduce_scatter_into(
    output: torch.Tensor,
    full: torch.Tensor,
    group: ProcessGroup,
    *,
    async_op: bool,
    stats: CommStats,
) -> dist.Work | None:
    """Sum ``full`` across ranks and keep this rank's contiguous part in ``output``."""
    stats.add("reduce_scatter", full.numel() * full.element_size())
    return _reduce_scatter_single(
        output.data, full, op=ReduceOp.SUM, group=group, async_op=async_op
    )


def replicate_all_reduce(
    reduced: torch.Tensor, group: ProcessGroup, *, async_op: bool, stats: CommStats
) -> dist.Work | None:
    """Sum a reduced grad shard across the replicate group, in place ([Note: hybrid sharding])."""
    stats.add("replicate_all_reduce", reduced.numel() * reduced.element_size())
    return dist.all_reduce(reduced.data, op=ReduceOp.SUM, group=group, async_op=async_op)


def check_reduce_dtype(mesh: ShardMesh, device: torch.device, dtype: torch.dtype) -> None:
    """Raise a one-line error if the backend cannot reduce grads in ``dtype``.

    Tiny collectives, at sharding time, instead of a backend error in the first
    backward: a reduce_scatter in the shard group and, under hybrid sharding, an
    all_reduce in the replicate group. fp32 needs no check.
    """
    if dtype == torch.float32:
        return
    group = mesh.shard_group
    world = dist.get_world_size(group)
    full = torch.ones(world, dtype=dtype, device=device)
    out = torch.empty(1, dtype=dtype, device=device)
    try:
        _reduce_scatter_single(out, full, op=ReduceOp.SUM, group=group)
        if mesh.replicate_group is not None:
            dist.all_reduce(out, op=ReduceOp.SUM, group=mesh.replicate_group)
    except (RuntimeError, ValueError) as error:
        backend = dist.get_backend(group)
        raise ValueError(
            f"reduce_dtype={dtype} is not supported by the '{backend}' backend's "
            f"reduce_scatter/all_reduce ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}); use reduce_dtype=torch.float32"
        ) from error


def all_reduce_(
    tensor: torch.Tensor, group: ProcessGroup, *, op: ReduceOp = ReduceOp.SUM, stats: CommStats
) -> None:
    """In-place blocking all_reduce (used for the global grad norm)."""
    stats.add("all_reduce", tensor.numel() * tensor.element_size())
    dist.all_reduce(tensor, op=op, group=group)


def broadcast_(
    tensor: torch.Tensor, group: ProcessGroup, *, src_rank: int, stats: CommStats
) -> None:
    """In-place blocking broadcast from group rank ``src_rank``."""
    stats.add("broadcast", tensor.numel() * tensor.element_size())
    dist.broadcast(tensor, src=dist.get_global_rank(group, src_rank), group=group)
