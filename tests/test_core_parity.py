"""Sharded training equals single-process training, loss by loss and weight by weight.

Every scenario runs on real gloo ranks and is compared with a single-process
fp32 reference of the same model and global batches (tests/core_scenarios.py).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.core_scenarios import SCENARIOS, run_many_sharded, run_reference
from tests.distributed import dist_run

FP32_RTOL = 1e-5
# bf16 has an 8-bit mantissa (relative step 2^-8 = 0.4%); 5 AdamW steps of
# bf16 compute stay within a few percent of fp32 on this model.
BF16_LOSS_RTOL = 2e-2
BF16_WEIGHT_RTOL = 5e-2

FP32_EVERYWHERE = ["adamw", "hf_llama"]  # world sizes 1, 2, 3, 4
FP32_AT_2 = [
    "fused_adamw",
    "sgd_momentum",
    "accumulation_2",
    "clipping",
    "checkpoint_alternate_units",
    "zero2",
    "tied_embeddings",
    "frozen_embeddings",
    "frozen_in_unit",
    "unused_parameter",
    "eval_between_steps",
    "hf_llama_accum_clip_ckpt",
]
# At 4 ranks (oversubscribing 2 cores) the scenarios whose math depends on the
# world size: the uneven shard boundaries, accumulation, clipping, ZeRO-2.
FP32_AT_4 = [
    "accumulation_2",
    "clipping",
    "zero2",
    "tied_embeddings",
    "frozen_in_unit",
    "hf_llama_accum_clip_ckpt",
]
# Hybrid sharding (shard groups of 2 ranks): 2 x 2 on 4 ranks, 3 x 2 on 6.
HYBRID_AT_4 = [
    "hsdp_accum_clip",
    "hsdp_zero2_checkpoint_unused",
    "hsdp_tied_frozen",
    "hsdp_hf_llama_accum_clip_ckpt",
    "hsdp_bf16_compute",
]
HYBRID_AT_6 = ["hsdp_accum_clip", "hsdp_hf_llama_accum_clip_ckpt"]
WORLD_SIZES = {
    1: FP32_EVERYWHERE,
    2: [*FP32_EVERYWHERE, *FP32_AT_2, "bf16_compute"],
    3: [*FP32_EVERYWHERE, "accumulation_2", "frozen_in_unit"],
    4: [*FP32_EVERYWHERE, *FP32_AT_4, *HYBRID_AT_4],
    6: HYBRID_AT_6,
}
CASES = [(ws, name) for ws, names in WORLD_SIZES.items() for name in names]


@functools.cache
def sharded_results(world_size: int) -> dict:
    return dist_run(world_size, run_many_sharded, WORLD_SIZES[world_size], timeout_s=850)[0]


@functools.cache
def reference_results(name: str, world_size: int):
    return run_reference(name, world_size)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (
        (actual.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-12)
    ).item()


# The first case of a world size runs all its scenarios in one spawn: allow for it.
@pytest.mark.timeout(900)
@pytest.mark.parametrize(("world_size", "name"), CASES, ids=[f"ws{ws}-{n}" for ws, n in CASES])
def test_sharded_training_matches_single_process(world_size: int, name: str) -> None:
    losses, state = sharded_results(world_size)[name]
    ref_losses, ref_state = reference_results(name, world_size)
    bf16 = SCENARIOS[name].param_dtype == torch.bfloat16
    loss_rtol, weight_rtol = (BF16_LOSS_RTOL, BF16_WEIGHT_RTOL) if bf16 else (FP32_RTOL, FP32_RTOL)

    assert len(losses) == len(ref_losses) == SCENARIOS[name].steps
    for step, (loss, ref) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(loss - ref) <= loss_rtol * abs(ref), (
            f"step {step}: loss {loss} vs reference {ref}"
        )
    assert set(state) == set(ref_state), "sharded state dict must use the original names"
    for key, expected in ref_state.items():
        assert state[key].shape == expected.shape, key
        error = relative_error(state[key], expected)
        assert error <= weight_rtol, f"{key}: relative error {error:.2e}"


def test_training_changes_the_weights() -> None:
    """Guards the parity test: the reference run does train (weights differ from init)."""
    from tests.core_scenarios import build_model

    init = build_model(SCENARIOS["adamw"]).state_dict()
    _, trained = reference_results("adamw", 2)
    changed = [k for k in init if not torch.equal(init[k], trained[k])]
    assert len(changed) == len(init)
