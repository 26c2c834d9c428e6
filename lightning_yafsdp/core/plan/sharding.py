"""``shard_model``: turn a module's parameters into flat, sharded groups, in place.

Reads as a script: validate, decide which group each parameter joins, build
layouts, fill the master shards one group at a time (no rank ever holds more
than one unflattened group beyond the model it was given), then rewire the
module: original parameters out, sharded parameters (views of the master
shards) in under the same names, hooks on.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_yafsdp.core.comm.collectives import CommStats, broadcast_, check_reduce_dtype
from lightning_yafsdp.core.comm.mesh import ShardMesh, resolve_mesh
from lightning_yafsdp.core.compat import outside_compile
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor
from lightning_yafsdp.core.plan.group_spec import GroupSpec
from lightning_yafsdp.core.plan.grouping import BlocksPerUnit, group_blocks
from lightning_yafsdp.core.plan.materialize import (
    Materializer,
    ModelInitFactory,
    draw_init_seed,
)
from lightning_yafsdp.core.plan.meta_build import constructor_values, prune_constructor_values
from lightning_yafsdp.core.plan.policy import NormSpec, UnitsSpec, find_units, is_norm_module
from lightning_yafsdp.core.plan.root_units import split_root
from lightning_yafsdp.core.plan.schedule import (
    ScheduledUnit,
    Segment,
    buffer_sizes,
    scheduled_units,
)
from lightning_yafsdp.core.runtime.chunk_rules import chunk_refusal, is_embedding_use
from lightning_yafsdp.core.runtime.chunked_unit import ChunkedParams, RowChunkUnit
from lightning_yafsdp.core.runtime.engine import EngineMasters, YaFSDPEngine
from lightning_yafsdp.core.runtime.flat_group import ParamOwner
from lightning_yafsdp.core.runtime.layout import FlatLayout
from lightning_yafsdp.core.runtime.resident import ResidentGroup
from lightning_yafsdp.core.runtime.row_chunks import RowChunk, split_rows
from lightning_yafsdp.core.runtime.unit import ShardedUnit

NORM_GROUP = "<norms>"
ROOT_GROUP = "<root>"
CheckpointSpec = (
    None | str | Sequence[int] | type | Sequence[type] | Callable[[int, str], bool]
)


def shard_model(
    module: nn.Module,
    *,
    process_group: ProcessGroup | None = None,
    shard_size: int | None = None,
    device_mesh: Any = None,
    mesh: ShardMesh | None = None,
    units: UnitsSpec = None,
    norm_classes: NormSpec = None,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    master_dtype: torch.dtype = torch.float32,
    zero_stage: int = 3,
    activation_checkpointing: CheckpointSpec = None,
    sync_module_states: bool = False,
    cast_forward_inputs: bool = True,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    model_init: ModelInitFactory | None = None,
    vocab_chunks: bool = True,
    blocks_per_unit: BlocksPerUnit = "auto",
) -> YaFSDPEngine:
    """Shard ``module`` in place across ``process_group`` and return its engine.

    After this call ``module.named_parameters()`` yields every original
    parameter under its original name as a sharded parameter (a RangeShardedTensor:
    full logical shape, this rank's piece of the flat master shard inside; see
    ``sharded_param.py``), so any optimizer and any param-group split work as on
    the unsharded model. The units are the blocks and the large modules outside
    them (embeddings, head: [Note: root units]). Frozen parameters
    (``requires_grad=False``) of a unit are sharded too, without grads or optimizer
    state ([Note: frozen shards]); frozen norms stay plain, replicated parameters.

    Args:
        module: a materialized model, identical on every rank (or pass
            ``sync_module_states=True`` to broadcast rank 0's weights).
        process_group: ranks to shard across (default: the world group).
        shard_size: hybrid sharding ([Note: hybrid sharding], ``mesh.py``): shard
            over groups of this many consecutive ranks of the world and replicate
            across the groups (the world size: flat sharding). Collective: creates
            the groups.
        device_mesh: a torch ``DeviceMesh``: 1-D (flat) or 2-D with dims
            ``("replicate", "shard")`` (hybrid).
        mesh: a ``ShardMesh`` built before (reuse its groups across models).
            At most one of ``process_group``, ``shard_size``, ``device_mesh``, ``mesh``.
        units: which submodules are sharded units (see ``policy.find_units``);
            default: the repeated blocks, auto-detected.
        norm_classes: which modules form the norm group (see
            ``policy.is_norm_module``); default: LayerNorm/RMSNorm look-alikes.
        param_dtype: compute dtype of gathered weights and buffers (default:
            ``master_dtype``). ``torch.bfloat16`` for mixed precision.
        reduce_dtype: dtype of grad buffers and of the reduce_scatter
            (default fp32: grads sum in fp32).
        master_dtype: dtype of the master shards the optimizer updates.
        zero_stage: 3 (re-gather weights in backward; two weight buffers) or
            2 (keep each unit's gathered weights from forward to backward; one
            weight buffer per unit).
        activation_checkpointing: None; "all"; unit indices; a block class or a list of
            classes; or a predicate ``(index, name) -> bool`` selecting units whose
            forward runs under non-reentrant activation checkpointing (indices and names
            are those of units: a unit of grouped blocks counts once, named
            ``layers.0-1``, and recomputes block by block).
        sync_module_states: broadcast each group, and then every buffer (frozen
            parameters included), from rank 0 before sharding, as DDP does.
        cast_forward_inputs: cast floating unit inputs to ``param_dtype``.
        param_init_fn: for a model built on the meta device: called on each
            unit module (and on each other module owning parameters or
            buffers) right after it is materialized on the target device and
            right before it is flattened and sharded, so no rank ever holds
            the whole unsharded model. Default: the model's own scheme,
            ``reset_parameters()`` of each module, then the ``model_init`` family's.
            Each group is initialized under a seed equal on every rank; anything
            left uninitialized raises, naming the tensor.
        model_init: how the model's family initializes beyond ``reset_parameters()``
            (``core/plan/materialize.py``, ``ModelInitFactory``); for Hugging Face and
            peft models ``lightning_yafsdp.hf_init.hf_model_init``, which both
            strategies pass. None: torch's convention only.
        vocab_chunks: run an embedding or head larger than a block in row chunks of
            at most a block each, so no buffer slot is vocabulary-sized ([Note: row
            chunks]); a tied embedding and head too ([Note: tied row chunks]). Which
            modules qualify: [Note: chunkable modules].
        blocks_per_unit: consecutive blocks gathered and reduced as one unit ([Note:
            grouped blocks], ``core/plan/grouping.py``): ``"auto"`` (default) groups
            auto-detected blocks smaller than 4M elements so that each unit moves enough
            bytes to pay for its collectives; an int groups that many (auto-detected or
            given by ``units=``); 1 keeps one block per unit. Units given by ``units=``
            stay as given under ``"auto"``.

    Raises:
        ValueError / RuntimeError: for input that cannot work, before any
            collective is issued, with the fix in the message.
    """
    param_dtype = _check_arguments(zero_stage, param_dtype, reduce_dtype, master_dtype)
    mesh = resolve_mesh(
        process_group=process_group, shard_size=shard_size, device_mesh=device_mesh, mesh=mesh
    )
    device, built_on_meta = _target_device(module, mesh, reduce_dtype)

    # 1. Plan: which parameter joins which group, and every layout. Layouts split each
    # group over the shard group: a shard group of K ranks is sharded exactly as a flat
    # world of K ranks ([Note: hybrid sharding]).
    plan = _plan(
        module, find_units(module, units), norm_classes, mesh.shard_size, vocab_chunks=vocab_chunks,
        zero_stage=zero_stage, blocks_per_unit=_grouping(units, blocks_per_unit),
    )  # fmt: skip
    _refuse_hidden_aliases(module, [*plan.specs[0], *plan.specs[1:3]])

    # 2. Build: the master shards, filled one group at a time (materialized first when
    # built on meta), then the engine over them and its units and resident groups.
    stats, init_on = CommStats(), None
    prune_constructor_values()  # [Note: constructor values in meta builds]
    if built_on_meta:
        _agree_on_constructor_values(module, mesh, device, stats)
        init_on = _materializer(module, plan, mesh, device, param_init_fn, model_init, stats)
    fill = dict(rank=mesh.shard_rank, group=mesh.world_group, sync=sync_module_states,
                stats=stats, device=device, dtype=master_dtype, init=init_on)  # fmt: skip
    engine = YaFSDPEngine(
        module,
        mesh=mesh,
        device=device,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        buffer_sizes=buffer_sizes(plan.schedule(), zero_stage),
        cast_forward_inputs=cast_forward_inputs,
        masters=_fill_masters(plan, frozen_dtype=param_dtype, **fill),
    )
    _add_groups(engine, plan)

    # 3. Install: sharded parameters and hooks into the module, then what no group owns.
    _install(module, engine, init_on, sync_module_states, activation_checkpointing, stats)
    return engine


def _install(module, engine, init_on, sync_module_states, activation_checkpointing, stats):
    _rewire_module(module, engine)
    if init_on is not None:
        _materialize_the_rest(module, engine, init_on)
    if sync_module_states:
        _broadcast_replicated(module, engine.group, stats)
    _apply_activation_checkpointing(engine, activation_checkpointing)
    engine.comm_stats.reset()


def _check_arguments(zero_stage, param_dtype, reduce_dtype, master_dtype) -> torch.dtype:
    """Refuse what cannot work before any collective; the compute dtype."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "shard_model needs torch.distributed: call "
            "torch.distributed.init_process_group() first "
            "(a world of size 1 is fine)."
        )
    if zero_stage not in (2, 3):
        raise ValueError(f"zero_stage must be 2 or 3, got {zero_stage!r}")
    param_dtype = param_dtype or master_dtype
    for label, dtype in (
        ("param_dtype", param_dtype),
        ("reduce_dtype", reduce_dtype),
        ("master_dtype", master_dtype),
    ):
        if not dtype.is_floating_point:
            raise ValueError(f"{label} must be a floating dtype, got {dtype}")
    return param_dtype


