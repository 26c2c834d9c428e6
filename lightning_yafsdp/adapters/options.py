"""``ShardingOptions``: the arguments of both strategies, checked before any process starts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn

from lightning_yafsdp.adapters.arguments import (
    SHARDING_CHECKS,
    check_against_run,
    check_plumbing,
)
from lightning_yafsdp.checkpoint.state import StateDictType

if TYPE_CHECKING:
    from lightning_yafsdp.core.plan.policy import NormSpec, UnitsSpec
    from lightning_yafsdp.core.plan.sharding import CheckpointSpec

# Arguments of other Lightning strategies that users bring along when migrating,
# and what to write instead (see docs/migration.md).
MIGRATION_HINTS = {
    "auto_wrap_policy": "units= (a block class, a list of module names or a predicate)",
    "sharding_strategy": "zero_stage=3 (FULL_SHARD) or zero_stage=2 (SHARD_GRAD_OP); "
    "HYBRID_SHARD: shard_size= (ranks per shard group) or device_mesh=(replicas, shard_size)",
    "mixed_precision": "the precision= flag ('bf16-mixed' or 'bf16-true')",
    "activation_checkpointing_policy": "activation_checkpointing= ('all', unit indices, a "
    "block class or a predicate (index, name) -> bool)",
    "cpu_offload": "nothing: CPU offload is not supported; try precision='bf16-true'",
    "data_parallel_size": "nothing: every rank is a data-parallel rank",
    "tensor_parallel_size": "nothing: tensor parallelism is not supported",
    "use_orig_params": "nothing: the model always keeps its own parameters (sharded, under "
    "their names)",
    "limit_all_gathers": "nothing: gathers are bounded by the two pre-allocated buffers",
}


@dataclass(frozen=True)
class ShardingOptions:
    """How a strategy shards, checkpoints and connects (documented on the strategies)."""

    units: UnitsSpec = None
    norm_classes: NormSpec = None
    zero_stage: int = 3
    reduce_dtype: torch.dtype = torch.float32
    activation_checkpointing: CheckpointSpec = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    sync_module_states: bool | None = None
    cast_forward_inputs: bool = True
    timeout: timedelta | None = default_pg_timeout
    process_group_backend: str | None = None
    state_dict_type: StateDictType = "sharded"
    verify_checksums: bool = True
    async_save: bool = False
    shard_size: int | None = None
    device_mesh: Any = None  # a DeviceMesh or (replicas, shard_size)
    vocab_chunks: bool = True
    blocks_per_unit: int | str = "auto"

    def __post_init__(self) -> None:
        # [Note: arguments checked in the constructor] (arguments.py): each value is
        # checked and stored in its canonical form ("bf16" -> torch.bfloat16).
        for field in fields(self):
            canonical = SHARDING_CHECKS[field.name](field.name, getattr(self, field.name))
            object.__setattr__(self, field.name, canonical)
        if self.async_save and self.state_dict_type == "full":
            raise ValueError(
                "async_save=True writes sharded checkpoints in the background, but "
                "state_dict_type='full' gathers one file on rank 0, which is written at "
                "once: pass state_dict_type='sharded' (the default) or async_save=False"
            )
        if self.shard_size is not None and self.device_mesh is not None:
            raise ValueError(
                f"shard_size={self.shard_size} and device_mesh={self.device_mesh!r} are both "
                "given: pass one, not both (device_mesh=(replicas, shard_size) already says "
                "the shard size)"
            )

    def check_against_run(self, *, world_size: int, device_type: str) -> None:
        """Refuse what the run's size or device rules out (before any collective)."""
        check_against_run(self, world_size=world_size, device_type=device_type)

    @classmethod
    def from_arguments(cls, owner: str, arguments: dict[str, Any], unknown: dict[str, Any]):
        """The options among a strategy's ``arguments`` (its ``locals()`` in ``__init__``).

        Raises a TypeError naming each unknown argument and its replacement.
        """
        if unknown:
            raise TypeError(unknown_arguments_message(owner, unknown))
        check_plumbing(arguments)
        return cls(**{field.name: arguments[field.name] for field in fields(cls)})


def unknown_arguments_message(owner: str, unknown: dict[str, Any]) -> str:
    """One line: the unknown names, the replacement of each that has one, the valid names."""
    hints = [
        f"{name}: use {MIGRATION_HINTS[name]}"
        for name in sorted(unknown)
        if name in MIGRATION_HINTS
    ]
    return (
        f"{owner} got unexpected argument(s) {', '.join(sorted(unknown))}"
        + (f" ({'; '.join(hints)})" if hints else "")
        + f"; it takes {', '.join(f.name for f in fields(ShardingOptions))} (see "
        "docs/user-guide.md)"
    )
