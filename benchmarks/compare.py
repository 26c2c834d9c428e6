"""Lightning-level benchmark: the same LightningModule under yafsdp and its peers.

One LightningModule (the reference Llama of ``lightning_yafsdp.models.llama``, built
with the same seed on every rank and under every strategy; next-token cross-entropy;
AdamW, lr 1e-4, weight decay 0.1) trained by ``Trainer.fit`` under:

* ``yafsdp``: ``Trainer(strategy="yafsdp")`` (ZeRO-3; ``import lightning_yafsdp``
  registers it);
* ``ddp``: ``Trainer(strategy="ddp")``;
* ``fsdp2``: ``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)``
  with ``fully_shard`` on every block, then on the model, in ``configure_model``;
* ``fsdp``: ``Trainer(strategy="fsdp")`` (FSDP1, blocks auto-wrapped): CUDA only,
  Lightning refuses it on CPU;
* ``deepspeed``: ``Trainer(strategy="deepspeed_stage_3")``: only if ``deepspeed`` is
  importable and CUDA is available;
* ``floor``: the compute floor, not a peer: ONE process (no process group, no
  distribution), ``Trainer(accelerator=<cpu|cuda>, devices=1, strategy="auto")``, the
  same per-rank batch and sequence (the rows rank 0 gets under the 2-rank strategies
  from Lightning's DistributedSampler, so its first loss is rank 0's), ``--threads``
  torch threads.

Unavailable peers are listed as "skipped: reason". Every (strategy, round) pair is a
fresh job of 2 ranks (the floor: 1 process; ``torch.multiprocessing`` spawn, ``file://``
rendezvous; the ranks look like externally launched processes to Lightning), so peak
memory never mixes between strategies; strategies, the floor among them, run in a
rotating order over ``--rounds`` rounds. A callback times each training batch with
``perf_counter`` from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, loss,
backward, optimizer step, zero_grad and Lightning's loop around them; not data loading);
a step's time is the slower rank's; ``--warmup`` batches are not measured. The report
gives median step time, tokens/s, peak memory per rank (RSS on CPU, with a separate
memory pass under RSS-tracking malloc settings; allocated/reserved and allocator
retries on CUDA), yafsdp's collectives per step (``engine.comm_stats``), and the ratios
against each peer next to the goals. When the floor ran, a second table gives each
strategy's overhead above the floor (its median step minus the floor's: communication,
sharding and distribution bookkeeping) and the overhead ratios against each peer
(``overhead vs DDP``, ``overhead vs FSDP2``: overhead(strategy) / overhead(peer)), with
the goals on yafsdp's row.

Examples::

    python benchmarks/compare.py --quick                       # tiny model, ~2 min
    python benchmarks/compare.py --model debug-50m --batch 4 --seq 128 --steps 4 \\
        --warmup 2 --rounds 2 --json results.json
    python benchmarks/compare.py --model llama-125m --set n_layers=6   # overrides
    python benchmarks/compare.py --profile yafsdp --model debug-50m    # torch.profiler
    python benchmarks/compare.py --quick --estimate                    # vs yafsdp estimate
    python benchmarks/compare.py --compile --strategies yafsdp,ddp,fsdp2  # compiled rows

``--compile [BACKEND]`` (default ``inductor``; ``aot_eager`` needs no C++ compiler)
compiles every job per block, the way docs/user-guide.md recommends: ``block.compile()``
on each decoder block when the module is built, before any strategy wraps or shards it
(FSDP2's ``fully_shard`` then runs on the compiled blocks). Compilation happens in the
warm-up steps, which are not measured; the goals become issue 23's compiled-step goals.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

try:  # run as a script (python benchmarks/compare.py): benchmarks/ is on sys.path
    import _breakdown as bd
    import _measure as m
except ImportError:  # imported as benchmarks.compare from the repository root
    from benchmarks import _breakdown as bd
    from benchmarks import _measure as m

WORLD_SIZE = 2
FLOOR = "floor"  # one process, no distribution: the compute floor of a step
# yafsdp-whole: yafsdp with vocabulary-sized units kept whole (vocab_chunks=False), to
# measure row chunks ([Note: row chunks]) side by side; only when asked for.
WHOLE = "yafsdp-whole"
# yafsdp-ungrouped: one block per unit (blocks_per_unit=1), to measure grouped blocks
# ([Note: grouped blocks]) side by side in one run; only when asked for.
UNGROUPED = "yafsdp-ungrouped"
VARIANTS = (WHOLE, UNGROUPED)
STRATEGIES = ("yafsdp", "ddp", "fsdp2", "fsdp", "deepspeed", FLOOR, *VARIANTS)
PEERS = ("ddp", "fsdp2", "fsdp", "deepspeed")
LABELS = {"ddp": "DDP", "fsdp2": "FSDP2", "fsdp": "FSDP1", "deepspeed": "DeepSpeed"}
OURS = "yafsdp"
# Goals of issue 7 (CPU, 2 ranks, Lightning, model >= 50M parameters): upper bounds on
# yafsdp / peer. Keys: (metric, peer).
GOALS = {
    ("step", "ddp"): 1.10,
    ("step", "fsdp2"): 0.70,
    ("mem", "fsdp2"): 1.00,
    ("mem", "ddp"): 0.75,
    # Upper bounds on overhead(yafsdp) / overhead(peer), overhead = step - floor's step.
    ("overhead", "fsdp2"): 0.60,
    ("overhead", "ddp"): 1.20,
}
# Goals of issue 23 for compiled runs (--compile): compiled yafsdp step / compiled peer step.
COMPILE_GOALS = {("step", "ddp"): 1.10, ("step", "fsdp2"): 0.90}

# Model presets: LlamaConfig presets plus a few mid-size shapes (~125M and ~350M
# parameters, Llama-2 vocabulary). ``--set field=value`` overrides any LlamaConfig field.
MODEL_PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny": ("tiny", {}),
    "debug-50m": ("debug-50m", {}),
    "llama-125m": (
        "debug-50m",
        dict(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden_dim=2048),
    ),
    "llama-350m": (
        "debug-50m",
        dict(
            vocab_size=32000, dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, ffn_hidden_dim=2816
        ),
    ),
}


def model_config(name: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The LlamaConfig fields of preset ``name`` with ``overrides`` (a plain dict)."""
    import dataclasses

    from lightning_yafsdp.models.llama import LLAMA_CONFIGS, LlamaConfig

    base, extra = MODEL_PRESETS.get(name, (name, {}))
    if base not in LLAMA_CONFIGS:
        choices = sorted({*MODEL_PRESETS, *LLAMA_CONFIGS})
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(choices)}")
    return dataclasses.asdict(LlamaConfig.from_name(base, **{**extra, **overrides}))


