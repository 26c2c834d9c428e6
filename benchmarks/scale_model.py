"""Alpha-beta scale model of sharded data parallelism at 64 to 1,024 GPUs.

Predicts, per training step, the communication time of ring all_gather /
reduce_scatter, the compute time, how much communication stays exposed (not
overlapped with compute) and the step time, for three schemes:

* ``zero3``  (a): one collective per parameter tensor (ZeRO-3 / DeepSpeed style);
* ``fsdp``   (b): one flat collective per transformer block (FSDP), norms inside the
  block's flat parameter, and the "fir tree": small preparatory kernels (copy into the
  reduce buffer, fp16-safe predivide) queued before every reduce_scatter, which stall
  compute and delay the collective;
* ``yafsdp`` (c): one flat collective per block without norms, the norm group
  gathered once per step and reduced once at the end, no preparatory kernels, and one
  division of the reduced shard at the end of backward.

Collective cost (NCCL's own tuning model, ``src/graph/tuning.cc``): a ring collective
over ``p`` ranks of ``S`` bytes (the gathered / unreduced size) costs

    base + (p - nodes) * alpha_intra + (nodes - 1) * alpha_inter + (p - 1) / p * S * beta

with ``beta = 1 / busbw`` (bus bandwidth: NVLink inside one node, the node's NICs
across nodes) and the cheapest of NCCL's protocols (LL, LL128, Simple). With one
level and no base term this is the textbook ``alpha * (p - 1) + (p - 1) / p * S * beta``
(:func:`ring_time`). Every hardware number below is an ASSUMPTION with its source
in a comment; change them with the command-line flags.

Commands::

    python benchmarks/scale_model.py predict [--gpu h100] [--json out.json]
    python benchmarks/scale_model.py readme  [--gpu a100]   # vs the YaFSDP README
    python benchmarks/scale_model.py calibrate [--json out.json]   # gloo, 2 CPU ranks

Method, tables and limitations: docs/scale-model.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import torch

from lightning_yafsdp.models.llama import Llama, LlamaConfig, RMSNorm

KiB = 1024
MiB = 1024 * KiB
SCHEMES = ("zero3", "fsdp", "yafsdp")
MODELS = ("llama2-7b", "llama2-70b", "llama3-70b")
GPU_COUNTS = (64, 128, 256, 512, 1024)
SEQ_LENS = (2048, 8192)

# --------------------------------------------------------------------------- collectives


def ring_time(nbytes: float, p: int, alpha: float, beta: float) -> float:
    """Textbook ring all_gather / reduce_scatter time (seconds).

    ``p - 1`` steps, each paying the latency ``alpha`` and moving ``nbytes / p``.

    Args:
        nbytes: Size of the gathered (or not yet reduced) tensor, bytes.
        p: Number of ranks.
        alpha: Latency of one ring step, seconds.
        beta: Seconds per byte (1 / bus bandwidth).
    """
    if p <= 1:
        return 0.0
    return alpha * (p - 1) + (p - 1) / p * nbytes * beta


def per_rank_bytes(numel: int, p: int, dtype_bytes: int = 2) -> float:
    """Bytes one rank contributes to (or keeps from) a collective over ``p`` ranks."""
    return numel * dtype_bytes / p


@dataclass(frozen=True)
class Protocol:
    """One NCCL protocol: latencies in seconds, ``bw_factor`` = share of busbw it reaches."""

    name: str
    base: float
    alpha_intra: float
    alpha_inter: float
    bw_factor: float


# NCCL's ring latencies (src/graph/tuning.cc, NCCL 2.18-2.21: baseLat and hwLat, ring
# column, NVLink and NET rows; microseconds per ring step). Bandwidth factors: LL sends
# 4 data bytes per 8-byte line (0.5), LL128 120 per 128-byte line (0.9375), Simple all.
NCCL_PROTOCOLS = (
    Protocol("LL", 6.6e-6, 0.6e-6, 2.7e-6, 0.5),
    Protocol("LL128", 14.0e-6, 1.9e-6, 4.0e-6, 0.9375),
    Protocol("Simple", 8.4e-6, 3.4e-6, 14.0e-6, 1.0),
)


@dataclass(frozen=True)
class Cluster:
    """A GPU cluster: compute rate, memory bandwidth and a two-level ring network.

    All rates in bytes/s or FLOP/s; see :data:`CLUSTERS` for the sources.
    """

    name: str
    peak_flops: float
    mfu: float
    hbm_bw: float
    intra_busbw: float
    inter_busbw: float
    gpus_per_node: int = 8
    protocols: tuple[Protocol, ...] = NCCL_PROTOCOLS

    @property
    def flops(self) -> float:
        """Achieved FLOP/s (peak times model FLOPs utilisation)."""
        return self.peak_flops * self.mfu

    def collective_time(self, nbytes: float, p: int) -> float:
        """Ring all_gather / reduce_scatter of ``nbytes`` (full size) over ``p`` GPUs.

        The cheapest protocol wins, as NCCL's tuner picks it. One node: NVLink steps
        only; more: the ring crosses each node boundary once (``nodes - 1`` network
        steps) and is limited by the node's NIC bandwidth.
        """
        if p <= 1:
            return 0.0
        nodes = max(1, math.ceil(p / self.gpus_per_node))
        busbw = self.intra_busbw if nodes == 1 else self.inter_busbw
        best = math.inf
        for proto in self.protocols:
            lat = proto.base + (p - nodes) * proto.alpha_intra + (nodes - 1) * proto.alpha_inter
            best = min(best, lat + ring_time(nbytes, p, 0.0, 1.0 / (busbw * proto.bw_factor)))
        return best


# Defaults. ASSUMPTIONS, not measurements; sources:
# * peak dense BF16 tensor FLOP/s: NVIDIA A100 datasheet (312 TFLOP/s, SXM4) and H100
#   datasheet (989 TFLOP/s, SXM5, without sparsity);
# * MFU: A100 0.50 (Narayanan et al. 2021, Megatron-LM, 44-52% of peak at scale);
#   H100 0.40 (Llama 3 paper, Dubey et al. 2024, 38-43% BF16 MFU on 16K H100s);
# * HBM: A100 80GB SXM 2.039 TB/s, H100 SXM 3.35 TB/s (datasheets);
# * intra-node busbw: NVLink3 600 GB/s and NVLink4 900 GB/s bidirectional per GPU
#   (datasheets), i.e. 300 / 450 GB/s one way; NCCL-tests all_gather busbw on 8-GPU
#   NVSwitch boxes is typically ~230 GB/s (A100) and ~370 GB/s (H100);
# * inter-node busbw: DGX A100 has 8 x 200 Gb/s HDR InfiniBand (200 GB/s per node),
#   DGX H100 8 x 400 Gb/s NDR (400 GB/s per node) (DGX datasheets); with one ring per
#   rail a multi-node ring reaches about the node's NIC total; we assume ~92% of line
#   rate (185 / 360 GB/s), close to NCCL-tests busbw commonly reported on such fabrics.
#   RoCE fabrics of the same line rate use the same numbers.
CLUSTERS: dict[str, Cluster] = {
    "a100": Cluster(
        "a100",
        peak_flops=312e12,
        mfu=0.50,
        hbm_bw=2.039e12,
        intra_busbw=230e9,
        inter_busbw=185e9,
    ),
    "h100": Cluster(
        "h100",
        peak_flops=989e12,
        mfu=0.40,
        hbm_bw=3.35e12,
        intra_busbw=370e9,
        inter_busbw=360e9,
    ),
}


# --------------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class Shapes:
    """Parameter tensors of one transformer block and of the rest of the model."""

    name: str
    n_layers: int
    dim: int
    layer_matrices: tuple[tuple[str, int], ...]  # (name, numel) per block matmul weight
    layer_norms: tuple[tuple[str, int], ...]  # (name, numel) per block norm weight
    root_tensors: tuple[tuple[str, int], ...]  # embeddings, output head (not norms)
    root_norms: tuple[tuple[str, int], ...]  # final norm (and an embedding norm)
    flops_per_token: dict[int, int] = field(compare=False)  # seq_len -> model FLOPs

    @property
    def layer_numel(self) -> int:
        return sum(n for _, n in self.layer_matrices) + sum(n for _, n in self.layer_norms)

    def layer_flops_per_token(self, seq_len: int) -> float:
        """Forward+backward FLOPs per token of one block (PaLM formula, as the model)."""
        return 6 * self.layer_numel + 12 * self.dim * seq_len

    def root_flops_per_token(self, seq_len: int) -> float:
        """The rest of :meth:`Llama.flops_per_token` (mostly the output head)."""
        total = self.flops_per_token[seq_len]
        return total - self.n_layers * self.layer_flops_per_token(seq_len)


@cache
def model_shapes(name: str, seq_lens: tuple[int, ...] = SEQ_LENS) -> Shapes:
    """Read a preset's tensors from the real model built on the meta device (free)."""
    config = LlamaConfig.from_name(name)
    with torch.device("meta"):
        model = Llama(config)
    block = model.layers[0]
    norm_names = {f"{n}.weight" for n, m in block.named_modules() if isinstance(m, RMSNorm)}
    matrices, norms = [], []
    for pname, param in block.named_parameters():
        (norms if pname in norm_names else matrices).append((pname, param.numel()))
    root, root_norms = [], []
    for pname, param in model.named_parameters():  # a tied matrix is listed once
        if pname.startswith("layers."):
            continue
        (root_norms if param.dim() == 1 else root).append((pname, param.numel()))
    return Shapes(
        name=name,
        n_layers=config.n_layers,
        dim=config.dim,
        layer_matrices=tuple(matrices),
        layer_norms=tuple(norms),
        root_tensors=tuple(root),
        root_norms=tuple(root_norms),
        flops_per_token={s: model.flops_per_token(s) for s in seq_lens},
    )


