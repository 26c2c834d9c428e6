"""The engine's CPU gathers and reductions against gloo's collectives, 2+ ranks, one job.

[Note: pairwise exchanges on gloo]: on CPU the engine gathers and reduce-scatters with
point-to-point sends and receives. This measures, for one gather and one reduction of
the given size, wall time and per-process CPU time (every thread: gloo's workers and
transport thread included) of:

* ``gather collective``: ``all_gather_single`` (what the engine used before);
* ``gather pairwise``: ``pairwise.gather_pairwise`` (what it uses now);
* ``reduce all_reduce``: ``all_reduce`` in place + copy of this rank's part out (before);
* ``reduce reduce_scatter``: gloo's own ``reduce_scatter_single`` (never used: slowest);
* ``reduce pairwise``: ``pairwise.reduce_scatter_pairwise`` (now).

Rounds rotate the order; medians over rounds of the per-call mean; rank 0 prints, with
each pairwise variant's ratio to its collective measured in the same run. A check that
the pairwise results equal the collectives' runs first.

    python benchmarks/gloo_exchanges.py                      # 12.8 MB per call, 2 ranks
    python benchmarks/gloo_exchanges.py --numel 800000 --ranks 3 --rounds 5
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _variants(numel: int):
    """name -> a function running one call; the tensors are made once."""
    import torch
    import torch.distributed as dist

    from lightning_yafsdp.core.comm.pairwise import gather_pairwise, reduce_scatter_pairwise
    from lightning_yafsdp.core.compat import all_gather_single, reduce_scatter_single

    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    chunk = numel // world
    full, reduced = torch.randn(chunk * world), torch.empty(chunk)
    shard, gathered = torch.randn(chunk), torch.empty(chunk * world)
    mine = full[rank * chunk : (rank + 1) * chunk]

    def all_reduce_then_copy():
        dist.all_reduce(full)
        reduced.copy_(mine)

    return {
        "gather collective": lambda: all_gather_single(gathered, shard),
        "gather pairwise": lambda: gather_pairwise(gathered, shard, group).wait(),
        "reduce all_reduce": all_reduce_then_copy,
        "reduce reduce_scatter": lambda: reduce_scatter_single(reduced, full),
        "reduce pairwise": lambda: reduce_scatter_pairwise(reduced, full, group).wait(),
    }


def _check_results(numel: int) -> None:
    """The pairwise results equal the collectives' (exact at 2 ranks; close at 3+)."""
    import torch
    import torch.distributed as dist

    from lightning_yafsdp.core.comm.pairwise import gather_pairwise, reduce_scatter_pairwise
    from lightning_yafsdp.core.compat import all_gather_single

    group, world, rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    chunk = numel // world
    gen = torch.Generator().manual_seed(rank)
    shard, full = torch.randn(chunk, generator=gen), torch.randn(chunk * world, generator=gen)
    expected_gather, got_gather = torch.empty(chunk * world), torch.empty(chunk * world)
    all_gather_single(expected_gather, shard)
    gather_pairwise(got_gather, shard, group).wait()
    summed = full.clone()
    dist.all_reduce(summed)
    got_reduce = torch.empty(chunk)
    reduce_scatter_pairwise(got_reduce, full, group).wait()
    expected_reduce = summed[rank * chunk : (rank + 1) * chunk]
    assert torch.equal(got_gather, expected_gather), "pairwise gather differs"
    if world == 2:
        assert torch.equal(got_reduce, expected_reduce), "pairwise reduction differs"
    else:
        torch.testing.assert_close(got_reduce, expected_reduce, rtol=1e-6, atol=1e-6)


def _rank(rank: int, args: argparse.Namespace, init_file: str, queue) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.ranks
    )
    _check_results(args.numel)
    variants = _variants(args.numel)
    names = list(variants)
    results = {name: [] for name in names}
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            call = variants[name]
            dist.barrier()
            call()  # warm
            dist.barrier()
            cpu, wall = _process_cpu(), time.perf_counter()
            for _ in range(args.calls):
                call()
            wall, cpu = time.perf_counter() - wall, _process_cpu() - cpu
            results[name].append((wall / args.calls * 1e3, cpu / args.calls * 1e3))
    if rank == 0:
        queue.put(results)
    dist.barrier()
    dist.destroy_process_group()


def _report(results: dict, args: argparse.Namespace) -> None:
    mb = args.numel * 4 / 1e6
    print(f"{args.ranks} ranks, {mb:.1f} MB per call (fp32), {args.calls} calls x "
          f"{args.rounds} rounds; per call, median over rounds (rank 0)")  # fmt: skip
    print("| variant | wall ms | CPU ms (all threads) | CPU vs its collective |")
    print("|---|---:|---:|---|")
    medians = {
        name: tuple(statistics.median(r[i] for r in rows) for i in range(2))
        for name, rows in results.items()
    }
    peers = {"gather pairwise": "gather collective", "reduce pairwise": "reduce all_reduce"}
    for name, (wall, cpu) in medians.items():
        peer = peers.get(name)
        ratio = f"{cpu / medians[peer][1]:.2f}x {peer}" if peer else "-"
        print(f"| {name} | {wall:.2f} | {cpu:.2f} | {ratio} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=3_200_000, help="fp32 elements per call")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20, help="calls per measurement")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    results = run_ranks(_rank, args, world_size=args.ranks)
    _report(results, args)


def run_ranks(target, args: argparse.Namespace, *, world_size: int):
    """Run ``target(rank, args, init_file, queue)`` on ``world_size`` spawned processes;
    rank 0's result (what it put in the queue), or exit naming the ranks' exit codes."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.Queue()
    with tempfile.TemporaryDirectory(prefix="benchmark_ranks_") as tmp:
        init_file = os.path.join(tmp, "init")
        ranks = [
            context.Process(target=target, args=(r, args, init_file, queue))
            for r in range(world_size)
        ]
        for process in ranks:
            process.start()
        results = _results_or_none(queue, ranks)
        for process in ranks:
            if results is None:
                process.kill()  # a rank failed: the others wait for it in a collective
            process.join()
    if results is None or any(process.exitcode != 0 for process in ranks):
        sys.exit(f"a rank failed: exit codes {[p.exitcode for p in ranks]}")
    return results


def _results_or_none(queue, ranks) -> dict | None:
    """Rank 0's results, or None as soon as any rank has exited with an error."""
    import queue as queues

    while True:
        try:
            return queue.get(timeout=0.5)
        except queues.Empty:
            if any(p.exitcode not in (None, 0) for p in ranks):
                return None


if __name__ == "__main__":
    main()