def _parse_overrides(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects field=value, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def skip_reason(strategy: str, accelerator: str) -> str | None:
    """Why ``strategy`` cannot run here, or None."""
    if strategy == "fsdp" and accelerator != "cuda":
        return "Lightning's strategy='fsdp' (FSDP1) refuses CPU; runs when CUDA is available"
    if strategy == "deepspeed":
        import importlib.util

        if importlib.util.find_spec("deepspeed") is None:
            return "deepspeed is not installed (pip install deepspeed)"
        if accelerator != "cuda":
            return "Lightning's DeepSpeedStrategy needs CUDA"
    return None


# --------------------------------------------------------------------------- one rank


def _make_module(cfg: dict):
    """The benchmarked LightningModule (defined here so that ranks import it lazily)."""
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F

    from lightning_yafsdp.models.llama import Llama, LlamaConfig

    class BenchLlama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(cfg["seed"])  # same weights on every rank and strategy
            self.model = Llama(LlamaConfig(**cfg["model_config"]))
            if cfg["compile"]:  # per block, before any strategy wraps or shards the model
                for layer in self.model.layers:
                    layer.compile(backend=cfg["compile"])
            self.losses: list[float] = []
            self._parallelized = False

        def configure_model(self) -> None:
            # Called for every fit; idempotent. Only the FSDP2 peer shards here (the
            # ModelParallelStrategy contract); yafsdp/ddp/fsdp wrap in their setup().
            if cfg["strategy"] != "fsdp2" or self._parallelized:
                return
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = self.device_mesh["data_parallel"]
            kwargs: dict[str, Any] = {"mesh": mesh}
            if cfg["precision"] == "bf16-mixed":
                kwargs["mp_policy"] = MixedPrecisionPolicy(
                    param_dtype=torch.bfloat16, reduce_dtype=torch.float32
                )
            for layer in self.model.layers:
                fully_shard(layer, **kwargs)
            fully_shard(self.model, **kwargs)
            self._parallelized = True

        def training_step(self, batch, batch_idx):
            (tokens,) = batch
            logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
            )
            self.losses.append(float(loss.detach()))
            return loss

        def configure_optimizers(self):
            if cfg["strategy"] in (OURS, *VARIANTS):
                from lightning_yafsdp.core import get_engine

                params = get_engine(self).param_groups(weight_decay=0.1)
            else:
                params = self.parameters()
            return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)

    return BenchLlama()


def _make_strategy(cfg: dict):
    name = cfg["strategy"]
    if name == "fsdp2":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=WORLD_SIZE, tensor_parallel_size=1)
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        from lightning_yafsdp.models.llama import TransformerBlock

        return FSDPStrategy(auto_wrap_policy={TransformerBlock})
    if name == "deepspeed":
        return "deepspeed_stage_3"
    if name in (OURS, *VARIANTS):
        from lightning_yafsdp import YaFSDPStrategy

        per_unit = cfg["blocks_per_unit"] if name != UNGROUPED else "1"
        per_unit = int(per_unit) if per_unit.isdigit() else per_unit
        return YaFSDPStrategy(vocab_chunks=name != WHOLE, blocks_per_unit=per_unit)
    return name  # "ddp"


