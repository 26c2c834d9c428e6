"""The engine's CPU gathers and reductions as point-to-point exchanges.

[Note: pairwise exchanges on gloo]
gloo's collectives cost the CPU more than the bytes they move. Its all_gather
receives into a flat temporary and copies that into the output; its
reduce_scatter flattens its input and is slower than its all_reduce, which moves
twice the bytes a reduce_scatter needs (the engine used that all_reduce until
this note).
On a 2-core machine that CPU is taken from compute: gloo's workers were most of
our step overhead over DDP's (docs/performance.md, "Step overhead: where the
limit is"). gloo's point-to-point send and recv move the bytes once, socket to
destination (on gloo's transport thread, or on the caller's when the peer's
receive is already posted). Measured at 2 ranks, 12.8 MB per call, per process
CPU time of every thread (``python benchmarks/gloo_exchanges.py``): a gather
6.1 ms as gloo's all_gather, 4.3 ms pairwise (0.71x); a reduction 7.4 ms as
all_reduce plus copy-out, 10.0 ms as gloo's reduce_scatter, 3.2 ms pairwise
(0.43x). Tiny exchanges (the order guard's tags) cost what a tiny collective costs.

So on CPU each rank:
- gathers by copying its own shard into its slice of the output and sending the
  shard to every peer, receiving each peer's shard straight into that peer's slice;
- reduce-scatters by sending every peer that peer's chunk of the full tensor and
  receiving the peers' copies of its own chunk, which are summed into the output
  when the exchange is waited. The output receives the first one directly when it
  is a tensor of its own (a reduction into the gradient window), so two ranks need
  no scratch; each further copy (and the first, for a reduction in place in the
  grad buffer) lands in a chunk of scratch, freed at the wait. Summing two values
  is exact in either order, so at two ranks the result is bit-identical to an
  all_reduce's; at three or more each rank sums in ring order from itself.

Matching: gloo pairs a send with the receive of the same tag from the same peer,
in the order they were posted. Every rank issues the engine's exchanges in the
same order (which the order guard checks), so the n-th exchange of a tag pairs
with the n-th on every peer. A receive that gets more bytes than it posted aborts
the process inside gloo (an uncatchable ``EnforceNotMet``); one that gets fewer
completes with stale bytes. Where ranks issue different exchanges, the order guard
must raise a clean error instead. So the tag encodes a channel (gather, reduction,
the guard's own tags) and the bytes per peer: exchanges of different sizes never
pair up; they wait while the guard's fixed-size tag exchange completes and raises
on every rank. (Two sizes share a tag only when they differ by a multiple of
512 MiB.) On an exchange line ([Note: exchange lines]) the tag hashes the bytes
with the exchange's identity instead (its position on the line, the model, the
kind, the group index, the elements), so that exchanges of different collectives
do not pair up even at equal sizes, and the line's watch raises. Sizes, dtypes
and layouts are checked before anything is posted.

Row chunks' parts go on a line too: ``broadcast_pairwise`` (the owner sends its
part to every peer) and ``reduce_pairwise`` (every peer sends its copy to the
owner, which sums them in ring order from itself when waited).

CUDA keeps NCCL's collectives, which are already pairwise rings on the GPU.
"""

from __future__ import annotations

import zlib

import torch
from torch.distributed import ProcessGroup

from lightning_yafsdp.core.comm.work_list import WorkList

# gloo's tags are non-negative 32-bit ints: two bits of channel, 29 of byte count.
_CHANNEL_TAGS = {"gather": 1 << 29, "reduce_scatter": 2 << 29, "order_guard": 3 << 29}
_NBYTES_BITS = (1 << 29) - 1


def exchange_tag(channel: str, nbytes: int, key: int | None = None) -> int:
    """The gloo tag of an exchange: its channel and (most of) its bytes per peer.

    ``key``: the exchange's identity on an exchange line ([Note: exchange lines]),
    hashed with the bytes instead, so that exchanges of different collectives never
    pair up even at equal sizes.
    """
    if key is None:
        return _CHANNEL_TAGS[channel] | (nbytes & _NBYTES_BITS)
    return _CHANNEL_TAGS[channel] | (zlib.crc32(nbytes.to_bytes(8, "little"), key) & _NBYTES_BITS)


def gather_pairwise(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup,
    *,
    channel: str = "gather",
    key: int | None = None,
) -> WorkList:
    """Every rank's ``shard`` into its slice of ``output`` (rank order), asynchronously.

    ``output`` is written through ``.data`` by the caller's contract
    ([Note: version-preserving gather]): pass ``output.data``. ``channel``: the
    order guard's tags travel apart from the data ("order_guard"). ``key``: see
    ``exchange_tag``.
    """
    rank, world, numel = group.rank(), group.size(), shard.numel()
    _check_sizes("gather", output, shard, per_rank=numel, world=world)
    if numel == 0:
        return WorkList([])
    slices = output.split(numel)
    slices[rank].copy_(shard)
    tag = exchange_tag(channel, numel * shard.element_size(), key)
    works = []
    for peer in _peers(rank, world):
        works.append(group.send([shard], peer, tag))
        works.append(group.recv([slices[peer]], peer, tag))
    return WorkList(works)


