"""Torch-level CPU benchmark of the core engine against DDP and FSDP2 (2 ranks, gloo).

Same model (built with the same seed on every rank), same data (a fixed token
stream per rank), same optimizer (AdamW, fp32 throughout), plain torch loop,
no Lightning. Strategies:

* ``yafsdp-z3``: ``shard_model(model, zero_stage=3)`` (the engine under test);
* ``yafsdp-z2``: ``shard_model(model, zero_stage=2)`` (extra row);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel``;
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every block, then on the root.

Every (strategy, round) pair is a fresh 2-rank job (``torch.multiprocessing``
spawn, ``file://`` rendezvous), so peak RSS never mixes between strategies.
Strategies run in a rotating order over ``--rounds`` rounds; each job runs
``--warmup`` unmeasured steps, then ``--steps`` measured steps. A step's time is
the slower rank's wall time for forward + loss + backward + optimizer step +
zero_grad; the reported step time is the median over all measured steps of
all rounds. ``optimizer.step()`` alone is timed too (same rule: the slower rank
per step, median over all measured steps), in wall time and in the rank process's
CPU time (``time.process_time``), which a busy shared machine disturbs less than
wall time (a descheduled rank accrues none). Each rank uses
``torch.set_num_threads(1)`` (2 ranks on 2 cores).

``--param-groups N`` sets the optimizer's param groups. ``1`` (default): each
strategy's usual groups (``engine.param_groups(weight_decay=0.1)`` for yafsdp,
``model.parameters()`` for DDP/FSDP2). ``N > 1``: the model's parameters, in
``named_parameters()`` order, dealt round-robin into N groups, each with its own
learning rate, and each split by the usual decay rule (weight decay 0.1 for
``p.dim() >= 2``, 0 for the rest), so up to 2N torch param groups. The engine must
give the original parameters back for this (per-parameter sharded views).

Examples::

    python benchmarks/engine_cpu.py                          # debug-50m defaults
    python benchmarks/engine_cpu.py --quick                  # tiny model, seconds
    python benchmarks/engine_cpu.py --model debug-50m --batch 4 --seq 128 \\
        --steps 8 --warmup 2 --rounds 2 --json results.json
    python benchmarks/engine_cpu.py --profile yafsdp-z3      # torch.profiler, rank 0
    python benchmarks/engine_cpu.py --strategies yafsdp-z3 --param-groups 10 --no-memory-pass
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:  # run as a script (python benchmarks/engine_cpu.py): benchmarks/ is on sys.path
    import _measure as m
except ImportError:  # imported as benchmarks.engine_cpu from the repository root
    from benchmarks import _measure as m

STRATEGIES = ("yafsdp-z3", "yafsdp-z2", "ddp", "fsdp2")
WORLD_SIZE = 2
GOAL_STEP_VS_DDP = 1.10
GOAL_STEP_VS_FSDP2 = 0.70
GOAL_MEM_VS_FSDP2 = 1.00


# --------------------------------------------------------------------------- one rank


BASE_LR = 1e-4
WEIGHT_DECAY = 0.1


def round_robin_groups(named_params, n_groups: int) -> list[dict]:
    """``named_params`` dealt round-robin into ``n_groups`` learning rates, each split by dim.

    Group ``i`` gets every ``n_groups``-th parameter starting at ``i`` and the learning rate
    ``BASE_LR * (1 + i / n_groups)``; within it, ``p.dim() >= 2`` parameters get weight decay
    ``WEIGHT_DECAY`` and the rest 0 (the nanoGPT/litgpt rule). Empty groups are left out.
    """
    dealt: list[list] = [[] for _ in range(n_groups)]
    for index, (_, param) in enumerate(named_params):
        dealt[index % n_groups].append(param)
    groups = []
    for i, params in enumerate(dealt):
        lr = BASE_LR * (1 + i / n_groups)
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups += [
            {"params": ps, "lr": lr, "weight_decay": wd}
            for ps, wd in ((decay, WEIGHT_DECAY), (no_decay, 0.0))
            if ps
        ]
    return groups


def _build(strategy: str, model_name: str, seed: int, param_groups: int = 1):
    """Build the model (same seed on every rank), wrap it, return (model, optimizer, engine)."""
    import torch

    from lightning_yafsdp.models.llama import Llama, LlamaConfig

    torch.manual_seed(seed)
    model = Llama(LlamaConfig.from_name(model_name))
    engine = None
    if strategy.startswith("yafsdp"):
        from lightning_yafsdp.core import shard_model

        engine = shard_model(model, zero_stage=int(strategy[-1]))
        params = engine.param_groups(weight_decay=0.1)
    elif strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        params = model.parameters()
    elif strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        params = model.parameters()
    else:
        raise ValueError(f"unknown strategy {strategy!r}; choose from {STRATEGIES}")
    if param_groups > 1:
        names = [name for name, _ in model.named_parameters()]
        if any(name.startswith("_yafsdp_") for name in names):
            raise SystemExit(
                f"--param-groups {param_groups}: this engine's model has only its fused "
                f"master shards as parameters ({names}), not the original parameters, so "
                "they cannot be split into groups; use --param-groups 1 on this tree"
            )
        params = round_robin_groups(model.named_parameters(), param_groups)
    optimizer = torch.optim.AdamW(params, lr=BASE_LR, weight_decay=WEIGHT_DECAY)
    return model, optimizer, engine


def _rank_main(rank: int, cfg: dict) -> None:
    """One rank of one job: build, warm up, time, write a JSON result."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group(
        "gloo", init_method=cfg["init_method"], rank=rank, world_size=WORLD_SIZE
    )
    import lightning_yafsdp.core  # noqa: F401  (import cost belongs to the baseline)
    import lightning_yafsdp.models.llama  # noqa: F401

    # Peak RSS has three parts, kept apart because the kernel's peak counter is reset
    # twice: the import phase (torch import dominates small models), build + wrap
    # (DDP/FSDP2/shard_model all start from the full model), and training.
    import_peak = m.hwm_kib()
    import_rss = m.current_rss_kib()  # torch + lightning_yafsdp imported, group up
    hwm_reset = m.reset_hwm()

    model, optimizer, engine = _build(
        cfg["strategy"], cfg["model"], cfg["seed"], cfg["param_groups"]
    )
    vocab = 256 if cfg["model"] in ("tiny", "debug-50m") else None
    if vocab is None:
        from lightning_yafsdp.models.llama import LlamaConfig

        vocab = LlamaConfig.from_name(cfg["model"]).vocab_size
    build_peak = m.hwm_kib()
    train_start_rss = m.current_rss_kib()
    m.reset_hwm()
    gen = torch.Generator().manual_seed(10_000 + rank)
    n_steps = cfg["warmup"] + cfg["steps"]
    batches = [
        torch.randint(0, vocab, (cfg["batch"], cfg["seq"] + 1), generator=gen)
        for _ in range(n_steps)
    ]

    def step(tokens):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt_start, opt_cpu_start = time.perf_counter(), time.process_time()
        optimizer.step()
        opt_elapsed = time.perf_counter() - opt_start
        opt_cpu = time.process_time() - opt_cpu_start
        optimizer.zero_grad()
        return loss.detach(), opt_elapsed, opt_cpu

    profiler = None
    times, opt_times, opt_cpu_times, losses = [], [], [], []
    for i, tokens in enumerate(batches):
        if i == cfg["warmup"]:
            if engine is not None:
                engine.comm_stats.reset()
            dist.barrier()
            if cfg["profile"] and rank == 0:
                profiler = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False
                )
                profiler.__enter__()
        start = time.perf_counter()
        loss, opt_elapsed, opt_cpu = step(tokens)
        elapsed = time.perf_counter() - start
        losses.append(float(loss))
        if i >= cfg["warmup"]:
            times.append(elapsed)
            opt_times.append(opt_elapsed)
            opt_cpu_times.append(opt_cpu)
    comm = engine.comm_stats.snapshot() if engine is not None else None
    if profiler is not None:
        profiler.__exit__(None, None, None)
        table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
        Path(cfg["out_dir"], "profile.txt").write_text(table)
        profiler.export_chrome_trace(str(Path(cfg["out_dir"], "trace.json")))

    train_peak = m.hwm_kib()
    if not hwm_reset:  # no reset possible: one process-wide peak for everything
        import_peak = build_peak = train_peak
    result = {
        "rank": rank,
        "step_times_s": times,
        "optimizer_step_times_s": opt_times,
        "optimizer_step_cpu_times_s": opt_cpu_times,
        "n_param_groups": len(optimizer.param_groups),
        "losses": losses,
        "import_rss_kib": import_rss,
        "import_peak_kib": import_peak,
        "build_peak_kib": build_peak,
        "train_start_rss_kib": train_start_rss,
        "train_peak_kib": train_peak,
        # what ru_maxrss would report without the resets: the whole-process peak
        "peak_rss_kib": max(import_peak, build_peak, train_peak),
        "peak_resets": hwm_reset,
        "end_rss_kib": m.current_rss_kib(),
        "n_params_local": sum(p.numel() for p in model.parameters()),
        "comm": comm,
        "memory_report": engine.memory_report() if engine is not None else None,
    }
    dist.barrier()
    dist.destroy_process_group()
    Path(cfg["out_dir"], f"rank{rank}.json").write_text(json.dumps(result))


