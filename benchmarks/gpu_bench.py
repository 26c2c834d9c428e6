"""yafsdp vs FSDP2 on one GPU: step time, peak memory, allocator retries (bf16, Llama).

World size 1 (the lent device has one GPU): this measures the engine's own costs
(buffers, copies, hooks, streams) against FSDP2's at equal compute, not scaling.

    python benchmarks/gpu_bench.py --model llama-1b --batch 2 --seq 2048 --steps 10 \
        --out results/gpu_bench.md

    python benchmarks/gpu_bench.py --compile --out results/gpu_bench_compile.md

``--compile`` compiles each block (``block.compile()``, inductor) before either strategy
shards the model: the per-block compile docs/user-guide.md recommends.

``--device cpu`` (gloo, no memory statistics) runs the same code on a CPU, for
``gpu_check.sh --dry-run``: ``--model tiny --batch 1 --seq 32 --steps 1 --warmup 0``.

Each strategy's step is split as ``compare.py --breakdown`` splits it (docs/performance.md):
forward, backward and optimizer time (CUDA events, medians), beside ``floor``, the same
model unsharded on the device (no process group, no hooks), and for yafsdp the engine's
host time in its hooks (Python, issuing collectives; [Note: step breakdown]).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

try:  # run as a script (python3 benchmarks/gpu_bench.py): benchmarks/ is on sys.path
    import _breakdown as bd
except ImportError:  # imported as benchmarks.gpu_bench (gpu_check.sh's import check)
    from benchmarks import _breakdown as bd


def _synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_memory(device: str) -> dict:
    # The CPU dry run has no allocator statistics to report: zeros, not a guess.
    stats = torch.cuda.memory_stats() if device == "cuda" else {}
    return {
        "peak_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / 2**30,
        "peak_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / 2**30,
        "alloc_retries": stats.get("num_alloc_retries", 0),
    }


def _build(strategy: str, model_name: str, device: str, compile_blocks: bool):
    from lightning_yafsdp.models.llama import Llama, LlamaConfig

    with torch.device("meta"):
        model = Llama(LlamaConfig.from_name(model_name))
    if compile_blocks:  # before sharding, as the user guide recommends
        for block in model.layers:
            block.compile()
    if strategy == "floor":  # the compute floor: bf16 weights, fp32 AdamW states
        model.to_empty(device=device)
        model.init_weights()
        model.to(torch.bfloat16)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    if strategy == "yafsdp":
        from lightning_yafsdp.core import shard_model

        engine = shard_model(model, param_dtype=torch.bfloat16, param_init_fn=model.init_submodule)
        return model, torch.optim.AdamW(engine.param_groups(weight_decay=0.1), lr=1e-4, fused=True)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    model.init_weights()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=True)


def _run(strategy: str, args) -> dict:
    torch.manual_seed(0)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    model, optimizer = _build(strategy, args.model, args.device, args.compile)
    vocab = model.config.vocab_size
    times, phases, timing = [], [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup and strategy == "yafsdp":
            timing = bd.start_engine_timing()
        tokens = torch.randint(0, vocab, (args.batch, args.seq), device=args.device)
        _synchronize(args.device)
        clock = _PhaseClock(args.device)
        start, host_start = time.perf_counter(), time.thread_time()
        logits = model(tokens)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        clock.mark()
        loss.backward()
        clock.mark()
        optimizer.step()
        optimizer.zero_grad()
        clock.mark()
        host_cpu = time.thread_time() - host_start  # before the sync: its spin is not work
        _synchronize(args.device)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            phases.append({**clock.phases(), "host_cpu": host_cpu})
    result = {
        "strategy": strategy,
        "median_step_s": statistics.median(times),
        "tokens_per_s": args.batch * args.seq / statistics.median(times),
        **_peak_memory(args.device),
        "final_loss": loss.item(),
        "phases_s": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
        "engine": bd.stop_engine_timing(timing, args.steps),
    }
    del model, optimizer, logits, loss
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


class _PhaseClock:
    """Forward / backward / optimizer time of one step: CUDA events on the GPU (no sync
    between phases, so the overlap is measured as it runs), the host clock on a CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"
        self.marks = [self._now()]

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def mark(self) -> None:
        self.marks.append(self._now())

    def phases(self) -> dict[str, float]:
        if self.cuda:
            spans = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            spans = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return dict(zip(("forward", "backward", "optimizer"), spans))