def _target_device(
    module: nn.Module, mesh: ShardMesh, reduce_dtype: torch.dtype
) -> tuple[torch.device, bool]:
    """Where the engine's tensors go, and whether the model was built on meta."""
    model_device = _single_device(module, allow_meta=True)
    built_on_meta = model_device.type == "meta"
    device = _default_device(mesh.world_group) if built_on_meta else model_device
    check_backend(str(dist.get_backend(mesh.world_group)), device)
    check_reduce_dtype(mesh, device, reduce_dtype)
    return device, built_on_meta


def _agree_on_constructor_values(module: nn.Module, mesh: ShardMesh, device, stats) -> None:
    """Rank 0's constructor values, on ``device``, on every rank ([Note: constructor values
    in meta builds]): a draw in ``__init__`` differs between unseeded ranks."""
    for _, param in constructor_values(module):
        with torch.no_grad():
            param.data = param.data.to(device)
            broadcast_(param.data, mesh.world_group, src_rank=0, stats=stats)


def _materializer(module, plan, mesh, device, param_init_fn, model_init, stats) -> Materializer:
    """The group-by-group materializer of a meta-built model, seeded alike on every rank."""
    seed = draw_init_seed(mesh.world_group, device, stats=stats)
    init_on = Materializer(
        module, device=device, init_fn=param_init_fn, seed=seed, model_init=model_init
    )
    blocks = [spec for spec in plan.specs[0] if spec.is_block]
    init_on.assign_unit_modules(blocks, [(spec.name, spec.modules) for spec in blocks])
    return init_on