LIVE_MALLOC_ENV = m.LIVE_MALLOC_ENV  # the memory pass's malloc settings (see _measure)


def _run_job(
    strategy: str,
    args: argparse.Namespace,
    profile: bool = False,
    *,
    steps: int | None = None,
    warmup: int | None = None,
    env: dict[str, str] | None = None,
) -> list[dict]:
    import torch.multiprocessing as mp

    with m.environment(env):  # spawned ranks inherit it; glibc reads it at start-up
        return _spawn(strategy, args, profile, steps or args.steps, warmup or args.warmup, mp)


def _spawn(strategy, args, profile, steps, warmup, mp) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="engine_cpu_") as tmp:
        cfg = {
            "strategy": strategy,
            "model": args.model,
            "batch": args.batch,
            "seq": args.seq,
            "steps": steps,
            "warmup": warmup,
            "seed": args.seed,
            "threads": args.threads,
            "param_groups": args.param_groups,
            "init_method": f"file://{tmp}/store",
            "out_dir": tmp,
            "profile": profile,
        }
        mp.spawn(_rank_main, args=(cfg,), nprocs=WORLD_SIZE, join=True)
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]
        if profile:
            results[0]["profile_table"] = Path(tmp, "profile.txt").read_text()
            if args.trace:
                Path(args.trace).write_bytes(Path(tmp, "trace.json").read_bytes())
        return results