def _timer_callback(cfg: dict, rank: int):
    import lightning.pytorch as pl
    import torch

    cuda = cfg["accelerator"] == "cuda"

    def engine_of(trainer):
        if cfg["strategy"] not in (OURS, *VARIANTS):
            return None
        return trainer.strategy.engine

    class StepTimer(pl.Callback):
        """Per-batch wall time (perf_counter), memory phases, comm stats, profiler."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self.profiler = None
            self.result: dict[str, Any] = {}
            self._t0 = 0.0
            self.phases = bd.PhaseClock() if cfg["breakdown"] else None
            self.engine_timing = None

        def on_train_start(self, trainer, pl_module) -> None:
            # End of the build phase: configure_model, wrapping/sharding, optimizers.
            self.result["build_peak_kib"] = m.hwm_kib()
            self.result["train_start_rss_kib"] = m.current_rss_kib()
            m.reset_hwm()
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if batch_idx == cfg["warmup"]:
                engine = engine_of(trainer)
                if engine is not None:
                    engine.comm_stats.reset()
                if self.phases is not None and engine is not None:
                    self.engine_timing = bd.start_engine_timing()
                trainer.strategy.barrier()
                if cfg["profile"] and rank == 0:
                    activities = [torch.profiler.ProfilerActivity.CPU]
                    if cuda:
                        activities.append(torch.profiler.ProfilerActivity.CUDA)
                    self.profiler = torch.profiler.profile(activities=activities)
                    self.profiler.__enter__()
            if cuda:
                torch.cuda.synchronize()
            self._t0 = time.perf_counter()
            if self.phases is not None:
                self.phases.mark("start")

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            if self.phases is not None:
                self.phases.mark("before_backward")

        def on_after_backward(self, trainer, pl_module) -> None:
            if self.phases is not None:
                self.phases.mark("after_backward")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if cuda:
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - self._t0
            if batch_idx >= cfg["warmup"]:
                self.times.append(elapsed)
            if self.phases is not None:
                self.phases.close_step(measured=batch_idx >= cfg["warmup"])
            if batch_idx == cfg["warmup"] + cfg["steps"] - 1:
                # Last step, before the next zero_grad: gradient shards still exist.
                engine = engine_of(trainer)
                if engine is not None:
                    self.result["memory_report"] = engine.memory_report()
                    self.result["comm"] = engine.comm_stats.snapshot()
                self.result["engine_timing"] = bd.stop_engine_timing(
                    self.engine_timing, cfg["steps"]
                )

        def on_train_end(self, trainer, pl_module) -> None:
            self.result["train_peak_kib"] = m.hwm_kib()
            if cuda:
                stats = torch.cuda.memory_stats()
                self.result["cuda"] = {
                    "max_allocated_mib": torch.cuda.max_memory_allocated() / 2**20,
                    "max_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
                    "num_alloc_retries": stats.get("num_alloc_retries", 0),
                    "num_ooms": stats.get("num_ooms", 0),
                }
            if self.profiler is not None:
                self.profiler.__exit__(None, None, None)
                prof = self.profiler
                sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
                table = prof.key_averages().table(sort_by=sort, row_limit=cfg["profile_rows"])
                Path(cfg["out_dir"], "profile.txt").write_text(table)
                prof.export_chrome_trace(str(Path(cfg["out_dir"], "trace.json")))

    return StepTimer()


def _init_process(rank: int, cfg: dict) -> None:
    """Threads, device and (not for the floor) the 2-rank process group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg["threads"])
    cuda = cfg["accelerator"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    if cfg["strategy"] == FLOOR:
        return  # one process: no rank variables, no process group
    # Externally launched ranks, as torchrun would start them: Lightning's
    # LightningEnvironment reads these and starts no processes of its own.
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(cfg["port"]),
    )
    # The group is up before Lightning looks (it then skips its own init), so the
    # import baseline below is the same for every strategy.
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=cfg["init_method"],
        rank=rank,
        world_size=WORLD_SIZE,
    )


def _make_loader(cfg: dict):
    """The rows of every job: ``WORLD_SIZE * batch`` per step. Lightning splits them over
    the ranks with the shuffling ``DistributedSampler`` it injects for training (seed
    ``PL_GLOBAL_SEED`` or 0); the floor, which gets no injected sampler, is given that
    sampler's rank-0 share explicitly, so it trains on rank 0's rows."""
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    n_steps = cfg["warmup"] + cfg["steps"]
    gen = torch.Generator().manual_seed(10_000)
    vocab = cfg["model_config"]["vocab_size"]
    rows = torch.randint(
        0, vocab, (n_steps * cfg["batch"] * WORLD_SIZE, cfg["seq"] + 1), generator=gen
    )
    dataset = TensorDataset(rows)
    sampler = None
    if cfg["strategy"] == FLOOR:
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        sampler = DistributedSampler(dataset, WORLD_SIZE, rank=0, shuffle=True, seed=seed)
    return DataLoader(dataset, batch_size=cfg["batch"], shuffle=False, sampler=sampler)


def _make_trainer(cfg: dict, timer):
    import lightning.pytorch as pl

    floor = cfg["strategy"] == FLOOR
    return pl.Trainer(
        accelerator=cfg["accelerator"],
        devices=1 if floor else WORLD_SIZE,
        strategy="auto" if floor else _make_strategy(cfg),
        precision=cfg["precision"],
        max_steps=cfg["warmup"] + cfg["steps"],
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )


def _rank_main(rank: int, cfg: dict) -> None:
    """One rank of one job (the floor: its one process): build the Trainer, fit, write a
    JSON result."""
    _init_process(rank, cfg)
    import logging
    import warnings

    import torch.distributed as dist

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no per-job banners
    warnings.filterwarnings("ignore", message=".*treespec, LeafSpec.*")  # lightning vs torch
    import lightning.pytorch  # noqa: F401

    import lightning_yafsdp  # noqa: F401  (registers "yafsdp"; import cost in the baseline)
    import lightning_yafsdp.models.llama  # noqa: F401

    # Peak RSS in three phases, as engine_cpu.py: import (+ process group), build
    # (module, Trainer setup: configure_model, wrapping, optimizer), training.
    memory = {"import_peak_kib": m.hwm_kib(), "import_rss_kib": m.current_rss_kib()}
    memory["peak_resets"] = m.reset_hwm()

    module = _make_module(cfg)
    loader = _make_loader(cfg)
    timer = _timer_callback(cfg, rank)
    trainer = _make_trainer(cfg, timer)
    trainer.fit(module, loader)

    result = _rank_result(rank, memory, module, trainer, timer)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    Path(cfg["out_dir"], f"rank{rank}.json").write_text(json.dumps(result))


