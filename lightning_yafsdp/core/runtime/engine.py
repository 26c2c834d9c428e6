"""The root of a sharded model: iteration boundaries, optimizer hand-off, state access.

``shard_model`` (``sharding.py``) builds a ``YaFSDPEngine``. The engine builds the step
context every group shares ([Note: step context], ``context.py``) and installs its own
part of a step's boundaries there; the groups never call the engine.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ReduceOp

from lightning_yafsdp.core.comm.buffers import GatherStaging
from lightning_yafsdp.core.comm.collectives import all_reduce_
from lightning_yafsdp.core.comm.exchange_line import exchange_line_for
from lightning_yafsdp.core.comm.mesh import ShardMesh
from lightning_yafsdp.core.comm.order_guard import CollectiveOrderGuard
from lightning_yafsdp.core.comm.step_timing import timed_hook
from lightning_yafsdp.core.comm.streams import ScheduleEvent
from lightning_yafsdp.core.optim.grads import ShardGrads
from lightning_yafsdp.core.optim.optim_step import OptimizerStepSwap
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor
from lightning_yafsdp.core.runtime.context import StepCallbacks, StepContext
from lightning_yafsdp.core.runtime.flat_group import FlatParamGroup
from lightning_yafsdp.core.runtime.full_params import FullGather
from lightning_yafsdp.core.runtime.resident import ResidentGroup
from lightning_yafsdp.core.runtime.unit import ShardedUnit


def _join_exchange_line(mesh: ShardMesh, device: torch.device) -> tuple:
    """``(line, model)``: on CPU the gathers and reductions of every engine of this process
    over the shard group's ranks go on one line, in order, this engine as ``model``
    ([Note: exchange lines]); ``(None, 0)`` on CUDA or for a shard group of one rank."""
    if device.type == "cuda" or mesh.shard_size == 1:
        return None, 0
    line = exchange_line_for(mesh.shard_group)
    return line, line.join()


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
    groups are added after (``add_groups``), since each is built over the step context
    and the masters.
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
        self.root, self.mesh, self.device = root, mesh, device
        # [Note: hybrid sharding] ``group`` / ``rank`` / ``world_size``: every rank of the
        # model (which parameters were used, checkpoint commits); the units are split
        # over the shard group and, with several shard groups, their reduced grads are
        # all-reduced over the replicate group.
        self.group, self.rank, self.world_size = mesh.world_group, mesh.rank, mesh.world_size
        self.shard_group, self.shard_rank = mesh.shard_group, mesh.shard_rank
        self.shard_size, self.replicate_group = mesh.shard_size, mesh.replicate_group
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype
        # The flat master shards (plain tensors): every sharded parameter is a view of one.
        self.flat_shard, self.norm_shard = masters.flat_shard, masters.norm_shard
        self.frozen_store = masters.frozen_store
        # [Note: cast on gather] No compute twin of the flat master: under mixed precision
        # units cast their shard into a staging tensor right before each gather. The norm
        # group keeps a twin.
        mixed = self.flat_shard.dtype != param_dtype
        self.flat_compute = None if mixed else self.flat_shard.detach()
        norm = self.norm_shard
        self.norm_compute = _compute_twin(norm, param_dtype) if norm is not None else None
        grads = (
            ShardGrads(self.flat_shard, []),
            ShardGrads(self.norm_shard, []) if norm is not None else None,
        )
        staging = GatherStaging(buffer_sizes.staging, dtype=param_dtype, device=device)
        self.context = StepContext(
            mesh=mesh, device=device, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            buffer_sizes=buffer_sizes, grads=grads, gather_staging=staging if mixed else None,
            cast_forward_inputs=cast_forward_inputs, master_dtype=self.flat_shard.dtype,
        )  # fmt: skip
        ctx = self.context
        ctx.install(StepCallbacks(self._forward_start, self._backward_start, self._backward_end))
        # The context's pieces, under the names readers of the engine know them by.
        self.scheduler, self.comm_stats = ctx.scheduler, ctx.comm_stats
        self.weight_buffers, self.grad_buffers = ctx.weight_buffers, ctx.grad_buffers
        self.gather_staging = ctx.gather_staging
        self.unit_grads, self.norm_grads = grads
        self._line, self._line_model = _join_exchange_line(mesh, device)
        self.verify_collective_order(device.type != "cuda")  # on by default where cheap (CPU)
        # The units in schedule order (the context's list) and every parameter group once,
        # in master order: the unit groups, then the resident groups.
        self.units: list[ShardedUnit] = ctx.order
        self._groups: list[FlatParamGroup] = []
        self._residents, self._root_units = (), ()  # views of the lists, set by add_groups
        self._hooks: list = []
        self._full = FullGather(self.shard_group, self.shard_rank, device, self.comm_stats)
        self._weights_stale = True
        self._seen_master_versions: tuple[int, ...] = ()
        self.optimizer_swap = OptimizerStepSwap(self)

    def add_groups(self, units: list[ShardedUnit], residents: list[ResidentGroup]) -> None:
        """The units of the schedule, in module order, and the resident groups.

        A module run in row chunks is several units over one parameter group
        ([Note: row chunks]): ``groups()`` lists that group once, where its chunks are.
        """
        self.units.extend(units)
        self._groups = [*dict.fromkeys(unit.param_group for unit in self.units), *residents]
        # Views of the one list, fixed from here on: every unit's pre-forward reads both.
        self._residents = tuple(g for g in self._groups if isinstance(g, ResidentGroup))
        self._root_units = tuple(unit for unit in self.units if not unit.is_block)

    @property
    def residents(self) -> tuple[ResidentGroup, ...]:
        """The resident groups ([Note: resident groups]): the root remainder, the norms."""
        return self._residents

    @property
    def root_units(self) -> tuple[ShardedUnit, ...]:
        """The units that are no block (embeddings, head: [Note: root units])."""
        return self._root_units

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
        """Check that all ranks issue the same collectives in the same order.

        Default: on for CPU (gloo) models, off for CUDA. On CPU the gathers and
        reductions go on the exchange line, which checks their order without traffic
        of its own ([Note: exchange lines]); the replicate all_reduce of a hybrid mesh,
        and every collective on CUDA, exchange a tag first ([Note: collective order
        guard]; a host sync per collective on CUDA). A mismatch raises
        ``CollectiveOrderError`` on every rank instead of hanging or exchanging shards
        of different units.
        """
        units = self.context.order

        def describe(index: int) -> str:
            if 0 <= index < len(units):
                return units[index].name
            return {-1: "<root>", -2: "<norms>"}.get(index, f"group {index}")

        self.scheduler.use_line(self._line if enabled else None, self._line_model)
        on_cpu_flat = self._line is not None and self.replicate_group is None
        self.scheduler.order_guard = (
            CollectiveOrderGuard(self.mesh, device=self.device, describe=describe)
            if enabled and not on_cpu_flat
            else None
        )

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide each backward's summed grads by ``factor`` (default: world size)."""
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        self.context.divide_factor = float(factor)

    @torch.no_grad()
    @timed_hook
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
        sharded, replicated = _grads_of(self, params)
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
    @timed_hook
    def clip_grad_value_(self, clip_value: float, *, params: Iterator | None = None) -> None:
        """Clamp every gradient element to ``[-clip_value, clip_value]`` (local, exact)."""
        for grads in _grads_of(self, params):
            for grad in grads:
                grad.clamp_(-clip_value, clip_value)

    # -- a step's boundaries, called through the step context ----------------------------

    def _forward_start(self) -> None:
        """Before any sharded module runs: refresh stale compute shards, expose residents."""
        if self.context.in_backward and not self.context.inside_autograd_backward():
            self._abandon_backward()  # the last backward raised before its end
        self.optimizer_swap.restore_all()
        if self._weights_stale or self._master_versions() != self._seen_master_versions:
            self._refresh_compute_shards()
        # [Note: batched step-boundary collectives] every resident's gather is in
        # flight before the first is waited.
        for group in self.residents:
            group.start_gather()
        for group in self.residents:
            group.ensure_views()
        for unit in self.root_units:
            unit.expose_placeholders()  # [Note: ungathered weights]

    def _backward_start(self) -> None:
        for grads in self.grads_by_master():
            grads[0].begin_backward()
        for group in dict.fromkeys([*self.units, *self._groups]):
            group.used_in_backward = [False] * len(group.owners)

    def _backward_end(self) -> None:
        # Collectives below run in the same order on every rank.
        for unit in self.units:
            unit.finish_backward()
        self.context.complete_reductions()
        # [Note: batched step-boundary collectives] the residents' reductions and the
        # used-parameter flags are all in flight before the first is waited.
        finishes = [group.start_reduction() for group in self.residents]
        used = self._used_anywhere()
        for finish in finishes:
            if finish is not None:
                finish()
        for grads, groups in self.grads_by_master():
            flags = [flag for g in groups for flag in used[id(g)]]
            ranges = [r for g in groups for r in g.grad_ranges(self.shard_rank)]
            grads.end_backward(ranges, flags)
        for unit in self.units:
            unit.end_iteration()

    def _abandon_backward(self) -> None:
        """Forget a backward that raised (an out-of-memory retry): the next step starts clean.

        Its end-of-backward callback never ran. In-flight collectives are waited
        (every rank issued them) and their results dropped, as torch drops the
        grads of a failed backward; ``.grad`` was never set from this pass.
        """
        for buffer in self.grad_buffers:
            buffer.drop_reduce()
        for group in dict.fromkeys([*self.units, *self._groups]):
            group.abandon_grad_writes()
        for unit in self.units:
            unit.abandon_iteration()
        for grads, _ in self.grads_by_master():
            grads.abandon_backward()
        self.context.leave_backward()

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

        def grads_of(group: FlatParamGroup) -> ShardGrads:
            return group.grads if isinstance(group, ResidentGroup) else self.unit_grads

        return [
            (grads, [g for g in self._groups if grads_of(g) is grads])
            for grads in (self.unit_grads, self.norm_grads)
            if grads is not None
        ]

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
        self.context.compute_version += 1
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
        return list(self._groups)

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
        ctx = self.context
        if ctx.in_backward and not ctx.inside_autograd_backward():
            self._abandon_backward()  # the last backward raised before its end
        if ctx.in_backward or any(unit.is_computing for unit in self.units):
            raise RuntimeError("summon_full_params() cannot be used during forward or backward")
        groups = self.groups()
        full_flats = [(self._full.trainable(g), self._full.frozen(g)) for g in groups]
        for group in groups:
            group.uninstall_views()  # resident views must not hide the full parameters
        for group in self.residents:
            group.forget_views()
        try:
            for group, (flat, frozen) in zip(groups, full_flats, strict=True):
                group.register_full_params(flat, frozen)
            yield
        finally:
            for group, (flat, frozen) in zip(groups, full_flats, strict=True):
                if writeback:
                    self._full.write_back(group, flat, frozen)
                group.register_sharded_params()
            if writeback:
                self.mark_weights_changed()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Original-name state dict with full master-dtype weights (every rank gets all of it)."""
        return self._full.state_dict(self.root, self.groups())

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
            "grad_shards": sum(nbytes(g.window()) for g, _ in self.grads_by_master()),
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
        for group in dict.fromkeys([*self.units, *self._groups]):
            group.remove_hooks()


def _grads_of(engine: YaFSDPEngine, params) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Local pieces of the sharded grads, and whole grads of replicated params."""
    params = engine.sharded_parameters() if params is None else list(params)
    with_grad = [p for p in params if p.grad is not None]
    sharded = [p.grad._local for p in with_grad if isinstance(p.grad, RangeShardedTensor)]
    replicated = [p.grad for p in with_grad if not isinstance(p.grad, RangeShardedTensor)]
    return sharded, replicated


def _compute_twin(master: torch.Tensor, param_dtype: torch.dtype) -> torch.Tensor:
    # [Note: compute shards] The norm group's all_gather source. When the compute dtype
    # equals the master dtype it IS the master shard (no copy); otherwise a twin that is
    # refreshed once after every optimizer step (tiny; units cast on gather instead).
    if master.dtype == param_dtype:
        return master.detach()
    return master.detach().to(param_dtype)