# --------------------------------------------------------------------------- one step


@dataclass(frozen=True)
class Workload:
    """What one step trains: tokens per GPU = batch * seq_len."""

    seq_len: int
    batch: int = 1  # the YaFSDP README's setting: per-device batch 1
    param_bytes: int = 2  # bf16 all_gather
    grad_bytes: int = 2  # bf16 reduce_scatter (our engine's default is fp32: 4)
    ckpt_layers: int = 0  # blocks with activation checkpointing (forward recomputed)
    # Fir tree (FSDP only): before each reduce_scatter, preparatory kernels read and
    # write the gradient `fir_passes` times at HBM speed (copy into the flat reduce
    # buffer: 2, predivide: 2), plus `fir_kernels` small-kernel gaps of `kernel_gap` s.
    fir_passes: float = 4.0
    fir_kernels: int = 2
    kernel_gap: float = 10e-6

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len


@dataclass
class StepPrediction:
    """Predicted times (seconds) of one step of one scheme."""

    scheme: str
    comm: float  # busy time of the communication stream
    compute: float  # matmuls and elementwise work of the model
    fir_stall: float  # compute stalled by preparatory kernels (FSDP's fir tree)
    step: float

    @property
    def exposed_comm(self) -> float:
        """Step time not explained by compute or fir-tree stalls: waiting on the network."""
        return max(0.0, self.step - self.compute - self.fir_stall)