# --------------------------------------------------------------------------- report


def _memory(jobs: list[list[dict]]) -> dict:
    """Per-rank peaks in MiB, max over jobs (see ``_rank_main`` for the three phases)."""
    return m.memory_summary(jobs, WORLD_SIZE)


def _summarize(strategy: str, jobs: list[list[dict]], mem_jobs: list[list[dict]], steps: int):
    step_times, opt_times, opt_cpu_times = [], [], []  # the slower rank's, per measured step
    for job in jobs:
        step_times += m.slower_rank_times(job)
        opt_times += m.slower_rank_times(job, "optimizer_step_times_s")
        opt_cpu_times += m.slower_rank_times(job, "optimizer_step_cpu_times_s")
    summary = {
        "strategy": strategy,
        "median_step_s": statistics.median(step_times),
        "min_step_s": min(step_times),
        "max_step_s": max(step_times),
        "step_times_s": step_times,
        "median_optimizer_step_s": statistics.median(opt_times),
        "optimizer_step_times_s": opt_times,
        "optimizer_step_median_per_job_s": [
            m.median_step(job, "optimizer_step_times_s") for job in jobs
        ],
        "median_optimizer_step_cpu_s": statistics.median(opt_cpu_times),
        "optimizer_step_cpu_times_s": opt_cpu_times,
        "n_param_groups": jobs[0][0]["n_param_groups"],
        "timing_runs_memory": _memory(jobs),
        "memory_pass": _memory(mem_jobs) if mem_jobs else None,
        "first_loss_per_rank": [jobs[0][r]["losses"][0] for r in range(WORLD_SIZE)],
        "last_loss_per_rank": [jobs[0][r]["losses"][-1] for r in range(WORLD_SIZE)],
        "local_params_per_rank": [jobs[0][r]["n_params_local"] for r in range(WORLD_SIZE)],
    }
    comm = jobs[0][0]["comm"]
    if comm is not None:
        summary["comm_per_step"] = m.comm_per_step(comm, steps)
        summary["memory_report"] = jobs[0][0]["memory_report"]
    return summary


