"""The order check of CPU exchanges without tag exchanges ([Note: order watch]).

Exchanges of different units never pair up (their gloo tags hash the unit), ranks that
issued different units raise ``CollectiveOrderError`` on every rank within seconds and
leave the process group usable, and a rank that is only slow raises nothing.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_yafsdp.core.comm import order_watch
from lightning_yafsdp.core.comm.collectives import CommStats, all_gather_into
from lightning_yafsdp.core.comm.order_guard import CollectiveOrderError, CollectiveOrderGuard
from lightning_yafsdp.core.comm.pairwise import exchange_tag
from lightning_yafsdp.core.comm.streams import CommScheduler
from tests.distributed import dist_run

NUMEL = 6  # elements per rank, the same for every unit below


def _gather(scheduler: CommScheduler, index: int) -> tuple:
    """Issue the gather of unit ``index``: every rank's shard is filled with its rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shard, output = torch.full((NUMEL,), float(rank)), torch.full((NUMEL * world,), -1.0)
    launch = lambda async_op: all_gather_into(  # noqa: E731 - the scheduler's launch
        output, shard, dist.group.WORLD, async_op=async_op, stats=CommStats()
    )
    pending = scheduler.issue(
        "gather", unit=f"unit {index}", slot=0, tag=(index, NUMEL), launch=launch, after=None
    )
    return pending, output


def _scheduler() -> tuple[CommScheduler, CollectiveOrderGuard]:
    mesh = SimpleNamespace(shard_group=dist.group.WORLD, replicate_group=None)
    guard = CollectiveOrderGuard(mesh, device=torch.device("cpu"), describe=lambda i: f"unit {i}")
    return CommScheduler(torch.device("cpu"), order_guard=guard), guard


def _diverging_rank(diverging: int) -> dict:
    """Rank ``diverging`` gathers unit 2 where the others gather unit 1 (same size)."""
    scheduler, guard = _scheduler()
    rank = dist.get_rank()
    first, _ = _gather(scheduler, 0)
    first.wait()
    pending, output = _gather(scheduler, 2 if rank == diverging else 1)
    started = time.monotonic()
    try:
        pending.wait()
        result = {"error": "no error", "output": output}
    except CollectiveOrderError as error:
        result = {"error": str(error)}
    result["seconds"] = time.monotonic() - started
    result["tag_exchanges"] = guard.stats.calls["all_gather"]
    # The group is still usable: a collective after the error gives the right sum.
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    result["all_reduce_after"] = total.item()
    guard.close()
    return result


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_gather_different_units_raise_on_every_rank_and_keep_the_group(
    world_size: int,
) -> None:
    results = dist_run(world_size, _diverging_rank, world_size - 1, timeout_s=60)
    last = world_size - 1
    for rank, result in enumerate(results):
        message = result["error"]
        assert "ranks issued different collectives" in message, (rank, message)
        for other in range(world_size):
            unit = 2 if other == last else 1
            assert f"rank {other}: gather of 'unit {unit}' ({NUMEL} elements)" in message
        # STALL_S, the watch's tick and the store: ~1.3 s measured.
        assert result["seconds"] < order_watch.STALL_S + 4, result["seconds"]
        assert result["tag_exchanges"] == 0  # the check exchanged no tags
        assert result["all_reduce_after"] == sum(range(1, world_size + 1))


def _slow_rank() -> dict:
    """Rank 1 issues the same gather 2.5 stall thresholds late: a wait, not a divergence."""
    scheduler, guard = _scheduler()
    if dist.get_rank() == 1:
        time.sleep(2.5 * order_watch.STALL_S)
    pending, output = _gather(scheduler, 1)
    started = time.monotonic()
    pending.wait()
    guard.close()
    return {"output": output, "seconds": time.monotonic() - started}


def test_a_slow_rank_is_waited_for_without_an_error() -> None:
    results = dist_run(2, _slow_rank, timeout_s=60)
    expected = torch.cat([torch.full((NUMEL,), float(r)) for r in range(2)])
    for result in results:
        torch.testing.assert_close(result["output"], expected, rtol=0, atol=0)
    assert results[0]["seconds"] > 2 * order_watch.STALL_S  # it did wait, past the stall


def test_exchange_tags_tell_units_apart_at_equal_sizes() -> None:
    unit_1, unit_2 = (1, 1, NUMEL), (1, 2, NUMEL)
    nbytes = NUMEL * 4
    assert exchange_tag("gather", nbytes, unit_1) == exchange_tag("gather", nbytes, unit_1)
    assert exchange_tag("gather", nbytes, unit_1) != exchange_tag("gather", nbytes, unit_2)
    assert exchange_tag("gather", nbytes, unit_1) != exchange_tag("gather", nbytes + 4, unit_1)
    for tag in (exchange_tag("gather", nbytes, unit_1), exchange_tag("gather", nbytes)):
        assert 0 <= tag < 2**31  # gloo's tags are non-negative 32-bit ints
