"""A contiguous element range of a parameter, as torch.distributed.checkpoint chunks.

[Note: element ranges as boxes]
A rank owns a contiguous run ``[start, end)`` of each flattened parameter. DCP
describes a shard as a box (an offset and a size per dimension) of the tensor's
FULL shape, and neither a plain tensor nor a DTensor can say "elements 100 to
1300 of a 32 x 64 matrix". A contiguous run of a row-major tensor is, however,
the union of at most ``2 * ndim - 1`` boxes: a partial first row, a block of
whole rows, a partial last row (recursively for the partial rows), and each of
those boxes is itself contiguous in memory. So every rank writes its run as a
few boxes of the full-shape tensor, and the checkpoint's metadata holds true
shapes: any DCP reader (Lightning's consolidation utility included) rebuilds
the full tensors, and a reader at another world size asks for the boxes of ITS
runs, which DCP intersects with the stored boxes.

``FlatRange`` is that run in a state dict; the planners below teach DCP to
write and read it. Everything else in a state dict goes through DCP's default
handling.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), one entry per dimension


def range_to_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """Split elements ``[start, end)`` of a row-major tensor of ``shape`` into boxes.

    Boxes come in element order, so box ``i`` covers the next ``prod(sizes_i)``
    elements of the run. Returns ``[]`` for an empty run.
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= end <= total:
        raise ValueError(f"range [{start}, {end}) is outside a tensor of {total} elements")
    if start == end:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first_row, last_row = start // inner, (end - 1) // inner
    rest = shape[1:]

    def in_row(row: int, lo: int, hi: int) -> list[Box]:
        return [((row, *off), (1, *size)) for off, size in range_to_boxes(rest, lo, hi)]

    if first_row == last_row:
        return in_row(first_row, start - first_row * inner, end - first_row * inner)
    boxes: list[Box] = []
    full_begin, full_end = first_row, last_row + 1
    if start % inner:
        boxes += in_row(first_row, start % inner, inner)
        full_begin += 1
    tail = in_row(last_row, 0, end % inner) if end % inner else []
    if tail:
        full_end -= 1
    if full_end > full_begin:
        boxes.append(((full_begin, *([0] * len(rest))), (full_end - full_begin, *rest)))
    return boxes + tail


class FlatRange:
    """Elements ``[start, end)`` of a flattened tensor of ``shape``, held by this rank.

    Args:
        shape: the full tensor's shape.
        start: first element (of the flattened full tensor) held here.
        end: one past the last.
        local: 1-D tensor of ``end - start`` elements; saving reads it, loading
            writes into it in place (a view into a master shard loads straight
            into the shard).
    """

    def __init__(self, shape: Sequence[int], start: int, end: int, local: torch.Tensor) -> None:
        if local.dim() != 1 or local.numel() != end - start:
            raise ValueError(
                f"local must be 1-D with {end - start} elements, got shape {tuple(local.shape)}"
            )
        self.shape = torch.Size(shape)
        self.start = start
        self.end = end
        self.local = local
        self.chunks: list[ChunkStorageMetadata] = []
        self.views: list[torch.Tensor] = []
        cursor = 0
        for offsets, sizes in range_to_boxes(self.shape, start, end):
            numel = math.prod(sizes)
            self.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            self.views.append(local.narrow(0, cursor, numel).view(sizes))
            cursor += numel
        self._by_offsets = {chunk.offsets: view for chunk, view in zip(self.chunks, self.views)}

    def __repr__(self) -> str:
        return f"FlatRange(shape={tuple(self.shape)}, start={self.start}, end={self.end})"

    @property
    def dtype(self) -> torch.dtype:
        return self.local.dtype

    def write_items(self, fqn: str) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape),
            )
            for chunk in self.chunks
        ]

    def view_at(self, offsets: torch.Size) -> torch.Tensor:
        return self._by_offsets[torch.Size(offsets)]


def _is_leaf_tensor(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor)


class RangeSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus ``FlatRange`` values (written as their boxes).

    Plain tensors are treated as replicated (DCP keeps one copy); other values
    are pickled. ``write_ranges=False`` (the other replicas of a hybrid-sharded
    model, which hold the same ranges as the first) writes no ``FlatRange``.
    """

    def __init__(self, *, write_ranges: bool = True) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=False)
        self.write_ranges = write_ranges

    def create_local_plan(self) -> SavePlan:
        items: list[WriteItem] = []
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, FlatRange):
                items += obj.write_items(fqn) if self.write_ranges else []
            elif _is_leaf_tensor(obj):
                offsets = torch.Size([0] * obj.dim())
                items.append(
                    WriteItem(
                        index=MetadataIndex(fqn, offsets),
                        type=WriteItemType.TENSOR,
                        tensor_data=TensorWriteData(
                            chunk=ChunkStorageMetadata(offsets, obj.size()),
                            properties=TensorProperties.create_from_tensor(obj),
                            size=obj.size(),
                        ),
                    )
                )
            else:
                items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
        self.plan = SavePlan(items, planner_data=self.mappings)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, FlatRange):
            return obj.view_at(index.offset)
        return super().lookup_object(index)


class RangeLoadPlanner(DefaultLoadPlanner):
    """Reads a flat ``{fqn: target}`` dict: ``FlatRange`` and tensors in place, objects by value.

    Keys are DCP's flattened keys (``metadata.state_dict_metadata``). A target
    for a pickled object may be anything (``None``); after ``dcp.load`` the
    loaded object is in ``loaded_objects[fqn]``.
    """

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.loaded_objects: dict[str, Any] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # Not DefaultLoadPlanner's: its meta-tensor pass replaces unknown values
        # (a FlatRange) by None.
        self.original_state_dict = state_dict
        self.state_dict = state_dict
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        requests: list[ReadItem] = []
        for fqn, obj in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            if isinstance(md, BytesStorageMetadata):
                requests += _bytes_read_items(fqn)
            elif isinstance(obj, FlatRange):
                requests += create_read_items_for_chunk_list(fqn, md, obj.chunks)
            else:
                chunk = ChunkStorageMetadata(torch.Size([0] * obj.dim()), obj.size())
                requests += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(requests)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.loaded_objects[read_item.dest_index.fqn] = torch.load(value, weights_only=False)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, FlatRange):
            return obj.views[index.index]
        return obj


def _bytes_read_items(fqn: str) -> list[ReadItem]:
    return [
        ReadItem(
            type=LoadItemType.BYTE_IO,
            dest_index=MetadataIndex(fqn),
            dest_offsets=torch.Size((0,)),
            storage_index=MetadataIndex(fqn),
            storage_offsets=torch.Size((0,)),
            lengths=torch.Size((0,)),
        )
    ]
