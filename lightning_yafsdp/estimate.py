"""``yafsdp estimate``: memory per rank and communication per step, before running.

Shards, gradients and buffers come from the very layouts the engine builds
(``FlatLayout`` over the groups ``find_units`` and the engine's parameter
assignment produce, on a meta-device copy of the model), so those numbers equal
``YaFSDPEngine.memory_report()`` exactly; a test holds them to it. Activations
come from an analytic count of the tensors a Llama-style block saves for
backward: an approximation, to be compared with measurements (benchmarks).

[Note: estimate formulas] Per rank, ZeRO-3, P/R/M = param/reduce/master dtype bytes:
  master shards   = sum(shard numel of every group) x M
  compute shards  = the norm group's shard numel x P, only when P != M (units have no
                    twin: [Note: cast on gather])
  gather staging  = when P != M: per grad slot (2) the largest unit shard, x P
  frozen shards   = sum(frozen shard numel of every unit) x P
  grad shards     = master shards
  optimizer       = 2 x master shards (AdamW exp_avg, exp_avg_sq)
  weight buffers  = per slot (2 in ZeRO-3, one per unit in ZeRO-2) the largest
                    (padded + frozen padded) of the units using it, x P
  grad buffers    = per slot (2) the largest padded of its units, x R (reductions write
                    the gradient window, or stage in the buffer: [Note: reduce into the
                    gradient window])
  resident groups = per group (resident root remainder, norms): padded x (P + R)
Units are the blocks and the root units (embeddings, head: [Note: root units]).
Communication per micro-batch (bytes of the gathered/unreduced tensor, as
``engine.comm_stats`` counts them; a ring moves (W-1)/W of that per rank):
  all_gather      = units forward + (ZeRO-3) units but the last two in backward, plain
                    embeddings excepted ([Note: weightless backward])
                    (a tied embedding/head unit is gathered once per call: counted once)
  reduce_scatter  = every group, once per backward
  all_reduce      = one byte per parameter, once per backward (which got a grad anywhere)
  + once per optimizer step: resident groups' all_gather.
Hybrid sharding ([Note: hybrid sharding], shard groups of K ranks): every layout above
is the layout of a K-rank world (memory per rank as with K ranks), the all_gathers and
reduce_scatters run in the shard group, and
  replicate_all_reduce = every group's reduced shard (shard numel x R), once per backward,
                    across the replicate group (a row chunk: the parts shard rank 0 owns,
                    once per use; ranks differ only by the padding they own).
Row chunks ([Note: row chunks]): the schedule lists each chunk of each use (a tied
weight: the embedding's and the head's), each gathered and reduced like a unit of its
rows; a tied weight's gradient is therefore reduced once per use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_yafsdp.config import ConfigError, RunConfig
from lightning_yafsdp.core.comm.mesh import default_shard_size
from lightning_yafsdp.core.plan.schedule import ScheduledUnit, buffer_sizes
from lightning_yafsdp.core.plan.sharding import NORM_GROUP, ROOT_GROUP, plan_layouts
from lightning_yafsdp.dtype_policy import DtypePolicy
from lightning_yafsdp.training.chunked_loss import recipe_chunk_tokens

GiB = 1024**3

_SIZE_UNITS = {
    "b": 1,
    **{f"{p}b": 1000 ** (i + 1) for i, p in enumerate("kmgt")},
    **{f"{p}ib": 1024 ** (i + 1) for i, p in enumerate("kmgt")},
}


def parse_memory_size(text: str) -> int:
    """``"80GB"`` -> 80e9 bytes, ``"80GiB"`` -> 80 x 2**30 (B, KB..TB, KiB..TiB).

    Raises:
        ValueError: no number, or no unit / an unknown one (one line, with examples).
    """
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("kmgtib")
    unit = stripped[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if value <= 0 or unit not in _SIZE_UNITS:
        raise ValueError(
            f"--device-memory {text!r} is not a size with a unit: write e.g. 80GB (80 x 10^9 "
            "bytes) or 80GiB (80 x 2^30); units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    return int(value * _SIZE_UNITS[unit])


@dataclass(frozen=True)
class GroupSize:
    """One flat group: a unit, the root remainder or the norms (elements)."""

    name: str
    numel: int
    padded_numel: int
    shard_numel: int
    num_params: int = 0
    is_block: bool = True  # False: a root unit (embedding, head) or a resident group
    backward_reads_weights: bool = True  # False: plain embeddings, not re-gathered (ZeRO-3)
    frozen_padded_numel: int = 0  # a unit's frozen parameters ([Note: frozen shards])
    frozen_shard_numel: int = 0
    blocks: int = 1  # a unit of grouped blocks holds several ([Note: grouped blocks])


@dataclass
class Estimate:
    """Memory per rank (bytes) and communication per step (bytes) of one recipe.

    ``engine_report()`` has the keys and values of ``YaFSDPEngine.memory_report()``.
    """

    world_size: int
    shard_size: int  # ranks a unit is split over (the world size: flat sharding)
    precision: str
    zero_stage: int
    param_bytes: int
    reduce_bytes: int
    master_bytes: int
    num_parameters: int
    units: list[GroupSize]
    residents: list[GroupSize]
    # The units of the schedule: each unit, or each row chunk of one ([Note: row chunks]).
    schedule: list[ScheduledUnit] = field(default_factory=list)
    master_shards: int = 0
    compute_shards: int = 0
    gather_staging: int = 0
    frozen_shards: int = 0
    grad_shards: int = 0
    optimizer_states: int = 0
    weight_buffers: int = 0
    grad_buffers: int = 0
    resident_buffers: int = 0
    activations_per_unit: int = 0
    activations_checkpointed_unit: int = 0
    activations_root: int = 0
    checkpointed_units: int = 0
    all_gather_per_micro_batch: int = 0
    all_gather_per_step: int = 0
    reduce_scatter_per_micro_batch: int = 0
    all_reduce_per_micro_batch: int = 0
    replicate_all_reduce_per_micro_batch: int = 0
    micro_batches: int = 1
    notes: list[str] = field(default_factory=list)

    def engine_report(self) -> dict[str, int]:
        return {
            "master_shards": self.master_shards,
            "compute_shards": self.compute_shards,
            "gather_staging": self.gather_staging,
            "frozen_shards": self.frozen_shards,
            "grad_shards": self.grad_shards,
            "weight_buffers": self.weight_buffers,
            "grad_buffers": self.grad_buffers,
            "resident_buffers": self.resident_buffers,
        }

    def activations(self, checkpointed_units: int) -> int:
        """Peak activation bytes with the first ``checkpointed_units`` units of blocks
        recomputed (``activations_per_unit``: of one block; a unit of grouped blocks
        recomputes block by block)."""
        blocks = [g.blocks for g in self.units if g.is_block]
        k = max(0, min(len(blocks), checkpointed_units))
        kept, recomputed = sum(blocks[k:]), sum(blocks[:k])
        total = kept * self.activations_per_unit + recomputed * self.activations_checkpointed_unit
        if k:  # one recomputed block's activations exist again during its backward
            total += self.activations_per_unit
        return total + self.activations_root

    @property
    def num_grouped_blocks(self) -> int:
        """Blocks in the units of blocks (more than ``num_blocks`` when grouped)."""
        return sum(g.blocks for g in self.units if g.is_block)

    @property
    def num_blocks(self) -> int:
        """Units that are blocks (what activation checkpointing counts)."""
        return sum(g.is_block for g in self.units)

    @property
    def states(self) -> int:
        """Bytes of sharded state and buffers (everything but activations)."""
        return sum(self.engine_report().values()) + self.optimizer_states

    @property
    def total(self) -> int:
        return self.states + self.activations(self.checkpointed_units)

    @property
    def comm_per_step(self) -> dict[str, int]:
        """Collective bytes per optimizer step, by kind (a kind never issued is absent)."""
        comm = {
            "all_gather": self.micro_batches * self.all_gather_per_micro_batch
            + self.all_gather_per_step,
            "reduce_scatter": self.micro_batches * self.reduce_scatter_per_micro_batch,
        }
        if self.all_reduce_per_micro_batch:
            comm["all_reduce"] = self.micro_batches * self.all_reduce_per_micro_batch
        if self.replicate_all_reduce_per_micro_batch:
            comm["replicate_all_reduce"] = (
                self.micro_batches * self.replicate_all_reduce_per_micro_batch
            )
        return comm

    @property
    def is_hybrid(self) -> bool:
        return self.shard_size < self.world_size


def fit_verdict(est: Estimate, device_bytes: int, *, given: str) -> tuple[bool, str]:
    """Whether the recipe's memory per rank fits a device, in one line.

    Args:
        est: The estimate.
        device_bytes: The device's memory (``parse_memory_size``).
        given: The size as the user wrote it (shown in the line).

    Returns:
        ``(fits, line)``; a line that does not fit names the cheapest fix the
        estimate can see (checkpoint every block, or more ranks for the state).
    """
    device = f"{device_bytes / GiB:.1f} GiB (--device-memory {given})"
    uncounted = "not counted: CUDA context, NCCL buffers, allocator fragmentation"
    if est.total <= device_bytes:
        left = device_bytes - est.total
        return True, (
            f"fits: {est.total / GiB:.1f} GiB per rank of {device}, {left / GiB:.1f} GiB "
            f"({left / device_bytes:.0%}) left ({uncounted})"
        )
    line = (
        f"does not fit: {est.total / GiB:.1f} GiB per rank exceeds {device} by "
        f"{(est.total - device_bytes) / GiB:.1f} GiB"
    )
    all_checkpointed = est.states + est.activations(est.num_blocks)
    if est.checkpointed_units < est.num_blocks and all_checkpointed <= device_bytes:
        line += (
            f"; with every block checkpointed (strategy.activation_checkpointing=all) it "
            f"is {all_checkpointed / GiB:.1f} GiB, which fits"
        )
    elif est.states > device_bytes:
        line += (
            f"; the sharded state and buffers alone are {est.states / GiB:.1f} GiB: shard "
            "over more ranks (trainer.devices x trainer.num_nodes, strategy.shard_size)"
        )
    else:
        line += "; checkpoint more blocks, or shrink data.batch_size / data.seq_len"
    return False, line


def group_sizes(
    model: nn.Module,
    world_size: int,
    *,
    units=None,
    norm_classes=None,
    vocab_chunks=False,
    zero_stage: int = 3,
    blocks_per_unit="auto",
    notes: list[str] | None = None,
) -> tuple[list[GroupSize], list[GroupSize], list[ScheduledUnit]]:
    """The engine's flat groups of ``model`` (meta device is fine): units, residents, schedule.

    Units are the blocks and the root units in module order; residents are listed
    as the engine builds them: the resident root remainder, then norms. The schedule
    lists each unit, or each of its row chunks ([Note: row chunks]). A root unit
    larger than a block that is not chunked is named in ``notes``, with the reason.
    """
    plan = plan_layouts(
        model,
        world_size=world_size,
        units=units,
        norm_classes=norm_classes,
        vocab_chunks=vocab_chunks,
        zero_stage=zero_stage,
        blocks_per_unit=blocks_per_unit,
    )
    members = [len(spec.modules) if spec.is_block else 1 for spec in plan.specs[0]]
    if notes is not None:
        notes += _grouping_notes(members, plan.blocks)
        notes += [
            f"not in row chunks: '{name}' ({blocks:.1f}x a block): {reason}; its buffer "
            "slots are its size"
            for name, reason, blocks in plan.unchunked
        ]

    def size(name, layout, *, is_block=False, frozen=None, reads=True, blocks=1) -> GroupSize:
        return GroupSize(
            name,
            layout.numel,
            layout.padded_numel,
            layout.shard_numel,
            len(layout.spans),
            is_block=is_block,
            backward_reads_weights=reads,
            frozen_padded_numel=frozen.padded_numel if frozen is not None else 0,
            frozen_shard_numel=frozen.shard_numel if frozen is not None else 0,
            blocks=blocks,
        )

    residents = [
        size(name, layout)
        for name, layout in ((ROOT_GROUP, plan.root), (NORM_GROUP, plan.norms))
        if layout is not None
    ]
    unit_sizes = [
        size(name, layout, is_block=block, frozen=frozen, reads=reads, blocks=count)
        for (name, layout), block, frozen, reads, count in zip(
            plan.units, plan.blocks, plan.frozen, plan.backward_reads_weights, members,
            strict=True,
        )
    ]
    return unit_sizes, residents, plan.schedule()


def _grouping_notes(members: list[int], blocks: tuple[bool, ...]) -> list[str]:
    """The grouping the plan chose, when it grouped ([Note: grouped blocks])."""
    if max(members, default=1) == 1:
        return []
    return [
        f"units: {sum(m for m, b in zip(members, blocks) if b)} blocks in {sum(blocks)} units "
        f"of up to {max(members)} (strategy.blocks_per_unit; small blocks share one gather "
        "and reduce-scatter)"
    ]


def estimate(
    config: RunConfig, *, world_size: int | None = None, model: nn.Module | None = None
) -> Estimate:
    """Estimate the memory per rank and the traffic per step of a recipe.

    Args:
        config: The resolved recipe.
        world_size: Ranks sharing the model; default ``trainer.devices x num_nodes``
            (``devices="auto"``: the visible GPUs, else 1). The shard group size is
            ``strategy.shard_size`` or the strategy's default (one node's ranks on
            several nodes).
        model: The model to measure (default: built from the recipe on the meta device).
    """
    from lightning_yafsdp.training.models import build_model

    world_size = world_size or _world_size(config)
    try:
        shard_size = default_shard_size(
            config.strategy.shard_size, world_size=world_size, num_nodes=config.trainer.num_nodes
        )
    except ValueError as error:
        raise ConfigError(f"strategy.shard_size: {error}") from None
    if model is None:
        with torch.device("meta"):
            model = build_model(config)
    policy = DtypePolicy.from_flag(config.trainer.precision)
    master_dtype, param_dtype = policy.master_dtype, policy.param_dtype
    reduce_dtype = getattr(torch, config.strategy.reduce_dtype)
    # As shard_model decides which vocabulary-sized modules run in chunks.
    strategy, notes = config.strategy, []
    units, residents, schedule = group_sizes(
        model, shard_size, vocab_chunks=strategy.vocab_chunks, zero_stage=strategy.zero_stage,
        blocks_per_unit=strategy.blocks_per_unit_value, notes=notes,
    )  # fmt: skip
    p, r, m = (dt.itemsize for dt in (param_dtype, reduce_dtype, master_dtype))
    est = Estimate(
        world_size=world_size,
        shard_size=shard_size,
        precision=config.trainer.precision,
        zero_stage=config.strategy.zero_stage,
        param_bytes=p,
        reduce_bytes=r,
        master_bytes=m,
        num_parameters=sum(t.numel() for t in {id(t): t for t in model.parameters()}.values()),
        units=units,
        residents=residents,
        schedule=schedule,
        micro_batches=config.trainer.accumulate_grad_batches,
        notes=notes,
    )
    _state_bytes(est, config.strategy.zero_stage)
    _traffic_bytes(est, config.strategy.zero_stage)
    _activation_bytes(est, config, model)
    est.checkpointed_units = checkpointed_units(est, config)
    return est


def _state_bytes(est: Estimate, zero_stage: int) -> None:
    """Sharded state and buffers, as ``engine.memory_report()`` counts them."""
    units, residents = est.units, est.residents
    p, r, m = est.param_bytes, est.reduce_bytes, est.master_bytes
    est.master_shards = sum(g.shard_numel for g in (*units, *residents)) * m
    # [Note: cast on gather] Only the norm group keeps a compute twin; units cast into
    # two shard-sized staging tensors before each gather.
    norm_shard = sum(g.shard_numel for g in residents if g.name == NORM_GROUP)
    est.compute_shards = norm_shard * p if p != m else 0
    est.frozen_shards = sum(g.frozen_shard_numel for g in units) * p
    est.grad_shards = est.master_shards
    est.optimizer_states = 2 * est.master_shards
    slots = buffer_sizes(est.schedule, zero_stage)
    est.gather_staging = sum(slots.staging) * p if p != m else 0
    est.weight_buffers = sum(slots.weights) * p
    # [Note: reduce into the gradient window] no reduced-shard twin: reductions write the
    # window, or stage in the grad buffer itself.
    est.grad_buffers = sum(slots.grads) * r
    est.resident_buffers = sum(g.padded_numel * (p + r) for g in residents)


def _traffic_bytes(est: Estimate, zero_stage: int) -> None:
    """Collective bytes, as ``engine.comm_stats`` counts them."""
    units, residents, schedule = est.units, est.residents, est.schedule
    p, r = est.param_bytes, est.reduce_bytes
    gathered = [u.gather_comm for u in schedule]
    regathered = []
    if zero_stage == 3:  # all but the last two units, plain embeddings excepted
        regathered = [u.gather_comm for u in schedule[:-2] if u.reads_weights]
    est.all_gather_per_micro_batch = (sum(gathered) + sum(regathered)) * p
    est.all_gather_per_step = sum(g.padded_numel for g in residents) * p
    est.reduce_scatter_per_micro_batch = (
        sum(u.reduce_comm for u in schedule) + sum(g.padded_numel for g in residents)
    ) * r
    if est.world_size > 1:  # which parameters got a grad anywhere: one byte each, per backward
        est.all_reduce_per_micro_batch = sum(g.num_params for g in (*units, *residents))
    if est.is_hybrid:  # each reduced shard (a row chunk: the owned parts), across the replicas
        est.replicate_all_reduce_per_micro_batch = (
            sum(u.replicated for u in schedule) + sum(g.shard_numel for g in residents)
        ) * r


def checkpointed_units(est: Estimate, config: RunConfig) -> int:
    """How many units the recipe's ``activation_checkpointing`` recomputes.

    ``"auto"`` picks the fewest units whose activations fit
    ``strategy.activation_memory_gb`` (each recomputed unit costs about a third of
    its forward+backward time), all of them if nothing fits.
    """
    spec = config.strategy.activation_checkpointing
    n = est.num_blocks
    if spec == "none":
        return 0
    if spec == "all":
        return n
    if spec.isascii() and spec.isdigit():
        return min(int(spec), n)
    budget = float(config.strategy.activation_memory_gb or 0) * GiB
    for k in range(n + 1):
        if est.activations(k) <= budget:
            return k
    est.notes.append(
        f"activations exceed strategy.activation_memory_gb={config.strategy.activation_memory_gb}"
        " even with every unit checkpointed: lower data.batch_size or data.seq_len"
    )
    return n


def _activation_bytes(est: Estimate, config: RunConfig, model: nn.Module) -> None:
    # Tensors a pre-norm Llama block saves for backward, per token (elements): two
    # norm inputs and outputs (4 h), q/k/v after rotary and the attention output
    # and its reshaped copy (3 h + 2 kv), the SwiGLU gate, up, activation and
    # product (4 f). Flash/memory-efficient SDPA saves no seq x seq matrix.
    b, s = config.data.batch_size, config.data.seq_len
    dims = _shape(model)
    if dims is None:
        est.notes.append("activations: unknown architecture, counted as 16 x dim per token")
    h, kv, f, vocab = dims or (_hidden_guess(model), 0, 0, 0)
    per_token = 7 * h + 2 * kv + 4 * f if dims else 16 * h
    if config.practices.dropout > 0:
        per_token += 3 * h  # masks of attention and residual dropout (bytes ~ elements)
    act = est.param_bytes
    est.activations_per_unit = b * s * per_token * act
    est.activations_checkpointed_unit = b * s * h * act
    # Root: embedding output, final norm in/out, logits and their fp32 copy for the loss:
    # of one chunk of tokens when the loss runs in chunks ([Note: chunked loss]).
    chunk = recipe_chunk_tokens(config)
    rows = b * s if chunk is None else min(b * s, chunk)
    if rows < b * s:
        est.notes.append(
            f"activations: the head and the loss run {rows} of the {b * s} tokens at a time "
            "(model.loss_chunk_size)"
        )
    logits = rows * vocab * (act + (4 if config.practices.fp32_loss and act != 4 else 0))
    est.activations_root = b * s * 3 * h * act + logits


def _shape(model: nn.Module) -> tuple[int, int, int, int] | None:
    cfg = getattr(model, "config", None)
    if cfg is None:
        return None
    h = getattr(cfg, "dim", None) or getattr(cfg, "hidden_size", None)
    heads = getattr(cfg, "n_heads", None) or getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "n_kv_heads", None) or getattr(cfg, "num_key_value_heads", heads)
    f = getattr(cfg, "ffn_hidden_dim", None) or getattr(cfg, "intermediate_size", None)
    vocab = getattr(cfg, "vocab_size", None)
    if not all((h, heads, kv_heads, f, vocab)):
        return None
    return h, kv_heads * (h // heads), f, vocab


def _hidden_guess(model: nn.Module) -> int:
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    return int(emb.weight.shape[1]) if emb is not None else 0


def _world_size(config: RunConfig) -> int:
    devices = config.trainer.lightning_devices()
    if devices == "auto" or devices == -1:
        devices = torch.cuda.device_count() if config.trainer.accelerator != "cpu" else 1
    return max(1, int(devices)) * config.trainer.num_nodes