def _flat_groups(plan: ShardingPlan) -> list[tuple[GroupSpec, FlatLayout, FlatLayout | None]]:
    """``(spec, layout, frozen layout)`` of each group in the flat master: units, then root."""
    unit_specs, _, root_spec, _ = plan.specs
    unit_layouts = [layout for _, layout in plan.units]
    groups = [*zip(unit_specs, unit_layouts, plan.frozen, strict=True)]
    if plan.root is not None:
        groups.append((root_spec, plan.root, None))
    return groups


def _fill_masters(plan: ShardingPlan, *, frozen_dtype, **fill) -> EngineMasters:
    flat_shard, frozen_store = _build_master(_flat_groups(plan), frozen_dtype=frozen_dtype, **fill)
    norm_shard = None
    if plan.norms is not None:
        norm_shard, _ = _build_master([(plan.specs[1], plan.norms, None)], **fill)
    return EngineMasters(flat_shard=flat_shard, norm_shard=norm_shard, frozen_store=frozen_store)


def _materialize_the_rest(module: nn.Module, engine: YaFSDPEngine, init_on: Materializer) -> None:
    # Frozen parameters and buffers; the sharded parameters are hidden from the
    # init code, which would otherwise re-initialize them.
    for flat_group in engine.groups():
        flat_group.install_placeholders()
    init_on.materialize_rest(module)
    for flat_group in engine.groups():
        flat_group.uninstall_views()


def _add_groups(engine: YaFSDPEngine, plan: ShardingPlan) -> None:
    """Create the units (views into the masters and the frozen store) and the residents.

    The groups are laid out in plan order (the master's order); the units of the
    schedule follow ``plan.segments`` (a tied weight's uses at their modules' places).
    """
    unit_specs, norm_spec, root_spec, _ = plan.specs
    groups, residents = [], []
    offset = frozen_offset = 0
    flat_units = _flat_groups(plan)[: len(unit_specs)]
    for (spec, layout, frozen_layout), chunks in zip(flat_units, plan.chunks, strict=True):
        kwargs = _group_kwargs(spec, layout, engine, "flat", offset)
        offset += layout.shard_numel
        if frozen_layout is not None:
            end = frozen_offset + frozen_layout.shard_numel
            kwargs.update(
                frozen_layout=frozen_layout,
                frozen_owners=spec.frozen_owners,
                frozen_shard=engine.frozen_store[frozen_offset:end],
            )
            frozen_offset = end
        # [Note: row chunks]
        groups.append(ChunkedParams(spec.modules, chunks, **kwargs) if chunks else kwargs)
    names = {id(m): name for name, m in engine.root.named_modules()}
    units = []
    for segment in plan.segments:
        spec, group = unit_specs[segment.unit], groups[segment.unit]
        if isinstance(group, ChunkedParams):
            use = spec.modules[segment.use]
            units += _chunk_units(engine.context, len(units), group, use, names[id(use)])
        else:
            units.append(
                ShardedUnit(
                    engine.context, len(units), spec.modules, is_block=spec.is_block, **group
                )
            )
    if plan.root is not None:
        kwargs = _group_kwargs(root_spec, plan.root, engine, "flat", offset)
        residents.append(ResidentGroup(engine.context, grads=engine.unit_grads, **kwargs))
    if plan.norms is not None:
        kwargs = _group_kwargs(norm_spec, plan.norms, engine, "norm", 0)
        residents.append(ResidentGroup(engine.context, grads=engine.norm_grads, **kwargs))
    engine.add_groups(units, residents)


