"""The alpha-beta scale model (benchmarks/scale_model.py): fast checks, no calibration run."""

import dataclasses

import pytest

from benchmarks.scale_model import (
    CLUSTERS,
    GPU_COUNTS,
    MODELS,
    SCHEMES,
    Cluster,
    Protocol,
    Workload,
    fit_alpha_beta,
    model_shapes,
    per_rank_bytes,
    predict_row,
    predict_step,
    ring_time,
)


def test_article_figure_128_kib_per_rank_at_1024_gpus():
    # The YaFSDP article: a Llama 70B 8192x8192 tensor in bf16 at 1,024 GPUs is
    # <= 128 KB per rank per all_gather.
    assert per_rank_bytes(8192 * 8192, 1024, 2) == 128 * 1024
    shapes = model_shapes("llama2-70b")
    wq = dict(shapes.layer_matrices)["attention.wq.weight"]
    assert wq == 8192 * 8192
    row = predict_row("llama2-70b", 1024, Workload(seq_len=2048), CLUSTERS["a100"])
    assert row["msg_wq_bytes"] == 128 * 1024


def test_ring_time_formula():
    alpha, beta, nbytes = 5e-6, 1 / 100e9, 256 * 2**20
    for p in (2, 8, 64, 1024):
        expected = alpha * (p - 1) + (p - 1) / p * nbytes * beta
        assert ring_time(nbytes, p, alpha, beta) == pytest.approx(expected)
    assert ring_time(nbytes, 1, alpha, beta) == 0.0
    # The cluster's two-level model reduces to it with one protocol, equal step
    # latencies, equal bandwidths and no base latency.
    flat = Cluster(
        "flat",
        peak_flops=1e15,
        mfu=0.5,
        hbm_bw=2e12,
        intra_busbw=100e9,
        inter_busbw=100e9,
        protocols=(Protocol("one", 0.0, alpha, alpha, 1.0),),
    )
    for p in (4, 64, 1024):
        assert flat.collective_time(nbytes, p) == pytest.approx(ring_time(nbytes, p, alpha, beta))


@pytest.mark.parametrize("name", MODELS)
def test_per_layer_message_larger_than_per_tensor_at_every_scale(name):
    work = Workload(seq_len=2048)
    for p in GPU_COUNTS:
        row = predict_row(name, p, work, CLUSTERS["a100"])
        assert row["msg_layer_bytes"] > row["msg_largest_tensor_bytes"] >= row["msg_wq_bytes"]


@pytest.mark.parametrize("gpu", sorted(CLUSTERS))
def test_yafsdp_speedup_shrinks_with_sequence_length(gpu):
    # The YaFSDP README's trend: large speed-up over FSDP at seq 2048, small at 8192.
    cluster = CLUSTERS[gpu]
    short = predict_row("llama2-70b", 1024, Workload(seq_len=2048), cluster)
    long = predict_row("llama2-70b", 1024, Workload(seq_len=8192), cluster)
    assert short["speedup_yafsdp_vs_fsdp"] > long["speedup_yafsdp_vs_fsdp"] > 0
    # Per-layer communication is fixed while compute grows with the sequence.
    assert short["fsdp"]["comm"] == pytest.approx(long["fsdp"]["comm"])
    assert long["yafsdp"]["compute"] > 4 * short["yafsdp"]["compute"]


def test_step_accounting():
    cluster, work = CLUSTERS["a100"], Workload(seq_len=2048)
    shapes = model_shapes("llama2-7b")
    tokens_flops = shapes.flops_per_token[2048] * work.tokens
    for scheme in SCHEMES:
        pred = predict_step(shapes, 64, work, cluster, scheme)
        assert pred.step >= pred.compute + pred.fir_stall - 1e-12
        assert pred.exposed_comm >= 0
        # compute is the model's own FLOP count at the achieved rate (+ tiny end ops)
        assert pred.compute == pytest.approx(tokens_flops / cluster.flops, rel=1e-3)
    assert predict_step(shapes, 64, work, cluster, "yafsdp").fir_stall == 0
    # An infinitely fast network leaves only compute and the fir tree.
    free = dataclasses.replace(
        cluster, intra_busbw=1e30, inter_busbw=1e30, protocols=(Protocol("free", 0, 0, 0, 1.0),)
    )
    pred = predict_step(shapes, 64, work, free, "yafsdp")
    assert pred.step == pytest.approx(pred.compute, rel=1e-6)


def test_per_tensor_collectives_lose_at_scale():
    # ZeRO-3 style per-tensor collectives pay the ring latency per tensor: more comm
    # than per-layer flat collectives, and the gap grows with the number of GPUs.
    cluster, work = CLUSTERS["a100"], Workload(seq_len=2048)
    small = predict_row("llama2-7b", 64, work, cluster)
    big = predict_row("llama2-7b", 1024, work, cluster)
    assert (
        big["zero3"]["comm"] / big["fsdp"]["comm"] > small["zero3"]["comm"] / small["fsdp"]["comm"]
    )
    assert big["speedup_yafsdp_vs_zero3"] > small["speedup_yafsdp_vs_zero3"]


def test_fit_alpha_beta_recovers_known_parameters():
    alpha, beta = 300e-6, 1 / 0.8e9
    sizes = [1024 * 4**k for k in range(9)]
    times = [ring_time(s, 2, alpha, beta) for s in sizes]
    got_alpha, got_beta = fit_alpha_beta(sizes, times, p=2)
    assert got_alpha == pytest.approx(alpha, rel=1e-9)
    assert got_beta == pytest.approx(beta, rel=1e-9)
