"""Ranks that exchange different units on CPU: never paired, and reported, at no cost per step.

[Note: order watch]
The order guard ([Note: collective order guard]) exchanges a tag before every
collective, so that ranks calling different units raise instead of hanging or
exchanging the wrong unit's data. On CPU that tag exchange cost more than the check
is worth: each is a gloo send and receive of 24 bytes, ~1 ms of CPU per collective
on 2 busy cores, 13-20 ms per step on an 8-layer model (docs/performance.md, "The
order check without tag exchanges"). The engine's CPU exchanges are point-to-point
([Note: pairwise exchanges on gloo]), so the check can ride on what they already
carry:

- The gloo tag of every send and receive hashes the collective's identity (kind,
  unit, elements) with its bytes (``IssueRecord.identity``): exchanges of different
  units never pair up. Nothing can be exchanged with the wrong unit, and no receive
  gets a size it did not post (which aborts the process inside gloo).
- So ranks that call different units wait: nothing else goes wrong. Each engine
  keeps a log of the identities it issued, in order. A watch thread looks, every
  quarter second, for a wait that has lasted over ``STALL_S``; it then publishes this
  rank's log and the sends and receives it still waits for in the process group's
  store, and reads the other ranks'. If two ranks issued different identities at the
  same position of their logs, the ranks diverged. Each rank then completes the
  transfers its peers wait for with it (a send of zeros, a receive into scratch). So
  every rank's wait returns, and every rank raises ``CollectiveOrderError`` naming what
  each rank issued there. The process group stays usable.
- A rank that is only slow (a long forward, a checkpoint write) has no divergent
  entry in its log: the check finds nothing and the wait goes on.

A wait that returns after a stall runs the check itself before anything reads the
result: the completion may have been a peer's zeros. Launches that issue any other
collective (a row chunk's broadcasts, hybrid sharding's all_reduce) keep the tag
exchange: gloo's collectives carry no tag of ours.
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# How long a wait lasts before the ranks' logs are compared, and how often the watch looks.
STALL_S = 1.0
TICK_S = 0.25
# How long a divergence seen in some ranks' reports waits for the others' (the message
# names what every rank issued).
REPORT_GRACE_S = 1.0
# After a divergence, how long the watch goes on completing peers that have not reported.
GIVE_UP_S = 60.0
# Entries of the log kept for the comparison (a rank more than this many collectives ahead
# of another is not compared with it: it only waits).
LOG_LENGTH = 512

_ISSUING: contextvars.ContextVar[IssueRecord | None] = contextvars.ContextVar(
    "yafsdp_issuing", default=None
)


@dataclass(frozen=True)
class Transfer:
    """One send or receive of an exchange: what a peer must post to complete it."""

    direction: str  # "send" or "recv", as this rank posted it
    peer: int  # group rank
    tag: int
    nbytes: int
    work: object = field(compare=False)


@dataclass
class IssueRecord:
    """What one scheduled collective posted: its identity and its transfers."""

    identity: tuple[int, ...]
    transfers: list[Transfer] = field(default_factory=list)
    other_collectives: bool = False  # a gloo collective was issued too (no tag of ours)


@contextlib.contextmanager
def issuing(identity: tuple[int, ...]) -> Iterator[IssueRecord]:
    """Record what the exchanges issued inside post, under ``identity``."""
    record = IssueRecord(identity)
    token = _ISSUING.set(record)
    try:
        yield record
    finally:
        _ISSUING.reset(token)


def current_record() -> IssueRecord | None:
    """The record of the collective being issued, if the engine's scheduler issues it."""
    return _ISSUING.get()


class CollectiveOrderError(RuntimeError):
    """Ranks issued different collectives (raised on every rank)."""


@dataclass
class _Entry:
    seq: int
    record: IssueRecord


