"""The engine's CPU exchanges of one shard group: a gloo group of their own, and tags
that name each exchange, so that their order is checked without a byte of traffic.

[Note: exchange lines]
Every rank must issue the engine's collectives in the same order ([Note: collective
order guard]). Exchanging a tag before each one checks that, but on gloo each tag
exchange cost ~1 ms of CPU on 2 busy cores: 17 per step were a fifth of our step
overhead on issue 36's model (docs/performance.md). On CPU an exchange line checks the
order with no traffic of its own while the ranks agree:

- The line is a gloo group of its own over the shard group's ranks, made from the
  default store, once per set of ranks and process; a process's engines share it
  and join it in creation order (their "model" number). The engine's gathers and
  reductions run there and nowhere else.
- Each exchange takes the line's next position. Its gloo tags hash the position, the
  model, the collective's kind, group index and elements, and the bytes per peer. A
  send therefore pairs only with the receive of the same collective at the same
  position: ranks that diverge do not exchange data of different collectives (not
  even of equal size; two exchanges share a tag by chance once in 2**29); their
  exchanges just wait.
- The line logs its last positions. Its watch (``order_watch.py``) notices a wait
  blocked for over a second, publishes this rank's log to the store and compares it
  with the logs its peers published (then again, ever more rarely, while the wait
  lasts). A log only grows, so two logs, however old, that name different
  collectives at one position prove that the ranks diverged; logs that agree prove
  nothing (a slow peer), and the wait goes on.
- On proof the watch closes the line: it posts a receive that nothing sends and
  times it out after 1 ms, and gloo then closes the group's connections. The blocked
  wait raises, on this rank and on its peers, and each turns that into
  ``CollectiveOrderError`` naming every rank's collective, 1-3 s after the
  divergence (a peer that closed the line published its proof first). Nothing is
  ever sent to complete a peer's transfer, and no transfer of the engine's is
  waited by the watch: an earlier design completed transfers from reports that
  could be stale, and could complete a later exchange with zeros (reverted in
  97121c1); waiting a transfer from the watch can use up its completion.
- A closed line stays closed: the process's later exchanges on it raise the same
  error. The world's and Lightning's groups are untouched.
- Limit (as with the tag exchanges): a rank that diverges into a collective that is
  not on the line (a barrier, a Lightning all_reduce) never waits on the line, so
  nothing is proven; both ranks wait for the group's timeout.
"""

from __future__ import annotations

import struct
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_yafsdp.core.comm.collectives import CommStats, broadcast_into
from lightning_yafsdp.core.comm.order_guard import CollectiveOrderError
from lightning_yafsdp.core.comm.order_watch import OrderWatch

_WINDOW = 64  # positions a log keeps: ranks stall within a few positions of a divergence
_KIND_CODES = {"gather": 1, "reduce_scatter": 2}
_KEY_FIELDS = struct.Struct("<5q")  # position, model, kind, group index, elements


@dataclass(frozen=True)
class Exchange:
    """Where one collective's exchanges go: the group, and the key of their tags.

    ``key`` None: tags by bytes alone ([Note: pairwise exchanges on gloo]).
    """

    group: ProcessGroup
    key: int | None = None

    def part(self, index: int) -> Exchange:
        """The exchange of part ``index`` of a collective made of several (row chunks)."""
        if self.key is None:
            return self
        return Exchange(self.group, zlib.crc32(index.to_bytes(8, "little"), self.key))


