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

Hybrid sharding (command ``hsdp``, :func:`predict_hsdp`): scheme (c) sharded over groups
of K consecutive ranks and replicated across the N / K groups: gathers and
reduce_scatters inside the group, then a ring all_reduce of each reduced shard across the
replicas; also the bytes each GPU sends over NVLink and the network, and its memory.

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
    python benchmarks/scale_model.py hsdp [--gpu h100] [--json out.json]  # hybrid sharding

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

    def ring_busbw(self, p: int, nodes: int) -> float:
        """Bus bandwidth of a ring over ``p`` ranks spanning ``nodes`` nodes ([Note: links]).

        One node: NVLink. More: every GPU of every node runs such a ring at the same
        time (all shard or replicate groups act in lockstep), each GPU's share of the
        node's NICs is one rail, ``inter_busbw / gpus_per_node``, and ``nodes / p`` of
        the bytes it sends cross it, so the ring runs at ``inter_busbw * p / (nodes *
        gpus_per_node)``: the node's NIC total for a ring through whole nodes (what
        :meth:`collective_time` assumes), one rail for a ring with one GPU per node.
        """
        if nodes <= 1:
            return self.intra_busbw
        if p == nodes * self.gpus_per_node:
            return self.inter_busbw
        return self.inter_busbw * p / (nodes * self.gpus_per_node)

    def ring_collective_time(
        self, nbytes: float, p: int, nodes: int, *, all_reduce: bool = False
    ) -> float:
        """Ring collective of ``nbytes`` over ``p`` ranks on ``nodes`` nodes.

        all_gather / reduce_scatter as :meth:`collective_time` (which it equals for a
        ring of consecutive ranks through whole nodes); ``all_reduce`` = reduce_scatter
        + all_gather: twice the ring steps of each kind (``2 (p - nodes)`` NVLink,
        ``2 (nodes - 1)`` network; one base latency) and twice the bytes,
        ``2 (p - 1) / p * nbytes``.
        """
        if p <= 1:
            return 0.0
        twice = 2 if all_reduce else 1
        busbw = self.ring_busbw(p, nodes)
        best = math.inf
        for proto in self.protocols:
            steps = (p - nodes) * proto.alpha_intra + (nodes - 1) * proto.alpha_inter
            beta = 1.0 / (busbw * proto.bw_factor)
            best = min(best, proto.base + twice * (steps + ring_time(nbytes, p, 0.0, beta)))
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
    ar: float = 0.0,
    ar_on_comm: bool = False,
    end_ar: float = 0.0,
) -> tuple[float, float]:
    """Two-stream schedule of one step; returns (step time, comm-stream busy time).

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

    Hybrid sharding, as the engine schedules it (``core/comm/streams.py``, condition 3):
    ``ar`` is a block's replicate all_reduce of its reduced shard, started when its
    reduce_scatter ends, on a stream of its own (``ar_on_comm`` False: the shard ring
    is NVLink only and the all_reduce has the NICs to itself) or, when both need the
    NICs (``ar_on_comm``), queued on the comm stream right behind the reduce_scatter
    (the shared NIC time is serialised). The reduced shard lives in the grad buffer:
    before block j's reduce_scatter, compute waits until the all_reduce of block j+2
    (the buffer's previous user) is done and its shard added to the master grad.
    ``end_ar`` (root remainder, norm group) runs after ``end_rs``. The step ends when
    every stream is done. With ``ar = end_ar = 0`` the schedule is unchanged.
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
    ar_end: dict[int, float] = {}
    ar_done = 0.0  # the all_reduce stream
    for j in reversed(range(n_layers)):
        start = max(t, ready, rs_end.get(j + 2, 0.0))
        if j > 0:
            ready = comm = max(comm, start) + ag
        t = start + bwd[j]
        if ar:  # the grad buffer's previous user: its all_reduce must be done
            t = max(t, ar_end.get(j + 2, 0.0))
        rs_end[j] = comm = max(comm, t) + fir + rs
        t += fir
        if ar and ar_on_comm:
            ar_end[j] = ar_done = comm = comm + ar
        elif ar:
            ar_end[j] = ar_done = max(ar_done, rs_end[j]) + ar
    step = max(t, comm, ar_done) + end_rs + end_ar + end_compute
    return step, busy


def predict_step(
    shapes: Shapes,
    p: int,
    work: Workload,
    cluster: Cluster,
    scheme: str,
    shard_size: int | None = None,
):
    """Predict one step of ``scheme`` on ``p`` GPUs. Returns a :class:`StepPrediction`.

    ``shard_size`` (yafsdp only): hybrid sharding over groups of that many consecutive
    ranks (:func:`predict_hsdp`); ``None`` or ``p``: plain sharding over all ``p``.
    """
    return _predict(shapes, p, work, cluster, scheme, shard_size)[0]


def check_hsdp(p: int, shard_size: int, gpus_per_node: int) -> None:
    """One-line error unless ``shard_size`` divides ``p`` and is node-aligned."""
    if shard_size < 1 or p % shard_size:
        raise ValueError(f"shard_size={shard_size} does not divide {p} GPUs")
    if shard_size % gpus_per_node and gpus_per_node % shard_size:
        raise ValueError(
            f"shard_size={shard_size} must divide or be a multiple of {gpus_per_node} "
            "GPUs per node (shard groups of consecutive ranks, aligned with nodes)"
        )


def replicate_ring(p: int, shard_size: int, gpus_per_node: int) -> tuple[int, int]:
    """(ranks, nodes) of one replicate group: ranks ``s, s + K, s + 2K, ...``.

    With ``K >= gpus_per_node`` every member is on its own node; with a smaller ``K``
    ``gpus_per_node / K`` members share a node.
    """
    ranks = p // shard_size
    per_node = max(1, gpus_per_node // shard_size)
    return ranks, math.ceil(ranks / per_node)


def _predict(
    shapes: Shapes,
    p: int,
    work: Workload,
    cluster: Cluster,
    scheme: str,
    shard_size: int | None,
) -> tuple[StepPrediction, dict[str, float]]:
    """:func:`predict_step` and the comm busy time by kind (all_gather, ...)."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; valid: {', '.join(SCHEMES)}")
    k = p if shard_size is None else shard_size
    if k != p:
        if scheme != "yafsdp":
            raise ValueError(f"shard_size is modelled for yafsdp only, not {scheme!r}")
        check_hsdp(p, k, cluster.gpus_per_node)
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
    end_compute = ar = end_ar = 0.0
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
        # Sharded over k ranks (k = p: plain; k < p: hybrid, [Note: hybrid sharding]).
        block = sum(matrices)
        ag, rs, fir = coll(block * pb, k), coll(block * gb, k), 0.0
        norm_group = sum(norms) * shapes.n_layers + sum(n for _, n in shapes.root_norms)
        root_rest = sum(n for _, n in shapes.root_tensors)
        start_ag = coll(root_rest * pb, k) + coll(norm_group * pb, k)
        end_rs = coll(root_rest * gb, k) + coll(norm_group * gb, k)
        # divide the reduced fp32 master-grad shard once (read + write)
        total = shapes.n_layers * shapes.layer_numel + sum(root)
        end_compute = 2 * 4 * total / k / cluster.hbm_bw
        if k != p:  # all_reduce of each reduced shard (1/k of it) across the replicas
            ranks, nodes = replicate_ring(p, k, cluster.gpus_per_node)

            def all_reduce(numel: int) -> float:
                nbytes = numel * gb / k
                return cluster.ring_collective_time(nbytes, ranks, nodes, all_reduce=True)

            ar = all_reduce(block)
            end_ar = all_reduce(root_rest) + all_reduce(norm_group)
    ar_on_comm = k > cluster.gpus_per_node  # the shard ring crosses nodes: shared NICs
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
        ar=ar,
        ar_on_comm=ar_on_comm,
        end_ar=end_ar,
    )
    compute = shapes.n_layers * fwd + sum(bwd) + head + end_compute
    by_kind = {
        "all_gather": start_ag + 2 * shapes.n_layers * ag,
        "reduce_scatter": shapes.n_layers * rs + end_rs,
        "all_reduce": shapes.n_layers * ar + end_ar,
    }
    comm = busy if k == p else busy + by_kind["all_reduce"]
    return StepPrediction(scheme, comm, compute, shapes.n_layers * fir, step), by_kind


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