class OrderWatch:
    """The log of one engine's CPU exchanges in its shard group, and the watch over its waits.

    Args:
        group: the group the exchanges run in.
        key_prefix: where in the store this engine's ranks publish (the same on every rank).
        explain: identity -> words for the error message.
    """

    def __init__(
        self, group: ProcessGroup, *, key_prefix: str, explain: Callable[[tuple], str]
    ) -> None:
        self._group = group
        self._rank, self._world = group.rank(), group.size()
        self._global = [dist.get_global_rank(group, r) for r in range(self._world)]
        self._store = dist.distributed_c10d._get_default_store()
        # One key per rank, under this engine and this group's ranks (hybrid sharding has
        # several shard groups).
        self._prefix = f"{key_prefix}/{'-'.join(map(str, self._global))}"
        self._explain = explain
        self._log: deque[tuple[int, tuple]] = deque(maxlen=LOG_LENGTH)
        self._seq = 0
        self._blocked: tuple[_Entry, float] | None = None
        self._lock = threading.Lock()  # one diagnosis at a time (watch thread, main thread)
        self._mismatch: str | None = None
        self._last_entry: _Entry | None = None
        self._divergence_seen: float | None = None
        self._completed_peers: set[int] = set()
        self._kept: list = []  # the completions' tensors and works, until exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def logged(self) -> int:
        """How many collectives were logged so far."""
        return self._seq

    def issued(self, record: IssueRecord) -> _Entry:
        """Log a scheduled collective; its entry is handed to ``waiting``."""
        self._seq += 1
        self._log.append((self._seq, record.identity))
        return _Entry(self._seq, record)

    @contextlib.contextmanager
    def waiting(self, entry: _Entry) -> Iterator[None]:
        """Around a wait that may block: watched; raises if the ranks had diverged."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="yafsdp-order", daemon=True)
            self._thread.start()
        started = time.monotonic()
        self._blocked = (entry, started)
        try:
            yield
        finally:
            self._blocked = None
        if time.monotonic() - started >= STALL_S:
            # The wait may have ended on a peer's zeros: nothing reads the result before
            # the check, which waits for the other ranks' reports once it saw a divergence.
            self._diagnose(entry)
            while self._mismatch is None and self._divergence_seen is not None:
                time.sleep(TICK_S)
                self._diagnose(entry)
        if self._mismatch is not None:
            raise CollectiveOrderError(self._mismatch)

    def close(self) -> None:
        """Stop watching (the thread stays until every peer it owes a completion has one)."""
        self._stop.set()

    def _watch(self) -> None:
        deadline = None
        while True:
            time.sleep(TICK_S)
            if self._mismatch is not None:
                # Peers that published after this rank raised still wait for their
                # completions from this rank: keep reading until each one has had them.
                if len(self._completed_peers) == self._world - 1:
                    return
                deadline = deadline or time.monotonic() + GIVE_UP_S
                if time.monotonic() > deadline:
                    return
                self._diagnose(self._last_entry)
            elif self._stop.is_set():
                return
            else:
                blocked = self._blocked
                if blocked is not None and time.monotonic() - blocked[1] >= STALL_S:
                    self._diagnose(blocked[0])

    def _diagnose(self, entry: _Entry) -> None:
        """Publish this rank's state, read the others'; on a divergence, complete the
        transfers each peer waits for from this rank (once per peer)."""
        with self._lock:
            self._last_entry = entry
            mine = self._state(entry)
            self._store.set(self._key(self._rank), pickle.dumps(mine))
            states = {self._rank: mine}
            for rank in range(self._world):
                if rank != self._rank and self._store.check([self._key(rank)]):
                    states[rank] = pickle.loads(self._store.get(self._key(rank)))  # noqa: S301
            if self._mismatch is None:
                self._mismatch = self._settled(self._divergence(states, entry), states)
            if self._mismatch is None:
                return
            for rank, state in states.items():
                if rank != self._rank and rank not in self._completed_peers:
                    self._complete(rank, state["pending"])
                    self._completed_peers.add(rank)

    def _settled(self, message: str | None, states: dict[int, dict]) -> str | None:
        """The message once every rank reported, or ``REPORT_GRACE_S`` after the divergence
        was first seen (a rank that never reports is not waiting in the engine)."""
        if message is None:
            return None
        missing = [self._global[r] for r in range(self._world) if r not in states]
        if not missing:
            return message
        self._divergence_seen = self._divergence_seen or time.monotonic()
        if time.monotonic() - self._divergence_seen < REPORT_GRACE_S:
            return None
        return message + f"\nRanks {missing} did not report: they are not waiting in the engine."

    def _state(self, entry: _Entry) -> dict:
        pending = [
            (t.direction, t.peer, t.tag, t.nbytes)
            for t in entry.record.transfers
            if not t.work.is_completed()
        ]
        return {"log": list(self._log), "pending": pending}

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/{rank}"

    def _divergence(self, states: dict[int, dict], entry: _Entry) -> str | None:
        """The error message if two ranks logged different identities at one position."""
        logs = {rank: dict(state["log"]) for rank, state in states.items()}
        common = set.intersection(*(set(log) for log in logs.values())) if len(logs) > 1 else ()
        for seq in sorted(common):
            issued = {rank: log[seq] for rank, log in logs.items()}
            if len(set(issued.values())) > 1:
                lines = [
                    f"  rank {self._global[r]}: {self._explain(issued[r])}" for r in sorted(issued)
                ]
                return (
                    f"ranks issued different collectives (this rank, {self._global[self._rank]}, "
                    f"waited for the {self._explain(entry.record.identity)}):\n"
                    + "\n".join(lines)
                    + "\nEvery rank must call the same sharded units in the same order in each "
                    "step; they would otherwise exchange data of different units or hang. "
                    "Per-rank randomness that skips or reorders units (LayerDrop, routing around "
                    "whole blocks) must be drawn from a generator seeded identically on every rank."
                )
        return None

    def _complete(self, rank: int, pending: list[tuple]) -> None:
        """Post what ``rank`` still waits for from this rank, so that its wait returns."""
        for direction, peer, tag, nbytes in pending:
            if peer != self._rank:
                continue
            scratch = torch.zeros(nbytes, dtype=torch.uint8)
            if direction == "recv":  # the peer waits for bytes from us
                work = self._group.send([scratch], rank, tag)
            else:  # the peer waits for us to take its bytes
                work = self._group.recv([scratch], rank, tag)
            self._kept.append((scratch, work))
