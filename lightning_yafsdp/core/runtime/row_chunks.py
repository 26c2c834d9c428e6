"""Row chunks of a vocabulary-sized unit: which rows, where they live, who sends them.

[Note: row chunks]
Every current model family has a vocabulary of 128k-256k tokens, so its token
embedding and output head are 2-8x a decoder block. Sizing the two shared
buffer slots to them (embedding on one slot, head on the other) costs 3.8 GB per
GPU at Llama-3-8B on 64 GPUs: the buffers would be 2.4x what a block needs.

So a root unit that is one plain ``nn.Embedding`` or ``nn.Linear``, larger than
the largest block, is run as several *row chunks* (rows of the embedding table,
output features of the head), each at most one block's size, gathered in turn
into the ordinary slots (chunk ``c`` of a unit is a unit of the schedule of its
own, so chunks alternate slots and the next chunk is gathered while one computes).
The head computes ``cat(x @ W_c^T + b_c)`` over its chunks; the embedding picks,
per token, the row from the chunk that holds it (``where``, exact).

The parameters are untouched: one sharded parameter per original tensor, stored
in the unit's flat layout as before, so checkpoints, optimizers and
``summon_full_params`` do not know about chunks. Chunk ``c`` is a contiguous run
of the flattened weight (and of the bias), which lies in one or a few ranks'
shards. Its gather is therefore one ``broadcast`` per owning rank (each owner
sends its part; total bytes as an all_gather of the same rows) and its gradient
one ``reduce`` per owning rank, the owner adding its part into its grad shard.
The ``Transfer`` list below says, for one chunk, which rank owns which part.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_yafsdp.core.runtime.layout import FlatLayout

# At most this many chunks per module: each costs a unit's hooks and a few collectives
# per pass, so a tiny model with a huge vocabulary (blocks of a few thousand elements,
# a 50k x 16 table) gets chunks of 1/16 of the table instead of hundreds of them. Real
# models need 2-8 (Llama 3 8B: 3; Gemma 2: 5).
MAX_ROW_CHUNKS = 16


@dataclass(frozen=True)
class Transfer:
    """One owning rank's part of a chunk.

    Attributes:
        chunk_offset: where the part starts in the chunk's buffer layout.
        numel: its length.
        rank: the shard-group rank that owns it.
        shard_offset: where it starts inside that rank's shard of the unit.
    """

    chunk_offset: int
    numel: int
    rank: int
    shard_offset: int


@dataclass(frozen=True)
class RowChunk:
    """Rows ``[start, end)`` of a vocabulary-sized unit.

    Attributes:
        start / end: the rows (first dimension of every parameter of the unit).
        layout: the chunk's own buffer layout (one span per parameter of the unit,
            those rows only; ``world_size`` 1: it is never sharded).
        transfers: every owning rank's part, in chunk order.
    """

    start: int
    end: int
    layout: FlatLayout
    transfers: tuple[Transfer, ...]

    def owned_by(self, rank: int) -> list[Transfer]:
        return [t for t in self.transfers if t.rank == rank]

    def owned_numel(self, rank: int) -> int:
        return sum(t.numel for t in self.owned_by(rank))

    @property
    def comm_numel(self) -> int:
        """Elements the chunk's collectives move (its rows, without alignment padding)."""
        return sum(t.numel for t in self.transfers)


def split_rows(parent: FlatLayout, max_numel: int) -> list[RowChunk] | None:
    """Chunks of at most ``max_numel`` buffer elements each, or None if one would do.

    Every parameter of ``parent`` must share its first dimension (a weight and its
    bias). Chunks are as equal as rows allow; there are at most ``MAX_ROW_CHUNKS`` (then
    each is a ``1 / MAX_ROW_CHUNKS`` of the module, larger than ``max_numel``).
    """
    rows = parent.spans[0].shape[0]
    if parent.padded_numel <= max_numel or rows < 2:
        return None
    widest = -(-rows // MAX_ROW_CHUNKS)  # the rows of a chunk when there are MAX_ROW_CHUNKS
    max_numel = max(max_numel, _chunk(parent, 0, widest).layout.padded_numel)
    # Alignment gaps make a chunk slightly larger than its rows: one more chunk then.
    for count in range(max(2, -(-parent.padded_numel // max_numel)), rows + 1):
        bounds = [rows * c // count for c in range(count + 1)]
        chunks = [_chunk(parent, a, b) for a, b in zip(bounds, bounds[1:], strict=False)]
        if max(chunk.layout.padded_numel for chunk in chunks) <= max_numel:
            return chunks
    return None


def _chunk(parent: FlatLayout, start: int, end: int) -> RowChunk:
    names = [span.name for span in parent.spans]
    shapes = [(end - start, *span.shape[1:]) for span in parent.spans]
    layout = FlatLayout(names, shapes, world_size=1)
    transfers = []
    for span, own in zip(parent.spans, layout.spans, strict=True):
        row_numel = span.numel // span.shape[0]
        first = span.offset + start * row_numel  # in the parent's flat tensor
        transfers += _owners(parent, first, own.numel, own.offset)
    return RowChunk(start, end, layout, tuple(transfers))


def _owners(parent: FlatLayout, first: int, numel: int, chunk_offset: int) -> list[Transfer]:
    """The ranks whose shards hold parent elements ``[first, first + numel)``."""
    parts = []
    cursor, end = first, first + numel
    while cursor < end:
        rank = cursor // parent.shard_numel
        shard_start, shard_end = parent.shard_range(rank)
        stop = min(end, shard_end)
        parts.append(
            Transfer(chunk_offset + cursor - first, stop - cursor, rank, cursor - shard_start)
        )
        cursor = stop
    return parts