# --------------------------------------------------------------------------- hybrid sharding

# [Note: links]
# Which link a ring's bytes take. Nodes have `gpus_per_node` GPUs on NVLink (NVSwitch)
# and one NIC rail per GPU (DGX: 8 NICs); `inter_busbw` is the node's NIC total. NCCL
# runs one channel per rail; per channel a ring over p ranks spanning `nodes` nodes has
# p hops, `nodes` of them between nodes (none on one node), and the crossing hops
# rotate over the GPUs, so each GPU sends `nodes / p` of its ring bytes through its own
# rail NIC ("network") and the rest over NVLink. Every GPU runs such a ring at the same
# time (the shard groups, or the replicate groups, act in lockstep), so a GPU's
# network share is one rail, `inter_busbw / gpus_per_node`, and the ring's bandwidth is
# the rail divided by `nodes / p`. Shard group of K consecutive ranks: K <= 8 is NVLink
# only; K = 16, 32 crosses K / 8 nodes, 1 / 8 of its bytes on the network, node NIC total
# bandwidth (= plain sharding's ring). Replicate group (one rank per shard group):
# K >= 8 puts every member on its own node, so all its bytes cross the rail at
# `inter_busbw / 8`. When the shard ring crosses nodes, its collectives and the
# all_reduce share the NICs: the schedule serialises them (:func:`_simulate`).

