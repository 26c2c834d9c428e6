"""The engine's collectives: pure functions over given tensors.

Every collective the engine issues goes through this file, so that the
communication volume can be counted in one place (``CommStats``) and the
torch API in use is chosen once (torch 2.13 recommends ``all_gather_single`` /
``reduce_scatter_single`` over the ``*_into_tensor`` spellings).
Streams are not handled here: the caller (``streams.CommScheduler``) decides on
which stream and with which waits a collective is issued.
"""

from __future__ import annotations

import atexit
import pickle
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from lightning_yafsdp.core import compat
from lightning_yafsdp.core.comm import step_timing
from lightning_yafsdp.core.comm.pairwise import (
    broadcast_pairwise,
    gather_pairwise,
    reduce_pairwise,
    reduce_scatter_pairwise,
)
from lightning_yafsdp.core.comm.work_list import WorkList

if TYPE_CHECKING:
    from lightning_yafsdp.core.comm.mesh import ShardMesh

# The torch-version shims (2.11 lacks the ``*_single`` names) live in core/compat.py.
_all_gather_single = compat.all_gather_single
_reduce_scatter_single = compat.reduce_scatter_single

# [Note: gloo work outlives its wait]
# gloo runs each collective on one of the process group's worker threads, which drops
# its reference to the work, and through it to the tensors, just AFTER marking it done:
# after the caller's wait() returned. When that drop takes a tensor that has a Python
# object from two references to one (torch 2.13's PyObject preservation: the C++ side
# holds the Python object while any C++ reference exists), torch takes the GIL to let
# go of the object. If the program has started exiting by then, CPython ends the worker
# thread (pthread_exit) and the unwinding through gloo's noexcept run loop calls
# std::terminate: "terminate called without an active exception", SIGABRT, exit code
# 134, after a run that went well. The engine's last collectives come a few ms before
# the end of a fit: 1 launch in 160 aborted; a script that exits right after a
# collective aborts in ~20% of its ranks.
# So no drop by a worker may be a tensor's last C++ reference. ``_issue`` hands the
# collective a fresh alias of each tensor (``detach()``: same storage and version
# counter, no other holder) and keeps a second C++ reference to each alias until the
# aliases' use counts show that the work let go of them; the main thread (with the
# GIL) then drops them. The second reference is a view of the alias (a view's autograd
# metadata holds its base: ~10 us); an inference tensor's views keep no base, so for
# one it is a ``torch.ScriptList`` (TorchScript's C++ list: ~55 us, measured per
# collective on this machine). The work itself is not kept:
# gloo's own temporaries (the flattened copy a reduce_scatter makes, ~a unit's grad)
# have no Python objects and go with the work when the worker drops it. Keeping the
# latest 8 works instead (issue 27's fix) held those temporaries: +100 MiB peak RSS per
# rank on a 64M-param model. What is held now is only the caller's tensors, until the
# worker is done with them (microseconds after the wait). At exit, ``release_at_exit``
# waits (with the GIL released) for the workers to let go of everything still held.
# CUDA (NCCL) collectives are not wrapped: their works run no Python-visible drops. Nor
# are gloo's sends and receives ([Note: pairwise exchanges on gloo]): their works own the
# tensors and only the main thread drops the works; gloo's transport thread holds no
# reference to a tensor (``benchmarks/exit_stress.py --engine-collectives``: 0 aborts in 60
# ranks).
_TENSORS_HELD_BY_US = 2  # the alias's own Python object + our second reference


class _HeldTensors:
    """Collectives' tensors kept alive from the main thread until gloo's worker let go."""

    def __init__(self) -> None:
        self._held: list[tuple[Any, tuple[torch.Tensor, ...]]] = []
        # A background checkpoint save issues object collectives from its own thread
        # while the main thread trains: an entry added during another thread's
        # rebuild of the list would be lost.
        self._lock = threading.Lock()

    def hold(self, aliases: tuple[torch.Tensor, ...]) -> None:
        self.release_finished()
        if aliases:
            entry = (tuple(_second_reference(a) for a in aliases), aliases)
            with self._lock:
                self._held.append(entry)

    def release_finished(self) -> None:
        """Let go of the entries no work refers to any more (from a Python thread)."""
        if self._held:
            with self._lock:
                self._held = [entry for entry in self._held if not _let_go(entry[1])]

    def __len__(self) -> int:
        return len(self._held)

    def release_at_exit(self, *, timeout_s: float = 2.0) -> None:
        """Wait, the GIL released, until the workers let go of every held tensor.

        What a work still holds after ``timeout_s`` (a collective that never finished)
        stays held: dropping it here would hand the last drop to the worker again.
        """
        deadline = time.monotonic() + timeout_s
        self.release_finished()
        while self._held and time.monotonic() < deadline:
            time.sleep(0.001)
            self.release_finished()