def _rank_result(rank: int, memory: dict, module, trainer, timer) -> dict:
    res = timer.result
    import_peak, import_rss = memory["import_peak_kib"], memory["import_rss_kib"]
    train_peak = res["train_peak_kib"]
    build_peak = res["build_peak_kib"]
    if not memory["peak_resets"]:  # no reset possible: one process-wide peak for everything
        import_peak = build_peak = train_peak
    return {
        "rank": rank,
        "step_times_s": timer.times,
        "losses": module.losses,
        "import_rss_kib": import_rss,
        "import_peak_kib": import_peak,
        "build_peak_kib": build_peak,
        "train_start_rss_kib": res["train_start_rss_kib"],
        "train_peak_kib": train_peak,
        "peak_rss_kib": max(import_peak, build_peak, train_peak),
        "peak_resets": memory["peak_resets"],
        "end_rss_kib": m.current_rss_kib(),
        "n_params_local": sum(p.numel() for p in module.parameters()),
        "comm": res.get("comm"),
        "memory_report": res.get("memory_report"),
        "phases": timer.phases.steps if timer.phases is not None else None,
        "engine_timing": res.get("engine_timing"),
        "cuda": res.get("cuda"),
        "strategy_class": type(trainer.strategy).__name__,
        "precision_class": type(trainer.strategy.precision_plugin).__name__,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(
    strategy: str,
    args: argparse.Namespace,
    *,
    profile: bool = False,
    steps: int | None = None,
    warmup: int | None = None,
    env: dict[str, str] | None = None,
) -> list[dict]:
    import torch.multiprocessing as mp

    with m.environment(env), tempfile.TemporaryDirectory(prefix="compare_") as tmp:
        cfg = {
            "strategy": strategy,
            "model_config": args.model_config,
            "batch": args.batch,
            "seq": args.seq,
            "steps": steps or args.steps,
            "warmup": args.warmup if warmup is None else warmup,
            "seed": args.seed,
            "threads": args.threads,
            "accelerator": args.accelerator,
            "precision": args.precision,
            "init_method": f"file://{tmp}/store",
            "port": _free_port(),
            "out_dir": tmp,
            "profile": profile,
            "profile_rows": args.profile_rows,
            "compile": args.compile,
            "breakdown": getattr(args, "breakdown", False),
            "blocks_per_unit": getattr(args, "blocks_per_unit", "auto"),
        }
        nprocs = 1 if strategy == FLOOR else WORLD_SIZE
        mp.spawn(_rank_main, args=(cfg,), nprocs=nprocs, join=True)
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(nprocs)]
        if profile:
            results[0]["profile_table"] = Path(tmp, "profile.txt").read_text()
            if args.trace:
                Path(args.trace).write_bytes(Path(tmp, "trace.json").read_bytes())
        return results


# --------------------------------------------------------------------------- report


def _summarize(name: str, jobs: list[list[dict]], mem_jobs: list[list[dict]], steps: int):
    step_times: list[float] = []
    for job in jobs:
        step_times += m.slower_rank_times(job)
    first = jobs[0]
    n = len(first)  # processes per job: WORLD_SIZE, the floor 1
    summary: dict[str, Any] = {
        "strategy": name,
        "lightning_strategy": first[0]["strategy_class"],
        "precision_plugin": first[0]["precision_class"],
        "median_step_s": statistics.median(step_times),
        "min_step_s": min(step_times),
        "max_step_s": max(step_times),
        "step_times_s": step_times,
        "round_medians_s": [m.median_step(job) for job in jobs],
        "timing_runs_memory": m.memory_summary(jobs, n),
        "memory_pass": m.memory_summary(mem_jobs, n) if mem_jobs else None,
        "first_loss_per_rank": [first[r]["losses"][0] for r in range(n)],
        "last_loss_per_rank": [first[r]["losses"][-1] for r in range(n)],
        "local_params_per_rank": [first[r]["n_params_local"] for r in range(n)],
    }
    if first[0]["cuda"] is not None:
        summary["cuda_memory_per_rank"] = [
            {k: max(job[r]["cuda"][k] for job in jobs) for k in first[r]["cuda"]} for r in range(n)
        ]
    summary["phases"] = bd.phase_medians(jobs)
    summary["engine_timing"] = bd.engine_means(jobs)
    if first[0]["comm"] is not None:
        summary["comm_per_step"] = m.comm_per_step(first[0]["comm"], steps)
        summary["memory_report"] = first[0]["memory_report"]
    return summary


def peak_memory_mib(summary: dict) -> float:
    """The memory number ratios and goals use: max over ranks of live bytes at peak.

    CUDA: ``max_memory_allocated``. CPU: peak RSS of the memory pass when it ran, else
    of the timing runs.
    """
    if "cuda_memory_per_rank" in summary:
        return max(r["max_allocated_mib"] for r in summary["cuda_memory_per_rank"])
    mem = summary["memory_pass"] or summary["timing_runs_memory"]
    return max(mem["peak_rss_mib_per_rank"])