def _chunk_units(context, first: int, parent: ChunkedParams, use, use_name: str) -> list:
    """The units of the schedule of one use of a chunked module, from index ``first`` on."""
    units = [
        RowChunkUnit(context, first + i, parent, chunk, source=use, use_name=use_name)
        for i, chunk in enumerate(parent.row_chunks)
    ]
    parent.install_forward(use, units)
    return units


@dataclass(frozen=True)
class ShardingPlan:
    """The flat groups ``shard_model`` builds, before any tensor is touched.

    Attributes:
        units: ``(name, layout)`` per unit, in module order: the blocks and the root
            units ([Note: root units]).
        blocks: per unit, whether it is a block (False: a root unit).
        backward_reads_weights: per unit, False for plain embeddings, which ZeRO-3
            does not re-gather for backward ([Note: weightless backward]).
        frozen: per unit, the layout of its frozen parameters, or None
            ([Note: frozen shards]).
        chunks: per unit, its row chunks when it runs in chunks ([Note: row
            chunks]), else None.
        segments: the runs of the schedule, in order: every unit once, a chunked
            unit of several modules once per module ([Note: tied row chunks]).
        unchunked: ``(name, reason, size in largest blocks)`` of every root unit larger
            than the largest block that keeps a whole unit ([Note: chunkable modules]).
        root: layout of the resident root remainder (parameters outside units and
            norms that stay resident), or None.
        norms: layout of the norm group.
    """

    units: list[tuple[str, FlatLayout]]
    blocks: tuple[bool, ...]
    backward_reads_weights: tuple[bool, ...]
    frozen: list[FlatLayout | None]
    root: FlatLayout | None
    norms: FlatLayout | None
    chunks: tuple[tuple[RowChunk, ...] | None, ...] = ()
    segments: tuple[Segment, ...] = ()
    unchunked: tuple[tuple[str, str, float], ...] = ()
    zero_stage: int = 3
    specs: tuple = field(default=(), repr=False, compare=False)

    def schedule(self) -> list[ScheduledUnit]:
        """The units of the schedule, in order: each unit, or each row chunk of each use.

        ZeRO-2 keeps a chunk's gathered rows from forward to backward, so a later use of
        the same rows (a tied weight's head) reads the first use's slot and gathers
        nothing ([Note: tied row chunks]).
        """
        chunks = self.chunks or (None,) * len(self.units)
        schedule: list[ScheduledUnit] = []
        first_use: dict[tuple[int, int], int] = {}  # (unit, chunk) -> schedule index
        for segment in self.segments:
            runs = scheduled_units(
                self.units[segment.unit][1],
                self.frozen[segment.unit],
                chunks[segment.unit],
                reads_weights=segment.reads_weights,
                is_block=self.blocks[segment.unit],
            )
            for k, run in enumerate(runs):
                earlier = first_use.setdefault((segment.unit, k), len(schedule))
                if self.zero_stage == 2 and chunks[segment.unit] and earlier != len(schedule):
                    run = replace(run, shares_weights_with=earlier, gather_comm=0)
                schedule.append(run)
        return schedule


def plan_layouts(
    module: nn.Module,
    *,
    world_size: int,
    units: UnitsSpec = None,
    norm_classes: NormSpec = None,
    vocab_chunks: bool = False,
    zero_stage: int = 3,
    blocks_per_unit: BlocksPerUnit = "auto",
) -> ShardingPlan:
    """The layouts ``shard_model`` would build for ``module`` at ``world_size``.

    Needs no process group and works on meta-device models: memory estimates
    (``yafsdp estimate``) use it so that they match the engine exactly.
    ``vocab_chunks``, ``zero_stage`` and ``blocks_per_unit``: as given to
    ``shard_model``; ``world_size``: the shard group's size.
    """
    unit_modules = find_units(module, units)
    return _plan(
        module, unit_modules, norm_classes, world_size,
        vocab_chunks=vocab_chunks, zero_stage=zero_stage,
        blocks_per_unit=_grouping(units, blocks_per_unit),
    )  # fmt: skip