def _simulate(
    *,
    n_layers: int,
    fwd: float,
    bwd: list[float],
    ag: float,
    rs: float,
    fir: float,
    start_ag: float,
    end_rs: float,
    head_fwd: float,
    head_bwd: float,
    end_compute: float,
) -> tuple[float, float]:
    """Two-stream schedule of one step; returns (step time, comm busy time).

    Compute and communication are two in-order streams. Forward: block i waits for its
    all_gather; the gather of block i+1 is issued when block i starts (two weight
    buffers, condition 2 of the article). Backward (reverse order): every block is
    re-gathered (ZeRO-3), the gather of block j-1 is issued when block j starts, block
    j waits for the reduce_scatter of block j+2 (two grad buffers, condition 3); after
    block j's backward, ``fir`` seconds of preparatory kernels run on the comm stream
    in front of its reduce_scatter (delaying it) and take the same time from compute
    (they share SMs and HBM with it: the "gaps in compute" of the article).
    ``start_ag`` (root remainder, norm group) is gathered first; ``end_rs`` runs after
    the last block's reduce_scatter.
    """
    comm = start_ag
    busy = start_ag + 2 * n_layers * ag + n_layers * (rs + fir) + end_rs
    t = 0.0
    ready = comm = comm + ag  # block 0's gather
    for i in range(n_layers):
        start = max(t, ready, start_ag)
        if i + 1 < n_layers:
            ready = comm = max(comm, start) + ag
        t = start + fwd
    t += head_fwd
    ready = comm = max(comm, t) + ag  # backward re-gather of the last block
    t += head_bwd
    rs_end: dict[int, float] = {}
    for j in reversed(range(n_layers)):
        start = max(t, ready, rs_end.get(j + 2, 0.0))
        if j > 0:
            ready = comm = max(comm, start) + ag
        t = start + bwd[j]
        rs_end[j] = comm = max(comm, t) + fir + rs
        t += fir
    step = max(t, comm) + end_rs + end_compute
    return step, busy


