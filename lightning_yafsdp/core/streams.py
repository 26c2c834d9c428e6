"""Every stream and event the engine uses, in one place.

[Note: two streams, four conditions]
On CUDA the engine uses the current (compute) stream and ONE high-priority
communication stream, ordered only by events:

1. a unit's forward/backward waits until its weights are gathered
   (compute waits the gather's done-event: ``PendingCollective.wait``);
2. no unit is gathered into a weight buffer before the holder's
   forward/backward has finished (the gather is issued ``after`` the holder's
   release event);
3. a unit's backward waits until the reduce_scatter of the previous user of
   its grad buffer is done (compute waits that collective's done-event);
4. a reduce_scatter does not start until its unit's backward is done
   (issued ``after`` the unit's grads-ready event).

Nothing but collectives is ever queued on the comm stream, so no small copy
or division can delay a collective (the "fir tree" of the YaFSDP article).
The CPU enqueues ahead of the GPU, which gives prefetch for free.

On CPU (gloo) compute is synchronous in program order, so conditions 2 and 4
hold by construction once the hook that issues a collective runs after the
holder's hook; the collectives run asynchronously in gloo's worker threads
and conditions 1 and 3 are the ``Work.wait()`` calls. The schedule code is the
same on both devices; only this file knows the difference.

A recording mode logs every issue, wait and compute boundary so that tests
can check the four conditions on a real run (``tests/schedule_check.py``).

Every wait and record names the engine's device explicitly: the current CUDA
device of the calling thread may be another one (a user's ``torch.cuda.device``
context, a second model), and an event waited on the wrong device's stream
orders nothing.

With an optional ``CollectiveOrderGuard`` (``order_guard.py``) each collective
carries a tag exchange that is verified before the collective is waited.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from lightning_yafsdp.core.order_guard import CollectiveOrderGuard, TagExchange

Launch = Callable[[bool], "dist.Work | None"]


@dataclass(frozen=True)
class ScheduleEvent:
    """One entry of the recorded schedule.

    Attributes:
        op: ``gather_issue``, ``gather_wait``, ``reduce_scatter_issue``,
            ``reduce_scatter_wait``, ``forward_start``, ``forward_end``,
            ``backward_start`` or ``backward_end``.
        unit: the unit's name.
        slot: the buffer index the collective writes or reads (weight buffer
            for gathers and compute, grad buffer for reduce_scatters), or None.
    """

    op: str
    unit: str
    slot: int | None


class PendingCollective:
    """A collective in flight; ``wait()`` orders the compute stream after it."""

    def __init__(
        self,
        scheduler: CommScheduler,
        event: ScheduleEvent,
        *,
        work=None,
        done_event=None,
        tag_exchange: TagExchange | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._event = event
        self._work = work
        self._done_event = done_event
        self._tag_exchange = tag_exchange
        self.waited = False

    def wait(self) -> None:
        if self.waited:
            return
        if self._tag_exchange is not None:
            exchange, self._tag_exchange = self._tag_exchange, None
            exchange.verify()  # raises on every rank if ranks issued different collectives
        if self._done_event is not None:
            torch.cuda.current_stream(self._scheduler.device).wait_event(self._done_event)
            self._done_event = None  # record -> wait -> drop
        elif self._work is not None:
            self._work.wait()
            self._work = None
        self.waited = True
        kind = self._event.op.removesuffix("_issue")
        self._scheduler.note(f"{kind}_wait", self._event.unit, self._event.slot)


class CommScheduler:
    """Issues collectives on the comm stream (CUDA) or as async gloo work (CPU).

    Args:
        device: the device the engine's tensors live on.
        order_guard: checks before each collective that all ranks issue the
            same one (None: no check).
    """

    def __init__(self, device: torch.device, *, order_guard: CollectiveOrderGuard | None = None):
        self.device = device
        self.order_guard = order_guard
        self.uses_streams = device.type == "cuda"
        # The comm stream exists so collectives overlap compute; high priority
        # so that a ready collective is never queued behind compute kernels.
        self.comm_stream = torch.cuda.Stream(device, priority=-1) if self.uses_streams else None
        self.log: list[ScheduleEvent] | None = None

    def note(self, op: str, unit: str, slot: int | None = None) -> None:
        """Append to the recorded schedule (no-op unless recording)."""
        if self.log is not None:
            self.log.append(ScheduleEvent(op, unit, slot))

    def compute_marker(self) -> torch.cuda.Event | None:
        """An event recorded on the compute stream now (None on CPU: compute is synchronous)."""
        if not self.uses_streams:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def issue(
        self,
        kind: str,
        *,
        unit: str,
        slot: int | None,
        tag: tuple[int, int],
        launch: Launch,
        after: torch.cuda.Event | None,
    ) -> PendingCollective:
        """Issue ``launch`` on the comm side, ordered after ``after``.

        Args:
            kind: ``gather`` or ``reduce_scatter`` (for the log).
            unit: unit name (for the log and profiler label).
            slot: buffer index (for the log).
            tag: ``(group index, elements)``: what every rank must be issuing
                now (checked by the order guard, if any).
            launch: ``launch(async_op)`` issues the collective.
            after: compute event the collective must wait for (CUDA only).
        """
        guard = self.order_guard
        event = ScheduleEvent(f"{kind}_issue", unit, slot)
        if self.log is not None:
            self.log.append(event)
        with torch.profiler.record_function(f"YaFSDP::{kind} ({unit})"):
            if not self.uses_streams:
                exchange = guard.start(kind, unit=unit, tag=tag) if guard else None
                return PendingCollective(self, event, work=launch(True), tag_exchange=exchange)
            with torch.cuda.device(self.device), torch.cuda.stream(self.comm_stream):
                if after is not None:
                    self.comm_stream.wait_event(after)
                exchange = guard.start(kind, unit=unit, tag=tag) if guard else None
                # NCCL orders itself after the current (comm) stream and makes it
                # wait for completion, so the done-event below marks completion.
                launch(False)
                done = torch.cuda.Event()
                done.record(self.comm_stream)
            return PendingCollective(self, event, done_event=done, tag_exchange=exchange)

    def comm_waits_for_compute(self) -> None:
        """Order all later collectives after everything queued on compute so far.

        Used after the compute shards are refreshed from the master shards
        (the gathers read them) and before blocking whole-model operations.
        """
        if self.uses_streams:
            self.comm_stream.wait_stream(torch.cuda.current_stream(self.device))
