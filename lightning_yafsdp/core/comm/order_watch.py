"""The watch of an exchange line: proves from the ranks' logs that a stalled wait cannot end.

[Note: exchange lines] (``exchange_line.py``) says why and when; this file is how. Each
rank publishes its log under its group rank in the line's own store, as JSON: a list of
``[position, model, kind, group index, elements, unit]``, the line's last positions.
"""

from __future__ import annotations

import atexit
import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from lightning_yafsdp.core.comm.order_guard import order_error_message
from lightning_yafsdp.core.comm.pairwise import exchange_tag

_STALL_S = 1.0  # a wait blocked this long is compared with the peers' logs
_POLL_S = 0.25  # how often the watch looks at the line
_BACKOFF_MAX_S = 4.0  # a long wait is compared ever more rarely (the store serves every rank)
_MESSAGE_WAIT_S = 1.5  # proven: how long the other peers' logs may take to name their part
# The tag of the receive that closes a line: the line's exchanges never use the order
# guard's channel, so nothing is ever sent with it.
_CLOSING_TAG = exchange_tag("order_guard", 0)


class WatchedLine(Protocol):
    """What the watch reads and sets of its line (``ExchangeLine``)."""

    group: ProcessGroup
    ranks: list[int]
    log: Iterable[tuple]
    blocked_since: float | None
    divergence: str | None


class OrderWatch:
    """A daemon thread that compares logs when its line's wait stalls, and closes the
    line on proof; also the same comparison for a wait that failed under its rank."""

    def __init__(self, line: WatchedLine, store: dist.Store) -> None:
        self._line = line
        self._store = store
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="yafsdp-order-watch", daemon=True)
        self._thread.start()
        _running.append(self)

    def stop(self) -> None:
        """End the thread (at exit, or when the line's group is gone); it ends between looks."""
        self._stop.set()
        if self in _running:
            _running.remove(self)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * _POLL_S)

    def prove_after_failure(self) -> str | None:
        """The divergence that made this rank's wait fail, if the logs prove one; None:
        the failure is something else. A peer that closed the line published, before it
        closed it, the log that proved the divergence: one comparison tells."""
        line = self._line
        if line.divergence is None:
            line.divergence = self._prove()
        return line.divergence

    def _run(self) -> None:
        line = self._line
        stall, interval, next_look = None, _POLL_S, 0.0
        while not self._stop.wait(_POLL_S):
            since = line.blocked_since
            now = time.monotonic()
            if since is None or now - since < _STALL_S:
                continue
            if since != stall:  # a new stall: look now, then ever more rarely
                stall, interval, next_look = since, _POLL_S, now
            if now < next_look:
                continue
            divergence = self._prove()
            if divergence is not None:
                line.divergence = divergence
                _close(line.group)
            interval = min(2 * interval, _BACKOFF_MAX_S)
            next_look = now + interval

    def _compare_quietly(self) -> Divergence | None:
        try:
            return self.compare()
        except Exception:  # noqa: BLE001 - a store that is gone proves nothing; waits go on
            return None

    def _prove(self) -> str | None:
        """The message of a divergence the logs prove, if any; the peers whose logs do not
        reach it yet get ``_MESSAGE_WAIT_S`` to publish theirs (they stall too)."""
        divergence = self._compare_quietly()
        deadline = time.monotonic() + _MESSAGE_WAIT_S
        while divergence is not None and not divergence.complete and time.monotonic() < deadline:
            time.sleep(_POLL_S)
            divergence = self._compare_quietly() or divergence
        return divergence.message if divergence is not None else None

    def compare(self) -> Divergence | None:
        """Publish this rank's log; the divergence it and the published logs prove, if any."""
        line = self._line
        me, size = line.group.rank(), line.group.size()
        mine = list(line.log)  # one C call under the GIL: no append can interleave
        self._store.set(f"log/{me}", json.dumps(mine))
        logs = {me: mine}
        for peer in range(size):
            key = f"log/{peer}"
            if peer != me and self._store.check([key]):
                logs[peer] = json.loads(self._store.get(key))
        return divergence_of(logs, ranks=line.ranks, me=me)


@dataclass(frozen=True)
class Divergence:
    """What the logs prove: the message, and whether every rank's log reached the position."""

    message: str
    complete: bool


def divergence_of(logs: dict[int, list], *, ranks: list[int], me: int) -> Divergence | None:
    """What the logs prove if two of them name different collectives at one position.

    ``logs``: group rank -> log entries; ``ranks``: each group rank's global rank.
    """
    at = {rank: {entry[0]: tuple(entry) for entry in log} for rank, log in logs.items()}
    first = None
    reported = sorted(at)
    for i, a in enumerate(reported):
        for b in reported[i + 1 :]:
            for position in sorted(at[a].keys() & at[b].keys()):
                if at[a][position][1:5] != at[b][position][1:5]:
                    first = position if first is None else min(first, position)
                    break
    if first is None:
        return None

    def issued(rank: int) -> str:
        if rank not in at:
            return "no log published yet"
        entry = at[rank].get(first)
        return _describe(entry) if entry else "nothing at this position yet"

    lines = [f"  rank {ranks[rank]}: {issued(rank)}" for rank in range(len(ranks))]
    mine = at[me].get(first)
    message = order_error_message(f"the {_describe(mine)}" if mine else "nothing there yet", lines)
    return Divergence(message, complete=all(first in at.get(r, ()) for r in range(len(ranks))))


def _describe(entry: tuple) -> str:
    _, model, kind, _, numel, unit = entry
    of_model = f" of model {model}" if model else ""
    return f"{kind} of '{unit}' ({numel} elements){of_model}"


def _close(group) -> None:
    """Close the line's connections: a receive that nothing sends, waited 1 ms, times out,
    and gloo then closes every connection of the group, so every wait on it raises. No
    transfer of the line's is touched: its completions stay the main thread's."""
    peer = (group.rank() + 1) % group.size()
    work = group.recv([torch.empty(1)], peer, _CLOSING_TAG)
    try:
        work.wait(timedelta(milliseconds=1))
    except RuntimeError:
        pass  # the timeout: the point


_running: list[OrderWatch] = []


@atexit.register
def _stop_all() -> None:
    """No watch may be inside a store call while the interpreter shuts down."""
    for watch in list(_running):
        watch.stop()
