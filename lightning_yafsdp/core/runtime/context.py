"""The step context: what every group of one engine reads and does during a step.

[Note: step context]
The engine builds ONE ``StepContext`` and hands it to every group it creates (units,
row chunks, resident groups); a group never sees the engine (no runtime group imports
it, not even for types), as FSDP2's param groups see only the ``FSDPCommContext`` their
state shares with them. The context holds:

- the comm pieces fixed for the engine's life: the scheduler (streams, events, the
  recorded schedule), the shard and replicate groups, the traffic counters;
- the slots, with the only slot arithmetic: ``weight_slot(i)`` / ``grad_slot(i)`` for
  unit ``i`` of the schedule, and the gather staging (``stage``);
- the reduction queue: the one way to issue a reduction (``issue_reduction``), where it
  writes (``reduce_output``: the gradient window itself, or staged in the grad buffer,
  [Note: reduce into the gradient window]), to start the replicate all_reduces that are
  ready (``advance_reductions``), to complete them in issue order
  (``complete_reductions``) and to divide or add a reduced shard in a master-dtype
  gradient (``divide`` / ``add_reduced``, once);
- the step: the phase (``in_backward``), the weights' version (``compute_version``), the
  units in schedule order (prefetch is ``order[i +/- 1]``), the input cast.

Hooks stay with the units and call only the context. What a step's boundaries do beyond
the groups (refresh the compute shards, restore swapped optimizer tensors, end the
backward for every group) is the engine's: it installs those as the context's
``StepCallbacks`` when it builds it, so the call goes down to the context and the
engine's code runs without any group naming it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree

from lightning_yafsdp.core.comm.buffers import (
    GatherStaging,
    GradBuffer,
    ReduceQueue,
    WeightBuffer,
)
from lightning_yafsdp.core.comm.collectives import (
    CommStats,
    reduce_scatter_into,
    replicate_all_reduce,
)
from lightning_yafsdp.core.comm.mesh import ShardMesh
from lightning_yafsdp.core.comm.step_timing import timed_hook
from lightning_yafsdp.core.comm.streams import CommScheduler, Launch, PendingReduce
from lightning_yafsdp.core.optim.grads import ShardGrads


class StepPhase(enum.Enum):
    """Where the model as a whole is; each unit's own state is its ``UnitLifecycle``."""

    OUTSIDE_BACKWARD = "outside backward"
    BACKWARD = "backward"  # the end-of-backward callback is queued and has not run


@dataclass(frozen=True)
class StepCallbacks:
    """The engine's part of a step's boundaries (see the note).

    Attributes:
        forward_start: before any sharded module runs (refresh, residents' views).
        backward_start: the first backward hook of a pass (prepare every group's grads).
        backward_end: autograd's end of the backward (reduce the rest, end the step).
    """

    forward_start: Callable[[], None]
    backward_start: Callable[[], None]
    backward_end: Callable[[], None]