def _second_reference(alias: torch.Tensor) -> Any:
    """An object holding a C++ reference to ``alias`` (see the Note)."""
    if alias.is_inference():
        return torch.ScriptList([alias])
    return alias.view_as(alias)


def _let_go(aliases: tuple[torch.Tensor, ...]) -> bool:
    return all(alias._use_count() <= _TENSORS_HELD_BY_US for alias in aliases)


_held_tensors = _HeldTensors()
atexit.register(_held_tensors.release_at_exit)


def _issue(collective, tensor: torch.Tensor, *args, async_op: bool, **kwargs):
    """``collective(*args, async_op=..., **kwargs)``; a CPU collective's tensors are held.

    ``tensor``: one of the collective's tensors, whose device decides
    ([Note: gloo work outlives its wait]).
    """
    if tensor.device.type != "cpu":
        return collective(*args, async_op=async_op, **kwargs)
    args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
    work = collective(*args, async_op=True, **kwargs)
    if work is not None:  # None: a backend or rank that did not take part
        _held_tensors.hold(tuple(a for a in args if isinstance(a, torch.Tensor)))
    if async_op:
        return work
    if work is not None:
        _wait_blocking(work)
    return None


def _wait_blocking(work) -> None:
    timing = step_timing.active()
    if timing is None:
        work.wait()
    else:  # [Note: step breakdown] a blocking collective is exposed by definition
        start = time.perf_counter()
        work.wait()
        timing.add_wait("blocking", time.perf_counter() - start, was_complete=False)


def _pairwise(exchange: WorkList, *, async_op: bool) -> WorkList | None:
    """An exchange returned as issued (``async_op``) or waited here."""
    if async_op:
        return exchange
    _wait_blocking(exchange)
    return None


