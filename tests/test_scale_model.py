"""The alpha-beta scale model (benchmarks/scale_model.py): fast checks, no calibration run."""

import dataclasses

import pytest

from benchmarks.scale_model import (
    CLUSTERS,
    GB,
    GPU_COUNTS,
    MODELS,
    SCHEMES,
    Cluster,
    Protocol,
    Shapes,
    Workload,
    _simulate,
    crossover,
    fit_alpha_beta,
    hsdp_memory,
    hsdp_rows,
    hsdp_traffic,
    model_shapes,
    per_rank_bytes,
    predict_hsdp,
    predict_row,
    predict_step,
    recommend,
    replicate_ring,
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


# --------------------------------------------------------------------------- hybrid sharding

# A toy model small enough to compute by hand: 2 blocks of one 1000-element matrix and
# one 8-element norm, a 500-element embedding, a final 8-element norm.
TOY = Shapes(
    name="toy",
    n_layers=2,
    dim=8,
    layer_matrices=(("w", 1000),),
    layer_norms=(("n", 8),),
    root_tensors=(("emb", 500),),
    root_norms=(("f", 8),),
    flops_per_token={2048: 20_000},
)


@pytest.mark.parametrize("gpu", sorted(CLUSTERS))
@pytest.mark.parametrize("grad_bytes", [2, 4])
def test_hsdp_with_k_equal_n_is_plain_sharding(gpu, grad_bytes):
    cluster = CLUSTERS[gpu]
    for name in ("llama2-70b", "llama3-8b"):
        shapes = model_shapes(name)
        for p in (64, 1024):
            for seq in (2048, 8192):
                work = Workload(seq_len=seq, grad_bytes=grad_bytes)
                plain = predict_step(shapes, p, work, cluster, "yafsdp")
                assert predict_step(shapes, p, work, cluster, "yafsdp", shard_size=p) == plain
                row = predict_hsdp(name, p, p, work, cluster)
                assert row["step"] == plain.step  # exactly, not approximately
                assert row["compute"] == plain.compute
                assert row["exposed_comm"] == plain.exposed_comm
                comm = row["comm"]["all_gather"] + row["comm"]["reduce_scatter"]
                assert comm == pytest.approx(plain.comm, rel=1e-12)
                # the all_reduce vanishes: no time, no bytes
                assert row["comm"]["all_reduce"] == 0.0
                assert row["bytes"]["all_reduce"] == {"nvlink": 0.0, "network": 0.0}
                assert row["replicate_size"] == 1
                # and with K < N it does not
                hsdp = predict_hsdp(name, p, 32, work, cluster)
                assert hsdp["comm"]["all_reduce"] > 0
                assert hsdp["bytes"]["all_reduce"]["network"] > 0


def test_plain_sharding_numbers_unchanged():
    # docs/scale-model.md's tables (A100, bf16 reduce): adding HSDP moved nothing.
    row = predict_row("llama2-70b", 64, Workload(seq_len=2048), CLUSTERS["a100"])
    assert row["yafsdp"]["step"] * 1e3 == pytest.approx(5659, abs=0.5)
    row = predict_row("llama2-70b", 1024, Workload(seq_len=8192), CLUSTERS["h100"])
    assert row["yafsdp"]["step"] * 1e3 == pytest.approx(9899, abs=0.5)


def test_hsdp_bytes_hand_computed():
    work = Workload(seq_len=2048, param_bytes=2, grad_bytes=4)
    params = 2 * 1000 + 500 + (2 * 8 + 8)  # 2524
    # 32 GPUs, K = 16: shard groups span 2 nodes, replicate groups 2 ranks on 2 nodes.
    t = hsdp_traffic(TOY, 32, 16, work, gpus_per_node=8)
    gathered = (2 * 2 * 1000 + 500 + 24) * 2  # blocks twice (re-gather), rest once
    ag = 15 / 16 * gathered
    assert t["all_gather"] == pytest.approx((ag * 14 / 16, ag * 2 / 16))  # 2 of 16 hops
    rs = 15 / 16 * params * 4
    assert t["reduce_scatter"] == pytest.approx((rs * 14 / 16, rs * 2 / 16))
    ar = 2 * (2 - 1) / 2 * params * 4 / 16  # ring all_reduce of the 1/16 shard, 2 ranks
    assert t["all_reduce"] == pytest.approx((0.0, ar))  # one rank per node: all network
    assert ar == 631.0
    # K = 8: the shard ring is NVLink only; replicate groups of 4, one rank per node.
    t = hsdp_traffic(TOY, 32, 8, work, gpus_per_node=8)
    assert t["all_gather"] == pytest.approx((7 / 8 * gathered, 0.0))
    assert t["reduce_scatter"] == pytest.approx((7 / 8 * params * 4, 0.0))
    assert t["all_reduce"] == pytest.approx((0.0, 2 * 3 / 4 * params * 4 / 8))
    # K = 4 (half a node): replicas 0, 4, 8, ... put 2 ranks on each of 4 nodes.
    assert replicate_ring(32, 4, 8) == (8, 4)
    t = hsdp_traffic(TOY, 32, 4, work, gpus_per_node=8)
    ar = 2 * 7 / 8 * params * 4 / 4
    assert t["all_reduce"] == pytest.approx((ar / 2, ar / 2))  # 4 of 8 hops cross nodes


def test_all_reduce_time_formula():
    # Equal step latencies, no base, one protocol: 2 (p-1) alpha + 2 (p-1)/p S beta,
    # beta = 1 / one rail (inter_busbw / 8) for a ring with one rank per node.
    alpha, nbytes = 4e-6, 64 * 2**20
    flat = Cluster(
        "flat",
        peak_flops=1e15,
        mfu=0.5,
        hbm_bw=2e12,
        intra_busbw=400e9,
        inter_busbw=400e9,
        protocols=(Protocol("one", 0.0, alpha, alpha, 1.0),),
    )
    for p in (2, 4, 16, 128):
        expected = 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes / 50e9
        got = flat.ring_collective_time(nbytes, p, p, all_reduce=True)
        assert got == pytest.approx(expected)
        # all_gather/reduce_scatter: half of it
        assert flat.ring_collective_time(nbytes, p, p) == pytest.approx(expected / 2)
    # A ring of consecutive ranks through whole nodes is the existing collective_time.
    for cluster in CLUSTERS.values():
        for p in (8, 16, 64, 1024):
            nodes = max(1, p // 8)
            got = cluster.ring_collective_time(nbytes, p, nodes)
            assert got == pytest.approx(cluster.collective_time(nbytes, p), rel=1e-12)


def test_hsdp_step_time_components():
    # 128 H100s, Llama 3 8B, K = 8: the all_reduce of each block's 1/8 shard over 16
    # ranks (one per node) is what the model says it is, on its own stream.
    cluster, work = CLUSTERS["h100"], Workload(seq_len=2048, grad_bytes=4)
    shapes = model_shapes("llama3-8b")
    block = sum(n for _, n in shapes.layer_matrices)
    root_rest = sum(n for _, n in shapes.root_tensors)  # embedding + head
    norms = shapes.n_layers * sum(n for _, n in shapes.layer_norms) + 4096

    def all_reduce(numel):  # 1/8 of it in fp32, over 16 ranks on 16 nodes
        return cluster.ring_collective_time(numel * 4 / 8, 16, 16, all_reduce=True)

    row = predict_hsdp("llama3-8b", 128, 8, work, cluster)
    expected = shapes.n_layers * all_reduce(block) + all_reduce(root_rest) + all_reduce(norms)
    assert row["comm"]["all_reduce"] == pytest.approx(expected, rel=1e-12)
    gathers = 2 * shapes.n_layers * cluster.collective_time(block * 2, 8)
    assert row["comm"]["all_gather"] > gathers
    assert row["step"] >= row["compute"]
    # An infinitely fast network leaves only compute, with or without HSDP.
    free = dataclasses.replace(
        cluster, intra_busbw=1e30, inter_busbw=1e30, protocols=(Protocol("free", 0, 0, 0, 1.0),)
    )
    for k in (8, 16, 128):
        row = predict_hsdp("llama3-8b", 128, k, work, free)
        assert row["step"] == pytest.approx(row["compute"], rel=1e-6)
    with pytest.raises(ValueError, match="does not divide"):
        predict_hsdp("llama3-8b", 128, 48, work, cluster)
    with pytest.raises(ValueError, match="multiple of 8"):
        predict_hsdp("llama3-8b", 96, 12, work, cluster)


def test_hsdp_memory_scales_as_one_over_k():
    work = Workload(seq_len=2048, grad_bytes=4)
    shapes = model_shapes("llama2-70b")
    params = shapes.n_layers * shapes.layer_numel + sum(
        n for _, n in shapes.root_tensors + shapes.root_norms
    )
    mems = {k: hsdp_memory(shapes, k, work) for k in (8, 16, 32, 64, 128)}
    for k, mem in mems.items():
        assert mem["sharded_state"] == pytest.approx(16 * params / k)  # (4 + 4 + 8) / K
        assert mem["sharded_state"] * k == pytest.approx(mems[8]["sharded_state"] * 8)
        # the gathered buffers do not shrink with K (two bf16 + two fp32 units)
        assert mem["weight_buffers"] == mems[8]["weight_buffers"]
    assert mems[8]["sharded_state"] / GB == pytest.approx(138, abs=1)  # 69e9 * 16 / 8
    fits = {k: predict_hsdp("llama2-70b", 128, k, work, CLUSTERS["h100"])["fits"] for k in mems}
    assert fits == {8: "no", 16: "tight", 32: "yes", 64: "yes", 128: "yes"}


def test_crossover_and_recommendation_match_the_table():
    cluster = CLUSTERS["h100"]
    work = Workload(seq_len=2048, grad_bytes=4)
    rows = hsdp_rows("llama3-8b", GPU_COUNTS, work, cluster)
    cross = crossover(rows)
    # by hand from the rows: the first GPU count with a fitting K < N >= 1% faster
    by_hand = [
        r
        for r in rows
        if r["shard_size"] < r["gpus"] and r["fits"] == "yes" and r["speedup_vs_pure"] >= 0.01
    ]
    first = min(r["gpus"] for r in by_hand)
    assert cross["gpus"] == first
    assert cross["speedup_vs_pure"] == max(
        r["speedup_vs_pure"] for r in by_hand if r["gpus"] == first
    )
    # what docs/scale-model.md states
    assert (cross["gpus"], cross["shard_size"]) == (512, 32)
    assert recommend(rows, 64)["shard_size"] == 64  # plain sharding below the crossover
    assert recommend(rows, 1024)["shard_size"] == 32
    # Llama 2 70B: K = 8 does not fit, K = 32 wins only at 1,024 GPUs and seq 2048
    rows = hsdp_rows("llama2-70b", GPU_COUNTS, work, cluster)
    cross = crossover(rows)
    assert (cross["gpus"], cross["shard_size"]) == (1024, 32)
    assert recommend(rows, 128)["shard_size"] == 128
    long = hsdp_rows("llama2-70b", GPU_COUNTS, Workload(seq_len=8192, grad_bytes=4), cluster)
    assert crossover(long) is None


def test_crossover_rule_on_synthetic_rows():
    def row(p, k, step, fits="yes"):
        return {"gpus": p, "shard_size": k, "step": step, "fits": fits, "memory": {"total": k}}

    rows = [
        row(64, 64, 100.0),
        row(64, 8, 90.0, fits="no"),  # fastest but does not fit: ignored
        row(64, 32, 99.5),  # +0.5%: under the 1% threshold
        row(128, 128, 100.0),
        row(128, 32, 95.0),
        row(128, 16, 96.0),
    ]
    for r in rows:
        pure = next(x for x in rows if x["gpus"] == r["gpus"] and x["shard_size"] == x["gpus"])
        r["speedup_vs_pure"] = pure["step"] / r["step"] - 1
    assert crossover(rows)["gpus"] == 128
    assert crossover(rows)["shard_size"] == 32
    assert recommend(rows, 64)["shard_size"] == 64
    assert recommend(rows, 128)["shard_size"] == 32
    assert crossover(rows, min_gain=0.1) is None
    assert crossover(rows, min_gain=0.0)["gpus"] == 64


def test_replicate_all_reduce_follows_its_reduce_scatter():
    # One block: forward 1, backward 2 (ends at 3), reduce_scatter 3 (ends at 6), then
    # the all_reduce 5 (ends at 11) and the small groups' all_reduce 0.5 at the end.
    base = dict(
        n_layers=1, fwd=1.0, bwd=[2.0], ag=0.0, rs=3.0, fir=0.0, start_ag=0.0, end_rs=0.0,
        head_fwd=0.0, head_bwd=0.0, end_compute=0.0,
    )  # fmt: skip
    assert _simulate(**base)[0] == 6.0
    for on_comm in (False, True):
        step, _ = _simulate(**base, ar=5.0, ar_on_comm=on_comm, end_ar=0.5)
        assert step == 11.5


def test_flat_sharding_sizes_buffers_to_a_block_with_row_chunks():
    # Llama 3 8B: the 128k-vocabulary embedding and head are 2.4 blocks each; flat
    # sharding runs them in row chunks ([Note: row chunks]), hybrid keeps them whole.
    work = Workload(seq_len=2048, grad_bytes=4)
    shapes = model_shapes("llama3-8b")
    flat = hsdp_memory(shapes, 64, work, flat=True)
    hybrid = hsdp_memory(shapes, 64, work)
    block = sum(n for _, n in shapes.layer_matrices)  # the norms are a group of their own
    assert flat["weight_buffers"] == 2 * block * work.param_bytes
    assert hybrid["weight_buffers"] > 2 * flat["weight_buffers"]