def _breakdown_lines(rows: dict) -> list[str]:
    floor = rows.get("floor")
    # host CPU: the main thread's CPU time from the step's start to its last launch. On a
    # GPU a step whose host CPU nears its wall time is bound by Python and launches, not
    # by the kernels: where our hooks' per-unit work shows against DDP's and FSDP2's.
    header = "| strategy | forward ms | backward ms | optimizer ms | host CPU ms | step over floor"
    header += " |"
    lines = ["", header, "|---|---:|---:|---:|---:|---:|"]
    for name, r in rows.items():
        p = r["phases_s"]
        over = f"{r['median_step_s'] / floor['median_step_s']:.2f}x" if floor else "-"
        lines.append(
            f"| {name} | {1e3 * p['forward']:.1f} | {1e3 * p['backward']:.1f} "
            f"| {1e3 * p['optimizer']:.1f} | {1e3 * p.get('host_cpu', float('nan')):.1f} "
            f"| {over} |"
        )
    engine = rows["yafsdp"].get("engine")
    if engine:  # seconds per step ([Note: step breakdown])
        issue = ", ".join(f"{k} {1e3 * v:.2f}" for k, v in sorted(engine["issue_s"].items()))
        lines.append(
            f"yafsdp host time in its hooks: {1e3 * engine['hook_s']:.1f} ms/step (Python "
            f"{1e3 * engine['python_s']:.1f}; issuing ms: {issue})"
        )
    return lines


def _device_name(device: str) -> str:
    return f"GPU ({torch.cuda.get_device_name(0)})" if device == "cuda" else "CPU (dry run)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-1b")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="compile each block (inductor)")
    parser.add_argument("--out", default=None, help="markdown table path (+ .json beside it)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    order = ("floor", "yafsdp", "fsdp2", "floor", "yafsdp", "fsdp2")  # interleaved
    results = [_run(s, args) for s in order]
    rows = {}
    for r in results:
        best = rows.get(r["strategy"])
        if best is None or r["median_step_s"] < best["median_step_s"]:
            rows[r["strategy"]] = r
    ours, peer = rows["yafsdp"], rows["fsdp2"]
    lines = [
        f"{args.model}, bf16, {'blocks compiled (inductor), ' if args.compile else ''}"
        f"batch {args.batch} x seq {args.seq}, 1 {_device_name(args.device)}, "
        "best of 2 interleaved runs",
        "",
        "| strategy | median step (s) | tokens/s | peak allocated (GiB) | peak reserved (GiB) "
        "| alloc retries | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in (ours, peer):
        lines.append(
            f"| {r['strategy']} | {r['median_step_s']:.3f} | {r['tokens_per_s']:,.0f} "
            f"| {r['peak_allocated_gib']:.2f} | {r['peak_reserved_gib']:.2f} "
            f"| {r['alloc_retries']} | {r['final_loss']:.4f} |"
        )
    lines.append("")
    ratio = f"yafsdp / fsdp2: step time {ours['median_step_s'] / peer['median_step_s']:.2f}x"
    if args.device == "cuda":
        ratio += f", peak allocated {ours['peak_allocated_gib'] / peer['peak_allocated_gib']:.2f}x"
    lines.append(ratio)
    lines += _breakdown_lines(rows)
    table = "\n".join(lines)
    print(table)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write(table + "\n")
        with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
            json.dump(results, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