def reduce_scatter_pairwise(
    output: torch.Tensor, full: torch.Tensor, group: ProcessGroup, *, key: int | None = None
) -> WorkList:
    """The sum over ranks of this rank's chunk of ``full``, into ``output``, asynchronously.

    ``full`` must not be written until the exchange is waited (its chunks are being
    sent); ``output`` may be this rank's own chunk of ``full`` (a reduction in place).
    ``key``: see ``exchange_tag``.
    """
    rank, world, numel = group.rank(), group.size(), output.numel()
    _check_sizes("reduce_scatter", full, output, per_rank=numel, world=world)
    if numel == 0:
        return WorkList([])
    chunks = full.split(numel)
    mine = chunks[rank]
    peers = _peers(rank, world)
    in_place = output.data_ptr() == mine.data_ptr()
    # Where each peer's copy of this rank's chunk lands: the output itself for the
    # first peer when the output is not our own chunk, scratch for the others.
    scratch = [torch.empty_like(mine) for _ in peers[0 if in_place else 1 :]]
    landing = scratch if in_place else [output, *scratch]
    tag = exchange_tag("reduce_scatter", numel * full.element_size(), key)
    works = []
    for peer, into in zip(peers, landing):
        works.append(group.send([chunks[peer]], peer, tag))
        works.append(group.recv([into], peer, tag))

    def sum_into_output() -> None:
        with torch.no_grad():
            if not in_place:
                output.add_(mine)
            for received in scratch:
                output.add_(received)

    return WorkList(works, then=sum_into_output)


def broadcast_pairwise(
    tensor: torch.Tensor, src: int, group: ProcessGroup, *, key: int
) -> WorkList:
    """Group rank ``src``'s ``tensor`` into every rank's ``tensor``, asynchronously: the
    source sends it to each peer (a row chunk's part, on an exchange line)."""
    rank, world = group.rank(), group.size()
    if tensor.numel() == 0:
        return WorkList([])
    tag = exchange_tag("gather", tensor.numel() * tensor.element_size(), key)
    if rank == src:
        return WorkList([group.send([tensor], peer, tag) for peer in _peers(rank, world)])
    return WorkList([group.recv([tensor], src, tag)])


def reduce_pairwise(tensor: torch.Tensor, dst: int, group: ProcessGroup, *, key: int) -> WorkList:
    """The sum over ranks of ``tensor`` into group rank ``dst``'s ``tensor``, asynchronously.

    Each peer sends its copy to ``dst``, which sums them in ring order from itself when
    the exchange is waited (as ``reduce_scatter_pairwise``). The peers' ``tensor`` must
    not be written until waited.
    """
    rank, world = group.rank(), group.size()
    if tensor.numel() == 0:
        return WorkList([])
    tag = exchange_tag("reduce_scatter", tensor.numel() * tensor.element_size(), key)
    if rank != dst:
        return WorkList([group.send([tensor], dst, tag)])
    peers = _peers(rank, world)
    received = [torch.empty_like(tensor) for _ in peers]
    works = [group.recv([into], peer, tag) for peer, into in zip(peers, received)]

    def sum_into_tensor() -> None:
        with torch.no_grad():
            for copy in received:
                tensor.add_(copy)

    return WorkList(works, then=sum_into_tensor)


def _check_sizes(
    kind: str, whole: torch.Tensor, part: torch.Tensor, *, per_rank: int, world: int
) -> None:
    """Refuse, before anything is posted, what would make a peer's transfer misfit:
    gloo aborts a process whose receive gets another size."""
    for name, tensor in (("whole", whole), ("part", part)):
        if tensor.dim() != 1 or not tensor.is_contiguous():
            raise ValueError(
                f"{kind}: the {name} tensor must be flat and contiguous, got shape "
                f"{tuple(tensor.shape)} (contiguous: {tensor.is_contiguous()})"
            )
    if whole.numel() != per_rank * world or whole.dtype != part.dtype:
        raise ValueError(
            f"{kind}: {whole.numel()} {whole.dtype} elements cannot be {world} ranks' "
            f"{per_rank} {part.dtype} elements"
        )


def _peers(rank: int, world: int) -> list[int]:
    """The other ranks, starting after this one (so that rank pairs start in a ring)."""
    return [(rank + step) % world for step in range(1, world)]
