"""The engine's CPU gathers and reductions as point-to-point exchanges.

[Note: pairwise exchanges on gloo] (``core/comm/pairwise.py``): the results must be
those of gloo's collectives (exact at two ranks, the same sum at three), several
exchanges in flight must pair up in issue order, and exchanges of different sizes on
two ranks must end in the order guard's error on every rank, not in gloo's abort.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_yafsdp.core.comm.collectives import CommStats, all_gather_into
from lightning_yafsdp.core.comm.exchange_line import exchange_line_for
from lightning_yafsdp.core.comm.order_guard import CollectiveOrderError, CollectiveOrderGuard
from lightning_yafsdp.core.comm.pairwise import gather_pairwise, reduce_scatter_pairwise
from lightning_yafsdp.core.comm.streams import CommScheduler
from tests.distributed import dist_run

SHARD, CHUNK = 5, 7  # elements per rank: a gather's shard, a reduction's chunk


def _terms(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """This rank's inputs, drawn from a generator seeded by rank (different on every rank)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)
    return {
        "shard_a": torch.randn(SHARD, generator=gen).to(dtype),
        "shard_b": torch.randn(SHARD, generator=gen).to(dtype),  # same size: pairs in order
        "full": torch.randn(CHUNK * world, generator=gen).to(dtype),
    }


def _exchanges_rank(dtype_name: str) -> dict[str, torch.Tensor]:
    """Four exchanges in flight at once, waited in reverse order; inputs and outputs back."""
    dtype = getattr(torch, dtype_name)
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    terms = _terms(dtype)
    gathered_a = torch.full((SHARD * world,), float("nan"), dtype=dtype)
    gathered_b = torch.full((SHARD * world,), float("nan"), dtype=dtype)
    reduced = torch.full((CHUNK,), float("nan"), dtype=dtype)
    in_place = terms["full"].clone()
    exchanges = [
        gather_pairwise(gathered_a, terms["shard_a"], group),
        reduce_scatter_pairwise(reduced, terms["full"], group),
        gather_pairwise(gathered_b, terms["shard_b"], group),
        reduce_scatter_pairwise(in_place[rank * CHUNK : (rank + 1) * CHUNK], in_place, group),
    ]
    for exchange in reversed(exchanges):
        exchange.wait()
    every_full = [torch.empty_like(terms["full"]) for _ in range(world)]
    dist.all_gather(every_full, terms["full"])
    return {
        "gathered_a": gathered_a,
        "gathered_b": gathered_b,
        "reduced": reduced,
        "reduced_in_place": in_place[rank * CHUNK : (rank + 1) * CHUNK].clone(),
        "every_full": torch.stack(every_full),
        **terms,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_pairwise_gathers_are_every_rank_shard_in_rank_order(world_size: int) -> None:
    results = dist_run(world_size, _exchanges_rank, "float32")
    for name in ("shard_a", "shard_b"):
        expected = torch.cat([r[name] for r in results])
        for rank, result in enumerate(results):
            assert torch.equal(result[f"gathered_{name[-1]}"], expected), (rank, name)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_two_rank_pairwise_reductions_equal_gloo_all_reduce_bit_for_bit(dtype_name) -> None:
    results = dist_run(2, _exchanges_rank, dtype_name)
    every_full = results[0]["every_full"]
    total = every_full[0] + every_full[1]  # two terms: the same sum in either order
    for rank, result in enumerate(results):
        mine = total[rank * CHUNK : (rank + 1) * CHUNK]
        assert torch.equal(result["reduced"], mine), rank
        assert torch.equal(result["reduced_in_place"], mine), rank


def test_three_rank_pairwise_reductions_are_the_sum_to_float_round_off() -> None:
    results = dist_run(3, _exchanges_rank, "float32")
    every_full = results[0]["every_full"].double()
    exact, magnitude = every_full.sum(0), every_full.abs().sum(0)
    for rank, result in enumerate(results):
        part = slice(rank * CHUNK, (rank + 1) * CHUNK)
        # Three float32 terms summed in some order: two roundings, each <= half an ulp
        # of a partial sum bounded by the sum of magnitudes.
        bound = 2 * torch.finfo(torch.float32).eps * magnitude[part]
        for key in ("reduced", "reduced_in_place"):
            error = (result[key].double() - exact[part]).abs()
            assert bool((error <= bound).all()), (rank, key, error.max().item())


def _uneven_gathers_rank(on_line: bool) -> str:
    """Rank 0 gathers 8 elements per rank, rank 1 gathers 12: the order check must raise,
    the guard's tag exchange or (``on_line``) the exchange line's watch."""
    rank = dist.get_rank()
    group = dist.group.WORLD
    mesh = SimpleNamespace(shard_group=group, replicate_group=None)
    guard = CollectiveOrderGuard(mesh, device=torch.device("cpu"), describe=lambda i: f"unit {i}")
    scheduler = CommScheduler(
        torch.device("cpu"), group=group, order_guard=None if on_line else guard
    )
    if on_line:
        scheduler.use_line(exchange_line_for(group))
    numel = 8 if rank == 0 else 12
    shard, output = torch.ones(numel), torch.zeros(numel * dist.get_world_size())
    pending = scheduler.issue(
        "gather",
        unit=f"unit {rank}",
        slot=0,
        tag=(rank, numel),
        launch=lambda async_op, exchange: all_gather_into(
            output, shard, exchange.group, async_op=async_op, stats=CommStats(), key=exchange.key
        ),
        after=None,
    )
    try:
        pending.wait()
    except CollectiveOrderError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize("on_line", [False, True], ids=["tag_exchange", "exchange_line"])
def test_exchanges_of_different_sizes_end_in_the_order_error_on_every_rank(on_line) -> None:
    # A send whose receive has another size aborts the receiving process inside gloo;
    # the exchanges' tags keep such sends and receives from ever pairing up.
    messages = dist_run(2, _uneven_gathers_rank, on_line, timeout_s=60)
    for message in messages:
        assert "ranks issued different collectives" in message, message
        assert "rank 0: gather of 'unit 0' (8 elements)" in message, message
        assert "rank 1: gather of 'unit 1' (12 elements)" in message, message


def _edge_cases_rank() -> dict:
    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    result = {}
    # Nothing to exchange: done at once, on every rank alike.
    empty = gather_pairwise(torch.empty(0), torch.empty(0), group)
    result["empty_done"] = empty.is_completed()
    empty.wait()
    # A size that does not fit is refused before anything is posted ...
    try:
        gather_pairwise(torch.empty(SHARD * world + 1), torch.ones(SHARD), group)
    except ValueError as error:
        result["refused"] = str(error)
    # ... and an exchange dropped unwaited (an exception between issue and wait) keeps
    # its transfers alive, so the next exchanges on the group still pair and complete.
    dropped = torch.zeros(SHARD * world)
    gather_pairwise(dropped, torch.full((SHARD,), -1.0), group)  # never waited
    out = torch.zeros(SHARD * world)
    gather_pairwise(out, torch.full((SHARD,), float(rank)), group).wait()
    result["after_drop"] = out
    return result


def test_empty_misfit_and_dropped_exchanges_leave_the_group_working() -> None:
    results = dist_run(2, _edge_cases_rank, timeout_s=60)
    expected = torch.cat([torch.full((SHARD,), float(r)) for r in range(2)])
    for result in results:
        assert result["empty_done"]
        assert "11 torch.float32 elements cannot be 2 ranks' 5" in result["refused"]
        assert torch.equal(result["after_drop"], expected)