def overheads(summaries: dict[str, dict]) -> dict[str, float]:
    """Each strategy's median step minus the floor's (s); ``{}`` when the floor did not run."""
    floor = summaries.get(FLOOR)
    if floor is None:
        return {}
    base = floor["median_step_s"]
    return {name: s["median_step_s"] - base for name, s in summaries.items() if name != FLOOR}


def compute_ratios(summaries: dict[str, dict]) -> dict[str, dict[str, float]]:
    """``{strategy: {"step_vs_<peer>": x, "mem_vs_<peer>": y, "overhead_vs_<peer>": z}}``
    for every peer present; ``overhead_vs_<peer>`` only with the floor and when the peer's
    overhead is positive (a ratio over a non-positive overhead means nothing)."""
    live = all(s["memory_pass"] for s in summaries.values())
    over = overheads(summaries)
    out: dict[str, dict[str, float]] = {}
    for name, s in summaries.items():
        row: dict[str, float] = {}
        for peer in PEERS:
            p = summaries.get(peer)
            if p is None:
                continue
            row[f"step_vs_{peer}"] = s["median_step_s"] / p["median_step_s"]
            if live or "cuda_memory_per_rank" in s:
                row[f"mem_vs_{peer}"] = peak_memory_mib(s) / peak_memory_mib(p)
            else:  # mixed: compare like with like (timing runs)
                row[f"mem_vs_{peer}"] = max(s["timing_runs_memory"]["peak_rss_mib_per_rank"]) / max(
                    p["timing_runs_memory"]["peak_rss_mib_per_rank"]
                )
            if name in over and over.get(peer, 0.0) > 0:
                row[f"overhead_vs_{peer}"] = over[name] / over[peer]
        out[name] = row
    return out


def goal_results(ratios: dict[str, dict[str, float]], goals: dict = GOALS) -> list[dict]:
    ours = ratios.get(OURS, {})
    out = []
    for (metric, peer), goal in goals.items():
        value = ours.get(f"{metric}_vs_{peer}")
        what = {
            "step": "step time",
            "mem": "peak memory/rank",
            "overhead": "step overhead above the floor",
        }[metric]
        out.append(
            {
                "name": f"yafsdp {what} vs {LABELS[peer]}",
                "key": f"{metric}_vs_{peer}",
                "value": value,
                "goal": goal,
                "met": m.goal_met(value, goal),
            }
        )
    return out


def render_table(
    summaries: dict[str, dict], ratios: dict, tokens_per_step: int, goals: dict = GOALS
) -> str:
    """Markdown: speed, memory, ratios vs every peer present (goals on yafsdp's row), comm."""
    peers = [p for p in PEERS if p in summaries]
    cuda = any("cuda_memory_per_rank" in s for s in summaries.values())
    header = ["strategy", "median step (s)", "tokens/s"]
    if cuda:
        header += [
            "peak allocated/rank (MiB)",
            "peak reserved/rank (MiB)",
            "alloc retries/rank",
        ]
    else:
        header += [
            "peak RSS/rank, timing runs (MiB)",
            "peak RSS/rank, memory pass (MiB)",
            "growth over import, memory pass (MiB)",
        ]
    header += [f"step vs {LABELS[p]}" for p in peers]
    header += [f"peak mem vs {LABELS[p]}" for p in peers]
    header += ["collectives/step (rank 0)"]
    rows = []
    for name, s in summaries.items():
        step = s["median_step_s"]
        row = [name, f"{step:.3f}", f"{tokens_per_step / step:,.0f}"]
        if cuda:
            per_rank = s.get("cuda_memory_per_rank") or []
            row += [
                m.pair(r["max_allocated_mib"] for r in per_rank),
                m.pair(r["max_reserved_mib"] for r in per_rank),
                " / ".join(str(r["num_alloc_retries"]) for r in per_rank),
            ]
        else:
            mp_ = s["memory_pass"]
            row += [
                m.pair(s["timing_runs_memory"]["peak_rss_mib_per_rank"]),
                m.pair(mp_["peak_rss_mib_per_rank"]) if mp_ else "-",
                m.pair(mp_["growth_over_import_mib_per_rank"]) if mp_ else "-",
            ]
        for metric in ("step", "mem"):
            for p in peers:
                goal = goals.get((metric, p)) if name == OURS else None
                row.append(m.ratio(ratios[name].get(f"{metric}_vs_{p}"), goal))
        row.append(m.fmt_comm(s.get("comm_per_step")))
        rows.append(row)
    align = "lrr" + "r" * 3 + "l" * (2 * len(peers) + 1)
    return m.markdown_table(header, rows, align)


def render_overhead_table(
    summaries: dict[str, dict], ratios: dict, goals: dict = GOALS
) -> str | None:
    """Markdown: per strategy, overhead = median step - floor's median step, its share of
    the floor, and overhead vs every peer present (goals on yafsdp's row). None without
    the floor."""
    over = overheads(summaries)
    if not over:
        return None
    floor_step = summaries[FLOOR]["median_step_s"]
    peers = [p for p in PEERS if p in summaries]
    header = ["strategy", "median step (s)", "overhead above floor (s)", "overhead / floor"]
    header += [f"overhead vs {LABELS[p]}" for p in peers]
    rows = [[FLOOR, f"{floor_step:.3f}", "0 (the floor)", "-"] + ["-"] * len(peers)]
    for name, extra in over.items():
        row = [name, f"{summaries[name]['median_step_s']:.3f}", f"{extra:+.3f}"]
        row.append(f"{100 * extra / floor_step:+.0f}%")
        for p in peers:
            goal = goals.get(("overhead", p)) if name == OURS else None
            row.append(m.ratio(ratios[name].get(f"overhead_vs_{p}"), goal))
        rows.append(row)
    return m.markdown_table(header, rows, "lrrr" + "l" * len(peers))