class StepContext:
    """The shared state of one engine's groups ([Note: step context]).

    Args:
        mesh: the shard and replicate groups.
        device: where the buffers live.
        param_dtype: the compute dtype (weight buffers, gathers).
        reduce_dtype: the dtype of the grad buffers and reductions.
        buffer_sizes: the schedule's slot sizes (``core/plan/schedule.py``).
        grads: the master-dtype gradients of the flat master and of the norm master.
        gather_staging: the cast-on-gather staging, under mixed precision.
        cast_forward_inputs: cast floating unit inputs to ``param_dtype``.
        master_dtype: the flat master's dtype.
    """

    def __init__(
        self,
        *,
        mesh: ShardMesh,
        device: torch.device,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        buffer_sizes,
        grads: tuple[ShardGrads, ShardGrads | None],
        gather_staging: GatherStaging | None,
        cast_forward_inputs: bool,
        master_dtype: torch.dtype,
    ) -> None:
        self.scheduler = CommScheduler(device, group=mesh.shard_group)
        self.comm_stats = CommStats()
        self.shard_group, self.shard_rank = mesh.shard_group, mesh.shard_rank
        self.replicate_group = mesh.replicate_group
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        self.weight_buffers = [
            WeightBuffer(i, numel, dtype=param_dtype, device=device)
            for i, numel in enumerate(buffer_sizes.weights)
        ]
        # Unit i of the schedule gathers into weight_buffers[_weight_slot_of[i]].
        self._weight_slot_of = list(buffer_sizes.weight_slots)
        # One queue: reductions complete in issue order ([Note: reduce into the gradient
        # window]).
        queue = ReduceQueue()
        self.grad_buffers = [
            GradBuffer(i, numel, dtype=reduce_dtype, device=device, queue=queue)
            for i, numel in enumerate(buffer_sizes.grads)
        ]
        self._reduce_queue = queue
        self.gather_staging = gather_staging
        self.unit_grads, self.norm_grads = grads
        # Reduced grads are sums over every rank (shard and replicate groups).
        self.divide_factor = float(mesh.world_size)
        self._cast = cast_forward_inputs and master_dtype != param_dtype
        # The step.
        self.order: list = []  # the units in schedule order
        self.compute_version = 0
        self.phase = StepPhase.OUTSIDE_BACKWARD
        self._callbacks: StepCallbacks | None = None

    def install(self, callbacks: StepCallbacks) -> None:
        self._callbacks = callbacks

    # -- slots -------------------------------------------------------------------------

    def weight_slot(self, index: int) -> WeightBuffer:
        """The weight buffer unit ``index`` of the schedule gathers into."""
        return self.weight_buffers[self._weight_slot_of[index]]

    def grad_slot(self, index: int) -> GradBuffer:
        """The grad buffer unit ``index`` of the schedule writes (units alternate)."""
        return self.grad_buffers[index % len(self.grad_buffers)]

    def stage(self, index: int, master_shard: torch.Tensor) -> torch.Tensor:
        """``master_shard`` cast to the compute dtype in unit ``index``'s staging half
        ([Note: cast on gather])."""
        return self.gather_staging.stage(index % 2, master_shard)

    def staged_read(self, index: int, pending) -> None:
        """The gather ``pending`` reads unit ``index``'s staging half until it lands."""
        self.gather_staging.readers[index % 2] = pending

    # -- the reduction queue -----------------------------------------------------------

    def reduce_scatter(self, full: torch.Tensor, reduced: torch.Tensor) -> Launch:
        """The launch of a reduce-scatter of ``full`` into ``reduced`` (the shard group's
        ranks: on CPU, the exchange line's group)."""
        return lambda async_op, exchange: reduce_scatter_into(
            reduced, full, exchange.group, async_op=async_op, stats=self.comm_stats,
            key=exchange.key,
        )  # fmt: skip

    def replicate(self, reduced: torch.Tensor) -> Launch | None:
        """The launch of the all_reduce of ``reduced`` across replicas; None when flat."""
        if self.replicate_group is None:
            return None
        return lambda async_op, _exchange: replicate_all_reduce(
            reduced, self.replicate_group, async_op=async_op, stats=self.comm_stats
        )

    def issue_reduction(
        self, *, unit: str, slot: int | None, tag: tuple[int, int], scatter: Launch,
        replicate: Launch | None,
    ) -> PendingReduce:  # fmt: skip
        """Issue a reduction after the compute so far (condition 4): ``scatter`` in the
        shard group, then (hybrid sharding) ``replicate`` across the replicas."""
        return self.scheduler.issue_reduce(
            unit=unit,
            slot=slot,
            tag=tag,
            scatter=scatter,
            replicate=replicate,
            after=self.scheduler.compute_marker(),
        )

    def advance_reductions(self) -> None:
        """Start the replicate all_reduces whose reduce_scatter is done (CPU; no-op on CUDA)."""
        for buffer in self.grad_buffers:
            if buffer.reduce is not None:
                buffer.reduce.advance()

    def complete_reductions(self) -> None:
        """Complete every reduction in flight, in issue order (the end of backward)."""
        self._reduce_queue.complete_all()

    def reduce_output(
        self, grads: ShardGrads, start: int, end: int, full: torch.Tensor
    ) -> tuple[torch.Tensor, Callable[[], None], bool]:
        """Where the reduce_scatter of ``full`` into ``grads[start:end]`` writes.

        Returns ``(output, on_reduced, in_buffer)``: the window's range itself when
        this is its first write in the window's dtype (``on_reduced`` divides it in
        place), else this rank's shard of ``full`` (an in-place reduce_scatter;
        ``on_reduced`` adds it into the window) ([Note: reduce into the gradient
        window]).
        """
        direct = grads.first_writes([(start, end)], full.dtype)
        if direct is not None:
            window = direct[0]
            return window, lambda: self.divide(window), False
        shard = end - start
        staged = full[self.shard_rank * shard : (self.shard_rank + 1) * shard]
        return staged, lambda: self.add_reduced(grads, start, end, staged), True

    def divide(self, written: torch.Tensor) -> None:
        """Divide a reduced sum written straight into the window ([Note: divide after
        reduce])."""
        written.div_(self.divide_factor)

    def add_reduced(self, grads: ShardGrads, start: int, end: int, reduced) -> None:
        """Add a reduced shard into ``grads[start:end]``, divided once ([Note: divide
        after reduce])."""
        grads.add(start, end, reduced, self.divide_factor)

    # -- the step ----------------------------------------------------------------------

    @timed_hook
    def begin_forward(self) -> None:
        """Before any sharded module runs (every unit's and resident's first hook)."""
        self._callbacks.forward_start()

    def enter_backward(self) -> None:
        """First backward hook of a pass: prepare grads, queue the end-of-backward callback.

        ``queue_callback`` attaches to the graph task running NOW. A reentrant
        checkpoint runs a nested backward (its own graph task) inside the outer
        one; a callback queued from inside it would fire when the nested task
        ends, mid-backward. Units therefore enter backward already when a
        reentrant checkpoint recomputes them (``ShardedUnit._pre_forward``),
        which runs in the outer task before the nested backward starts.
        """
        if self.phase is StepPhase.BACKWARD:
            return
        self.phase = StepPhase.BACKWARD
        self._callbacks.backward_start()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    @timed_hook
    def _end_backward(self) -> None:
        self._callbacks.backward_end()
        self.phase = StepPhase.OUTSIDE_BACKWARD

    def leave_backward(self) -> None:
        """A backward that raised is forgotten: the step is outside backward again."""
        self.phase = StepPhase.OUTSIDE_BACKWARD

    @property
    def in_backward(self) -> bool:
        return self.phase is StepPhase.BACKWARD

    @staticmethod
    def inside_autograd_backward() -> bool:
        """True while autograd executes a backward on this thread (recomputation runs here)."""
        return torch._C._current_graph_task_id() != -1

    def prefetch_next(self, unit) -> None:
        """Start gathering the unit after ``unit`` (schedule order) while ``unit`` computes."""
        if unit.index + 1 < len(self.order):
            self.order[unit.index + 1].prefetch()

    def prefetch_previous(self, unit) -> None:
        """In backward: start gathering the unit before ``unit`` if it awaits its backward."""
        if unit.index > 0:
            previous = self.order[unit.index - 1]
            if previous.life.awaits_backward and previous.backward_reads_weights:
                previous.prefetch()

    def refuse_nested_call(self, unit) -> None:
        """Raise if another unit's forward is running: ``unit`` is called inside it."""
        for buffer in self.weight_buffers:
            holder = buffer.holder
            if holder is not None and holder is not unit and holder.in_forward:
                raise RuntimeError(
                    f"unit '{unit.name}' is called inside unit '{holder.name}'. Nested sharded "
                    "units are not supported: list only the outer module in units=."
                )

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Cast floating inputs of a unit to the compute dtype (mixed precision)."""
        if not self._cast:
            return args, kwargs
        dtype = self.param_dtype

        def cast(x):
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
                return x.to(dtype)
            return x

        return pytree.tree_map(cast, (args, kwargs))
