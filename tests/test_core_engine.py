"""Engine behaviour on real gloo ranks: schedule, traffic, memory, allocations, errors."""

from __future__ import annotations

import functools

import pytest
import torch

from lightning_yafsdp.core import ScheduleEvent
from tests import core_probes
from tests.distributed import dist_run
from tests.schedule_check import four_condition_violations


@functools.cache
def probe(name: str, world_size: int = 2, **kwargs):
    fn = getattr(core_probes, name)
    items = tuple(sorted(kwargs.items()))
    return dist_run(world_size, _call, fn, items, timeout_s=240)[0]


def _call(fn, items):
    return fn(**dict(items))


# -- the four ordering conditions -------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"activation_checkpointing": (0, 2)},
        {"activation_checkpointing": "all"},
        {"zero_stage": 2},
        {"blocks_per_unit": 2},
        {"blocks_per_unit": 3, "activation_checkpointing": "all"},
        {"blocks_per_unit": 2, "zero_stage": 2},
    ],
    ids=[
        "zero3", "checkpoint-alternate", "checkpoint-all", "zero2", "grouped",
        "grouped-uneven-checkpointed", "grouped-zero2",
    ],
)  # fmt: skip
def test_recorded_schedule_meets_the_four_conditions(options) -> None:
    recorded = probe("record_schedule", **options)
    assert any(e.op == "backward_start" for e in recorded["log"]), "the step was recorded"
    assert four_condition_violations(recorded["log"], recorded["slots"]) == []


@pytest.mark.parametrize("zero_stage", [3, 2])
def test_hybrid_schedule_meets_the_four_conditions_with_the_replicate_all_reduce(
    zero_stage,
) -> None:
    recorded = probe("record_schedule", world_size=4, shard_size=2, zero_stage=zero_stage)
    log = recorded["log"]
    assert four_condition_violations(log, recorded["slots"]) == []
    reduced = [e.unit for e in log if e.op == "reduce_scatter_issue"]
    assert [e.unit for e in log if e.op == "all_reduce_issue"] == reduced  # one per reduce


def test_a_replicate_all_reduce_runs_during_a_later_units_backward() -> None:
    """Unit i's all_reduce is issued before unit i-2's backward and waited after it."""
    recorded = probe("record_schedule", world_size=4, shard_size=2, zero_stage=3)  # cached
    log, names = recorded["log"], recorded["unit_names"]

    def at(op: str, unit: str) -> int:
        return max(i for i, e in enumerate(log) if e.op == op and e.unit == unit)

    for later, earlier in zip(names[2:], names, strict=False):
        if not any(e.op == "backward_start" and e.unit == earlier for e in log):
            continue  # a weightless embedding: no backward_start of its own
        issued, waited = at("all_reduce_issue", later), at("all_reduce_wait", later)
        assert issued < at("backward_start", earlier) < at("backward_end", earlier) < waited


@pytest.mark.parametrize("blocks_per_unit", [1, 2])
def test_a_units_reduce_is_in_flight_during_the_previous_units_backward(blocks_per_unit) -> None:
    """Unit i's reduction is issued when its backward ends and waited only after unit i-1's
    backward (by unit i-2, the next user of its grad buffer: condition 3)."""
    recorded = probe("record_schedule", blocks_per_unit=blocks_per_unit)
    log, names = recorded["log"], recorded["unit_names"]

    def at(op: str, unit: str) -> int:
        return max(i for i, e in enumerate(log) if e.op == op and e.unit == unit)

    checked = 0
    for earlier, later in zip(names, names[1:], strict=False):
        if not any(e.op == "backward_start" and e.unit == earlier for e in log):
            continue  # a weightless embedding: no backward_start of its own
        issued, waited = at("reduce_scatter_issue", later), at("reduce_scatter_wait", later)
        assert issued < at("backward_start", earlier) < at("backward_end", earlier) < waited
        checked += 1
    assert checked >= 2


def test_next_units_gather_is_in_flight_while_the_current_unit_computes() -> None:
    recorded = probe("record_schedule")
    log, names = recorded["log"], recorded["unit_names"]
    for current, following in zip(names, names[1:], strict=False):
        start = log.index(ScheduleEvent("forward_start", current, recorded["slots"][current][0]))
        end = log.index(ScheduleEvent("forward_end", current, recorded["slots"][current][0]))
        issued = [i for i, e in enumerate(log) if e.op == "gather_issue" and e.unit == following]
        assert any(start < i < end for i in issued), f"{following} not prefetched during {current}"