def _grouping(units: UnitsSpec, blocks_per_unit: BlocksPerUnit) -> BlocksPerUnit:
    """[Note: grouped blocks] ``"auto"`` groups auto-detected blocks only: units the user
    named stay as named unless a number of blocks per unit is given."""
    return 1 if units is not None and blocks_per_unit == "auto" else blocks_per_unit


def _plan(
    module, unit_modules, norm_classes, world_size, *, vocab_chunks: bool, zero_stage: int,
    blocks_per_unit: BlocksPerUnit,
) -> ShardingPlan:  # fmt: skip
    groups = group_blocks(unit_modules, blocks_per_unit)
    block_specs, norm_spec, root_spec, frozen = _assign_params(module, groups, norm_classes)
    if not any(spec.params for spec in (*block_specs, norm_spec, root_spec)):
        raise ValueError(f"{type(module).__name__} has no trainable parameters to shard")
    empty = [spec.name for spec in block_specs if not spec.numel()]
    if empty:
        raise ValueError(f"units {empty} hold no parameters to shard; leave them out of units=")
    root_units, root_spec = split_root(module, unit_modules, root_spec)
    unit_specs = _in_module_order(module, [*block_specs, *root_units])

    def layout_of(params: list[nn.Parameter], owners) -> FlatLayout:
        names = [group[0].name for group in owners]
        return FlatLayout(names, [p.shape for p in params], world_size)

    def frozen_layout_of(spec: GroupSpec) -> FlatLayout | None:
        if not spec.frozen_params:
            return None
        return layout_of(spec.frozen_params, spec.frozen_owners)

    # A unit with only frozen parameters has an empty trainable layout (padding only).
    layouts = [layout_of(spec.params, spec.owners) for spec in unit_specs]
    frozen_layouts = [frozen_layout_of(spec) for spec in unit_specs]
    chunks, unchunked = _row_chunks(unit_specs, layouts, frozen_layouts, enabled=vocab_chunks)
    reads = tuple(not all(type(m) is nn.Embedding for m in spec.modules) for spec in unit_specs)
    return ShardingPlan(
        units=[(spec.name, layout) for spec, layout in zip(unit_specs, layouts, strict=True)],
        blocks=tuple(spec.is_block for spec in unit_specs),
        backward_reads_weights=reads,
        frozen=frozen_layouts,
        chunks=chunks,
        segments=_segments(module, unit_specs, chunks, reads),
        unchunked=unchunked,
        zero_stage=zero_stage,
        root=layout_of(root_spec.params, root_spec.owners) if root_spec.params else None,
        norms=layout_of(norm_spec.params, norm_spec.owners) if norm_spec.params else None,
        specs=(unit_specs, norm_spec, root_spec, frozen),
    )


def _row_chunks(specs: list[GroupSpec], layouts, frozen_layouts, *, enabled: bool):
    """Per unit, its row chunks if it is a chunkable root unit larger than the largest
    block; and ``(name, reason, size / largest block)`` of each larger one that stays whole
    (sizes count frozen parameters: they fill the weight slots too)."""
    sizes = [
        layout.padded_numel + (frozen.padded_numel if frozen is not None else 0)
        for layout, frozen in zip(layouts, frozen_layouts, strict=True)
    ]
    largest = max((n for n, spec in zip(sizes, specs, strict=True) if spec.is_block), default=0)
    chunks, unchunked = [], []
    for spec, layout, frozen, size in zip(specs, layouts, frozen_layouts, sizes, strict=True):
        if spec.is_block or not largest or size <= largest:
            chunks.append(None)
            continue
        reason = (
            chunk_refusal(spec.modules, spec.params, spec.frozen_params)
            if enabled
            else "vocab_chunks is off"
        )
        # A frozen module's rows are those of its frozen layout, after a one-element
        # trainable part ([Note: frozen shards]).
        split, bound = (layout, largest) if spec.params else (frozen, largest - 1)
        rows = split_rows(split, bound) if reason is None else None
        if reason is None and rows is None:
            reason = "it has a single row"
        chunks.append(rows)
        if reason is not None:
            unchunked.append((spec.name, reason, size / largest))
    return tuple(chunks), tuple(unchunked)


def _segments(root: nn.Module, specs: list[GroupSpec], chunks, reads) -> tuple[Segment, ...]:
    """The runs of the schedule in module order: each unit at its first module, each use
    of a chunked unit of several modules (a tied weight) at its own module."""
    position = {id(m): i for i, (_, m) in enumerate(root.named_modules())}
    placed = []
    for index, spec in enumerate(specs):
        if chunks[index] is None:
            first = min(position[id(m)] for m in spec.modules)
            placed.append((first, Segment(index, 0, reads[index])))
            continue
        for use, module in enumerate(spec.modules):
            segment = Segment(index, use, not is_embedding_use(module))
            placed.append((position[id(module)], segment))
    return tuple(segment for _, segment in sorted(placed, key=lambda item: item[0]))


