"""The units of the schedule and the buffer slots they need, from a plan's layouts.

A unit of the plan is one unit of the schedule, except a vocabulary-sized
embedding or head, which is one per row chunk ([Note: row chunks]), and a tied
embedding and head, which is one per row chunk of each use, the uses at their
modules' places ([Note: tied row chunks]). Both the engine (what it allocates) and
``yafsdp estimate`` (what it predicts) size the buffers from this list, so the two
agree to the byte.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_yafsdp.core.runtime.layout import FlatLayout
from lightning_yafsdp.core.runtime.row_chunks import RowChunk


@dataclass(frozen=True)
class Segment:
    """One run of the schedule: a unit of the plan, or one use of a chunked one.

    Attributes:
        unit: the unit's index in the plan.
        use: which of the unit's modules this run computes (a chunked unit of several
            modules, a tied embedding and head, runs once per module); 0 otherwise.
        reads_weights: whether its backward reads its weights ([Note: weightless
            backward]).
    """

    unit: int
    use: int
    reads_weights: bool


@dataclass(frozen=True)
class ScheduledUnit:
    """What one unit of the schedule gathers, reduces and moves (elements).

    Attributes:
        gathered: what its gather writes into its weight slot (trainable + frozen).
        grads: its full-size grads in its grad slot.
        staged: its shard cast before the gather under mixed precision (row chunks
            cast as they copy: 0).
        gather_comm / reduce_comm: elements its gather / reduce count in ``CommStats``.
        replicated: elements its hybrid-sharding all_reduce across the replicas sends
            on shard rank 0 (a row chunk: the parts rank 0 owns; ranks differ by padding).
        reads_weights: whether its backward reads its weights (re-gathered, ZeRO-3).
        is_block: a block of the policy (False: a root unit or a chunk of one).
        shares_weights_with: ZeRO-2, a tied weight's head chunk: the schedule index of the
            embedding chunk of the same rows, whose weight slot (and gathered rows) it
            uses, so it gathers nothing ([Note: tied row chunks]); else None.
    """

    gathered: int
    grads: int
    staged: int
    gather_comm: int
    reduce_comm: int
    replicated: int
    reads_weights: bool
    is_block: bool
    shares_weights_with: int | None = None


def scheduled_units(
    layout: FlatLayout,
    frozen: FlatLayout | None,
    chunks: tuple[RowChunk, ...] | None,
    *,
    reads_weights: bool,
    is_block: bool,
) -> list[ScheduledUnit]:
    """The schedule's units for one unit of the plan (several when it is chunked)."""
    if chunks is None:
        frozen_numel = frozen.padded_numel if frozen is not None else 0
        gathered = layout.padded_numel + frozen_numel
        return [
            ScheduledUnit(
                gathered,
                layout.padded_numel,
                layout.shard_numel,
                gathered,
                layout.padded_numel,
                layout.shard_numel,
                reads_weights,
                is_block,
            )
        ]
    if not layout.spans:  # frozen rows after an empty trainable part: no grads, no reduce
        return [
            ScheduledUnit(
                1 + chunk.layout.padded_numel,
                1,
                0,
                chunk.comm_numel,
                0,
                0,
                reads_weights,
                is_block,
            )  # fmt: skip
            for chunk in chunks
        ]
    return [
        ScheduledUnit(
            chunk.layout.padded_numel,
            chunk.layout.padded_numel,
            0,
            chunk.comm_numel,
            chunk.comm_numel,
            chunk.owned_numel(0),
            reads_weights,
            is_block,
        )
        for chunk in chunks
    ]


@dataclass(frozen=True)
class BufferSizes:
    """Element counts of the engine's buffers, per slot.

    Unit ``i`` of the schedule uses weight slot ``weight_slots[i]`` (ZeRO-3: ``i % 2``;
    ZeRO-2: one per unit, but a unit sharing another's weights uses that unit's) and grad
    slot ``i % 2``; each slot is sized to the largest unit using it, not to the largest
    unit overall (ZeRO-2's per-unit buffers are each their own unit's size).
    """

    weights: list[int]
    weight_slots: list[int]
    grads: list[int]
    staging: list[int]


def buffer_sizes(schedule: list[ScheduledUnit], zero_stage: int) -> BufferSizes:
    """Slot sizes of the units of the schedule, in schedule order."""

    def per_slot(sizes: list[int], slots: int) -> list[int]:
        return [max(sizes[k::slots], default=0) for k in range(slots)]

    if zero_stage == 3:
        slot_of, count = [i % 2 for i in range(len(schedule))], 2
    else:
        slot_of, count = [], 0
        for unit in schedule:
            if unit.shares_weights_with is not None:
                slot_of.append(slot_of[unit.shares_weights_with])
            else:
                slot_of.append(count)
                count += 1
    weights = [0] * max(count, 1)
    for unit, slot in zip(schedule, slot_of, strict=True):
        weights[slot] = max(weights[slot], unit.gathered)
    return BufferSizes(
        weights,
        slot_of,
        per_slot([u.grads for u in schedule], 2),
        per_slot([u.staged for u in schedule], 2),
    )
