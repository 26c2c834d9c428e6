"""``ShardingOptions``: the arguments of both strategies, checked before any process starts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from torch import nn

from lightning_yafsdp.checkpoint.entries import StateDictType

if TYPE_CHECKING:
    from lightning_yafsdp.core.policy import NormSpec, UnitsSpec
    from lightning_yafsdp.core.sharding import CheckpointSpec

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
    shard_size: int | None = None
    device_mesh: Any = None  # a DeviceMesh or (replicas, shard_size)

    def __post_init__(self) -> None:
        if self.shard_size is not None and self.device_mesh is not None:
            raise ValueError(
                "pass shard_size= or device_mesh=, not both (device_mesh=(replicas, "
                "shard_size) already says the shard size)"
            )
        size = self.shard_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"shard_size must be a positive integer, got {size!r}")
        mesh = self.device_mesh
        if isinstance(mesh, (tuple, list)) and not (
            len(mesh) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in mesh)
        ):
            raise ValueError(
                f"device_mesh={mesh!r}: give (replicas, shard_size), two positive integers, "
                "or a 2-D DeviceMesh with mesh_dim_names=('replicate', 'shard')"
            )
        if self.zero_stage not in (2, 3):
            raise ValueError(f"zero_stage must be 2 or 3, got {self.zero_stage!r}")
        if self.state_dict_type not in ("sharded", "full"):
            raise ValueError(
                f"state_dict_type must be 'sharded' or 'full', got {self.state_dict_type!r}"
            )

    @classmethod
    def from_arguments(cls, owner: str, arguments: dict[str, Any], unknown: dict[str, Any]):
        """The options among a strategy's ``arguments`` (its ``locals()`` in ``__init__``).

        Raises a TypeError naming each unknown argument and its replacement.
        """
        if unknown:
            raise TypeError(unknown_arguments_message(owner, unknown))
        return cls(**{field.name: arguments[field.name] for field in fields(cls)})


def unknown_arguments_message(owner: str, unknown: dict[str, Any]) -> str:
    lines = [f"{owner} got unexpected argument(s): {', '.join(sorted(unknown))}."]
    for name in sorted(unknown):
        if name in MIGRATION_HINTS:
            lines.append(f"  {name}: use {MIGRATION_HINTS[name]}")
    lines.append(
        "Valid arguments: units, norm_classes, zero_stage, reduce_dtype, "
        "activation_checkpointing, param_init_fn, sync_module_states, cast_forward_inputs, "
        "timeout, process_group_backend, state_dict_type, shard_size, device_mesh (see "
        "docs/user-guide.md)."
    )
    return "\n".join(lines)