HSDP_MODELS = ("llama2-70b", "llama3-8b")
HSDP_SHARD_SIZES = (8, 16, 32)
GB = 1e9  # memory and traffic in decimal GB, as GPUs are sold ("80 GB")
GPU_MEMORY_GB = 80.0
HEADROOM_GB = 20.0  # left for activations, CUDA context, allocator slack
MIN_GAIN = 0.01  # HSDP must beat plain sharding by this much to be recommended


def link_split(sent: float, p: int, nodes: int) -> tuple[float, float]:
    """(NVLink, network) bytes of the ``sent`` bytes one GPU sends in a ring ([Note: links]).

    ``nodes / p`` of them go through the GPU's own NIC rail (none on one node), the
    rest over NVLink.
    """
    if nodes <= 1:
        return sent, 0.0
    network = sent * nodes / p
    return sent - network, network


def _groups(shapes: Shapes) -> tuple[int, int, int]:
    """(block, root remainder, norm group) elements, as scheme yafsdp flattens them."""
    block = sum(n for _, n in shapes.layer_matrices)
    root_rest = sum(n for _, n in shapes.root_tensors)
    norms = sum(n for _, n in shapes.layer_norms) * shapes.n_layers
    return block, root_rest, norms + sum(n for _, n in shapes.root_norms)


def hsdp_traffic(
    shapes: Shapes, p: int, k: int, work: Workload, gpus_per_node: int = 8
) -> dict[str, tuple[float, float]]:
    """Bytes one GPU sends per step, by kind: ``{kind: (NVLink, network)}``.

    A ring over ``q`` ranks sends ``(q - 1) / q * S`` per rank for an all_gather or
    reduce_scatter of ``S`` (full) bytes, ``2 (q - 1) / q * S`` for an all_reduce.
    Shard group: ``k`` consecutive ranks; every block gathered twice (forward and the
    backward re-gather), the root remainder and norm group once; everything reduced
    once. Replicate group: ``p / k`` ranks all-reducing ``1 / k`` of every gradient.
    """
    block, root_rest, norm_group = _groups(shapes)
    params = shapes.n_layers * block + root_rest + norm_group
    gathered = (2 * shapes.n_layers * block + root_rest + norm_group) * work.param_bytes
    shard_ring = (k, max(1, math.ceil(k / gpus_per_node)))
    traffic = {
        "all_gather": link_split((k - 1) / k * gathered, *shard_ring),
        "reduce_scatter": link_split((k - 1) / k * params * work.grad_bytes, *shard_ring),
        "all_reduce": (0.0, 0.0),
    }
    ranks, nodes = replicate_ring(p, k, gpus_per_node)
    if ranks > 1:
        shard = params * work.grad_bytes / k
        traffic["all_reduce"] = link_split(2 * (ranks - 1) / ranks * shard, ranks, nodes)
    return traffic


