"""What the CPU order check costs a training step: the exchange line against tag exchanges.

[Note: exchange lines]: on CPU the engine checks that every rank issues the same
collectives through its exchange line, with no traffic of its own. This trains one
model on 2 gloo ranks (plain loop, AdamW, 1 thread per rank) and switches the engine,
step by step, between three ways of checking the order:

* ``line``: the exchange line (the default);
* ``tags``: a tag all_gather before each collective (the order guard, what the engine
  did on CPU before the lines), the exchanges on the shard group;
* ``off``: no check (``engine.verify_collective_order(False)``).

One cycle runs one step of each, in a rotating order, so that each comparison is
between neighbouring steps (this machine's speed drifts by more than the difference).
Printed: each mode's median step (the slower rank's wall time) and rank 0's CPU time
(every thread), and the median over cycles of the paired differences.

    python benchmarks/order_check.py                 # issue 36's model, 36 cycles
    python benchmarks/order_check.py --quick --cycles 2
"""

from __future__ import annotations

import argparse
import statistics
import time

try:  # run as a script (benchmarks/ on sys.path) or imported from the tests
    from gloo_exchanges import run_ranks
except ImportError:
    from benchmarks.gloo_exchanges import run_ranks

MODES = ("line", "tags", "off")
ISSUE_36_MODEL = dict(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_hidden_dim=688)


def _set_mode(engine, mode: str) -> None:
    from lightning_yafsdp.core.comm.order_guard import CollectiveOrderGuard

    engine.verify_collective_order(mode != "off")
    if mode == "tags":  # the guard on every collective, the exchanges off the line
        engine.scheduler.use_line(None)
        engine.scheduler.order_guard = CollectiveOrderGuard(
            engine.mesh, device=engine.device, describe=str
        )


def _train_step(model, optimizer, tokens) -> None:
    import torch.nn.functional as F

    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _rank(rank: int, args: argparse.Namespace, init_file: str, queue) -> None:
    import torch
    import torch.distributed as dist

    from lightning_yafsdp.core import shard_model
    from lightning_yafsdp.models.llama import Llama, LlamaConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    overrides = {} if args.quick else ISSUE_36_MODEL
    config = LlamaConfig.from_name("tiny", vocab_size=4096, **overrides)
    model = Llama(config)
    engine = shard_model(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=generator)
    for mode in MODES:  # warm every path
        _set_mode(engine, mode)
        _train_step(model, optimizer, tokens)
    steps = {mode: [] for mode in MODES}
    for cycle in range(args.cycles):
        shift = cycle % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            _set_mode(engine, mode)
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            _train_step(model, optimizer, tokens)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            slower = torch.tensor([wall])
            dist.all_reduce(slower, op=dist.ReduceOp.MAX)
            steps[mode].append((slower.item() * 1e3, cpu * 1e3))
    if rank == 0:
        queue.put(steps)
    dist.barrier()
    dist.destroy_process_group()


def _report(steps: dict, args: argparse.Namespace) -> None:
    print(f"2 ranks, {args.cycles} cycles of one step per mode; ms per step")
    print(
        "| mode | step (wall, median) | CPU rank 0 (median) | tags minus it, paired: wall / CPU |"
    )
    print("|---|---:|---:|---|")
    for mode in MODES:
        wall = statistics.median(s[0] for s in steps[mode])
        cpu = statistics.median(s[1] for s in steps[mode])
        paired = [
            statistics.median(t[i] - m[i] for t, m in zip(steps["tags"], steps[mode]))
            for i in range(2)
        ]
        saved = "-" if mode == "tags" else f"{paired[0]:+.1f} / {paired[1]:+.1f}"
        print(f"| {mode} | {wall:.1f} | {cpu:.1f} | {saved} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=36)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="the tiny preset, seconds")
    args = parser.parse_args(argv)
    _report(run_ranks(_rank, args, world_size=2), args)


if __name__ == "__main__":
    main()
