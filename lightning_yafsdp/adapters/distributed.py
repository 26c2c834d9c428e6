"""The process group and the object collectives both strategies need (as DDP does them)."""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import torch
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
)
from lightning.fabric.utilities.distributed import group as _group

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
    wrapped = [obj]
    torch.distributed.broadcast_object_list(wrapped, src, group=_group.WORLD)
    return wrapped[0]