@pytest.mark.parametrize("kind", ["gather", "reduce_scatter"])
def test_resident_collectives_of_a_step_boundary_are_all_in_flight_before_any_wait(kind) -> None:
    """[Note: batched step-boundary collectives]: the first forward after an optimizer step
    issues every resident's gather, and the end of backward every resident's reduction,
    before waiting for any of them."""
    recorded = probe("record_resident_schedule")
    log, residents = recorded["log"], recorded["residents"]
    assert len(residents) == 2, residents
    ops = [(i, e.op) for i, e in enumerate(log) if e.unit in residents and e.op.startswith(kind)]
    issued = [i for i, op in ops if op == f"{kind}_issue"]
    waited = [i for i, op in ops if op == f"{kind}_wait"]
    assert len(issued) == len(waited) == 2, ops
    assert max(issued) < min(waited)


def test_hf_gradient_checkpointing_matches_and_keeps_the_schedule() -> None:
    results = probe("hf_gradient_checkpointing")
    for plain, checkpointed in zip(results[False]["grads"], results[True]["grads"], strict=True):
        torch.testing.assert_close(checkpointed, plain, rtol=1e-6, atol=1e-7)
    recorded = results[True]
    assert four_condition_violations(recorded["log"], recorded["slots"]) == []


# The checker itself must catch each kind of violation.
SLOTS = {"a": (0, 0), "b": (1, 1), "c": (0, 0)}


def _events(*specs: str) -> list[ScheduleEvent]:
    events = []
    for spec in specs:
        op, unit = spec.split(":")
        grad_op = op.startswith(("reduce_scatter", "all_reduce"))
        slot = SLOTS[unit][1] if grad_op else SLOTS[unit][0]
        events.append(ScheduleEvent(op, unit, slot))
    return events


@pytest.mark.parametrize(
    ("condition", "log"),
    [
        ("condition 1", _events("gather_issue:a", "forward_start:a")),
        (
            "condition 2",
            _events("gather_issue:a", "gather_wait:a", "forward_start:a", "gather_issue:c"),
        ),
        (
            "condition 3",
            _events(
                "gather_issue:a",
                "gather_wait:a",
                "backward_start:a",
                "backward_end:a",
                "reduce_scatter_issue:a",
                "gather_issue:c",
                "gather_wait:c",
                "backward_start:c",
            ),
        ),
        (
            "condition 4",
            _events(
                "gather_issue:a", "gather_wait:a", "backward_start:a", "reduce_scatter_issue:a"
            ),
        ),
        (
            "condition 3",  # hybrid: a reduce_scatter into a shard still being all-reduced
            _events(
                "gather_issue:a",
                "gather_wait:a",
                "backward_start:a",
                "backward_end:a",
                "reduce_scatter_issue:a",
                "reduce_scatter_wait:a",
                "all_reduce_issue:a",
                "gather_issue:c",
                "gather_wait:c",
                "backward_start:c",
                "backward_end:c",
                "reduce_scatter_issue:c",
            ),
        ),
        (
            "condition 3",  # hybrid: an all_reduce of a shard not reduce-scattered yet
            _events(
                "gather_issue:a",
                "gather_wait:a",
                "backward_start:a",
                "backward_end:a",
                "reduce_scatter_issue:a",
                "all_reduce_issue:a",
            ),
        ),
    ],
)
def test_schedule_checker_catches_each_violation(condition: str, log) -> None:
    violations = four_condition_violations(log, SLOTS)
    assert any(v.startswith(condition) for v in violations), violations


# -- traffic, memory, allocations -----------------------------------------------------------


@pytest.mark.parametrize("zero_stage", [3, 2])
def test_collectives_per_step_match_the_design(zero_stage: int) -> None:
    result = probe("traffic_memory_and_allocations", zero_stage=zero_stage)
    calls = result["traffic"]["calls"]
    # The blocks plus the root units: the embedding and the output head ([Note: root units]).
    units, residents = core_probes.N_LAYERS + 2, len(result["residents"])
    assert len(result["unit_padded"]) == units
    # Forward gathers every unit once. ZeRO-3 re-gathers in backward all but the
    # last two units, which still hold their buffers when backward starts, and the
    # embedding, whose backward reads no weights ([Note: weightless backward]).
    backward_gathers = units - 3 if zero_stage == 3 else 0
    assert calls["all_gather"] == units + backward_gathers + residents
    # One reduce_scatter per unit, one per resident group (the norms) at the end.
    assert calls["reduce_scatter"] == units + residents
    # One tiny all_reduce per backward: which parameters got a grad on any rank
    # ([Note: per-parameter grads]), one byte per parameter.
    assert calls["all_reduce"] == 1
    assert result["traffic"]["bytes"]["all_reduce"] == len(result["param_names"])
    assert set(calls) == {"all_gather", "reduce_scatter", "all_reduce"}


