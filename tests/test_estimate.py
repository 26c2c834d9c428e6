"""``yafsdp estimate`` equals what a real engine allocates and sends, for a tiny model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_yafsdp.config import load_config
from lightning_yafsdp.estimate import checkpointed_units, estimate
from tests.distributed import dist_run

_DTYPES = {"32-true": (torch.float32, torch.float32), "bf16-mixed": (torch.float32, torch.bfloat16)}


def _engine_facts(overrides: tuple[str, ...]) -> dict:
    """Shard the recipe's model on this rank's group, run one step, report bytes."""
    import torch.distributed as dist

    from lightning_yafsdp.core import shard_model
    from lightning_yafsdp.training.models import build_model, model_init_fn

    config = load_config(None, list(overrides))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build_model(config)
    master, param = _DTYPES[config.trainer.precision]
    engine = shard_model(
        model,
        param_dtype=param,
        master_dtype=master,
        reduce_dtype=getattr(torch, config.strategy.reduce_dtype),
        zero_stage=config.strategy.zero_stage,
        param_init_fn=model_init_fn(model),
    )
    tokens = torch.randint(0, 256, (2, 17))
    engine.comm_stats.reset()
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    traffic = engine.comm_stats.snapshot()["bytes"]
    est = estimate(config, world_size=dist.get_world_size())
    return {
        "engine": engine.memory_report(),
        "estimate": est.engine_report(),
        "traffic": traffic,
        "estimated_traffic": est.comm_per_step,
    }


_CASES = {
    1: [("trainer.precision=32-true",)],
    2: [
        ("trainer.precision=32-true",),
        ("trainer.precision=bf16-mixed", "strategy.reduce_dtype=bfloat16"),
        ("trainer.precision=32-true", "strategy.zero_stage=2"),
    ],
}


def _all_cases(cases: list[tuple[str, ...]]) -> list[dict]:
    return [_engine_facts(overrides) for overrides in cases]


@pytest.fixture(scope="module")
def runs() -> dict:
    """``{(world_size, overrides): facts}``; one process group per world size."""
    out = {}
    for world_size, cases in _CASES.items():
        results = dist_run(world_size, _all_cases, cases, timeout_s=180)[0]
        out.update({(world_size, case): facts for case, facts in zip(cases, results)})
    return out


def test_memory_estimate_equals_the_engine_memory_report(runs: dict) -> None:
    for case, facts in runs.items():
        assert facts["estimate"] == facts["engine"], case


def test_traffic_estimate_equals_the_engine_comm_stats(runs: dict) -> None:
    for case, facts in runs.items():
        assert facts["estimated_traffic"] == facts["traffic"], case


def test_bf16_mixed_casts_on_gather_instead_of_keeping_a_twin(runs: dict) -> None:
    # [Note: cast on gather] Only the norm group keeps a bf16 twin of its master shard;
    # units cast into two shard-sized staging tensors before each gather.
    bf16 = runs[(2, ("trainer.precision=bf16-mixed", "strategy.reduce_dtype=bfloat16"))]
    fp32 = runs[(2, ("trainer.precision=32-true",))]
    assert fp32["engine"]["compute_shards"] == fp32["engine"]["gather_staging"] == 0
    twin, staging = bf16["engine"]["compute_shards"], bf16["engine"]["gather_staging"]
    assert 0 < twin < bf16["engine"]["master_shards"] / 50  # the norms only
    assert 0 < staging < bf16["engine"]["master_shards"] / 2  # two unit shards, in bf16


def test_activations_shrink_with_checkpointing_and_auto_picks_the_fewest_units() -> None:
    config = load_config(None, ["data.batch_size=64"])
    est = estimate(config, world_size=2)
    n = est.num_blocks
    sizes = [est.activations(k) for k in range(n + 1)]
    assert sizes[0] > sizes[-1]
    # A budget that just fits two checkpointed units: auto must choose exactly two.
    budget_gib = (sizes[2] + sizes[1]) / 2 / 2**30
    config = load_config(
        None,
        [
            "data.batch_size=64",
            "strategy.activation_checkpointing=auto",
            f"strategy.activation_memory_gb={budget_gib}",
        ],
    )
    assert checkpointed_units(estimate(config, world_size=2), config) == 2


def test_sharding_divides_the_state_by_the_world_size() -> None:
    config = load_config("llama3-8b")
    one, eight = estimate(config, world_size=1), estimate(config, world_size=8)
    assert eight.master_shards == pytest.approx(one.master_shards / 8, rel=1e-3)
    assert eight.num_parameters == one.num_parameters == 8_030_261_248
