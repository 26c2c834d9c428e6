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
   under hybrid sharding ([Note: hybrid sharding], ``mesh.py``) the reduced
   shard is then all-reduced across the replicate group, and the next
   reduce_scatter into that buffer's shard waits for that all_reduce (the
   all_reduce overlaps the whole backward of the unit in between);
4. a reduce_scatter does not start until its unit's backward is done
   (issued ``after`` the unit's grads-ready event).

The replicate all_reduce has a stream of its own (waiting only for its
reduce_scatter's done-event), so a slow inter-node all_reduce never delays the
intra-node gathers queued behind it on the comm stream. On CPU it is issued
once its reduce_scatter is done: at the next unit's reduce (``advance``).

Nothing but collectives is ever queued on the comm streams, so no small copy
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
carries a tag exchange that is verified before the collective is waited. On CPU the
gathers and reductions go on an exchange line instead (``exchange_line.py``), whose
tags name each exchange and whose watch checks the order without a tag exchange.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_yafsdp.core.comm import step_timing
from lightning_yafsdp.core.comm.exchange_line import Exchange

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from lightning_yafsdp.core.comm.exchange_line import ExchangeLine
    from lightning_yafsdp.core.comm.order_guard import CollectiveOrderGuard, TagExchange

# ``launch(async_op, exchange)`` issues a collective; gathers and reductions go where
# ``exchange`` says (an exchange line's group and tags on CPU, else the shard group).
Launch = Callable[[bool, Exchange], "dist.Work | None"]


@dataclass(frozen=True)
class ScheduleEvent:
    """One entry of the recorded schedule.

    Attributes:
        op: ``gather_issue``, ``gather_wait``, ``reduce_scatter_issue``,
            ``reduce_scatter_wait``, ``all_reduce_issue``, ``all_reduce_wait``
            (hybrid sharding), ``forward_start``, ``forward_end``,
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
        line: ExchangeLine | None = None,
    ) -> None:
        self._scheduler = scheduler
        self._event = event
        self._work = work
        self._done_event = done_event
        self._tag_exchange = tag_exchange
        self._line = line  # the exchange line the work is on (its wait is watched)
        self.waited = False

    @property
    def done_event(self) -> torch.cuda.Event | None:
        """The comm-stream event marking completion (CUDA), until waited."""
        return self._done_event

    def wait(self) -> None:
        if self.waited:
            return
        kind = self._event.op.removesuffix("_issue")
        timing = step_timing.active()
        if self._tag_exchange is not None:
            exchange, self._tag_exchange = self._tag_exchange, None
            exchange.verify(timing)  # raises on every rank if ranks issued different collectives
        if self._done_event is not None:
            torch.cuda.current_stream(self._scheduler.device).wait_event(self._done_event)
            self._done_event = None  # record -> wait -> drop
        elif self._work is not None:
            wait = self._work.wait if self._line is None else self._watched_wait
            if timing is None:
                wait()
            else:
                _timed_wait(timing, kind, self._work, wait)
            self._work = None
        self.waited = True
        self._scheduler.note(f"{kind}_wait", self._event.unit, self._event.slot)

    def _watched_wait(self) -> None:
        self._line.wait(self._work)


def _timed_wait(timing: step_timing.StepTiming, kind: str, work, wait) -> None:
    """``wait()`` of ``work``, its blocked time counted as exposed ``kind`` communication."""
    complete = work.is_completed()
    start = time.perf_counter()
    wait()
    timing.add_wait(kind, time.perf_counter() - start, was_complete=complete)


class PendingReduce:
    """A unit's gradient reduction in flight: the reduce_scatter and, under hybrid
    sharding, the all_reduce of its reduced shard across the replicate group.

    Two moments matter to the schedule (condition 3): ``scatter_done`` (the grad
    buffer may be rewritten: the reduce_scatter has read it) and ``wait`` (the
    reduced shard is final and may be added to the master grad).
    """

    def __init__(
        self,
        scheduler: CommScheduler,
        scatter: PendingCollective,
        replicate: Launch | None,
        *,
        unit: str,
        slot: int | None,
        tag: tuple[int, int],
    ) -> None:
        self._scheduler = scheduler
        self._scatter = scatter
        self._replicate_launch = replicate
        self._replicate: PendingCollective | None = None
        self._where = dict(unit=unit, slot=slot, tag=tag)
        if replicate is not None and scheduler.uses_streams:
            # Stream-ordered after the reduce_scatter: nothing waits on the host.
            self._start_replicate(after=scatter.done_event)

    def advance(self) -> None:
        """Start the replicate all_reduce if it still waits for its reduce_scatter (CPU)."""
        if self._replicate_launch is not None:
            self.scatter_done()

    def scatter_done(self) -> None:
        """Order compute after the reduce_scatter (its input, the grad buffer, is free)."""
        self._scatter.wait()
        if self._replicate_launch is not None:
            self._start_replicate(after=None)

    def wait(self) -> None:
        """Order compute after the whole reduction (the reduced shard is final)."""
        self.scatter_done()
        if self._replicate is not None:
            self._replicate.wait()

    def _start_replicate(self, *, after) -> None:
        launch, self._replicate_launch = self._replicate_launch, None
        self._replicate = self._scheduler.issue(
            "all_reduce", launch=launch, after=after, **self._where
        )


class CommScheduler:
    """Issues collectives on the comm stream (CUDA) or as async gloo work (CPU).

    Args:
        device: the device the engine's tensors live on.
        group: where gathers and reductions go without an exchange line (the shard group).
        order_guard: checks before each collective that all ranks issue the
            same one (None: no check).

    ``line`` (set by ``use_line``): the exchange line that CPU gathers and reductions go
    on, in their order, as model number ``line_model`` ([Note: exchange lines]).
    """

    def __init__(
        self,
        device: torch.device,
        *,
        group: ProcessGroup | None = None,
        order_guard: CollectiveOrderGuard | None = None,
    ) -> None:
        self.device = device
        self.exchange = Exchange(group)
        self.order_guard = order_guard
        self.line: ExchangeLine | None = None
        self.line_model = 0
        self.uses_streams = device.type == "cuda"
        # The comm stream exists so collectives overlap compute; high priority
        # so that a ready collective is never queued behind compute kernels.
        self.comm_stream = torch.cuda.Stream(device, priority=-1) if self.uses_streams else None
        self._replicate_stream = None  # created by the first replicate all_reduce
        self.log: list[ScheduleEvent] | None = None

    def use_line(self, line: ExchangeLine | None, model: int = 0) -> None:
        """Issue CPU gathers and reductions on ``line`` as model ``model`` (None: don't)."""
        self.line, self.line_model = line, model

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
            kind: ``gather``, ``reduce_scatter`` or ``all_reduce`` (the replicate
                all_reduce of hybrid sharding, on its own stream).
            unit: unit name (for the log and profiler label).
            slot: buffer index (for the log).
            tag: ``(group index, elements)``: what every rank must be issuing
                now (checked by the exchange line or the order guard, if any).
            launch: ``launch(async_op, exchange)`` issues the collective where
                ``exchange`` says (group, tag key).
            after: compute event the collective must wait for (CUDA only).
        """
        timing = step_timing.active()
        if timing is None:
            return self._issue(kind, unit=unit, slot=slot, tag=tag, launch=launch, after=after)
        start = time.perf_counter()
        pending = self._issue(kind, unit=unit, slot=slot, tag=tag, launch=launch, after=after)
        timing.add_issue(kind, time.perf_counter() - start)
        return pending

    def _issue(self, kind: str, *, unit, slot, tag, launch: Launch, after) -> PendingCollective:
        guard = self.order_guard
        event = ScheduleEvent(f"{kind}_issue", unit, slot)
        if self.log is not None:
            self.log.append(event)
        with torch.profiler.record_function(f"YaFSDP::{kind} ({unit})"):
            if not self.uses_streams:
                return self._issue_on_host(kind, event, unit=unit, tag=tag, launch=launch)
            stream = self._stream_for(kind)
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                if after is not None:
                    stream.wait_event(after)
                exchange = guard.start(kind, unit=unit, tag=tag) if guard else None
                # NCCL orders itself after the current (comm) stream and makes it
                # wait for completion, so the done-event below marks completion.
                launch(False, self.exchange)
                done = torch.cuda.Event()
                done.record(stream)
            return PendingCollective(self, event, done_event=done, tag_exchange=exchange)

    def _issue_on_host(self, kind: str, event, *, unit, tag, launch: Launch):
        """CPU: on the exchange line, if any (not the replicate all_reduce: gloo's own
        collective on the replicate group, which keeps its tag exchange)."""
        line = self.line
        if line is not None and kind != "all_reduce":
            work = line.issue(
                launch, model=self.line_model, kind=kind, index=tag[0], numel=tag[1], unit=unit
            )
            return PendingCollective(self, event, work=work, line=line)
        guard = self.order_guard
        exchange = guard.start(kind, unit=unit, tag=tag) if guard else None
        return PendingCollective(
            self, event, work=launch(True, self.exchange), tag_exchange=exchange
        )

    def issue_reduce(
        self,
        *,
        unit: str,
        slot: int | None,
        tag: tuple[int, int],
        scatter: Launch,
        replicate: Launch | None,
        after: torch.cuda.Event | None,
    ) -> PendingReduce:
        """Issue a reduce_scatter (after ``after``) and, if given, its replicate all_reduce."""
        pending = self.issue(
            "reduce_scatter", unit=unit, slot=slot, tag=tag, launch=scatter, after=after
        )
        return PendingReduce(self, pending, replicate, unit=unit, slot=slot, tag=tag)

    def _stream_for(self, kind: str) -> torch.cuda.Stream:
        if kind != "all_reduce":
            return self.comm_stream
        if self._replicate_stream is None:
            self._replicate_stream = torch.cuda.Stream(self.device, priority=-1)
        return self._replicate_stream

    def comm_waits_for_compute(self) -> None:
        """Order all later collectives after everything queued on compute so far.

        Used after the compute shards are refreshed from the master shards
        (the gathers read them) and before blocking whole-model operations.
        """
        if self.uses_streams:
            for stream in (self.comm_stream, self._replicate_stream):
                if stream is not None:
                    stream.wait_stream(torch.cuda.current_stream(self.device))