def render_table(summaries: dict[str, dict], tokens_per_step: int) -> str:
    """One markdown table: speed, memory (both measurements), ratios with goals, comm."""
    ddp, fsdp = summaries.get("ddp"), summaries.get("fsdp2")
    live = all(s["memory_pass"] for s in summaries.values())
    mem_key = "memory_pass" if live else "timing_runs_memory"
    header = [
        "strategy",
        "median step (s)",
        "optimizer step (ms)",
        "tokens/s",
        "peak RSS/rank, timing runs (MiB)",
        "peak RSS/rank, memory pass (MiB)",
        "growth over import, memory pass (MiB)",
        "step vs DDP",
        "step vs FSDP2",
        "peak RSS vs FSDP2",
        "collectives/step (rank 0)",
    ]
    rows = []
    for name, s in summaries.items():
        step = s["median_step_s"]
        ours = name.startswith("yafsdp")
        peak = max(s[mem_key]["peak_rss_mib_per_rank"])
        vs_ddp = step / ddp["median_step_s"] if ddp else None
        vs_fsdp = step / fsdp["median_step_s"] if fsdp else None
        mem_fsdp = peak / max(fsdp[mem_key]["peak_rss_mib_per_rank"]) if fsdp else None
        mp_ = s["memory_pass"]
        rows.append(
            [
                name,
                f"{step:.3f}",
                f"{1000 * s['median_optimizer_step_s']:.1f}",
                f"{tokens_per_step / step:,.0f}",
                m.pair(s["timing_runs_memory"]["peak_rss_mib_per_rank"]),
                m.pair(mp_["peak_rss_mib_per_rank"]) if mp_ else "-",
                m.pair(mp_["growth_over_import_mib_per_rank"]) if mp_ else "-",
                m.ratio(vs_ddp, GOAL_STEP_VS_DDP if ours else None),
                m.ratio(vs_fsdp, GOAL_STEP_VS_FSDP2 if ours else None),
                m.ratio(mem_fsdp, GOAL_MEM_VS_FSDP2 if ours else None),
                m.fmt_comm(s.get("comm_per_step")),
            ]
        )
    return m.markdown_table(header, rows, "lrrrrrrllll")


