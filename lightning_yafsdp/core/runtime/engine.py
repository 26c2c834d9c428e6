"""The root of a sharded model: iteration boundaries, optimizer hand-off, state access.

``shard_model`` (``sharding.py``) builds a ``YaFSDPEngine``; units and
resident groups call back into it. The engine answers every "which buffer /
which group / which dtype" question so no other code does that arithmetic.
"""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed import ReduceOp

from lightning_yafsdp.core.comm.buffers import GatherStaging, GradBuffer, WeightBuffer
from lightning_yafsdp.core.comm.collectives import (
    CommStats,
    all_gather_into,
    all_reduce_,
    reduce_scatter_into,
    replicate_all_reduce,
)
from lightning_yafsdp.core.comm.mesh import ShardMesh
from lightning_yafsdp.core.comm.order_guard import CollectiveOrderGuard
from lightning_yafsdp.core.comm.streams import CommScheduler, PendingReduce, ScheduleEvent
from lightning_yafsdp.core.optim.grads import ShardGrads
from lightning_yafsdp.core.optim.optim_step import OptimizerStepSwap
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor
from lightning_yafsdp.core.runtime.flat_group import FlatParamGroup
from lightning_yafsdp.core.runtime.resident import ResidentGroup
from lightning_yafsdp.core.runtime.unit import ShardedUnit, UnitState


class EnginePhase(enum.Enum):
    """Where the model as a whole is; each unit's own state is its ``UnitLifecycle``."""

    OUTSIDE_BACKWARD = "outside backward"
    BACKWARD = "backward"  # the end-of-backward callback is queued and has not run


@dataclass(frozen=True)
class ParamShard:
    """The part of one original parameter that this rank owns.

    Attributes:
        name: original fully qualified parameter name.
        shape: the full parameter's shape.
        start: first owned element of the flattened parameter.
        end: one past the last owned element.
        tensor: 1-D view into the master shard holding those elements.
    """

    name: str
    shape: torch.Size
    start: int
    end: int
    tensor: torch.Tensor


@dataclass(frozen=True)
class EngineMasters:
    """The flat tensors ``shard_model`` filled, handed to the engine when it is built.

    Attributes:
        flat_shard: the master shard of every unit and of the root remainder (master
            dtype): every trainable sharded parameter outside the norms is a view of it.
        norm_shard: the norm group's master shard, or None.
        frozen_store: every unit's frozen parameters, sharded, in the compute dtype
            ([Note: frozen shards]), or None.
    """

    flat_shard: torch.Tensor
    norm_shard: torch.Tensor | None
    frozen_store: torch.Tensor | None


