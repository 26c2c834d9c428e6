"""Full tensors from sharded leaves: one checkpoint tree in, the same tree with full tensors out.

[Note: ragged gather of element ranges]
Every sharded leaf (a ``RangeShardedTensor``) holds elements
``[start, end)`` of its flattened full tensor, a different count on every rank
(possibly none). Instead of asking each leaf's owner to gather its flat group,
the leaves of a whole checkpoint tree are gathered together, which works for
any leaf, whoever holds its storage: the engine's master shards, an
``AveragedModel``'s deep copy, optimizer state. First one ``all_gather_object``
of each leaf's ``(path, shape, dtype, start, end)``: it pairs leaves across
ranks, checks that the tree is the same everywhere (otherwise every rank raises
the same error instead of hanging in a collective), and tells rank 0 where
each rank's elements go. Then the leaves go in buckets of about
``bucket_numel`` full elements: each rank concatenates its pieces, pads to the
longest rank's count, one ``all_gather``; the keeping ranks cut the pieces back
out. So no rank ever holds more than one bucket unsharded beyond what it keeps.
Leaves that are the same tensor on every rank (tied aliases) are gathered once
and share the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError
from lightning_yafsdp.checkpoint.trees import (
    Path,
    describe_path,
    map_leaves,
    sharded_leaves,
)
from lightning_yafsdp.core.comm.collectives import (
    CommStats,
    all_gather_into,
    all_gather_objects,
)
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor

DEFAULT_BUCKET_NUMEL = 1 << 26  # full elements per all_gather (256 MiB of fp32)


@dataclass(frozen=True)
class _Leaf:
    """One sharded leaf as every rank sees it."""

    path: Path
    shape: torch.Size
    dtype: torch.dtype
    pieces: tuple[tuple[int, int], ...]  # (start, end) per rank
    identity: tuple  # per rank: what makes two leaves the same tensor there

    @property
    def numel(self) -> int:
        return self.shape.numel()


def world_info(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group`` (1 process when torch.distributed is not set up)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@torch.no_grad()
def gather_full(
    tree: Any,
    *,
    group=None,
    rank0_only: bool = True,
    cpu: bool = True,
    bucket_numel: int = DEFAULT_BUCKET_NUMEL,
) -> Any:
    """``tree`` with every sharded leaf replaced by its full tensor (see the note above).

    Collective over ``group``: every rank calls it with a tree of the same
    structure. With ``rank0_only`` (default) the other ranks get ``None`` leaves.

    Raises:
        CheckpointMismatchError: on every rank, if the ranks' trees differ or a
            leaf's pieces do not tile its tensor.
    """
    rank, world = world_info(group)
    found = sharded_leaves(tree)
    ranges = [v for _, v in found]
    mine = [
        (path, tuple(r.shape), str(r.dtype), r._placement.start, r._placement.end, _identity(r))
        for (path, _), r in zip(found, ranges, strict=True)
    ]
    everyone = [mine] if world == 1 else all_gather_objects(mine, group=group)
    leaves = _pair_leaves(everyone, ranges)
    keep = rank == 0 or not rank0_only
    by_identity: dict[tuple, torch.Tensor | None] = {}
    for bucket in _buckets(leaves, bucket_numel):
        gathered = _gather_bucket(bucket, leaves, ranges, group=group, world=world, keep=keep)
        for position, full in gathered.items():
            if cpu and full is not None:
                full = full.cpu()
            by_identity[leaves[position].identity] = full
    results = {leaf.path: by_identity[leaf.identity] for leaf in leaves}
    return map_leaves(
        tree,
        lambda path, v: results[path] if isinstance(v, RangeShardedTensor) else v,
    )


def _identity(tensor: RangeShardedTensor) -> tuple:
    local, placement = tensor._local, tensor._placement
    pointer = local.data_ptr() if local.numel() else None
    return (pointer, placement.start, placement.end, tuple(placement.shape))


def _pair_leaves(everyone: list[list[tuple]], ranges: list[RangeShardedTensor]) -> list[_Leaf]:
    reference = everyone[0]
    for rank, theirs in enumerate(everyone):
        described = [(p, s, d) for p, s, d, *_ in theirs]
        if described != [(p, s, d) for p, s, d, *_ in reference]:
            raise CheckpointMismatchError(_difference(reference, theirs, rank))
    leaves = []
    for position, (path, shape, *_rest) in enumerate(reference):
        pieces = tuple((theirs[position][3], theirs[position][4]) for theirs in everyone)
        _check_tiling(path, shape, pieces)
        leaves.append(
            _Leaf(
                path=path,
                shape=torch.Size(shape),
                dtype=ranges[position].dtype,
                pieces=pieces,
                identity=tuple(theirs[position][5] for theirs in everyone),
            )
        )
    return leaves


def _difference(reference: list[tuple], theirs: list[tuple], rank: int) -> str:
    ours = {p: (s, d) for p, s, d, *_ in reference}
    other = {p: (s, d) for p, s, d, *_ in theirs}
    only_0 = ", ".join(describe_path(p) for p in ours if p not in other) or "none"
    only_r = ", ".join(describe_path(p) for p in other if p not in ours) or "none"
    differ = ", ".join(describe_path(p) for p in ours if p in other and ours[p] != other[p])
    return (
        f"the checkpoint dict holds different sharded tensors on rank 0 and rank {rank} "
        f"(only on rank 0: {only_0}; only on rank {rank}: {only_r}; other shape or dtype: "
        f"{differ or 'none'}, or another order); every rank must build the same "
        "checkpoint (e.g. an on_save_checkpoint or state_dict() override must not depend on "
        "the rank)"
    )


def _check_tiling(path: Path, shape: tuple, pieces: tuple[tuple[int, int], ...]) -> None:
    cursor = 0
    for start, end in sorted(p for p in pieces if p[1] > p[0]):
        if start != cursor:
            break
        cursor = end
    if cursor != torch.Size(shape).numel():
        raise CheckpointMismatchError(
            f"the sharded tensor at {describe_path(path)} (shape {tuple(shape)}) has pieces "
            f"{list(pieces)} on the ranks, which do not cover its elements exactly once; it "
            "does not come from one sharded model on this process group"
        )


def _buckets(leaves: list[_Leaf], bucket_numel: int) -> list[list[int]]:
    """Positions of leaves, split into runs of one dtype and about ``bucket_numel`` elements."""
    buckets: list[list[int]] = []
    seen: set[tuple] = set()
    numel, dtype = 0, None
    for position, leaf in enumerate(leaves):
        if leaf.identity in seen:
            continue  # a tied alias: gathered with its first occurrence
        seen.add(leaf.identity)
        if not buckets or leaf.dtype != dtype or numel + leaf.numel > bucket_numel:
            buckets.append([])
            numel, dtype = 0, leaf.dtype
        buckets[-1].append(position)
        numel += leaf.numel
    return buckets


def _gather_bucket(
    bucket: list[int],
    leaves: list[_Leaf],
    ranges: list[RangeShardedTensor],
    *,
    group,
    world: int,
    keep: bool,
) -> dict[int, torch.Tensor | None]:
    """All-gather the pieces of the leaves at ``bucket``; full tensors where ``keep``."""
    rank = world_info(group)[0]
    per_rank = [0] * world  # elements each rank sends
    offsets: dict[tuple[int, int], int] = {}  # (leaf, rank) -> where its piece starts
    for position in bucket:
        for r, (start, end) in enumerate(leaves[position].pieces):
            offsets[(position, r)] = per_rank[r]
            per_rank[r] += end - start
    longest = max(per_rank)
    device = ranges[bucket[0]]._local.device
    send = torch.zeros(longest, dtype=leaves[bucket[0]].dtype, device=device)
    if per_rank[rank]:
        torch.cat([ranges[p]._local.reshape(-1) for p in bucket], out=send[: per_rank[rank]])
    out = send
    if world > 1:
        out = torch.empty(longest * world, dtype=send.dtype, device=device)
        all_gather_into(out, send, group, async_op=False, stats=CommStats())
    if not keep:
        return dict.fromkeys(bucket)
    gathered = {}
    for position in bucket:
        leaf = leaves[position]
        full = torch.empty(leaf.numel, dtype=send.dtype, device=device)
        for r, (start, end) in enumerate(leaf.pieces):
            begin = r * longest + offsets[(position, r)]
            full[start:end] = out[begin : begin + end - start]
        gathered[position] = full.view(leaf.shape)
    return gathered