def _package_dir() -> str:
    """Where the measured ``lightning_yafsdp`` comes from (set ``PYTHONPATH`` to pick a tree)."""
    import lightning_yafsdp

    return str(Path(lightning_yafsdp.__file__).resolve().parent.parent)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="debug-50m", help="LlamaConfig preset name")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per job")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per job")
    parser.add_argument("--rounds", type=int, default=2, help="rotations over the strategies")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--param-groups",
        type=int,
        default=1,
        metavar="N",
        help="1: each strategy's usual groups; N>1: parameters round-robin into N lr groups, "
        "each split by p.dim() >= 2 into weight decay 0.1 / 0 (see the module docstring)",
    )
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated subset to run"
    )
    parser.add_argument(
        "--no-memory-pass",
        action="store_true",
        help="skip the extra 1-job-per-strategy pass with RSS-tracking malloc settings",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, a few seconds/job")
    parser.add_argument("--json", dest="json_path", help="write all results to this file")
    parser.add_argument(
        "--profile",
        metavar="STRATEGY",
        help="instead of the comparison: profile one job of STRATEGY on rank 0 (torch.profiler)",
    )
    parser.add_argument("--trace", help="with --profile: write rank 0's chrome trace here")
    args = parser.parse_args(argv)
    if args.param_groups < 1:
        parser.error(f"--param-groups must be >= 1, got {args.param_groups}")
    if args.quick:
        args.model, args.batch, args.seq, args.steps, args.warmup = "tiny", 4, 64, 10, 3
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in strategies:
        if s not in STRATEGIES:
            parser.error(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")

    header = (
        f"model={args.model} batch={args.batch}/rank seq={args.seq} world_size={WORLD_SIZE} "
        f"backend=gloo device=cpu dtype=fp32 torch.set_num_threads({args.threads}) per rank, "
        f"steps={args.steps} warmup={args.warmup} rounds={args.rounds} "
        f"param_groups={args.param_groups}; "
        f"{m.platform_line()}; lightning_yafsdp from {_package_dir()}"
    )
    print(header, flush=True)

    if args.profile:
        results = _run_job(args.profile, args, profile=True)
        print(f"{args.profile}: median step {m.median_step(results):.3f} s (profiled)")
        print(results[0]["profile_table"])
        return 0

    jobs: dict[str, list[list[dict]]] = {s: [] for s in strategies}
    for rnd, order in m.rotations(strategies, args.rounds):
        for strategy in order:
            t0 = time.perf_counter()
            results = _run_job(strategy, args)
            jobs[strategy].append(results)
            med = m.median_step(results)
            opt = m.median_step(results, "optimizer_step_times_s")
            opt_cpu = m.median_step(results, "optimizer_step_cpu_times_s")
            print(
                f"  round {rnd + 1}/{args.rounds} {strategy:10s} median step {med:.3f} s, "
                f"optimizer step {1000 * opt:.1f} ms (CPU time {1000 * opt_cpu:.1f} ms), "
                f"{results[0]['n_param_groups']} groups "
                f"(job {time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    mem_jobs: dict[str, list[list[dict]]] = {s: [] for s in strategies}
    if not args.no_memory_pass:
        for strategy in strategies:
            mem_jobs[strategy].append(
                _run_job(strategy, args, steps=2, warmup=1, env=LIVE_MALLOC_ENV)
            )
            print(f"  memory pass {strategy}", file=sys.stderr, flush=True)

    summaries = {s: _summarize(s, jobs[s], mem_jobs[s], args.steps) for s in strategies}
    tokens_per_step = args.batch * args.seq * WORLD_SIZE
    table = render_table(summaries, tokens_per_step)
    print()
    print(table)
    print(
        "\nstep = slower rank, median over all measured steps of all rounds (optimizer step: "
        "optimizer.step() alone, same rule; its CPU time, less sensitive to other load on "
        "the machine, is in the JSON and on stderr); tokens/s = "
        f"{tokens_per_step} tokens per step (both ranks) / median step. Peak RSS = "
        "ru_maxrss/VmHWM of each rank process (rank 0 / rank 1, max over jobs). Timing runs "
        "use the default glibc malloc, whose heap keeps freed memory, so their RSS grows "
        "with the step count; the memory pass (1 job per strategy, 1+2 steps) runs with "
        f"{m.live_malloc_note()} so RSS follows live "
        "tensor bytes; the memory goal is judged on it (when run). Growth over import = "
        "peak minus the RSS after imports + init_process_group. Collectives: per step, "
        "rank 0, bytes = gathered/unreduced size (CommStats)."
    )
    losses = {s: v["first_loss_per_rank"] for s, v in summaries.items()}
    print(f"first-step loss per rank (should agree across strategies): {losses}")
    if args.json_path:
        payload = {
            "config": {
                k: v for k, v in vars(args).items() if k not in ("json_path", "profile", "trace")
            },
            "header": header,
            **m.platform_info(),
            "tokens_per_step": tokens_per_step,
            "goals": {
                "step_vs_ddp": GOAL_STEP_VS_DDP,
                "step_vs_fsdp2": GOAL_STEP_VS_FSDP2,
                "peak_rss_vs_fsdp2": GOAL_MEM_VS_FSDP2,
            },
            "summaries": summaries,
            "table_markdown": table,
        }
        m.write_json(args.json_path, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