@dataclass
class CommStats:
    """Running count of collectives and bytes by kind (bytes sent+received by this rank's calls).

    ``bytes`` counts the size of the larger (gathered / unreduced) tensor of
    each call, the number comparable across sharding schemes.
    """

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A plain-dict copy: ``{"calls": {kind: n}, "bytes": {kind: nbytes}}``."""
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}


# [Note: one rank copies] A group of one rank (one GPU, a world of 1) has nothing to
# exchange: the gather and the reduce are a copy on the calling stream, done at once, and
# the order guard has no other rank to compare with. Counted in CommStats all the same,
# as the traffic the design names.
_DONE = WorkList([])


def all_gather_into(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup,
    *,
    async_op: bool,
    stats: CommStats,
    channel: str = "gather",
    key: int | None = None,
) -> dist.Work | WorkList | None:
    """Gather every rank's ``shard`` into ``output`` (rank order, back to back).

    ``channel``: on CPU, which tags the exchange uses ([Note: pairwise exchanges on
    gloo]); the order guard's tags use their own. ``key``: on CPU, the identity of the
    exchange on an exchange line ([Note: exchange lines]), in its tags.

    [Note: version-preserving gather]
    ``output`` is a weight buffer that autograd may have saved views of in an
    earlier forward (ZeRO-3 re-gathers the same values before backward). gloo
    bumps the version counter of the tensor it writes, which would fail
    backward with "modified by an inplace operation". Writing through
    ``.data`` (a fresh version counter over the same storage) keeps the saved
    views valid; the four ordering conditions, not the version counter,
    guarantee that their contents are right when read.
    """
    stats.add("all_gather", output.numel() * output.element_size())
    if group.size() == 1:  # [Note: one rank copies]
        output.data.copy_(shard)
        return _DONE if async_op else None
    if shard.device.type == "cpu":  # [Note: pairwise exchanges on gloo]
        exchange = gather_pairwise(output.data, shard.detach(), group, channel=channel, key=key)
        return _pairwise(exchange, async_op=async_op)
    return _issue(_all_gather_single, shard, output.data, shard, group=group, async_op=async_op)


def reduce_scatter_into(
    output: torch.Tensor,
    full: torch.Tensor,
    group: ProcessGroup,
    *,
    async_op: bool,
    stats: CommStats,
    key: int | None = None,
) -> dist.Work | WorkList | None:
    """Sum ``full`` across ranks and keep this rank's contiguous part in ``output``.

    On CPU the reduction is a pairwise exchange ([Note: pairwise exchanges on gloo]):
    gloo's reduce_scatter is slower than its all_reduce, which moves twice the bytes.
    ``full`` (a grad buffer) must not be rewritten until the reduction is waited.
    ``key``: as for ``all_gather_into``.
    """
    stats.add("reduce_scatter", full.numel() * full.element_size())
    if group.size() == 1:  # [Note: one rank copies]
        output.data.copy_(full.detach()[: output.numel()])
        return _DONE if async_op else None
    if full.device.type != "cpu":
        return _issue(
            _reduce_scatter_single, full, output.data, full, op=ReduceOp.SUM, group=group,
            async_op=async_op,
        )  # fmt: skip
    exchange = reduce_scatter_pairwise(output.data, full.detach(), group, key=key)
    return _pairwise(exchange, async_op=async_op)


def replicate_all_reduce(
    reduced: torch.Tensor, group: ProcessGroup, *, async_op: bool, stats: CommStats
) -> dist.Work | None:
    """Sum a reduced grad shard across the replicate group, in place ([Note: hybrid sharding])."""
    stats.add("replicate_all_reduce", reduced.numel() * reduced.element_size())
    return _issue(
        dist.all_reduce, reduced, reduced.data, op=ReduceOp.SUM, group=group, async_op=async_op
    )


def check_reduce_dtype(mesh: ShardMesh, device: torch.device, dtype: torch.dtype) -> None:
    """Raise a one-line error if the backend cannot reduce grads in ``dtype``.

    Tiny collectives, at sharding time, instead of a backend error in the first
    backward: a reduce_scatter in the shard group and, under hybrid sharding, an
    all_reduce in the replicate group. fp32 needs no check.
    """
    if dtype == torch.float32:
        return
    group = mesh.shard_group
    world = dist.get_world_size(group)
    full = torch.ones(world, dtype=dtype, device=device)
    out = torch.empty(1, dtype=dtype, device=device)
    try:
        # The engine's own reduce (gloo: a pairwise exchange, summed by torch).
        reduce_scatter_into(out, full, group, async_op=False, stats=CommStats())
        if mesh.replicate_group is not None:
            _issue(
                dist.all_reduce, out, out, op=ReduceOp.SUM, group=mesh.replicate_group,
                async_op=False,
            )  # fmt: skip
    except (RuntimeError, ValueError) as error:
        backend = dist.get_backend(group)
        raise ValueError(
            f"reduce_dtype={dtype} is not supported by the '{backend}' backend's "
            f"reduce_scatter/all_reduce ({type(error).__name__}: "
            f"{str(error).splitlines()[0]}); use reduce_dtype=torch.float32"
        ) from error


def broadcast_into(
    tensor: torch.Tensor,
    src_rank: int,
    group: ProcessGroup,
    *,
    async_op: bool,
    stats: CommStats,
    key: int | None = None,
) -> dist.Work | WorkList | None:
    """Group rank ``src_rank``'s ``tensor`` into every rank's ``tensor`` (in place).

    Written through ``.data`` ([Note: version-preserving gather]): ``tensor`` is a
    region of a weight buffer. ``key``: on an exchange line ([Note: exchange lines]),
    sends and receives tagged with it.
    """
    stats.add("all_gather", tensor.numel() * tensor.element_size())
    if key is not None and tensor.device.type == "cpu":
        exchange = broadcast_pairwise(tensor.data, src_rank, group, key=key)
        return _pairwise(exchange, async_op=async_op)
    src = dist.get_global_rank(group, src_rank)
    return _issue(dist.broadcast, tensor, tensor.data, src=src, group=group, async_op=async_op)


def reduce_into(
    tensor: torch.Tensor,
    dst_rank: int,
    group: ProcessGroup,
    *,
    async_op: bool,
    stats: CommStats,
    key: int | None = None,
) -> dist.Work | WorkList | None:
    """The sum of every rank's ``tensor`` into group rank ``dst_rank``'s ``tensor`` (in place).

    Other ranks' ``tensor`` may be overwritten (gloo uses it as scratch). ``key``: as
    for ``broadcast_into``.
    """
    stats.add("reduce_scatter", tensor.numel() * tensor.element_size())
    if key is not None and tensor.device.type == "cpu":
        exchange = reduce_pairwise(tensor.detach(), dst_rank, group, key=key)
        return _pairwise(exchange, async_op=async_op)
    dst = dist.get_global_rank(group, dst_rank)
    return _issue(
        dist.reduce, tensor, tensor, dst=dst, op=ReduceOp.SUM, group=group, async_op=async_op
    )


def all_reduce_(
    tensor: torch.Tensor,
    group: ProcessGroup | None,
    *,
    op: ReduceOp = ReduceOp.SUM,
    stats: CommStats | None = None,
) -> None:
    """In-place blocking all_reduce (global norms and reductions, logged metrics)."""
    if stats is not None:
        stats.add("all_reduce", tensor.numel() * tensor.element_size())
    _issue(dist.all_reduce, tensor, tensor, op=op, group=group, async_op=False)


def broadcast_(
    tensor: torch.Tensor, group: ProcessGroup, *, src_rank: int, stats: CommStats
) -> None:
    """In-place blocking broadcast from group rank ``src_rank``."""
    stats.add("broadcast", tensor.numel() * tensor.element_size())
    src = dist.get_global_rank(group, src_rank)
    _issue(dist.broadcast, tensor, tensor, src=src, group=group, async_op=False)


# [Note: object collectives] torch's ``all_gather_object``/``broadcast_object_list``
# make their own tensors and wait inside, out of ``_issue``'s reach, and checkpoint
# saves and loads end with them, often right before the program exits
# ([Note: gloo work outlives its wait]). These two send the pickled bytes through
# ``_issue`` instead: a size, then the padded bytes.


def all_gather_objects(obj: Any, *, group: ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``obj`` (picklable), in group-rank order. Blocking."""
    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    device = _object_device(group)
    payload = _pickled(obj, device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = torch.empty(world, dtype=torch.int64, device=device)
    _issue(_all_gather_single, size, sizes, size, group=group, async_op=False)
    counts = sizes.tolist()
    width = max(counts)
    padded = torch.zeros(width, dtype=torch.uint8, device=device)
    padded[: payload.numel()].copy_(payload)
    gathered = torch.empty(width * world, dtype=torch.uint8, device=device)
    _issue(_all_gather_single, padded, gathered, padded, group=group, async_op=False)
    gathered = gathered.cpu()
    return [_unpickled(gathered[r * width : r * width + n]) for r, n in enumerate(counts)]


def broadcast_object(obj: Any, *, src_rank: int = 0, group: ProcessGroup | None = None) -> Any:
    """``obj`` of group rank ``src_rank`` (picklable) on every rank; others pass None. Blocking."""
    if dist.get_world_size(group) == 1:
        return obj
    device = _object_device(group)
    src = dist.get_global_rank(group, src_rank) if group is not None else src_rank
    sending = dist.get_rank(group) == src_rank
    payload = _pickled(obj, device) if sending else None
    size = torch.tensor([payload.numel() if sending else 0], dtype=torch.int64, device=device)
    _issue(dist.broadcast, size, size, src=src, group=group, async_op=False)
    if not sending:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _issue(dist.broadcast, payload, payload, src=src, group=group, async_op=False)
    return obj if sending else _unpickled(payload.cpu())


def _object_device(group: ProcessGroup | None) -> torch.device:
    """Where a group's object bytes travel: the GPU for an NCCL-only group, else the CPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _pickled(obj: Any, device: torch.device) -> torch.Tensor:
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    return payload.to(device)


def _unpickled(data: torch.Tensor) -> Any:
    return pickle.loads(data.numpy().tobytes())  # noqa: S301 - bytes from our own ranks