def hsdp_memory(shapes: Shapes, k: int, work: Workload, *, flat: bool = False) -> dict[str, float]:
    """Bytes per GPU of sharded state and buffers (not activations), shard group of ``k``.

    As ``yafsdp estimate`` counts them ([Note: estimate formulas], padding ignored):
    fp32 master shard 4 + fp32 grad shard 4 + AdamW 8 bytes per parameter, over ``k``;
    two gathered-unit weight buffers (param dtype) and two grad buffers (reduce dtype,
    unit + its shard) of the largest unit (a block, or the embedding/head unit); two
    staging shards (param dtype) for the cast before each gather; the norm group kept
    gathered with its grad buffer. With ``flat`` sharding (``k`` is every GPU) an
    embedding or head larger than a block runs in row chunks of at most a block ([Note:
    row chunks]): the largest unit is a block.
    """
    block, root_rest, norm_group = _groups(shapes)
    params = shapes.n_layers * block + root_rest + norm_group
    largest = block if flat else max(block, *(n for _, n in shapes.root_tensors))
    shard = math.ceil(largest / k)
    pb, gb = work.param_bytes, work.grad_bytes
    mem = {
        "sharded_state": params * (4 + 4 + 8) / k,
        "weight_buffers": 2 * largest * pb,
        "grad_buffers": 2 * (largest + shard) * gb,
        "gather_staging": 2 * shard * pb,
        "resident_buffers": norm_group * pb + (norm_group + math.ceil(norm_group / k)) * gb,
    }
    mem["total"] = sum(mem.values())
    return mem


def memory_fit(nbytes: float, gpu_gb: float = GPU_MEMORY_GB, headroom_gb: float = HEADROOM_GB):
    """``"yes"`` (leaves the headroom), ``"tight"`` (fits, less headroom) or ``"no"``."""
    if nbytes > gpu_gb * GB:
        return "no"
    return "tight" if nbytes > (gpu_gb - headroom_gb) * GB else "yes"


def predict_hsdp(
    name: str,
    p: int,
    k: int,
    work: Workload,
    cluster: Cluster,
    *,
    gpu_gb: float = GPU_MEMORY_GB,
    headroom_gb: float = HEADROOM_GB,
) -> dict:
    """yafsdp on ``p`` GPUs sharded over groups of ``k`` (``k = p``: plain): a flat dict."""
    shapes = model_shapes(name, tuple(sorted(set(SEQ_LENS) | {work.seq_len})))
    pred, kinds = _predict(shapes, p, work, cluster, "yafsdp", k)
    traffic = hsdp_traffic(shapes, p, k, work, cluster.gpus_per_node)
    mem = hsdp_memory(shapes, k, work, flat=k == p)
    return {
        "model": name,
        "gpu": cluster.name,
        "gpus": p,
        "shard_size": k,
        "replicate_size": p // k,
        "seq_len": work.seq_len,
        "batch": work.batch,
        "ckpt_layers": work.ckpt_layers,
        "grad_bytes": work.grad_bytes,
        "compute": pred.compute,
        "comm": kinds,
        "exposed_comm": pred.exposed_comm,
        "step": pred.step,
        "bytes": {kind: {"nvlink": a, "network": b} for kind, (a, b) in traffic.items()},
        "bytes_nvlink": sum(a for a, _ in traffic.values()),
        "bytes_network": sum(b for _, b in traffic.values()),
        "memory": mem,
        "fits": memory_fit(mem["total"], gpu_gb, headroom_gb),
    }


