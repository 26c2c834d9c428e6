"""The process group and the object collectives both strategies need (as DDP does them)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from lightning_yafsdp._registration import STRATEGY_DESCRIPTION
from lightning_yafsdp.core.comm import collectives

if TYPE_CHECKING:
    from lightning.fabric.plugins import ClusterEnvironment

T = TypeVar("T")


def init_process_group(
    cluster_environment: ClusterEnvironment,
    root_device: torch.device,
    *,
    backend: str | None,
    timeout: timedelta | None,
) -> str:
    """Join (or reuse) the default process group; returns the backend (gloo on CPU, nccl)."""
    backend = backend or _get_default_process_group_backend_for_device(root_device)
    device_id = root_device if root_device.type != "cpu" else None
    _init_dist_connection(cluster_environment, backend, timeout=timeout, device_id=device_id)
    return backend


def assign_world_ranks(strategy: Any) -> None:
    """Tell the cluster environment this process's rank, as DDP does (either front door)."""
    if strategy.cluster_environment is not None:
        strategy.cluster_environment.set_global_rank(
            strategy.node_rank * strategy.num_processes + strategy.local_rank
        )
        strategy.cluster_environment.set_world_size(strategy.num_nodes * strategy.num_processes)
    # The getter, not the setter: some cluster environments ignore set_global_rank.
    rank_zero_only.rank = utils_rank_zero_only.rank = strategy.global_rank


def register_once(strategy_class: Any, registry: Any) -> None:
    """Register ``"yafsdp"``; a second call (re-import, reload) is a no-op.

    A factory that stood in while the class's module loaded is replaced by the class
    ([Note: registering while our own modules load]).
    """
    entry = dict.get(registry, strategy_class.strategy_name)  # the registry's get() builds one
    if entry is not None and not getattr(entry["strategy"], "imports_on_first_use", False):
        return
    registry.register(
        strategy_class.strategy_name,
        strategy_class,
        description=STRATEGY_DESCRIPTION,
        override=True,
    )


def barrier(root_device: torch.device) -> None:
    if not _distributed_is_initialized():
        return
    if torch.distributed.get_backend() == "nccl":
        torch.distributed.barrier(device_ids=[root_device.index])
    else:
        torch.distributed.barrier()


def broadcast_object(obj: T, src: int = 0) -> T:
    if not _distributed_is_initialized():
        return obj
    return collectives.broadcast_object(obj, src_rank=src, group=_group.WORLD)