def test_buffer_bytes_equal_the_formula() -> None:
    result = probe("traffic_memory_and_allocations")
    memory, fp32 = result["memory"], 4
    padded, shards = result["unit_padded"], result["unit_shards"]
    # Each of the two slots is sized to the largest unit using it (units alternate).
    slots = [max(padded[k::2]) for k in (0, 1)]
    assert memory["weight_buffers"] == sum(slots) * fp32
    # No reduced-shard twin: reductions write the gradient window ([Note: reduce into the
    # gradient window]).
    assert memory["grad_buffers"] == sum(slots) * fp32
    assert memory["resident_buffers"] == sum(
        2 * padded * fp32 for _, padded, _ in result["residents"]
    )
    shards = sum(result["unit_shards"]) + sum(shard for _, _, shard in result["residents"])
    assert memory["master_shards"] == shards * fp32
    assert memory["compute_shards"] == 0  # fp32 compute gathers straight from the master


def test_zero2_keeps_one_weight_buffer_per_unit() -> None:
    result = probe("traffic_memory_and_allocations", zero_stage=2)
    # One per unit, each its own unit's size.
    assert result["memory"]["weight_buffers"] == sum(result["unit_padded"]) * 4


def test_steady_state_allocates_no_unit_sized_tensor() -> None:
    result = probe("traffic_memory_and_allocations")
    assert result["smallest_unit"] > 40_000  # the probe model is big enough to tell
    # The only large allocations: one gradient per master parameter, made at the
    # first backward after zero_grad(set_to_none=True) (which frees it), as torch
    # does for any parameter's .grad. Nothing per unit, nothing per gather.
    grads = sorted(shape for _, shape in result["large_allocations"])
    assert grads == sorted(s for s in result["master_shapes"] if s[0] >= result["smallest_unit"])


def test_gradients_are_freed_by_zero_grad() -> None:
    result = probe("traffic_memory_and_allocations")
    assert result["memory"]["grad_shards"] == 0  # the probe ends with zero_grad()


def test_module_keeps_its_parameter_names() -> None:
    result = probe("traffic_memory_and_allocations")
    assert result["param_names"] == result["unsharded_param_names"]


# -- full weights, shards by original name ---------------------------------------------------


def test_summon_full_params_and_named_shards() -> None:
    result = probe("summon_and_shards")
    assert result["inside_equal"]
    assert torch.equal(result["after_writeback"], torch.full_like(result["after_writeback"], 2.0))
    # Outside forward the attribute is the sharded parameter: full shape, this rank's piece.
    kind, shape, local_numel = result["outside_forward"]
    shards, shapes = result["shards"], result["shapes"]
    assert (kind, shape) == ("RangeShardedTensor", (64, 64))
    assert local_numel == shards.get("layers.1.attention.wq.weight", (0, 0, 0))[2]
    assert result["logits_finite"]
    # Rank 0 owns the first half of each unit's flat tensor: a prefix of its first params.
    first = shards["layers.0.attention.wq.weight"]
    assert first[0] == 0 and first[1] - first[0] == first[2]
    assert all(name in shapes for name in shards)


# -- errors ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("nested", "called inside unit 'layers.0'"),
        ("tied_across_units", "one tied tensor used by different sharded groups"),
        ("no_trainable", "no trainable parameters"),
        ("mixed_devices", "several devices"),
        ("no_blocks", "could not auto-detect the blocks"),
        ("bad_units_class", "matched no submodule"),
        ("bad_zero_stage", "zero_stage must be 2 or 3"),
    ],
)
def test_bad_input_gets_a_clear_error(case: str, expected: str) -> None:
    message = probe("error_messages", world_size=1)[case]
    assert expected in message, message


def test_tied_error_names_both_parameters() -> None:
    message = probe("error_messages", world_size=1)["tied_across_units"]
    assert "layers.1.weight" in message and "head.weight" in message


def test_a_module_shared_by_two_units_is_refused_naming_both() -> None:
    message = probe("error_messages", world_size=1)["module_shared_by_units"]
    assert message.startswith("ValueError: module 'layers.1.attention.wq' is the same object"), (
        message
    )
    assert "unit 'layers.0'" in message and "copy.deepcopy" in message


def test_wrong_backend_for_the_device_is_rejected() -> None:
    from lightning_yafsdp.core.plan.sharding import check_backend

    with pytest.raises(ValueError, match="need 'nccl'"):
        check_backend("gloo", torch.device("cuda", 0))
    with pytest.raises(ValueError, match="need 'gloo'"):
        check_backend("nccl", torch.device("cpu"))
    check_backend("cpu:gloo,cuda:nccl", torch.device("cpu"))