def _in_module_order(root: nn.Module, specs: list[GroupSpec]) -> list[GroupSpec]:
    """Units sorted by where their first module appears in ``root.named_modules()``.

    Module order is the order prefetching assumes (unit i+1 is gathered while
    unit i computes); for the usual embedding, blocks, head it is the call order.
    """
    position = {id(m): i for i, (_, m) in enumerate(root.named_modules())}
    return sorted(specs, key=lambda spec: min(position[id(m)] for m in spec.modules))


def get_engine(module: nn.Module) -> YaFSDPEngine:
    """The engine of a module sharded by ``shard_model``."""
    engine = module.__dict__.get("_yafsdp_engine")
    if engine is None:
        raise ValueError(f"{type(module).__name__} is not sharded: call shard_model(module) first")
    return engine


# -- validation -------------------------------------------------------------------------


def _single_device(module: nn.Module, *, allow_meta: bool) -> torch.device:
    kept = {id(p) for _, p in constructor_values(module)} if allow_meta else set()
    devices = {p.device for p in module.parameters() if id(p) not in kept}
    if not devices:
        raise ValueError(f"{type(module).__name__} has no parameters to shard")
    if len(devices) > 1:
        where = defaultdict(list)
        for name, p in module.named_parameters():
            where[str(p.device)].append(name)
        detail = "; ".join(f"{dev}: {names[:3]}" for dev, names in where.items())
        raise ValueError(
            f"parameters are on several devices ({detail}). Move the whole model to one device "
            "(e.g. module.to(device)) before shard_model."
        )
    device = devices.pop()
    if device.type == "meta" and not allow_meta:
        raise ValueError(
            "parameters are on the meta device: materialize them (module.to_empty(device=...) and "
            "initialize) before shard_model, or let the Lightning strategy do it in "
            "configure_model."
        )
    return device


def check_backend(backend: str, device: torch.device) -> None:
    """Raise if collectives of ``backend`` cannot serve tensors on ``device``."""
    backend = backend.lower()
    needs = {"cpu": "gloo", "cuda": "nccl"}.get(device.type)
    if needs is not None and needs not in backend:
        raise ValueError(
            f"the process group uses backend '{backend}' but the model is on {device.type}; "
            f"{device.type} tensors need '{needs}'. Initialize the group with backend='{needs}' "
            f"(or move the model to the device the backend serves)."
        )


def _refuse_hidden_aliases(root: nn.Module, specs: list[GroupSpec]) -> None:
    # A module attribute that holds a trainable parameter outside ``_parameters``
    # (object.__setattr__(self, "ref", other.weight)) would keep the full original after
    # sharding: never trained, silently stale. Registered aliases (tied weights) are fine.
    sharded = {id(p) for spec in specs for p in (*spec.params, *spec.frozen_params)}
    for module_name, sub in root.named_modules():
        for attr, value in vars(sub).items():
            if isinstance(value, nn.Parameter) and id(value) in sharded:
                where = f"{module_name}.{attr}" if module_name else attr
                raise ValueError(
                    f"{where} holds a trainable parameter as a plain attribute, outside the "
                    "module's registered parameters: sharding replaces every parameter by a "
                    "sharded one, so this reference would keep the old full tensor, never "
                    "trained. Register it (module.register_parameter / assign it as an "
                    "nn.Module attribute, which ties it) or read it through its owner module."
                )


# -- which parameter joins which group ----------------------------------------------


def _units_of_modules(unit_groups) -> dict[int, int]:
    """Map ``id(submodule)`` to the index of the one unit it belongs to (``unit_groups``:
    ``(name, modules)``, several modules for grouped blocks).

    A submodule object reachable from two units (``blocks[2].fc1 = blocks[0].fc1``)
    would have its parameters in one unit's buffer while the other unit's forward uses
    them too: refused here, naming both units, instead of failing mid-forward.
    """
    unit_of_module: dict[int, int] = {}
    members = [
        (index, unit_name, module)
        for index, (unit_name, modules) in enumerate(unit_groups)
        for module in modules
    ]
    for index, unit_name, unit_module in members:
        for sub_name, sub in unit_module.named_modules(remove_duplicate=False):
            earlier = unit_of_module.setdefault(id(sub), index)
            if earlier != index and any(True for _ in sub.parameters()):
                first = unit_groups[earlier][0]
                where = f"{unit_name}.{sub_name}" if sub_name else unit_name
                raise ValueError(
                    f"module '{where}' is the same object as a module of unit '{first}': "
                    "one module shared by two sharded units cannot live in both units' "
                    "buffers. Give each unit its own copy (copy.deepcopy), or list the "
                    "sharing modules as one unit (layers=[...]) so the shared module "
                    "belongs to one unit only."
                )
    return unit_of_module