# --------------------------------------------------------------------------- estimate


def estimate_comparison(args: argparse.Namespace, summary: dict | None) -> dict:
    """``yafsdp estimate`` for this configuration against the measured yafsdp run.

    Per term of ``engine.memory_report()`` and per collective kind: estimated bytes,
    measured bytes, relative error. Returns ``{"unavailable": reason}`` when the
    estimator (lightning_yafsdp/estimate.py) is missing or its API does not fit.
    """
    if summary is None or "memory_report" not in summary:
        return {"unavailable": "no measured yafsdp run (add yafsdp to --strategies)"}
    try:
        import torch

        from lightning_yafsdp.config import DataConfig, RunConfig, StrategyConfig, TrainerConfig
        from lightning_yafsdp.estimate import estimate
        from lightning_yafsdp.models.llama import Llama, LlamaConfig

        with torch.device("meta"):
            model = Llama(LlamaConfig(**args.model_config))
        config = RunConfig(
            data=DataConfig(seq_len=args.seq, batch_size=args.batch),
            trainer=TrainerConfig(
                accelerator=args.accelerator, devices=str(WORLD_SIZE), precision=args.precision
            ),
            strategy=StrategyConfig(zero_stage=3),
        )
        est = estimate(config, world_size=WORLD_SIZE, model=model)
        est_memory = est.engine_report()
        est_comm = est.comm_per_step
    except Exception as err:  # the estimator is young; report rather than fail
        return {"unavailable": f"{type(err).__name__}: {err}"}

    def row(term: str, estimated: float, measured: float | None) -> dict:
        err = None
        if measured:
            err = (estimated - measured) / measured
        elif measured == 0 and estimated == 0:
            err = 0.0
        return {"term": term, "estimated": estimated, "measured": measured, "rel_error": err}

    measured_mem = summary["memory_report"]
    rows = [row(t, est_memory[t], measured_mem.get(t)) for t in est_memory]
    measured_comm = summary.get("comm_per_step") or {}
    for kind in sorted({*est_comm, *measured_comm}):
        meas = measured_comm.get(kind, {}).get("bytes")
        rows.append(row(f"comm {kind} bytes/step", est_comm.get(kind, 0), meas))
    out: dict[str, Any] = {
        "rows": rows,
        "estimated_optimizer_states": est.optimizer_states,
        "estimated_activations": est.activations(0),
        "estimated_total": est.total,
        "notes": list(est.notes),
    }
    mem = summary.get("memory_pass")
    if mem:  # the whole-process number: RSS growth over import includes more than tensors
        out["measured_growth_over_import_mib"] = max(mem["growth_over_import_mib_per_rank"])
    return out


def render_estimate(cmp: dict) -> str:
    if "unavailable" in cmp:
        return f"estimate: unavailable ({cmp['unavailable']})"
    rows = []
    for r in cmp["rows"]:
        meas = "-" if r["measured"] is None else f"{r['measured'] / 2**20:.2f}"
        err = "-" if r["rel_error"] is None else f"{100 * r['rel_error']:+.1f}%"
        rows.append([r["term"], f"{r['estimated'] / 2**20:.2f}", meas, err])
    table = m.markdown_table(
        ["term (yafsdp, rank 0)", "estimated (MiB)", "measured (MiB)", "error"], rows, "lrrr"
    )
    extra = (
        f"\nestimate also: optimizer states {cmp['estimated_optimizer_states'] / 2**20:.1f} MiB, "
        f"activations {cmp['estimated_activations'] / 2**20:.1f} MiB, total "
        f"{cmp['estimated_total'] / 2**20:.1f} MiB"
    )
    if "measured_growth_over_import_mib" in cmp:
        extra += (
            f"; measured RSS growth over import (memory pass, whole process) "
            f"{cmp['measured_growth_over_import_mib']:.1f} MiB"
        )
    return table + extra


# --------------------------------------------------------------------------- plot


