"""Units sized by bytes: consecutive small blocks gathered and reduced as one unit.

[Note: grouped blocks]
Every unit costs a fixed price per collective on top of its bytes: the launch, the order
guard's tag exchange, the hooks' bookkeeping and the backend's latency (measured with
``benchmarks/compare.py --breakdown``). A block of a small model (an 8-layer dim-256
Llama: 0.7M elements, 2.9 MB in fp32) moves too few bytes to pay it: its gather costs
about what an empty collective costs. FSDP answers with size-based wrapping, YaFSDP with
layers per unit; here consecutive blocks of one container (``model.layers.2`` and
``model.layers.3``) become ONE unit: one flat layout, one gather, one reduce-scatter, one
pair of buffer slots sized to the group, a third as many tag exchanges. The members keep
their own forward hooks and run as the calls of one unit ([Note: unit state machine]:
a unit called k times is gathered once and reduced after its last call), so skipping a
member (LayerDrop), calling members out of order or recomputing one under activation
checkpointing work as for any unit. Exactness is unchanged: the same grads are summed in
the same dtype, in a bigger flat buffer.

``blocks_per_unit="auto"`` (the default) groups as many auto-detected blocks as fit in
``MIN_UNIT_NUMEL`` elements, never more, keeping at least ``MIN_BLOCK_UNITS`` units of
blocks so that the next unit's gather still overlaps the current one's compute (the first
unit's gather is always exposed). A group never exceeds the threshold because a bigger
unit costs where latency no longer dominates: its slots (memory), its exposed first
gather, and on CPU the gloo copies of a buffer twice as large. Measured on debug-50m
(blocks of 3.1M elements, 2 gloo ranks, three interleaved rounds; ``benchmarks/compare.py
--strategies floor,ddp,yafsdp,yafsdp-ungrouped``): pairs of 6.3M cost 120 ms more CPU
per step than single blocks in both of two runs (+534 against +410 ms over the floor),
and 47 MiB of peak RSS. Blocks of more than 2M elements (a Llama of dim 512 and up)
stay one per unit. Units given with ``units=`` stay as given unless
``blocks_per_unit`` is a number. The grouping is part of the plan, so ``yafsdp estimate``
sizes the same slots as the engine.
"""

from __future__ import annotations

import math
import operator
import re

from torch import nn

# Elements a group of blocks may hold: below it a gather is latency-bound: at ~2-5 GB/s
# (gloo on CPU loopback) or ~100 GB/s (NCCL within a node) per rank, 4M elements (8-16
# MB) take several times a collective's fixed cost (0.3-1 ms on gloo here, ~30 us on NCCL).
MIN_UNIT_NUMEL = 4 * 2**20
# Units of blocks the auto rule keeps at least: prefetch needs a next unit to overlap.
MIN_BLOCK_UNITS = 4

BlocksPerUnit = int | str
_INDEXED = re.compile(r"^(.*)\.(\d+)$")


def group_blocks(
    blocks: list[tuple[str, nn.Module]], blocks_per_unit: BlocksPerUnit
) -> list[tuple[str, list[nn.Module]]]:
    """The units made of ``blocks`` (``(name, module)`` in module order): runs of
    consecutive siblings (``prefix.i``, ``prefix.i+1``, ...) split into groups of at most
    ``blocks_per_unit`` (``"auto"``: see the note), each named ``prefix.first-last``."""
    per_unit = _blocks_per_unit(blocks, blocks_per_unit)
    if per_unit == 1:
        return [(name, [module]) for name, module in blocks]
    units: list[tuple[str, list[nn.Module]]] = []
    for run in _sibling_runs(blocks):
        count = math.ceil(len(run) / per_unit)
        # Near-equal groups (sizes differ by at most one, larger first) rather than a short
        # last one: 8 blocks by 3 are 3 + 3 + 2.
        size, larger = divmod(len(run), count)
        start = 0
        for group in range(count):
            end = start + size + (group < larger)
            members = run[start:end]
            units.append((_group_name(members), [module for _, module in members]))
            start = end
    return units


def auto_blocks_per_unit(block_numels: list[int]) -> int:
    """How many blocks of these sizes (elements) ``"auto"`` puts in one unit: as many as
    fit in ``MIN_UNIT_NUMEL`` (see the note)."""
    if not block_numels:
        return 1
    fitting = MIN_UNIT_NUMEL // max(max(block_numels), 1)
    return max(1, min(fitting, len(block_numels) // MIN_BLOCK_UNITS))


def _blocks_per_unit(blocks, blocks_per_unit: BlocksPerUnit) -> int:
    if blocks_per_unit == "auto":
        return auto_blocks_per_unit([_numel(module) for _, module in blocks])
    if isinstance(blocks_per_unit, bool) or not hasattr(blocks_per_unit, "__index__"):
        raise ValueError(f"blocks_per_unit must be 'auto' or an int >= 1, got {blocks_per_unit!r}")
    blocks_per_unit = operator.index(blocks_per_unit)
    if blocks_per_unit < 1:
        raise ValueError(f"blocks_per_unit must be 'auto' or an int >= 1, got {blocks_per_unit}")
    return blocks_per_unit


def _sibling_runs(blocks) -> list[list[tuple[str, nn.Module]]]:
    """``blocks`` cut into runs of consecutive indices under one container.

    Sorted by index first: the policy lists blocks of alternating classes (Jamba's Mamba
    and attention layers) class by class, and their runs are still consecutive.
    """
    runs: list[list[tuple[str, nn.Module]]] = []
    previous = None
    for name, module in sorted(blocks, key=_position):
        match = _INDEXED.match(name)
        key = (match.group(1), int(match.group(2))) if match else None
        follows = key is not None and previous is not None and previous == (key[0], key[1] - 1)
        if follows:
            runs[-1].append((name, module))
        else:
            runs.append([(name, module)])
        previous = key
    return runs


def _position(block: tuple[str, nn.Module]) -> tuple:
    """Container, then index within it (``layers.10`` after ``layers.9``)."""
    match = _INDEXED.match(block[0])
    return (match.group(1), int(match.group(2))) if match else (block[0], -1)


def _group_name(members: list[tuple[str, nn.Module]]) -> str:
    if len(members) == 1:
        return members[0][0]
    last_index = _INDEXED.match(members[-1][0]).group(2)
    return f"{members[0][0]}-{last_index}"


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