def _assign_params(root, unit_groups, norm_classes):
    unit_of_module = _units_of_modules(unit_groups)
    owners_of: dict[int, list[ParamOwner]] = defaultdict(list)
    params: dict[int, nn.Parameter] = {}
    for module_name, sub in root.named_modules(remove_duplicate=False):
        for attr, param in sub._parameters.items():
            if param is None:
                continue
            name = f"{module_name}.{attr}" if module_name else attr
            owners_of[id(param)].append(ParamOwner(sub, attr, name))
            params[id(param)] = param

    unit_specs = [GroupSpec(name, modules=list(modules)) for name, modules in unit_groups]
    norm_spec, root_spec = GroupSpec(NORM_GROUP), GroupSpec(ROOT_GROUP)
    frozen: list[tuple[nn.Parameter, list[ParamOwner]]] = []
    for key, owners in owners_of.items():
        param = params[key]
        homes = set()
        for owner in owners:
            if is_norm_module(owner.module, norm_classes):
                homes.add(NORM_GROUP)
            elif id(owner.module) in unit_of_module:
                homes.add(unit_of_module[id(owner.module)])
            else:
                homes.add(ROOT_GROUP)
        if not param.requires_grad:
            # [Note: frozen shards] A frozen tensor of one unit (or of the root, which
            # may become a root unit) is sharded with it; norms, ties across groups
            # and integer tensors stay plain, replicated parameters.
            home = homes.pop() if len(homes) == 1 else NORM_GROUP
            if home == NORM_GROUP or not param.is_floating_point():
                frozen.append((param, owners))
            else:
                (root_spec if home == ROOT_GROUP else unit_specs[home]).add(param, owners)
            continue
        if len(homes) > 1:
            names = [owner.name for owner in owners]
            groups = sorted(h if isinstance(h, str) else unit_groups[h][0] for h in homes)
            raise ValueError(
                f"parameters {names} are one tied tensor used by different sharded groups "
                f"({groups}); a tied tensor must live in one group. "
                "Keep both users "
                "outside the units (e.g. tied embedding and output head in the root) or untie them."
            )
        home = homes.pop()
        spec = (
            norm_spec
            if home == NORM_GROUP
            else root_spec
            if home == ROOT_GROUP
            else unit_specs[home]
        )
        spec.add(param, owners)
    return unit_specs, norm_spec, root_spec, frozen


# -- master shards ----------------------------------------------------------------------------


