"""Flat layout math: where each parameter of a sharded group lives.

A group (a transformer block, the norm group, the root remainder) stores all of
its parameters back to back in ONE flat 1-D tensor. The flat tensor is padded
so that it splits into ``world_size`` equal, contiguous shards; rank ``r`` owns
elements ``[r * shard_numel, (r + 1) * shard_numel)``. Everything here is pure
arithmetic on shapes: no tensors, no process groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# [Note: parameter alignment]
# Each parameter starts at a multiple of PARAM_ALIGN_ELEMENTS inside the flat
# tensor, so that every view handed to a kernel is at least 32-byte aligned in
# bf16 (64 in fp32); vectorised CUDA kernels take slow paths on misaligned
# views. The alignment gaps are padding: always zero in weights and grads.
PARAM_ALIGN_ELEMENTS = 16


@dataclass(frozen=True)
class ParamSpan:
    """One parameter's place in a flat group.

    Attributes:
        name: the parameter's original fully qualified name (first owner).
        shape: the parameter's original shape.
        offset: index of its first element in the flat tensor (elements).
        numel: number of elements.
    """

    name: str
    shape: torch.Size
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class ShardSlice:
    """The part of one parameter that one rank owns.

    Attributes:
        param_start: first owned element, counted in the flattened parameter.
        param_end: one past the last owned element (flattened parameter).
        shard_offset: where that run starts inside the rank's shard.
    """

    param_start: int
    param_end: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


class FlatLayout:
    """Offsets, padding and shard ranges of one flat group.

    Args:
        names: original names of the group's parameters, in flat order.
        shapes: their shapes, same order.
        world_size: number of ranks the flat tensor is split across.
    """

    def __init__(self, names: Sequence[str], shapes: Sequence[torch.Size], world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if len(names) != len(shapes):
            raise ValueError("names and shapes must have the same length")
        spans = []
        cursor = 0
        for name, shape in zip(names, shapes, strict=True):
            cursor = _round_up(cursor, PARAM_ALIGN_ELEMENTS)
            numel = math.prod(shape)
            spans.append(ParamSpan(name=name, shape=torch.Size(shape), offset=cursor, numel=numel))
            cursor += numel
        self.spans: tuple[ParamSpan, ...] = tuple(spans)
        self.world_size = world_size
        self.numel = cursor
        self.padded_numel = _round_up(max(cursor, 1), world_size)
        self.shard_numel = self.padded_numel // world_size
        # Two layouts with the same signature have the same padding ranges.
        self.signature = (self.padded_numel, tuple((s.offset, s.numel) for s in spans))

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Flat element range ``[start, end)`` owned by ``rank``."""
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def padding_ranges(self) -> list[tuple[int, int]]:
        """Flat ranges that belong to no parameter (alignment gaps and the tail)."""
        gaps = []
        cursor = 0
        for span in self.spans:
            if span.offset > cursor:
                gaps.append((cursor, span.offset))
            cursor = span.end
        if self.padded_numel > cursor:
            gaps.append((cursor, self.padded_numel))
        return gaps

    def shard_slice(self, index: int, rank: int) -> ShardSlice | None:
        """The run of parameter ``index`` that ``rank`` owns, or None if it owns none."""
        span = self.spans[index]
        shard_start, shard_end = self.shard_range(rank)
        start = max(span.offset, shard_start)
        end = min(span.end, shard_end)
        if start >= end:
            return None
        return ShardSlice(
            param_start=start - span.offset,
            param_end=end - span.offset,
            shard_offset=start - shard_start,
        )


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