def hsdp_rows(
    name: str,
    gpus,
    work: Workload,
    cluster: Cluster,
    shard_sizes=HSDP_SHARD_SIZES,
    **fit,
) -> list[dict]:
    """Per GPU count: plain sharding (``k = p``) then every ``k < p`` of ``shard_sizes``.

    Each row gets ``speedup_vs_pure`` = step(plain) / step(k) - 1.
    """
    rows = []
    for p in gpus:
        pure = predict_hsdp(name, p, p, work, cluster, **fit)
        group = [pure] + [
            predict_hsdp(name, p, k, work, cluster, **fit)
            for k in sorted(set(shard_sizes))
            if k < p and p % k == 0
        ]
        for row in group:
            row["speedup_vs_pure"] = pure["step"] / row["step"] - 1
        rows += group
    return rows


def recommend(rows: list[dict], p: int, min_gain: float = MIN_GAIN) -> dict:
    """The recommended row at ``p`` GPUs among ``rows`` (one model and workload).

    Rule: among the shard sizes whose memory leaves the headroom (``fits == "yes"``),
    the fastest; an HSDP ``k`` only if it beats plain sharding by at least
    ``min_gain`` (less is within the model's error), else plain sharding. If nothing
    leaves the headroom, the one with the least memory.
    """
    at = [r for r in rows if r["gpus"] == p]
    pure = next(r for r in at if r["shard_size"] == p)
    ok = [r for r in at if r["fits"] == "yes"]
    if not ok:
        return min(at, key=lambda r: r["memory"]["total"])
    best = min(ok, key=lambda r: r["step"])
    if best is not pure and best["speedup_vs_pure"] < min_gain and pure in ok:
        return pure
    return best


def crossover(rows: list[dict], min_gain: float = MIN_GAIN) -> dict | None:
    """The smallest GPU count at which a fitting HSDP ``k`` beats plain sharding.

    "Fitting" = leaves the headroom (``fits == "yes"``); "beats" = by at least
    ``min_gain``. Returns that GPU count's best such row, or None if there is none.
    """
    for p in sorted({r["gpus"] for r in rows}):
        wins = [
            r
            for r in rows
            if r["gpus"] == p
            and r["shard_size"] < p
            and r["fits"] == "yes"
            and r["speedup_vs_pure"] >= min_gain
        ]
        if wins:
            return max(wins, key=lambda r: r["speedup_vs_pure"])
    return None


