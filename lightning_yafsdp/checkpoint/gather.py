"""Sharded values anywhere in a checkpoint dict: walk the tree, count them, gather them.

Every ``RangeShardedTensor`` in a checkpoint (callbacks' entries too) holds only this
rank's elements: pickling one would keep rank 0's piece and lose the rest without a
word, so it is written sharded or gathered. The walk's order is the same on every rank
for the same tree, so collective steps pair leaves by position.

[Note: ragged gather of element ranges]
One ``all_gather_object`` of every leaf's ``(path, shape, dtype, start, end)`` pairs the
leaves across ranks, checks that the tree is the same everywhere (else every rank raises
the same error instead of hanging) and gives each rank's element count; then each leaf
is one ``all_gather`` of the pieces padded to the longest, cut back out and kept (on
CPU) where asked: no rank holds more than one tensor unsharded beyond what it keeps.
Tied aliases (the same piece under two paths) are gathered once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError
from lightning_yafsdp.core.comm.collectives import CommStats, all_gather_into, all_gather_objects
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor


def sharded_leaves(tree: Any) -> list[tuple[tuple, RangeShardedTensor]]:
    """Every ``RangeShardedTensor`` in ``tree`` with its pytree key path, in tree order."""
    found = pytree.tree_leaves_with_path(tree)
    return [(path, v) for path, v in found if isinstance(v, RangeShardedTensor)]


def describe_path(path: tuple) -> str:
    return pytree.keystr(path) or "<root>"


def tensor_bytes(tree: Any, *, whole: bool = True) -> int:
    """Bytes of this rank's sharded pieces in ``tree``, plus its other tensors if ``whole``.

    For the message of a failed save ([Note: a failed write is one line]).
    """
    return sum(
        v._local.nbytes if isinstance(v, RangeShardedTensor) else v.nbytes * whole
        for v in pytree.tree_leaves(tree)
        if isinstance(v, torch.Tensor)
    )


def world_info(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group`` (1 process when torch.distributed is not set up)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@torch.no_grad()
def gather_full(tree: Any, *, group=None, rank0_only: bool = True, cpu: bool = True) -> Any:
    """``tree`` with every sharded leaf replaced by its full tensor (see the note above).

    Collective over ``group``. With ``rank0_only`` (default) other ranks get ``None``
    leaves; with ``cpu`` every tensor of the kept result is on the CPU. Raises
    ``CheckpointMismatchError`` on every rank if the ranks' trees or pieces do not fit.
    """
    rank, world = world_info(group)
    found = sharded_leaves(tree)
    mine = [(path, tuple(v.shape), str(v.dtype), *_range(v), _identity(v)) for path, v in found]
    everyone = [mine] if world == 1 else all_gather_objects(mine, group=group)
    _check_same_tree(everyone)
    keep = rank == 0 or not rank0_only
    by_identity: dict[tuple, torch.Tensor | None] = {}
    results = {}
    for position, (path, value) in enumerate(found):
        identity = tuple(theirs[position][5] for theirs in everyone)
        if identity not in by_identity:
            pieces = [(theirs[position][3], theirs[position][4]) for theirs in everyone]
            _check_tiling(path, value.shape, pieces)
            full = _gather_one(value, pieces, group=group, world=world)
            by_identity[identity] = full if keep else None
        results[path] = by_identity[identity]

    def full_leaf(path, value):
        if isinstance(value, RangeShardedTensor):
            value = results[path]
        return value.detach().cpu() if cpu and keep and isinstance(value, torch.Tensor) else value

    return pytree.tree_map_with_path(full_leaf, tree)


def _range(value: RangeShardedTensor) -> tuple[int, int]:
    return value._placement.start, value._placement.end


def _identity(value: RangeShardedTensor) -> tuple:
    local = value._local
    return (local.data_ptr() if local.numel() else None, *_range(value), tuple(value.shape))


def _gather_one(value: RangeShardedTensor, pieces: list, *, group, world: int) -> torch.Tensor:
    longest = max(end - start for start, end in pieces)
    send = torch.zeros(longest, dtype=value.dtype, device=value._local.device)
    send[: value._local.numel()].copy_(value._local.reshape(-1))
    out = send
    if world > 1:
        out = torch.empty(longest * world, dtype=send.dtype, device=send.device)
        all_gather_into(out, send, group, async_op=False, stats=CommStats())
    full = torch.empty(value.shape.numel(), dtype=send.dtype, device=send.device)
    for r, (start, end) in enumerate(pieces):
        full[start:end] = out[r * longest : r * longest + end - start]
    return full.view(value.shape)


def _check_same_tree(everyone: list[list[tuple]]) -> None:
    reference = [(p, s, d) for p, s, d, *_ in everyone[0]]
    for rank, theirs in enumerate(everyone):
        if [(p, s, d) for p, s, d, *_ in theirs] == reference:
            continue
        only_0 = {p for p, *_ in reference} - {p for p, *_ in theirs}
        only_r = {p for p, *_ in theirs} - {p for p, *_ in reference}
        raise CheckpointMismatchError(
            f"the checkpoint dict holds different sharded tensors on rank 0 and rank {rank} "
            f"(only on rank 0: {', '.join(map(describe_path, only_0)) or 'none'}; only on "
            f"rank {rank}: {', '.join(map(describe_path, only_r)) or 'none'}; or other shapes, "
            "dtypes or order); every rank must build the same checkpoint (e.g. an "
            "on_save_checkpoint or state_dict() override must not depend on the rank)"
        )


def _check_tiling(path: tuple, shape: torch.Size, pieces: list[tuple[int, int]]) -> None:
    cursor = 0
    for start, end in sorted(p for p in pieces if p[1] > p[0]):
        if start != cursor:
            break
        cursor = end
    if cursor != torch.Size(shape).numel():
        raise CheckpointMismatchError(
            f"the sharded tensor at {describe_path(path)} (shape {tuple(shape)}) has pieces "
            f"{pieces} on the ranks, which do not cover its elements exactly once; it "
            "does not come from one sharded model on this process group"
        )