def predict_step(shapes: Shapes, p: int, work: Workload, cluster: Cluster, scheme: str):
    """Predict one step of ``scheme`` on ``p`` GPUs. Returns a :class:`StepPrediction`."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; valid: {', '.join(SCHEMES)}")
    coll = cluster.collective_time
    pb, gb = work.param_bytes, work.grad_bytes
    fwd = shapes.layer_flops_per_token(work.seq_len) * work.tokens / 3 / cluster.flops
    bwd = [2 * fwd + (fwd if j < work.ckpt_layers else 0.0) for j in range(shapes.n_layers)]
    head = shapes.root_flops_per_token(work.seq_len) * work.tokens / cluster.flops
    head_fwd, head_bwd = head / 3, 2 * head / 3

    def fir_time(numel: int) -> float:
        hbm = work.fir_passes * numel * gb / cluster.hbm_bw
        return hbm + work.fir_kernels * work.kernel_gap

    matrices = [n for _, n in shapes.layer_matrices]
    norms = [n for _, n in shapes.layer_norms]
    root = [n for _, n in shapes.root_tensors + shapes.root_norms]
    end_compute = 0.0
    if scheme == "zero3":  # every tensor its own collective, norms included
        tensors = matrices + norms
        ag = sum(coll(n * pb, p) for n in tensors)
        rs = sum(coll(n * gb, p) for n in tensors)
        fir = sum(fir_time(n) for n in tensors)
        start_ag = sum(coll(n * pb, p) for n in root)
        end_rs = sum(coll(n * gb, p) for n in root)
    elif scheme == "fsdp":  # one flat parameter per block (norms inside), one for the root
        ag = coll(shapes.layer_numel * pb, p)
        rs = coll(shapes.layer_numel * gb, p)
        fir = fir_time(shapes.layer_numel)
        start_ag, end_rs = coll(sum(root) * pb, p), coll(sum(root) * gb, p)
    else:  # yafsdp: blocks without norms; root remainder and norm group once per step
        block = sum(matrices)
        ag, rs, fir = coll(block * pb, p), coll(block * gb, p), 0.0
        norm_group = sum(norms) * shapes.n_layers + sum(n for _, n in shapes.root_norms)
        root_rest = sum(n for _, n in shapes.root_tensors)
        start_ag = coll(root_rest * pb, p) + coll(norm_group * pb, p)
        end_rs = coll(root_rest * gb, p) + coll(norm_group * gb, p)
        # divide the reduced fp32 master-grad shard once (read + write)
        total = shapes.n_layers * shapes.layer_numel + sum(root)
        end_compute = 2 * 4 * total / p / cluster.hbm_bw
    step, busy = _simulate(
        n_layers=shapes.n_layers,
        fwd=fwd,
        bwd=bwd,
        ag=ag,
        rs=rs,
        fir=fir,
        start_ag=start_ag,
        end_rs=end_rs,
        head_fwd=head_fwd,
        head_bwd=head_bwd,
        end_compute=end_compute,
    )
    compute = shapes.n_layers * fwd + sum(bwd) + head + end_compute
    return StepPrediction(scheme, busy, compute, shapes.n_layers * fir, step)


def predict_row(name: str, p: int, work: Workload, cluster: Cluster) -> dict:
    """All schemes for one (model, GPUs, workload): a flat dict for tables and JSON."""
    shapes = model_shapes(name, tuple(sorted(set(SEQ_LENS) | {work.seq_len})))
    preds = {s: predict_step(shapes, p, work, cluster, s) for s in SCHEMES}
    largest = max(n for _, n in shapes.layer_matrices)
    wq = dict(shapes.layer_matrices)["attention.wq.weight"]
    row = {
        "model": name,
        "gpu": cluster.name,
        "gpus": p,
        "seq_len": work.seq_len,
        "batch": work.batch,
        "ckpt_layers": work.ckpt_layers,
        "msg_wq_bytes": per_rank_bytes(wq, p, work.param_bytes),
        "msg_largest_tensor_bytes": per_rank_bytes(largest, p, work.param_bytes),
        "msg_layer_bytes": per_rank_bytes(shapes.layer_numel, p, work.param_bytes),
    }
    for s, pred in preds.items():
        row[s] = dataclasses.asdict(pred) | {"exposed_comm": pred.exposed_comm}
    row["speedup_yafsdp_vs_fsdp"] = preds["fsdp"].step / preds["yafsdp"].step - 1
    row["speedup_yafsdp_vs_zero3"] = preds["zero3"].step / preds["yafsdp"].step - 1
    return row


# --------------------------------------------------------------------------- tables


def _size(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f} MiB" if nbytes >= MiB else f"{nbytes / KiB:.0f} KiB"


def _ms(rows: dict, key: str) -> str:
    return " / ".join(f"{rows[s][key] * 1e3:.0f}" for s in SCHEMES)


def markdown_table(rows: list[dict]) -> str:
    """One markdown table: a row per (GPUs, seq); times in ms, ``zero3 / fsdp / yafsdp``."""
    head = (
        "| GPUs | seq | msg/rank wq 8192² or 4096² (a) | largest tensor (a) | layer (b) "
        "| comm/step a / b / c | compute/step | exposed comm a / b / c "
        "| step a / b / c | YaFSDP vs FSDP |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        lines.append(
            f"| {r['gpus']} | {r['seq_len']} | {_size(r['msg_wq_bytes'])} "
            f"| {_size(r['msg_largest_tensor_bytes'])} | {_size(r['msg_layer_bytes'])} "
            f"| {_ms(r, 'comm')} | {r['yafsdp']['compute'] * 1e3:.0f} "
            f"| {_ms(r, 'exposed_comm')} | {_ms(r, 'step')} "
            f"| {100 * r['speedup_yafsdp_vs_fsdp']:+.1f}% |"
        )
    return head + "\n".join(lines)


# The YaFSDP README's benchmark (github.com/yandex/YaFSDP, README "Benchmarks"): per-device
# batch 1, speed-up of YaFSDP over FSDP. Rows whose model has a preset here.
README_ROWS = (
    ("llama2-7b", 64, 2048, 0, 9.92),
    ("llama2-7b", 64, 4096, 0, 3.43),
    ("llama2-7b", 64, 8192, 0, 2.68),
    ("llama2-7b", 128, 2048, 0, 9.57),
    ("llama2-7b", 128, 4096, 0, 2.42),
    ("llama2-7b", 128, 8192, 0, 2.32),
    ("llama2-70b", 256, 2048, 10, 21.48),
    ("llama2-70b", 256, 4096, 50, 7.17),
    ("llama3-8b", 64, 2048, 0, 10.15),
    ("llama3-8b", 64, 4096, 0, 7.98),
    ("llama3-70b", 256, 2048, 20, 26.60),
)


def fit_fir_passes(cluster: Cluster, base: Workload, row=README_ROWS[0]) -> float:
    """The ``fir_passes`` that makes the model match one README row (bisection)."""
    name, p, seq, ckpt, target = row
    lo, hi = 0.0, 200.0
    for _ in range(60):
        mid = (lo + hi) / 2
        work = dataclasses.replace(base, seq_len=seq, ckpt_layers=ckpt, fir_passes=mid)
        got = 100 * predict_row(name, p, work, cluster)["speedup_yafsdp_vs_fsdp"]
        lo, hi = (mid, hi) if got < target else (lo, mid)
    return (lo + hi) / 2


def readme_table(cluster: Cluster, base: Workload) -> tuple[str, float]:
    """README speed-ups next to the model's, with default and fitted fir-tree cost."""
    fitted = fit_fir_passes(cluster, base)
    lines = [
        "| model | GPUs | seq | ckpt layers | README | model (fir_passes="
        f"{base.fir_passes:g}) | model (fitted to row 1: {fitted:.1f}) "
        "| compute/layer fwd+bwd | comm/layer AG+RS (b) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p, seq, ckpt, readme in README_ROWS:
        work = dataclasses.replace(base, seq_len=seq, ckpt_layers=ckpt)
        r0 = predict_row(name, p, work, cluster)
        r1 = predict_row(name, p, dataclasses.replace(work, fir_passes=fitted), cluster)
        shapes = model_shapes(name, tuple(sorted(set(SEQ_LENS) | {seq})))
        layer = shapes.layer_flops_per_token(seq) * work.tokens / cluster.flops
        comm = 2 * cluster.collective_time(shapes.layer_numel * work.param_bytes, p)
        lines.append(
            f"| {name} | {p} | {seq} | {ckpt} | {readme:+.1f}% "
            f"| {100 * r0['speedup_yafsdp_vs_fsdp']:+.1f}% "
            f"| {100 * r1['speedup_yafsdp_vs_fsdp']:+.1f}% "
            f"| {layer * 1e3:.1f} ms | {comm * 1e3:.1f} ms |"
        )
    return "\n".join(lines), fitted


# --------------------------------------------------------------------------- calibration

CAL_SIZES = tuple(KiB * 4**k for k in range(9))  # 1 KiB .. 64 MiB (gathered size)


def _cal_worker(rank: int, world: int, init_file: str, sizes, reps: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    bufs = {
        n: (torch.ones(n // 4, dtype=torch.float32), torch.ones(n // 4 // world)) for n in sizes
    }
    ops = {
        "all_gather": lambda full, shard: dist.all_gather_single(full, shard),
        "reduce_scatter": lambda full, shard: dist.reduce_scatter_single(shard, full),
    }
    samples = {kind: {n: [] for n in sizes} for kind in ops}
    # Repetitions outermost: a burst of load from another process hits every size a
    # little instead of one size a lot. The first round is a warm-up (first touch of
    # the buffers, socket buffers) and is dropped.
    for rep in range(reps + 1):
        for n in sizes:
            for kind, op in ops.items():
                dist.barrier()
                t0 = time.perf_counter()
                op(*bufs[n])
                if rep:
                    samples[kind][n].append(time.perf_counter() - t0)
    results = {kind: {} for kind in ops}
    for kind, by_size in samples.items():
        for n, times in by_size.items():
            t = torch.tensor([statistics.median(times)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slower rank's median
            results[kind][n] = t.item()
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


def measure_gloo(sizes=CAL_SIZES, reps: int = 25, world: int = 2) -> dict[str, dict[int, float]]:
    """Median seconds of gloo all_gather / reduce_scatter per gathered size (bytes)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out.json")
        mp.spawn(_cal_worker, args=(world, init, tuple(sizes), reps, out), nprocs=world)
        raw = json.loads(Path(out).read_text())
    return {k: {int(s): v for s, v in d.items()} for k, d in raw.items()}


def fit_alpha_beta(sizes, times, p: int = 2) -> tuple[float, float]:
    """Least-squares ``alpha, beta`` of :func:`ring_time`, minimising relative error.

    ``t = alpha * (p - 1) + (p - 1) / p * S * beta`` is linear in (alpha, beta); each
    equation is divided by its measured time so that 1 KiB and 64 MiB weigh alike.
    """
    rows = [((p - 1) / t, (p - 1) / p * s / t) for s, t in zip(sizes, times)]
    a11 = sum(x * x for x, _ in rows)
    a12 = sum(x * y for x, y in rows)
    a22 = sum(y * y for _, y in rows)
    b1 = sum(x for x, _ in rows)
    b2 = sum(y for _, y in rows)
    det = a11 * a22 - a12 * a12
    return (b1 * a22 - b2 * a12) / det, (a11 * b2 - a12 * b1) / det


def calibration_report(measured: dict[str, dict[int, float]], p: int = 2) -> tuple[str, dict]:
    """Fit per collective, residuals per size, and a hold-out check (fit on every other size)."""
    lines, summary = [], {}
    for kind, by_size in measured.items():
        sizes = sorted(by_size)
        times = [by_size[s] for s in sizes]
        alpha, beta = fit_alpha_beta(sizes, times, p)
        pred = [ring_time(s, p, alpha, beta) for s in sizes]
        rel = [(q - t) / t for q, t in zip(pred, times)]
        even = sizes[::2]
        ha, hb = fit_alpha_beta(even, [by_size[s] for s in even], p)
        held = [s for s in sizes if s not in even]
        hold_rel = [abs(ring_time(s, p, ha, hb) - by_size[s]) / by_size[s] for s in held]
        small = [x for x in sizes if x <= 16 * MiB]
        sa, sb = fit_alpha_beta(small, [by_size[x] for x in small], p)
        big = [x for x in sizes if x > 16 * MiB]
        big_rel = [(ring_time(x, p, sa, sb) - by_size[x]) / by_size[x] for x in big]
        summary[kind] = {
            "alpha_s": alpha,
            "busbw_GBps": 1 / beta / 1e9,
            "max_rel_err": max(abs(r) for r in rel),
            "median_rel_err": statistics.median(abs(r) for r in rel),
            "holdout_max_rel_err": max(hold_rel),
            "upto_16MiB": {
                "alpha_s": sa,
                "busbw_GBps": 1 / sb / 1e9,
                "max_rel_err": max(
                    abs(ring_time(x, p, sa, sb) - by_size[x]) / by_size[x] for x in small
                ),
                "extrapolated_rel_err": dict(zip(big, big_rel)),
            },
            "points": [
                {"bytes": s, "measured_s": t, "predicted_s": q, "rel_err": r}
                for s, t, q, r in zip(sizes, times, pred, rel)
            ],
        }
        lines.append(
            f"\n{kind}: alpha = {alpha * 1e6:.1f} us per ring step, "
            f"busbw = 1/beta = {1 / beta / 1e9:.2f} GB/s (p={p})"
        )
        lines.append("| size | measured | predicted | residual |")
        lines.append("|---:|---:|---:|---:|")
        for s, t, q, r in zip(sizes, times, pred, rel):
            lines.append(f"| {_size(s)} | {t * 1e3:.3f} ms | {q * 1e3:.3f} ms | {100 * r:+.1f}% |")
        lines.append(
            f"max |residual| {100 * summary[kind]['max_rel_err']:.1f}%, median "
            f"{100 * summary[kind]['median_rel_err']:.1f}%; fit on {len(even)} sizes, "
            f"max error on the {len(held)} held-out sizes "
            f"{100 * summary[kind]['holdout_max_rel_err']:.1f}%"
        )
        sub = summary[kind]["upto_16MiB"]
        lines.append(
            f"fit on sizes <= 16 MiB only: alpha = {sa * 1e6:.1f} us, busbw = "
            f"{sub['busbw_GBps']:.2f} GB/s, max |residual| {100 * sub['max_rel_err']:.1f}%; "
            "extrapolated to "
            + ", ".join(f"{_size(x)}: {100 * r:+.1f}%" for x, r in zip(big, big_rel))
        )
    return "\n".join(lines), summary


# --------------------------------------------------------------------------- command line


def _cluster_from_args(args) -> Cluster:
    cluster = CLUSTERS[args.gpu]
    overrides = {
        k: v
        for k, v in {
            "mfu": args.mfu,
            "intra_busbw": args.intra_busbw and args.intra_busbw * 1e9,
            "inter_busbw": args.inter_busbw and args.inter_busbw * 1e9,
        }.items()
        if v
    }
    return dataclasses.replace(cluster, **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("predict", "readme"):
        sp = sub.add_parser(name)
        sp.add_argument("--gpu", choices=sorted(CLUSTERS), default="a100")
        sp.add_argument("--mfu", type=float, help="model FLOPs utilisation (0-1)")
        sp.add_argument("--intra-busbw", type=float, help="NVLink busbw, GB/s")
        sp.add_argument("--inter-busbw", type=float, help="per-node network busbw, GB/s")
        sp.add_argument("--batch", type=int, default=1, help="sequences per GPU per step")
        sp.add_argument("--fir-passes", type=float, default=Workload.fir_passes)
        sp.add_argument("--grad-bytes", type=int, default=2, choices=(2, 4))
        sp.add_argument("--json", type=Path, help="also write the rows as JSON")
    sub.choices["predict"].add_argument("--models", nargs="+", default=list(MODELS))
    sub.choices["predict"].add_argument("--gpus", nargs="+", type=int, default=list(GPU_COUNTS))
    sub.choices["predict"].add_argument("--seqs", nargs="+", type=int, default=list(SEQ_LENS))
    cal = sub.add_parser("calibrate")
    cal.add_argument("--reps", type=int, default=25)
    cal.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    if args.cmd == "calibrate":
        t0 = time.perf_counter()
        measured = measure_gloo(reps=args.reps)
        text, summary = calibration_report(measured)
        print(f"gloo, 2 ranks on this CPU, median of {args.reps} repetitions")
        print(text)
        print(f"\ncalibration took {time.perf_counter() - t0:.1f} s")
        if args.json:
            args.json.write_text(json.dumps(summary, indent=1))
        return 0

    cluster = _cluster_from_args(args)
    base = Workload(seq_len=SEQ_LENS[0], batch=args.batch, grad_bytes=args.grad_bytes)
    base = dataclasses.replace(base, fir_passes=args.fir_passes)
    print(
        f"{cluster.name}: {cluster.flops / 1e12:.0f} TFLOP/s achieved (MFU {cluster.mfu}), "
        f"busbw NVLink {cluster.intra_busbw / 1e9:.0f} / network "
        f"{cluster.inter_busbw / 1e9:.0f} GB/s, {cluster.gpus_per_node} GPUs/node; "
        f"batch {base.batch}/GPU; fir tree {base.fir_passes:g} passes + "
        f"{base.fir_kernels} x {base.kernel_gap * 1e6:.0f} us per FSDP reduce_scatter\n"
        "times in ms; a = zero3 (per tensor), b = fsdp (per block), c = yafsdp"
    )
    if args.cmd == "readme":
        table, fitted = readme_table(cluster, base)
        print(table)
        if args.json:
            args.json.write_text(json.dumps({"fitted_fir_passes": fitted}, indent=1))
        return 0
    rows = []
    for name in args.models:
        model_rows = [
            predict_row(name, p, dataclasses.replace(base, seq_len=s), cluster)
            for p in args.gpus
            for s in args.seqs
        ]
        rows += model_rows
        print(f"\n### {name} ({cluster.name})\n")
        print(markdown_table(model_rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
