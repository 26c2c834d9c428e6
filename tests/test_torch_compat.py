"""Each torch-version shim in core/compat.py resolves to an API that does its job here."""

import torch

from lightning_yafsdp.core import compat
from tests.distributed import dist_run


def test_tree_is_leaf_tells_tensors_from_containers():
    assert compat.tree_is_leaf(torch.zeros(2))
    assert not compat.tree_is_leaf((torch.zeros(2),))
    assert not compat.tree_is_leaf({"a": torch.zeros(2)})


def _gather_and_reduce_scatter() -> None:
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    shard = torch.full((2,), float(rank))
    gathered = torch.empty(2 * world_size)
    compat.all_gather_single(gathered, shard, group=dist.group.WORLD)
    assert gathered.tolist() == [0.0, 0.0, 1.0, 1.0], gathered
    full = torch.arange(2.0 * world_size)
    out = torch.empty(2)
    compat.reduce_scatter_single(out, full, group=dist.group.WORLD)
    assert out.tolist() == [2.0 * (2 * rank), 2.0 * (2 * rank + 1)], out


def test_collective_shims_gather_and_reduce_scatter_on_two_ranks():
    dist_run(2, _gather_and_reduce_scatter)