class ExchangeLine:
    """The exchange group and order log of one shard group, shared by a process's engines.

    Args:
        group: the line's own gloo group (the shard group's ranks, in its order).
        ranks: the global rank of each group rank (for messages).
        store: a store private to the line (the watch's logs).
    """

    def __init__(self, group: ProcessGroup, *, ranks: list[int], store: dist.Store) -> None:
        self.group = group
        self.ranks = ranks
        self.models = 0
        self.position = 0
        # (position, model, kind, group index, elements, unit name) of the last exchanges.
        self.log: deque[tuple] = deque(maxlen=_WINDOW)
        # Since when the main thread waits on the line (None: it does not); the watch reads it.
        self.blocked_since: float | None = None
        self.divergence: str | None = None  # the proof's message, once proven
        self.watch = OrderWatch(self, store)

    def join(self) -> int:
        """A new engine's model number (every rank builds its engines in one order)."""
        self.models += 1
        return self.models - 1

    def issue(
        self, launch: Callable[[bool, Exchange], object], *, model: int, kind: str,
        index: int, numel: int, unit: str,
    ) -> object:  # fmt: skip
        """Post the exchanges of the line's next position (async); returns their work."""
        self.raise_if_closed()
        position = self.position
        self.position += 1
        self.log.append((position, model, kind, index, numel, unit))
        key = zlib.crc32(_KEY_FIELDS.pack(position, model, _KIND_CODES[kind], index, numel))
        try:
            return launch(True, Exchange(self.group, key))
        except RuntimeError as error:  # a line a peer closed refuses new transfers
            self._raise_divergence_of(error)

    def wait(self, work) -> None:
        """``work.wait()``, watched: a divergence proven meanwhile raises on every rank."""
        self.blocked_since = time.monotonic()
        try:
            work.wait()
        except RuntimeError as error:
            self._raise_divergence_of(error)
        finally:
            self.blocked_since = None
        self.raise_if_closed()  # proven just as the wait completed

    def raise_if_closed(self) -> None:
        if self.divergence is not None:
            raise CollectiveOrderError(self.divergence)

    def _raise_divergence_of(self, error: RuntimeError):
        """The line failed under us: raise the divergence the logs prove, or ``error``
        (a peer that closed the line published the log that proved it first)."""
        divergence = self.watch.prove_after_failure()
        if divergence is None:
            raise error
        raise CollectiveOrderError(divergence) from error


# The lines of this process by the global ranks of their shard group, each with the group
# it was made over (kept alive: a line lives while that group does).
_lines: dict[tuple[int, ...], tuple[ProcessGroup, ExchangeLine]] = {}


def exchange_line_for(shard_group: ProcessGroup) -> ExchangeLine:
    """The exchange line of ``shard_group``'s ranks: made by the first engine over them
    (collective over the group), shared by the later ones, even over another group
    object of the same ranks (hybrid sharding makes new groups per model)."""
    _forget_destroyed_groups()
    ranks = tuple(dist.get_process_group_ranks(shard_group))
    entry = _lines.get(ranks)
    if entry is not None:
        return entry[1]
    line = _new_line(shard_group)
    _lines[ranks] = (shard_group, line)
    return line


def _new_line(shard_group: ProcessGroup) -> ExchangeLine:
    """A gloo group over ``shard_group``'s ranks, under a store prefix no other line used."""
    store = dist.distributed_c10d._get_default_store()
    rank, size = dist.get_rank(shard_group), dist.get_world_size(shard_group)
    token = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        token[0] = store.add("yafsdp/exchange_lines", 1)
    broadcast_into(token, 0, shard_group, async_op=False, stats=CommStats())
    line_store = dist.PrefixStore(f"yafsdp/exchange_line/{int(token.item())}/", store)
    group = dist.ProcessGroupGloo(line_store, rank, size, _timeout_of(shard_group))
    ranks = dist.get_process_group_ranks(shard_group)
    return ExchangeLine(group, ranks=ranks, store=line_store)


def _timeout_of(group: ProcessGroup) -> timedelta:
    """The shard group's collective timeout (a hang ends as it would there)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout


def _forget_destroyed_groups() -> None:
    """Drop the lines of shard groups torch destroyed (a finished run in this process: a
    new process group over the same ranks gets a new line)."""
    for key, (group, line) in list(_lines.items()):
        try:
            dist.get_process_group_ranks(group)
        except (KeyError, RuntimeError, ValueError):
            line.watch.stop()
            del _lines[key]