def write_plot(path: str, summaries: dict[str, dict]) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"--plot skipped: matplotlib is not installed (pip install matplotlib); {path}"
    names = list(summaries)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax1.bar(names, [summaries[n]["median_step_s"] for n in names], color="tab:blue")
    ax1.set_ylabel("median step (s)")
    ax2.bar(names, [peak_memory_mib(summaries[n]) for n in names], color="tab:orange")
    ax2.set_ylabel("peak memory / rank (MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"wrote {path}"


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="debug-50m",
        help=f"model preset: {', '.join(MODEL_PRESETS)} or any LlamaConfig preset",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a LlamaConfig field (repeatable), e.g. --set n_layers=8",
    )
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument(
        "--steps", type=int, default=None, help="measured steps per job (4; --quick: 8)"
    )
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per job")
    parser.add_argument("--rounds", type=int, default=2, help="rotations over the strategies")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", default="32-true", help="Trainer precision flag")
    parser.add_argument(
        "--accelerator",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda when 2 GPUs are visible, else cpu",
    )
    parser.add_argument(
        "--strategies",
        default=",".join(s for s in STRATEGIES if s not in VARIANTS),
        help=f"comma-separated subset to run (also {WHOLE}: yafsdp, vocab_chunks=False; "
        f"{UNGROUPED}: yafsdp, blocks_per_unit=1)",
    )
    parser.add_argument(
        "--no-memory-pass",
        action="store_true",
        help="CPU: skip the 1-job-per-strategy pass with RSS-tracking malloc settings",
    )
    parser.add_argument(
        "--blocks-per-unit",
        default="auto",
        help="yafsdp's blocks_per_unit: 'auto' (default) or a number (1: one block per unit)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="where each step's milliseconds go: forward/backward/optimizer per strategy "
        "against the floor, and yafsdp's hooks (Python, issuing, exposed waits by kind)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model, seconds per job")
    parser.add_argument("--json", dest="json_path", help="write all results to this file")
    parser.add_argument("--plot", help="write a PNG chart here (needs matplotlib)")
    parser.add_argument(
        "--estimate",
        action="store_true",
        help="compare `yafsdp estimate` with the measured yafsdp run (per term)",
    )
    parser.add_argument(
        "--profile",
        metavar="STRATEGY",
        help="instead of the comparison: profile one job of STRATEGY on rank 0 (torch.profiler)",
    )
    parser.add_argument(
        "--compile",
        nargs="?",
        const="inductor",
        default=None,
        metavar="BACKEND",
        help="compile every job per block with torch.compile (default backend: inductor)",
    )
    parser.add_argument("--profile-rows", type=int, default=30, help="rows of the profile table")
    parser.add_argument("--trace", help="with --profile: write rank 0's chrome trace here")
    parser.add_argument(
        "--from-json",
        metavar="PATH",
        help="re-render the report of a saved --json run (with --estimate, --plot, --json)",
    )
    args = parser.parse_args(argv)
    if args.from_json:
        return _from_json(args)
    if args.quick:
        args.model, args.batch, args.seq = "tiny", 4, 64
    if args.steps is None:
        args.steps = 8 if args.quick else 4
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps >= 1, --warmup >= 0, --rounds >= 1")

    import torch

    if args.accelerator == "auto":
        args.accelerator = "cuda" if torch.cuda.device_count() >= WORLD_SIZE else "cpu"
    if args.accelerator == "cuda" and torch.cuda.device_count() < WORLD_SIZE:
        parser.error(f"--accelerator cuda needs {WORLD_SIZE} visible GPUs")
    try:
        args.model_config = model_config(args.model, _parse_overrides(args.overrides))
    except (ValueError, TypeError) as err:
        parser.error(str(err))

    requested = [s.strip() for s in args.strategies.split(",") if s.strip()]
    for s in requested:
        if s not in STRATEGIES:
            parser.error(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    skipped = {s: r for s in requested if (r := skip_reason(s, args.accelerator))}
    strategies = [s for s in requested if s not in skipped]

    from lightning_yafsdp.models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        n_params = sum(p.numel() for p in Llama(LlamaConfig(**args.model_config)).parameters())
    mc = args.model_config
    header = (
        f"model={args.model} ({n_params / 1e6:.1f}M params, {mc['n_layers']} layers, "
        f"dim {mc['dim']}, vocab {mc['vocab_size']}) batch={args.batch}/rank seq={args.seq} "
        f"world_size={WORLD_SIZE} accelerator={args.accelerator} "
        f"backend={'nccl' if args.accelerator == 'cuda' else 'gloo'} "
        f"precision={args.precision} torch.set_num_threads({args.threads}) per rank, "
        f"compile={'per block, ' + args.compile if args.compile else 'no'}, "
        f"steps={args.steps} warmup={args.warmup} rounds={args.rounds}; "
        f"{m.platform_line()}, lightning {_lightning_version()}"
    )
    print(header, flush=True)
    for s, reason in skipped.items():
        print(f"skipped: {s} ({reason})", flush=True)

    if args.profile:
        if args.profile not in strategies:
            parser.error(f"cannot profile {args.profile!r} here")
        results = _run_job(args.profile, args, profile=True)
        print(f"{args.profile}: median step {m.median_step(results):.3f} s (profiled)")
        print(results[0]["profile_table"])
        return 0
    if not strategies:
        parser.error("no strategy left to run")

    jobs: dict[str, list[list[dict]]] = {s: [] for s in strategies}
    for rnd, order in m.rotations(strategies, args.rounds):
        for strategy in order:
            t0 = time.perf_counter()
            results = _run_job(strategy, args)
            jobs[strategy].append(results)
            print(
                f"  round {rnd + 1}/{args.rounds} {strategy:10s} median step "
                f"{m.median_step(results):.3f} s (job {time.perf_counter() - t0:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    mem_jobs: dict[str, list[list[dict]]] = {s: [] for s in strategies}
    if args.accelerator == "cpu" and not args.no_memory_pass:
        for strategy in strategies:
            mem_jobs[strategy].append(
                _run_job(strategy, args, steps=2, warmup=1, env=m.LIVE_MALLOC_ENV)
            )
            print(f"  memory pass {strategy}", file=sys.stderr, flush=True)

    summaries = {s: _summarize(s, jobs[s], mem_jobs[s], args.steps) for s in strategies}
    _report(args, header, summaries, skipped, n_params)
    return 0


def _from_json(args: argparse.Namespace) -> int:
    """Re-render a saved run's report (table, goals, ``--estimate``) without running."""
    payload = json.loads(Path(args.from_json).read_text())
    for key in ("model", "model_config", "batch", "seq", "steps", "accelerator", "precision"):
        setattr(args, key, payload["config"][key])
    args.compile = payload["config"].get("compile")
    print(payload["header"], f"(from {args.from_json})", flush=True)
    _report(args, payload["header"], payload["summaries"], payload["skipped"], payload["n_params"])
    return 0


def _report(
    args: argparse.Namespace,
    header: str,
    summaries: dict[str, dict],
    skipped: dict[str, str],
    n_params: int,
) -> None:
    """Print the tables, notes, goals and (``--estimate``) the estimate; plot; dump JSON."""
    ratios = compute_ratios(summaries)
    goal_set = COMPILE_GOALS if args.compile else GOALS
    goals = goal_results(ratios, goal_set)
    tokens_per_step = args.batch * args.seq * WORLD_SIZE
    table = render_table(summaries, ratios, tokens_per_step, goal_set)
    print()
    print(table)
    _print_notes(args, tokens_per_step)
    overhead_table = render_overhead_table(summaries, ratios, goal_set)
    if overhead_table:
        print(
            "\nOverhead above the compute floor (floor = one process, no distribution, "
            "the same per-rank batch, the same threads; overhead = median step - floor's "
            "median step; overhead vs PEER = overhead(strategy) / overhead(PEER)):\n"
        )
        print(overhead_table)
    breakdown = bd.render(summaries, FLOOR, m.markdown_table)
    if breakdown:
        print("\nWhere the step goes (phase medians, ms; the slower rank per step):\n")
        print(breakdown)
    print(
        "per-round medians (s): "
        + "; ".join(
            f"{s} " + ", ".join(f"{t:.3f}" for t in v["round_medians_s"])
            for s, v in summaries.items()
        )
    )
    losses = {s: v["first_loss_per_rank"] for s, v in summaries.items()}
    print(
        "first-step loss per rank (should agree across strategies; the floor's one process "
        f"trains on rank 0's rows): {losses}"
    )
    _print_goals(goals, n_params, skipped, compiled=bool(args.compile))

    estimate_cmp = None
    if args.estimate:
        estimate_cmp = estimate_comparison(args, summaries.get(OURS))
        print()
        print(render_estimate(estimate_cmp))
    if args.plot:
        print(write_plot(args.plot, summaries))
    if args.json_path:
        payload = {
            "header": header,
            "n_params": n_params,
            "tokens_per_step": tokens_per_step,
            "strategies": list(summaries),
            "skipped": skipped,
            "goals": goals,
            "ratios": ratios,
            "overheads_s": overheads(summaries),
            "summaries": summaries,
            "estimate": estimate_cmp,
            "table_markdown": table,
            "overhead_markdown": overhead_table,
        }
        _write_json(args, payload)


def _print_notes(args: argparse.Namespace, tokens_per_step: int) -> None:
    print(
        "\nstep = slower rank, on_train_batch_start -> on_train_batch_end, median over all "
        f"measured steps of all rounds; tokens/s = {tokens_per_step} tokens per step (both "
        "ranks) / median step. "
        + (
            "Peak memory = torch.cuda.max_memory_allocated per rank (ratios use it); "
            "reserved = max_memory_reserved; retries = num_alloc_retries."
            if args.accelerator == "cuda"
            else "Peak RSS = VmHWM of each rank process (rank 0 / rank 1, max over jobs). "
            "Timing runs use the default glibc malloc (RSS grows with the heap's history); "
            f"the memory pass (1 job per strategy, 1+2 steps) runs with {m.live_malloc_note()} "
            "so RSS follows live tensor bytes; memory ratios use it when it ran. Growth over "
            "import = peak minus the RSS after imports + init_process_group."
        )
        + " Collectives: yafsdp's engine.comm_stats per step, rank 0, bytes = "
        "gathered/unreduced size."
    )


def _print_goals(
    goals: list[dict], n_params: int, skipped: dict[str, str], *, compiled: bool = False
) -> None:
    what = "compiled per block, " if compiled else ""
    print(f"goals ({what}CPU, 2 ranks, Lightning, model >= 50M params):")
    for g in goals:
        status = m.ratio(g["value"], g["goal"])
        if g["met"] is None:
            status = "n/a (peer not run)"
            if g["key"].startswith("overhead_"):
                status = "n/a (floor or peer not run, or the peer's overhead <= 0)"
        print(f"  {g['name']}: {status}")
    if n_params < 50e6:
        print(f"  (this model has {n_params / 1e6:.1f}M params: the goals are for >= 50M)")
    for s, reason in skipped.items():
        print(f"skipped: {s} ({reason})")


def _write_json(args: argparse.Namespace, payload: dict) -> None:
    """``payload`` with the run's config and platform first, to ``--json``."""
    config = {
        k: v
        for k, v in vars(args).items()
        if k not in ("json_path", "profile", "trace", "plot", "profile_rows", "from_json")
    }
    head = {"config": config, "header": payload.pop("header")}
    head.update(m.platform_info(), lightning=_lightning_version())
    m.write_json(args.json_path, {**head, **payload})


def _lightning_version() -> str:
    import lightning

    return lightning.__version__


if __name__ == "__main__":
    sys.exit(main())