@torch.no_grad()
def _build_master(
    groups, *, rank, group, sync, stats, device, dtype, init, frozen_dtype=None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fill the master shard (and, for units, the frozen store) one group at a time.

    ``groups``: ``(spec, layout, frozen_layout or None)``. Returns the master shard in
    ``dtype`` and the frozen store in ``frozen_dtype`` (None when nothing is frozen).
    """
    total = sum(layout.shard_numel for _, layout, _ in groups)
    frozen_total = sum(f.shard_numel for _, _, f in groups if f is not None)
    master = torch.empty(total, dtype=dtype, device=device)
    frozen = torch.empty(frozen_total, dtype=frozen_dtype, device=device) if frozen_total else None
    offset = frozen_offset = 0
    fill = dict(rank=rank, group=group, sync=sync, stats=stats)
    for spec, layout, frozen_layout in groups:
        if init is not None:
            init.materialize(spec)
        _fill_shard(master[offset : offset + layout.shard_numel], spec.params, layout, **fill)
        offset += layout.shard_numel
        if frozen_layout is not None:
            end = frozen_offset + frozen_layout.shard_numel
            _fill_shard(frozen[frozen_offset:end], spec.frozen_params, frozen_layout, **fill)
            frozen_offset = end
        if init is not None:
            init.release(spec)
    return master, frozen


def _fill_shard(out: torch.Tensor, params, layout: FlatLayout, *, rank, group, sync, stats) -> None:
    flat = torch.zeros(layout.padded_numel, dtype=out.dtype, device=out.device)
    for span, param in zip(layout.spans, params, strict=True):
        flat[span.offset : span.end].copy_(param.detach().reshape(-1))
    if sync:
        broadcast_(flat, group, src_rank=0, stats=stats)
    start, end = layout.shard_range(rank)
    out.copy_(flat[start:end])


@torch.no_grad()
def _broadcast_replicated(module: nn.Module, group: ProcessGroup, stats: CommStats) -> None:
    # As DDP at construction: every rank starts from rank 0's frozen parameters and
    # buffers (running stats, anything __init__ drew at random), in module order.
    frozen = [p.detach() for p in module.parameters() if not isinstance(p, RangeShardedTensor)]
    tensors = frozen + [b for _, b in module.named_buffers()]
    for buffer in tensors:
        if not buffer.numel():
            continue
        staged = buffer if buffer.is_contiguous() else buffer.contiguous()
        broadcast_(staged, group, src_rank=0, stats=stats)
        if staged is not buffer:
            buffer.copy_(staged)


def _default_device(group: ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _group_kwargs(spec, layout, engine, which, offset) -> dict:
    master = engine.flat_shard if which == "flat" else engine.norm_shard
    compute = engine.flat_compute if which == "flat" else engine.norm_compute
    end = offset + layout.shard_numel
    return dict(
        name=spec.name,
        layout=layout,
        owners=spec.owners,
        master_shard=master[offset:end],
        compute_shard=compute[offset:end] if compute is not None else None,
        grad_range=(offset, end),
    )


# -- rewiring the module ---------------------------------------------------------------------


def _rewire_module(module: nn.Module, engine: YaFSDPEngine) -> None:
    for group in engine.groups():
        group.make_sharded_params(engine.shard_rank, engine.shard_group)
        group.make_frozen_params(engine.shard_rank, engine.shard_group)
        group.register_sharded_params()
    for grads, groups in engine.grads_by_master():
        grads.params = [
            (param, *span)
            for g in groups
            for param, span in zip(g.sharded_params, g.master_ranges, strict=True)
        ]
    # Any module that owns resident parameters, every ancestor of one, and the root make
    # sure they are gathered and exposed before it runs, whoever calls it: a parent may
    # read a child's weight before calling it (CLIP's text embeddings read
    # position_embedding.weight.shape), and Lightning never calls the root's forward.
    # The ancestors of root units too: their weight attributes must show the compute
    # dtype before the unit runs ([Note: ungathered weights]).
    exposed = [*engine.residents, *engine.root_units]
    owner_modules = [module] + [
        module.get_submodule(prefix)
        for group in exposed
        for owners in group.owners
        for owner in owners
        for prefix in _module_path_prefixes(owner.name)
    ]
    # Inside a compiled block the block's own pre-forward (run eagerly) has called
    # begin_forward already: there the hook is skipped while Dynamo traces, so it adds no
    # graph break; run eagerly it works as everywhere ([Note: engine hooks under compile]).
    in_blocks = {
        id(sub)
        for unit in engine.units
        if unit.is_block
        for m in unit.modules
        for sub in m.modules()
    }
    begin_forward = outside_compile(lambda *_: engine.context.begin_forward())

    def begin_forward_unless_traced(*_):
        if not torch.compiler.is_compiling():
            begin_forward()

    hooked: set[int] = set()
    for owner_module in owner_modules:
        if id(owner_module) in hooked:
            continue
        hooked.add(id(owner_module))
        hook = begin_forward_unless_traced if id(owner_module) in in_blocks else begin_forward
        engine._hooks.append(owner_module.register_forward_pre_hook(hook))
    module.__dict__["_yafsdp_engine"] = engine


def _module_path_prefixes(param_name: str) -> list[str]:
    """``"a.b.c.weight"`` -> ``["a", "a.b", "a.b.c"]``: the owner and its ancestors."""
    parts = param_name.split(".")[:-1]
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _is_class_list(spec: Any) -> bool:
    return isinstance(spec, (list, tuple)) and bool(spec) and all(isinstance(c, type) for c in spec)


def _apply_activation_checkpointing(engine: YaFSDPEngine, spec: CheckpointSpec) -> None:
    if spec is None:
        return
    # Indices count blocks only: root units (embeddings, head) are never recomputed.
    blocks = engine.blocks()
    if spec == "all":
        chosen = blocks
    elif isinstance(spec, type) or _is_class_list(spec):
        # A block class (FSDPStrategy's form), matched block by block: in a unit of grouped
        # blocks of several classes only the matching ones recompute ([Note: grouped blocks]).
        classes = (spec,) if isinstance(spec, type) else tuple(spec)
        for unit in blocks:
            unit.enable_activation_checkpointing(lambda m: isinstance(m, classes))
        return
    elif callable(spec):
        chosen = [u for i, u in enumerate(blocks) if spec(i, u.name)]
    elif isinstance(spec, (list, tuple, range)):
        bad = [i for i in spec if not 0 <= i < len(blocks)]
        if bad:
            raise ValueError(
                f"activation_checkpointing indices {bad} out of range 0..{len(blocks) - 1}"
            )
        chosen = [blocks[i] for i in spec]
    else:
        raise ValueError(
            f"activation_checkpointing must be None, 'all', indices or a predicate; got {spec!r}"
        )
    for unit in chosen:
        unit.enable_activation_checkpointing()