def hsdp_table(rows: list[dict]) -> str:
    """One markdown table of :func:`hsdp_rows` (one model and workload); times in ms."""
    head = (
        "| GPUs | K | R | step | vs plain | exposed comm | comm AG / RS / AR "
        "| NVLink GB/GPU | network GB/GPU | memory GB/GPU | fits 80 GB |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    lines = []
    for r in rows:
        pure = r["shard_size"] == r["gpus"]
        comm = " / ".join(f"{r['comm'][k] * 1e3:.0f}" for k in ("all_gather", "reduce_scatter"))
        comm += " / " + (f"{r['comm']['all_reduce'] * 1e3:.0f}" if not pure else "-")
        gain = "" if pure else f"{100 * r['speedup_vs_pure']:+.1f}%"
        lines.append(
            f"| {r['gpus']} | {'plain' if pure else r['shard_size']} | {r['replicate_size']} "
            f"| {r['step'] * 1e3:.0f} | {gain} "
            f"| {r['exposed_comm'] * 1e3:.0f} | {comm} | {r['bytes_nvlink'] / GB:.0f} "
            f"| {r['bytes_network'] / GB:.1f} | {r['memory']['total'] / GB:.1f} | {r['fits']} |"
        )
    return head + "\n".join(lines)


def hsdp_summary(name: str, rows: list[dict], seq: int, min_gain: float = MIN_GAIN) -> str:
    """Crossover and recommended K of one model at one sequence length, in words."""
    cross = crossover(rows, min_gain)
    if cross is None:
        cross_line = (
            f"crossover: none; at no GPU count here does a K that leaves the headroom "
            f"beat plain sharding by >= {100 * min_gain:g}%"
        )
    else:
        cross_line = (
            f"crossover: {cross['gpus']} GPUs, K={cross['shard_size']} is "
            f"{100 * cross['speedup_vs_pure']:+.1f}% vs plain sharding"
        )
    recs = []
    for p in sorted({r["gpus"] for r in rows}):
        r = recommend(rows, p, min_gain)
        if r["shard_size"] == p:
            k = f"plain (K={p})"
        else:
            k = f"K={r['shard_size']} ({100 * r['speedup_vs_pure']:+.1f}%)"
        note = "" if r["fits"] == "yes" else f", memory {r['fits']}"
        recs.append(f"{p}: {k}{note}")
    return f"{name}, seq {seq}: {cross_line}\nrecommended: " + ", ".join(recs)


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
    hs = sub.add_parser("hsdp")
    hs.add_argument("--gpu", choices=sorted(CLUSTERS), default="h100")
    hs.add_argument("--mfu", type=float, help="model FLOPs utilisation (0-1)")
    hs.add_argument("--intra-busbw", type=float, help="NVLink busbw, GB/s")
    hs.add_argument("--inter-busbw", type=float, help="per-node network busbw, GB/s")
    hs.add_argument("--batch", type=int, default=1, help="sequences per GPU per step")
    hs.add_argument("--grad-bytes", type=int, default=4, choices=(2, 4), help="reduce dtype")
    hs.add_argument("--ckpt-layers", type=int, default=0, help="checkpointed blocks")
    hs.add_argument("--models", nargs="+", default=list(HSDP_MODELS))
    hs.add_argument("--gpus", nargs="+", type=int, default=list(GPU_COUNTS))
    hs.add_argument("--seqs", nargs="+", type=int, default=list(SEQ_LENS))
    hs.add_argument("--shard-sizes", nargs="+", type=int, default=list(HSDP_SHARD_SIZES))
    hs.add_argument("--gpu-memory-gb", type=float, default=GPU_MEMORY_GB)
    hs.add_argument("--headroom-gb", type=float, default=HEADROOM_GB)
    hs.add_argument("--min-gain", type=float, default=MIN_GAIN, help="e.g. 0.01 = 1%%")
    hs.add_argument("--json", type=Path, help="also write the rows as JSON")
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
    if args.cmd == "hsdp":
        return _hsdp_main(args, cluster)
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


def _hsdp_main(args, cluster: Cluster) -> int:
    fit = {"gpu_gb": args.gpu_memory_gb, "headroom_gb": args.headroom_gb}
    print(
        f"{cluster.name}: {cluster.flops / 1e12:.0f} TFLOP/s achieved (MFU {cluster.mfu}), "
        f"busbw NVLink {cluster.intra_busbw / 1e9:.0f} / network "
        f"{cluster.inter_busbw / 1e9:.0f} GB/s per node "
        f"({cluster.inter_busbw / cluster.gpus_per_node / 1e9:.0f} per rail), "
        f"{cluster.gpus_per_node} GPUs/node; yafsdp, batch {args.batch}/GPU, bf16 gathers, "
        f"reduce in {'fp32' if args.grad_bytes == 4 else 'bf16'}, "
        f"{args.ckpt_layers} checkpointed blocks\n"
        "K = shard group (plain = all GPUs), R = replicas; times in ms per step; "
        "vs plain = step(plain) / step(K) - 1; bytes each GPU sends per step; memory = "
        f"sharded state + buffers (no activations); fits: yes = leaves {args.headroom_gb:g} "
        f"of {args.gpu_memory_gb:g} GB, tight = fits with less, no = does not fit"
    )
    rows, summaries = [], []
    for name in args.models:
        for seq in args.seqs:
            work = Workload(
                seq_len=seq,
                batch=args.batch,
                grad_bytes=args.grad_bytes,
                ckpt_layers=args.ckpt_layers,
            )
            model_rows = hsdp_rows(name, args.gpus, work, cluster, args.shard_sizes, **fit)
            rows += model_rows
            print(f"\n### {name}, seq {seq} ({cluster.name})\n")
            print(hsdp_table(model_rows))
            summaries.append(hsdp_summary(name, model_rows, seq, args.min_gain))
    print(
        f"\n### Crossover and recommended K\n\nrule: the fastest K whose memory leaves "
        f"{args.headroom_gb:g} GB of {args.gpu_memory_gb:g} GB free; an HSDP K only if "
        f">= {100 * args.min_gain:g}% faster than plain sharding\n"
    )
    print("\n\n".join(summaries))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
