"""The order check of the engine's CPU exchanges ([Note: exchange lines]).

Ranks that issue different collectives must end in ``CollectiveOrderError`` on every
rank within seconds, without exchanging a byte of different collectives (not even of
equal size, not even between two engines of the same shape); ranks that agree but run
at different speeds must never be stopped, whatever the age of the logs they compare.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_yafsdp.core import shard_model
from lightning_yafsdp.core.comm import order_watch
from lightning_yafsdp.core.comm.collectives import CommStats, all_gather_into
from lightning_yafsdp.core.comm.exchange_line import exchange_line_for
from lightning_yafsdp.core.comm.order_guard import CollectiveOrderError
from lightning_yafsdp.core.comm.streams import CommScheduler
from tests.distributed import dist_run

WIDTH, BLOCKS = 16, 4


def _line_scheduler() -> CommScheduler:
    group = dist.group.WORLD
    scheduler = CommScheduler(torch.device("cpu"), group=group)
    scheduler.use_line(exchange_line_for(group))
    return scheduler


def _gather(scheduler: CommScheduler, shard: torch.Tensor, output: torch.Tensor, *, index: int):
    """Issue a gather of ``shard`` as group ``index`` (the unit named after it)."""
    return scheduler.issue(
        "gather",
        unit=f"unit {index}",
        slot=0,
        tag=(index, shard.numel()),
        launch=lambda async_op, exchange: all_gather_into(
            output, shard, exchange.group, async_op=async_op, stats=CommStats(), key=exchange.key
        ),
        after=None,
    )


# -- ranks that diverge ---------------------------------------------------------------------


def _equal_sizes_rank() -> dict:
    """Each rank gathers a unit of its own, both of 8 elements: tags by size would pair them."""
    rank = dist.get_rank()
    scheduler = _line_scheduler()
    shard, output = torch.full((8,), float(rank + 1)), torch.zeros(16)
    started = time.monotonic()
    try:
        _gather(scheduler, shard, output, index=rank).wait()
        message = "no error"
    except CollectiveOrderError as error:
        message = str(error)
    peer = output[8:] if rank == 0 else output[:8]
    return {"message": message, "seconds": time.monotonic() - started, "peer": peer}


def test_collectives_of_equal_size_never_pair_and_fail_on_every_rank() -> None:
    for rank, result in enumerate(dist_run(2, _equal_sizes_rank, timeout_s=60)):
        message = result["message"]
        assert "ranks issued different collectives" in message, message
        assert "rank 0: gather of 'unit 0' (8 elements)" in message, message
        assert "rank 1: gather of 'unit 1' (8 elements)" in message, message
        assert result["seconds"] < 5, f"rank {rank} took {result['seconds']:.1f} s"
        # Nothing of the other rank's collective arrived.
        assert bool((result["peer"] == 0).all()), result["peer"]


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(BLOCKS))

    def forward(self, x: torch.Tensor, skip: int | None = None) -> torch.Tensor:
        for index, layer in enumerate(self.layers):
            if index != skip:
                x = torch.tanh(layer(x))
        return x


def _sharded_stack() -> nn.Module:
    torch.manual_seed(0)
    model = _Stack()
    shard_model(model, units=[f"layers.{i}" for i in range(BLOCKS)], blocks_per_unit=1)
    return model


def _one_rank_skips_a_block_rank() -> tuple[str, str, float]:
    """Rank 2 of 3 skips block 1 in its second step."""
    rank = dist.get_rank()
    model = _sharded_stack()
    started = time.monotonic()
    try:
        for step in range(2):
            skip = 1 if step == 1 and rank == 2 else None
            model(torch.randn(2, WIDTH), skip=skip).sum().backward()
    except Exception as error:  # noqa: BLE001 - the error is the fact under test
        return type(error).__name__, str(error), time.monotonic() - started
    return "no error", "", time.monotonic() - started


def test_one_rank_of_three_that_skips_a_block_fails_every_rank_within_seconds() -> None:
    for rank, (kind, message, seconds) in enumerate(
        dist_run(3, _one_rank_skips_a_block_rank, timeout_s=120)
    ):
        assert kind == "CollectiveOrderError", message
        # In backward ranks 0 and 1 gather block 1 again; rank 2 still holds the gather
        # of block 1 that block 0 prefetched in forward, and reduces block 2 instead.
        assert "rank 0: gather of 'layers.1'" in message, message
        assert "rank 1: gather of 'layers.1'" in message, message
        assert "rank 2: reduce_scatter of 'layers.2'" in message, message
        assert seconds < 10, f"rank {rank} took {seconds:.1f} s"


def _teacher_on_one_rank_rank() -> tuple[str, str]:
    """Two engines of one shape; rank 0 runs the teacher first, rank 1 the student."""
    student, teacher = _sharded_stack(), _sharded_stack()
    first, second = (teacher, student) if dist.get_rank() == 0 else (student, teacher)
    try:
        with torch.no_grad():
            first(torch.randn(2, WIDTH))
            second(torch.randn(2, WIDTH))
    except Exception as error:  # noqa: BLE001 - the error is the fact under test
        return type(error).__name__, str(error)
    return "no error", ""


def test_two_engines_of_one_shape_called_in_different_orders_never_pair() -> None:
    for kind, message in dist_run(2, _teacher_on_one_rank_rank, timeout_s=120):
        assert kind == "CollectiveOrderError", message
        assert "rank 0: gather of 'layers.0' (" in message and "of model 1" in message, message


# -- ranks that agree -----------------------------------------------------------------------


def _slow_ranks_rank(pauses: dict[int, int]) -> list[bool]:
    """Twelve gathers; before gather ``i`` rank ``pauses[i]`` sleeps past the stall limit,
    so the other rank's watch compares its log with the sleeper's older one."""
    rank = dist.get_rank()
    scheduler = _line_scheduler()
    correct = []
    for index in range(12):
        if pauses.get(index) == rank:
            time.sleep(1.6)
        shard, output = torch.full((5,), float(10 * index + rank)), torch.zeros(10)
        _gather(scheduler, shard, output, index=index % 3).wait()
        expected = torch.tensor([10.0 * index] * 5 + [10.0 * index + 1] * 5)
        correct.append(bool(torch.equal(output, expected)))
    return correct


def test_ranks_that_agree_are_never_stopped_by_old_logs() -> None:
    pauses = {1: 1, 4: 0, 7: 1, 10: 0}  # each rank publishes while the other sleeps
    for correct in dist_run(2, _slow_ranks_rank, pauses, timeout_s=120):
        assert correct == [True] * 12


def _train_reinit_train_rank(store_path: str) -> list[float]:
    """Train, destroy the process group, make a new one, train a new model: lines of the
    first group are dropped, the new group gets a line of its own."""
    losses = []
    for attempt in range(2):
        model = _sharded_stack()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            loss = model(torch.ones(2, WIDTH)).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        if attempt == 0:
            rank, world = dist.get_rank(), dist.get_world_size()
            dist.destroy_process_group()
            store = dist.FileStore(store_path, world)
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
            )
    return losses


def test_a_new_process_group_in_the_same_process_gets_a_line_of_its_own() -> None:
    with tempfile.TemporaryDirectory() as folder:
        results = dist_run(2, _train_reinit_train_rank, os.path.join(folder, "store"))
    assert results[0] == results[1]
    assert results[0][:2] == results[0][2:]  # the same model, seed and data each time


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_line_carries_every_collective_of_a_step(world_size: int) -> None:
    results = dist_run(world_size, _positions_per_step_rank, timeout_s=120)
    # Forward: 4 unit gathers; backward: 2 (blocks 3 and 2 are still in the two slots),
    # 4 reduce-scatters; nothing resident (every parameter is in a unit).
    assert results == [4 + 2 + 4] * world_size


def _positions_per_step_rank() -> int:
    torch.manual_seed(0)
    model = _Stack()
    engine = shard_model(model, units=[f"layers.{i}" for i in range(BLOCKS)], blocks_per_unit=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    line = engine.scheduler.line
    positions = []
    for _ in range(2):
        before = line.position
        model(torch.ones(2, WIDTH)).sum().backward()
        optimizer.step()  # new weights: the next forward gathers every block again
        positions.append(line.position - before)
    return positions[1]


# -- the line itself --------------------------------------------------------------------------


def _close_after_a_transfer_landed_rank() -> str:
    """Rank 0 closes its line (as its watch does on proof) after its gather's transfers
    arrived but before it waited them: the wait must still return, and then raise."""
    rank = dist.get_rank()
    scheduler = _line_scheduler()
    line = scheduler.line
    shard, output = torch.full((5,), float(rank)), torch.zeros(10)
    pending = _gather(scheduler, shard, output, index=0)
    time.sleep(1.0)  # the transfers land
    if rank == 1:
        pending.wait()
        dist.barrier()  # on the world group: rank 0 closed its line meanwhile
        try:
            _gather(scheduler, shard, output, index=1).wait()
            result = "no error"
        except RuntimeError as error:
            result = type(error).__name__
        dist.barrier()  # rank 0 is alive until here: only the closing ends the wait above
        return result
    line.divergence = "proven (as the watch sets it before closing)"
    closer = threading.Thread(target=order_watch._close, args=(line.group,))
    closer.start()
    closer.join()
    started = time.monotonic()
    try:
        pending.wait()
    except CollectiveOrderError:
        message = f"{type(line).__name__} raised"
    else:
        message = "no error"
    seconds = time.monotonic() - started
    dist.barrier()
    dist.barrier()
    return f"{message} after {seconds:.0f} s"


def test_closing_a_line_never_takes_a_transfer_from_its_wait() -> None:
    closed, peer = dist_run(2, _close_after_a_transfer_landed_rank, timeout_s=60)
    assert closed == "ExchangeLine raised after 0 s"
    # The peer's next exchange on the closed line fails; no log proves a divergence
    # (nothing diverged), so its error is gloo's own.
    assert peer == "RuntimeError"


def _engines_over_two_groups_of_the_same_ranks_rank() -> list[bool]:
    torch.manual_seed(0)
    first, second = _Stack(), _Stack()
    engine = shard_model(first, blocks_per_unit=1)
    other = shard_model(second, process_group=dist.new_group([0, 1]), blocks_per_unit=1)
    return [engine.scheduler.line is other.scheduler.line, other.scheduler.line_model == 1]


def test_engines_over_groups_of_the_same_ranks_share_one_line() -> None:
    # Hybrid sharding makes new shard groups for every model: one line per set of ranks
    # keeps one order (and one thread and gloo group) for all of a process's engines.
    assert dist_run(2, _engines_over_two_groups_of_the_same_ranks_rank) == [[True, True]] * 2