class YaFSDPEngine:
    """Runtime state of one sharded model (see ``shard_model`` for the arguments).

    Built complete from the plan's buffer sizes and the filled master shards; only its
    units and resident groups are added after (``add_groups``), since each is built
    over the engine's buffers and masters.
    """

    def __init__(
        self,
        root: nn.Module,
        *,
        mesh: ShardMesh,
        device: torch.device,
        param_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        buffer_sizes,
        cast_forward_inputs: bool,
        masters: EngineMasters,
    ) -> None:
        self.root = root
        self._adopt_mesh(mesh)
        self.device = device
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.cast_forward_inputs = cast_forward_inputs
        # Reduced grads are sums over every rank (shard and replicate groups).
        self.divide_factor = float(self.world_size)
        self.scheduler = CommScheduler(device)
        # [Note: collective order guard] on by default where it is cheap (CPU).
        self.verify_collective_order(device.type != "cuda")
        self.comm_stats = CommStats()
        self.weight_buffers = [
            WeightBuffer(i, numel, dtype=param_dtype, device=device)
            for i, numel in enumerate(buffer_sizes.weights)
        ]
        self.grad_buffers = [
            GradBuffer(i, numel, shard, dtype=reduce_dtype, device=device)
            for i, (numel, shard) in enumerate(
                zip(buffer_sizes.grads, buffer_sizes.grad_shards, strict=True)
            )
        ]
        self._adopt_masters(masters, buffer_sizes)
        self.units: list[ShardedUnit] = []
        self.residents: list[ResidentGroup] = []
        self._unit_groups: list[FlatParamGroup] = []  # derived in add_groups
        self._writers: list[FlatParamGroup] = []
        self._hooks: list = []
        # Iteration state.
        self.compute_version = 0
        self.phase = EnginePhase.OUTSIDE_BACKWARD
        self._weights_stale = True
        self._seen_master_versions: tuple[int, ...] = ()
        self.optimizer_swap = OptimizerStepSwap(self)

    def _adopt_mesh(self, mesh: ShardMesh) -> None:
        # [Note: hybrid sharding] ``group`` / ``rank`` / ``world_size``: every rank of the
        # model (which parameters were used, checkpoint commits); the units are split
        # over the shard group and, with several shard groups, their reduced grads are
        # all-reduced over the replicate group.
        self.mesh = mesh
        self.group, self.rank, self.world_size = mesh.world_group, mesh.rank, mesh.world_size
        self.shard_group, self.shard_rank = mesh.shard_group, mesh.shard_rank
        self.shard_size = mesh.shard_size
        self.replicate_group = mesh.replicate_group

    def _adopt_masters(self, masters: EngineMasters, buffer_sizes) -> None:
        # The flat master shards (plain tensors): every sharded parameter is a view of one.
        self.flat_shard, self.norm_shard = masters.flat_shard, masters.norm_shard
        self.frozen_store = masters.frozen_store
        # [Note: cast on gather] No compute twin of the flat master: under mixed precision
        # units cast their shard into a staging tensor right before each gather. The norm
        # group keeps a twin.
        mixed = self.flat_shard.dtype != self.param_dtype
        self.gather_staging: GatherStaging | None = (
            GatherStaging(buffer_sizes.staging, dtype=self.param_dtype, device=self.device)
            if mixed
            else None
        )
        self.flat_compute = None if mixed else self.flat_shard.detach()
        norm = self.norm_shard
        self.norm_compute = _compute_twin(norm, self.param_dtype) if norm is not None else None
        self.unit_grads = ShardGrads(self.flat_shard, [])
        self.norm_grads = ShardGrads(self.norm_shard, []) if self.norm_shard is not None else None

    def add_groups(self, units: list[ShardedUnit], residents: list[ResidentGroup]) -> None:
        """The units of the schedule, in module order, and the resident groups.

        A module run in row chunks is several units over one parameter group
        ([Note: row chunks]): ``groups()`` lists that group once, where its chunks are.
        """
        self.units.extend(units)
        self.residents.extend(residents)
        self._unit_groups = list(dict.fromkeys(unit.param_group for unit in self.units))
        self._writers = list(dict.fromkeys([*self.units, *self.groups()]))

    @property
    def root_units(self) -> list[ShardedUnit]:
        """The units that are no block (embeddings, head: [Note: root units])."""
        return [unit for unit in self.units if not unit.is_block]

    # -- what the optimizer sees -------------------------------------------------

    def sharded_parameters(self, *, frozen: bool = False) -> list[nn.Parameter]:
        """Every trainable sharded parameter, once per tied set, in layout order.

        With ``frozen=True`` the frozen sharded parameters follow ([Note: frozen shards]):
        what a checkpoint holds, not what an optimizer steps.
        """
        params = [param for group in self.groups() for param in group.sharded_params]
        if frozen:
            params += [param for group in self.groups() for param in group.frozen_params]
        return params

    def master_parameters(self) -> list[nn.Parameter]:
        raise AttributeError(
            "engine.master_parameters() is gone: the model keeps its own parameters now "
            "(sharded, under their original names). Use module.parameters() or "
            "engine.sharded_parameters(), and engine.param_groups(weight_decay=...) for the "
            "usual decay split."
        )

    def param_groups(self, *, weight_decay: float = 0.0) -> list[dict]:
        """Optimizer param groups: matrices with ``weight_decay``, everything else without.

        The nanoGPT / litgpt rule (``p.dim() >= 2`` decays: linear and embedding
        weights; biases and norm weights do not). Example:
        ``torch.optim.AdamW(engine.param_groups(weight_decay=0.1), lr=3e-4)``.
        """
        params = self.sharded_parameters()
        decay = [p for p in params if p.dim() >= 2]
        rest = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}] if decay else []
        if rest:
            groups.append({"params": rest, "weight_decay": 0.0})
        return groups

    def mark_weights_changed(self) -> None:
        """Tell the engine the master shards were modified outside an optimizer step.

        Optimizer steps are detected automatically (a global step hook); call
        this after writing master shards by hand, e.g. through ``.data``.
        """
        self._weights_stale = True

    def verify_collective_order(self, enabled: bool = True) -> None:
        """Check before every collective that all ranks issue the same one (see order_guard.py).

        Default: on for CPU (gloo) models, off for CUDA, where the check costs a
        host sync per collective. A mismatch raises ``CollectiveOrderError`` on
        every rank instead of hanging or exchanging shards of different units.
        """
        self.scheduler.order_guard = (
            CollectiveOrderGuard(self.mesh, device=self.device, describe=self._describe_group)
            if enabled
            else None
        )

    def _describe_group(self, index: int) -> str:
        if 0 <= index < len(self.units):
            return self.units[index].name
        return {-1: "<root>", -2: "<norms>"}.get(index, f"group {index}")

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide each backward's summed grads by ``factor`` (default: world size)."""
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        self.divide_factor = float(factor)

    @torch.no_grad()
    def clip_grad_norm_(
        self,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        params: Iterator | None = None,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """Clip the global grad norm of ``params`` (default: all); returns the total norm.

        Matches ``torch.nn.utils.clip_grad_norm_`` on the unsharded model: one
        all_reduce of this rank's partial norm over the sharded grads, in the shard
        group (every replica holds the same shards: counting them again would
        multiply the norm by the replica count); grads of replicated (unsharded)
        parameters count once. Collective. With
        ``error_if_nonfinite`` a nan/inf norm raises on every rank before any grad is
        touched (one host sync, as in torch).
        """
        sharded, replicated = self._grads_of(params)
        norm_type = float(norm_type)
        inf = norm_type == math.inf
        local = torch.zeros((), dtype=torch.float32, device=self.device)
        extra = torch.zeros((), dtype=torch.float32, device=self.device)
        for grads, total in ((sharded, local), (replicated, extra)):
            for norm in torch._foreach_norm(grads, norm_type) if grads else ():
                norm = norm.float()
                total.copy_(torch.maximum(total, norm) if inf else total + norm**norm_type)
        op = ReduceOp.MAX if inf else ReduceOp.SUM
        all_reduce_(local, self.shard_group, op=op, stats=self.comm_stats)
        total = torch.maximum(local, extra) if inf else (local + extra) ** (1.0 / norm_type)
        if error_if_nonfinite and not torch.isfinite(total):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from `parameters` is "
                "non-finite, so it cannot be clipped. To disable this error and scale the "
                "gradients by the non-finite norm anyway, set `error_if_nonfinite=False`"
            )
        clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for grads in (sharded, replicated):
            if grads:
                torch._foreach_mul_(grads, clip_coef.to(grads[0].dtype))
        return total

    @torch.no_grad()
    def clip_grad_value_(self, clip_value: float, *, params: Iterator | None = None) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (local, exact)."""
        for grads in self._grads_of(params):
            for grad in grads:
                grad.clamp_(-clip_value, clip_value)

    def _grads_of(self, params) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Local pieces of the sharded grads, and whole grads of replicated params."""
        params = self.sharded_parameters() if params is None else list(params)
        with_grad = [p for p in params if p.grad is not None]
        sharded = [p.grad._local for p in with_grad if isinstance(p.grad, RangeShardedTensor)]
        replicated = [p.grad for p in with_grad if not isinstance(p.grad, RangeShardedTensor)]
        return sharded, replicated

    # -- called by units and resident groups ---------------------------------------

    def begin_forward(self) -> None:
        """Before any sharded module runs: refresh stale compute shards, expose residents."""
        self._recover_from_failed_backward()
        self.optimizer_swap.restore_all()
        if self._weights_stale or self._master_versions() != self._seen_master_versions:
            self._refresh_compute_shards()
        for group in self.residents:
            group.ensure_views()
        for unit in self.root_units:
            unit.expose_placeholders()  # [Note: ungathered weights]

    def issue_reduction(
        self, *, unit: str, slot: int | None, tag: tuple[int, int], full, reduced
    ) -> PendingReduce:
        """Reduce-scatter ``full`` into ``reduced`` in the shard group, after compute so far
        (condition 4); under hybrid sharding then all-reduce ``reduced`` across replicas."""
        stats = self.comm_stats

        def scatter(async_op: bool):
            return reduce_scatter_into(
                reduced, full, self.shard_group, async_op=async_op, stats=stats
            )

        def replicate(async_op: bool):
            return replicate_all_reduce(
                reduced, self.replicate_group, async_op=async_op, stats=stats
            )

        return self.scheduler.issue_reduce(
            unit=unit,
            slot=slot,
            tag=tag,
            scatter=scatter,
            replicate=replicate if self.replicate_group is not None else None,
            after=self.scheduler.compute_marker(),
        )

    def advance_reductions(self) -> None:
        """Start the replicate all_reduces whose reduce_scatter is done (CPU; no-op on CUDA)."""
        for buffer in self.grad_buffers:
            if buffer.reduce is not None:
                buffer.reduce.advance()

    def prefetch_next(self, unit: ShardedUnit) -> None:
        """Start gathering the unit after ``unit`` (module order) while ``unit`` computes."""
        if unit.index + 1 < len(self.units):
            self.units[unit.index + 1].prefetch()

    def prefetch_previous(self, unit: ShardedUnit) -> None:
        """In backward: start gathering the unit before ``unit`` if it awaits its backward."""
        if unit.index > 0:
            previous = self.units[unit.index - 1]
            if previous.life.awaits_backward and previous.backward_reads_weights:
                previous.prefetch()

    def refuse_nested_call(self, unit: ShardedUnit) -> None:
        """Raise if another unit's forward is running: ``unit`` is called inside it."""
        for buffer in self.weight_buffers:
            holder = buffer.holder
            if holder is not None and holder is not unit and holder.state in _FORWARD_STATES:
                raise RuntimeError(
                    f"unit '{unit.name}' is called inside unit '{holder.name}'. Nested sharded "
                    "units are not supported: list only the outer module in units=."
                )

    @property
    def in_backward(self) -> bool:
        return self.phase is EnginePhase.BACKWARD

    @staticmethod
    def inside_autograd_backward() -> bool:
        """True while autograd executes a backward on this thread (recomputation runs here)."""
        return torch._C._current_graph_task_id() != -1

    def cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Cast floating inputs of a unit to the compute dtype (mixed precision)."""
        if not self.cast_forward_inputs or self.flat_shard.dtype == self.param_dtype:
            return args, kwargs

        def cast(x):
            if (
                isinstance(x, torch.Tensor)
                and x.is_floating_point()
                and x.dtype != self.param_dtype
            ):
                return x.to(self.param_dtype)
            return x

        return pytree.tree_map(cast, (args, kwargs))

    def enter_backward(self) -> None:
        """First backward hook of a pass: prepare grads, queue the end-of-backward callback.

        ``queue_callback`` attaches to the graph task running NOW. A reentrant
        checkpoint runs a nested backward (its own graph task) inside the outer
        one; a callback queued from inside it would fire when the nested task
        ends, mid-backward. Units therefore enter backward already when a
        reentrant checkpoint recomputes them (``ShardedUnit._pre_forward``),
        which runs in the outer task before the nested backward starts.
        """
        if self.phase is EnginePhase.BACKWARD:
            return
        self.phase = EnginePhase.BACKWARD
        for grads in self._all_grads():
            grads.begin_backward()
        for group in self._grad_writers():
            group.used_in_backward = [False] * len(group.owners)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    # -- internals ---------------------------------------------------------------------

    def _end_of_backward(self) -> None:
        # Collectives below run in the same order on every rank.
        for unit in self.units:
            unit.finish_backward()
        for buffer in self.grad_buffers:
            buffer.complete_reduce()
        for group in self.residents:
            group.reduce_grads()
        used = self._used_anywhere()
        for grads, groups in self.grads_by_master():
            flags = [flag for g in groups for flag in used[id(g)]]
            ranges = [r for g in groups for r in g.grad_ranges(self.shard_rank)]
            grads.end_backward(ranges, flags)
        for unit in self.units:
            unit.end_iteration()
        self.phase = EnginePhase.OUTSIDE_BACKWARD

    def _recover_from_failed_backward(self) -> None:
        if self.phase is EnginePhase.BACKWARD and not self.inside_autograd_backward():
            self._abandon_backward()  # the last backward raised before its end

    def _abandon_backward(self) -> None:
        """Forget a backward that raised (an out-of-memory retry): the next step starts clean.

        Its end-of-backward callback never ran. In-flight collectives are waited
        (every rank issued them) and their results dropped, as torch drops the
        grads of a failed backward; ``.grad`` was never set from this pass.
        """
        for buffer in self.grad_buffers:
            if buffer.reduce is not None:
                buffer.reduce.wait()
                buffer.reduce, buffer.on_reduced = None, None
        for group in self._grad_writers():
            group.abandon_grad_writes()
        for unit in self.units:
            unit.abandon_iteration()
        for grads in self._all_grads():
            grads.abandon_backward()
        self.phase = EnginePhase.OUTSIDE_BACKWARD

    def _used_anywhere(self) -> dict[int, list[bool]]:
        """Per group, per parameter: did ANY rank write a grad for it in this backward?

        One tiny all_reduce (MAX over one byte per parameter), as DDP does with
        ``find_unused_parameters``: a parameter no rank used keeps ``grad is None``
        and the optimizer skips it; one used anywhere gets its (reduced) grad on
        every rank, so every rank holds the same set of grads.
        """
        groups = self.groups()
        flags = [flag for g in groups for flag in g.used_in_backward]
        tensor = torch.tensor(flags, dtype=torch.uint8, device=self.device)
        if self.world_size > 1:
            all_reduce_(tensor, self.group, op=ReduceOp.MAX, stats=self.comm_stats)
        values = tensor.tolist()
        result, cursor = {}, 0
        for group in groups:
            count = len(group.owners)
            result[id(group)] = [bool(v) for v in values[cursor : cursor + count]]
            cursor += count
        return result

    def grads_by_master(self) -> list[tuple[ShardGrads, list[FlatParamGroup]]]:
        """Each master's gradient accumulator with the groups stored in that master."""
        pairs = [(self.unit_grads, [*self._unit_groups, *self._residents_of(self.unit_grads)])]
        if self.norm_grads is not None:
            pairs.append((self.norm_grads, self._residents_of(self.norm_grads)))
        return pairs

    def _residents_of(self, grads: ShardGrads) -> list[ResidentGroup]:
        return [g for g in self.residents if g.grads is grads]

    def _all_grads(self) -> list[ShardGrads]:
        return [g for g in (self.unit_grads, self.norm_grads) if g is not None]

    def _master_versions(self) -> tuple[int, ...]:
        return tuple(m._version for m in (self.flat_shard, self.norm_shard) if m is not None)

    @torch.no_grad()
    def _refresh_compute_shards(self) -> None:
        for buffer in self.weight_buffers:
            if buffer.gather is not None:  # a speculative prefetch still reads the old shard
                buffer.gather.wait()
                buffer.gather = None
        for master, compute in (
            (self.flat_shard, self.flat_compute),
            (self.norm_shard, self.norm_compute),
        ):
            if (
                master is not None
                and compute is not None
                and compute.data_ptr() != master.data_ptr()
            ):
                compute.copy_(master)
        self.compute_version += 1
        self._weights_stale = False
        self._seen_master_versions = self._master_versions()
        self.scheduler.comm_waits_for_compute()

    # -- inspection ----------------------------------------------------------------------

    def blocks(self) -> list[ShardedUnit]:
        """The units the policy chose (transformer blocks), without the root units."""
        return [unit for unit in self.units if unit.is_block]

    def groups(self) -> list[FlatParamGroup]:
        """Every parameter group: units in module order, then resident groups.

        A module run in row chunks appears once, as the group holding its parameters.
        """
        return [*self._unit_groups, *self.residents]

    def _grad_writers(self) -> list[FlatParamGroup]:
        """Every group that writes grads or tracks their use: the groups and the row chunks."""
        return self._writers

    def named_parameter_shards(self) -> Iterator[ParamShard]:
        """This rank's part of every original parameter, by original name (first tied alias)."""
        for param in self.sharded_parameters():
            placement = param._placement
            if placement.numel:
                yield ParamShard(
                    placement.name, placement.shape, placement.start, placement.end, param._local
                )

    @contextlib.contextmanager
    def summon_full_params(self, *, writeback: bool = False) -> Iterator[None]:
        """Put the full master-dtype weights into the modules, as plain parameters.

        For inspection or export outside forward (``state_dict()``,
        ``named_parameters()``, peft's ``save_pretrained`` see full weights).
        Collective; every rank holds the whole model for the duration. With
        ``writeback=True`` changes made to the full tensors are copied back into
        this rank's shards on exit. On exit the modules hold the same sharded
        parameter objects as before, so optimizers stay valid.
        """
        self._recover_from_failed_backward()
        if self.in_backward or any(unit.is_computing for unit in self.units):
            raise RuntimeError("summon_full_params() cannot be used during forward or backward")
        full_flats = [(self._gather_full(g), self._gather_frozen(g)) for g in self.groups()]
        for group in self.groups():
            group.uninstall_views()  # resident views must not hide the full parameters
        for group in self.residents:
            group.forget_views()
        try:
            for group, (flat, frozen) in zip(self.groups(), full_flats, strict=True):
                group.register_full_params(flat, frozen)
            yield
        finally:
            for group, (flat, frozen) in zip(self.groups(), full_flats, strict=True):
                if writeback:
                    self._write_back(group, flat, frozen)
                group.register_sharded_params()
            if writeback:
                self.mark_weights_changed()

    @torch.no_grad()
    def _write_back(self, group: FlatParamGroup, flat: torch.Tensor, frozen) -> None:
        start, end = group.layout.shard_range(self.shard_rank)
        group.master_shard.copy_(flat[start:end])
        if frozen is not None:
            start, end = group.frozen_layout.shard_range(self.shard_rank)
            group.frozen_shard.copy_(frozen[start:end])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Original-name state dict with full master-dtype weights (every rank gets all of it)."""
        state = {
            name: tensor.detach()
            for name, tensor in self.root.state_dict(keep_vars=True).items()
            if not isinstance(tensor, RangeShardedTensor)
        }
        for group in self.groups():
            placed = [(group.layout, self._gather_full(group), group.owners)]
            if group.frozen_layout is not None:
                placed.append(
                    (group.frozen_layout, self._gather_frozen(group), group.frozen_owners)
                )
            for layout, flat, owners_list in placed:
                for span, owners in zip(layout.spans, owners_list, strict=True):
                    value = flat[span.offset : span.end].view(span.shape)
                    for owner in owners:
                        state[owner.name] = value
        return state

    def _gather_full(self, group: FlatParamGroup) -> torch.Tensor:
        full = torch.empty(
            group.layout.padded_numel, dtype=group.master_shard.dtype, device=self.device
        )
        all_gather_into(
            full, group.master_shard, self.shard_group, async_op=False, stats=self.comm_stats
        )
        return full

    def _gather_frozen(self, group: FlatParamGroup) -> torch.Tensor | None:
        if group.frozen_layout is None:
            return None
        full = torch.empty(
            group.frozen_layout.padded_numel, dtype=group.frozen_shard.dtype, device=self.device
        )
        all_gather_into(
            full, group.frozen_shard, self.shard_group, async_op=False, stats=self.comm_stats
        )
        return full

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds, by role (shards, grads, buffers)."""

        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        masters = (self.flat_shard, self.norm_shard)
        computes = (self.flat_compute, self.norm_compute)
        return {
            "master_shards": sum(nbytes(m) for m in masters),
            "compute_shards": sum(
                nbytes(c)
                for c, m in zip(computes, masters, strict=True)
                if c is not None and c.data_ptr() != m.data_ptr()
            ),
            "gather_staging": self.gather_staging.nbytes if self.gather_staging else 0,
            "frozen_shards": nbytes(self.frozen_store),
            "grad_shards": sum(nbytes(g.window()) for g in self._all_grads()),
            "weight_buffers": sum(b.nbytes for b in self.weight_buffers),
            "grad_buffers": sum(b.nbytes for b in self.grad_buffers),
            "resident_buffers": sum(
                g.weight_buffer.nbytes + g.grad_buffer.nbytes for g in self.residents
            ),
        }

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[ScheduleEvent]]:
        """Record every gather/reduce issue and wait and every compute boundary."""
        log: list[ScheduleEvent] = []
        self.scheduler.log = log
        try:
            yield log
        finally:
            self.scheduler.log = None

    def __deepcopy__(self, memo: dict) -> YaFSDPEngine:
        # copy.deepcopy of a sharded model (an EMA's AveragedModel) shares the engine:
        # one process group, one set of buffers; the copy's parameters are its own.
        return self

    def __reduce__(self):
        raise TypeError(
            "a sharded model cannot be pickled whole (torch.save(model)): its engine holds a "
            "process group. Save model.state_dict() (this rank's pieces), or the full weights "
            "with engine.full_state_dict() / the Lightning strategy's checkpoints."
        )

    def close(self) -> None:
        """Remove the engine's hooks (the model stays sharded)."""
        self.optimizer_swap.close()
        for handle in self._hooks:
            handle.remove()
        for group in self._grad_writers():
            group.remove_hooks()


_FORWARD_STATES = (UnitState.FORWARD, UnitState.NO_GRAD_FORWARD)


def _compute_twin(master: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
    # [Note: compute shards] The norm group's all_gather source. When the compute dtype
    # equals the master dtype it IS the master shard (no copy); otherwise a twin that is
    # refreshed once after every optimizer step (tiny; units cast on gather instead).
    if master.dtype == param_dtype:
        return master.detach()
    return master.detach().to(param_dtype)
