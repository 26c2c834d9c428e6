"""Sharded checkpoints: a torch.distributed.checkpoint directory plus ``meta.pt``.

The layout and its DCP keys: docs/design.md, "Checkpoints". DCP's default planners write
and read every ``RangeShardedTensor`` ([Note: element ranges as boxes]).
"""

from __future__ import annotations

import io
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.checkpoint.atomic import DCP_METADATA_FILENAME
from lightning_yafsdp.checkpoint.background import BackgroundSaver, stage
from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError
from lightning_yafsdp.checkpoint.gather import sharded_leaves, tensor_bytes
from lightning_yafsdp.checkpoint.optimizer_state import (
    ParamNames,
    check_optimizer_count,
    check_state_names,
    optimizer_state_to_load,
)
from lightning_yafsdp.checkpoint.state import check_targets
from lightning_yafsdp.checkpoint.verify import META_FILENAME, write_manifest
from lightning_yafsdp.core import YaFSDPEngine
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor

MODEL_KEY = "model"
# Where Lightning's ModelParallelStrategy (FSDP2) keeps the weights in its DCP directories
# (its FSDPStrategy, like us, uses "model"): read as the model when there is no "model".
MODEL_PARALLEL_MODEL_KEY = "state_dict"
FORMAT_KEY = "yafsdp"
FORMAT_VERSION = 2  # 2: per-parameter optimizer groups (DCP's protocol writes the same files)
_OPTIMIZER_KEY = re.compile(r"optimizer_(\d+)$")


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """True if ``path`` is a directory with a DCP ``.metadata`` file."""
    return Path(path).is_dir() and (Path(path) / DCP_METADATA_FILENAME).is_file()


def read_meta(path: Path) -> dict[str, Any]:
    """``meta.pt`` of a sharded checkpoint (``{}`` when there is none)."""
    if not (path / META_FILENAME).is_file():
        return {}
    return torch.load(path / META_FILENAME, map_location="cpu", weights_only=False)


def format_info(
    engine: YaFSDPEngine, kind: str, num_optimizers: int, *, sharded_keys: Sequence[str] = ()
) -> dict:
    """What ``inspect`` and loaders want to know without reading the tensors."""
    parameters = engine.sharded_parameters(frozen=True)
    return {
        "format_version": FORMAT_VERSION,
        "state_dict_type": kind,
        "world_size": engine.world_size,
        "shard_size": engine.shard_size,
        "num_optimizers": num_optimizers,
        "parameter_count": sum(p._placement.shape.numel() for p in parameters),
        "sharded_keys": list(sharded_keys),
    }


# -- save ---------------------------------------------------------------------------------


def save_sharded(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
    *,
    background: BackgroundSaver | None = None,
) -> None:
    """Write a sharded checkpoint to the directory ``path`` (collective, [Note: atomic
    commit]): ``extra`` to ``meta.pt``, its entries holding ``RangeShardedTensor``s to the
    DCP files. ``background``: staged here, written in that saver's thread ([Note:
    background saves]). Raises ``CheckpointSaveError`` on every rank if any rank failed
    (with ``background``: from the saver's ``wait()``), the previous checkpoint intact.
    """
    if background is not None:
        background.wait()  # one save in flight at a time; raises a failed one's error
    state, meta = _dcp_state_and_meta(engine, model_state, optimizer_states, extra)
    bytes_here = tensor_bytes(state, whole=engine.rank == 0)
    # Rank 0 writes meta.pt: pickled now, so a background write holds a copy of it; a
    # failure to pickle is reported by every rank in the write phase.
    buffer = io.BytesIO()
    failure = atomic.attempt(lambda: torch.save(meta, buffer)) if engine.rank == 0 else None
    meta_bytes = failure or buffer.getvalue()
    path = Path(path)
    if background is None:
        _write_sharded(path, state, meta_bytes, group=engine.group, bytes_here=bytes_here)
        return
    staged = stage(state)
    background.submit(
        path,
        lambda group: _write_sharded(path, staged, meta_bytes, group=group, bytes_here=bytes_here),
    )


def _write_sharded(
    path: Path, state: dict[str, Any], meta: bytes | Exception, *, group, bytes_here: int
) -> None:
    """DCP's files, ``meta.pt`` and the manifest into a temporary directory, then commit."""
    with atomic.atomic_path(path, group=group, bytes_here=bytes_here) as tmp:
        dcp.save(
            state,
            storage_writer=FileSystemWriter(tmp, sync_files=True),
            # [Note: hybrid sharding] replicas hold the same boxes: the lowest rank, in
            # replica 0, writes each (and rank 0 the whole tensors and objects).
            planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
            process_group=group,
        )
        failure = meta if isinstance(meta, Exception) else None
        if dist.get_rank(group) == 0 and failure is None:
            failure = atomic.attempt(lambda: (tmp / META_FILENAME).write_bytes(meta))
        # Collective even when meta.pt failed, so no rank is left waiting in it.
        write_manifest(tmp, rank_zero_files=(META_FILENAME,), group=group, failure=failure)


def _dcp_state_and_meta(
    engine: YaFSDPEngine,
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Mapping[str, Any]],
    extra: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What DCP writes (weights, optimizers, sharded extras) and what ``meta.pt`` holds."""
    optimizers = {f"optimizer_{i}": dict(o) for i, o in enumerate(optimizer_states)}
    state: dict[str, Any] = {MODEL_KEY: dict(model_state), **optimizers}
    meta = dict(extra or {})
    sharded_keys = [key for key, value in meta.items() if sharded_leaves(value)]
    for key in sharded_keys:
        if key == MODEL_KEY or _OPTIMIZER_KEY.match(str(key)):
            raise CheckpointMismatchError(
                f"the checkpoint entry {key!r} holds sharded tensors and its name is taken by "
                "the weights or an optimizer in the sharded layout; rename it"
            )
        state[key] = meta.pop(key)
    kind, count = "sharded", len(optimizer_states)
    meta[FORMAT_KEY] = format_info(engine, kind, count, sharded_keys=sharded_keys)
    return state, meta


# -- load ----------------------------------------------------------------------------------


def load_sharded(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    strict: bool = True,
) -> dict[str, Any]:
    """Load a verified sharded checkpoint of any world size (collective).

    Names, shapes and the optimizer count are checked against ``.metadata`` before one
    ``dcp.load`` reads the weights in place and the optimizer states into fresh pieces.
    Returns ``meta.pt``'s contents and the ``"sharded_keys"`` entries (sharded).
    """
    path = Path(path)
    layout = CheckpointLayout(FileSystemReader(path).read_metadata())
    meta = read_meta(path)
    names = ParamNames(engine)
    model = engine.root.state_dict()  # sharded values are views of the parameters
    # Everything .metadata can tell is checked before anything is read.
    check_targets(engine, model, layout.model_shapes, strict=strict, what=f"checkpoint {path}")
    check_optimizer_count(path, saved=layout.num_optimizers, given=len(optimizers))
    extra_keys = [k for k in meta.get(FORMAT_KEY, {}).get("sharded_keys", []) if k in layout.top]
    targets = {layout.model_key: {n: v for n, v in model.items() if n in layout.model_shapes}}
    for key in [f"optimizer_{i}" for i in range(len(optimizers))] + extra_keys:
        targets[key] = layout.read_targets(key, lambda p, md: _target(names, model, p, md))
    for i in range(len(optimizers)):
        state = targets[f"optimizer_{i}"].get("state", {})
        check_state_names(names, state, what=f"optimizer {i} in checkpoint {path}")
    dcp.load(targets, storage_reader=FileSystemReader(path), process_group=engine.group)
    engine.mark_weights_changed()
    for i, optimizer in enumerate(optimizers):
        saved = targets[f"optimizer_{i}"]
        optimizer.load_state_dict(optimizer_state_to_load(names, optimizer, saved))
    return {**meta, **{key: targets[key] for key in extra_keys}}


def _target(
    names: ParamNames, model: Mapping[str, Any], path: tuple, md: Any
) -> RangeShardedTensor | torch.Tensor | None:
    """Where DCP reads the value at ``path`` (under an optimizer or a sharded entry):
    this rank's elements for per-element state of a sharded parameter and for a tensor
    named and shaped like one; other tensors whole; None for an object (DCP sets it)."""
    if isinstance(md, BytesStorageMetadata):
        return None
    param = names.sharded.get(path[2]) if len(path) == 4 and path[1] == "state" else None
    if param is not None and len(md.size) > 0:
        if torch.Size(md.size) != param._placement.shape:
            raise CheckpointMismatchError(
                f"{path[0]} state {path[3]!r} of {path[2]!r} has shape {tuple(md.size)} in "
                f"the checkpoint, the parameter {tuple(param._placement.shape)}; only "
                "per-element and scalar optimizer state can be loaded by name"
            )
        device = param._local.device
        local = torch.zeros(param._placement.numel, dtype=md.properties.dtype, device=device)
        return RangeShardedTensor(local, param._placement, param._group)
    like = model.get(path[1]) if len(path) == 2 else None
    if isinstance(like, RangeShardedTensor) and torch.Size(md.size) == like.shape:
        return like.detach().clone()
    return torch.empty(md.size, dtype=md.properties.dtype)


class CheckpointLayout:
    """What a DCP checkpoint holds, by the paths it was saved under (from ``.metadata``)."""

    def __init__(self, metadata: Metadata) -> None:
        planner_paths = metadata.planner_data or {}
        self.storage = dict(metadata.state_dict_metadata)
        self.paths = {fqn: tuple(planner_paths.get(fqn, (fqn,))) for fqn in self.storage}
        self.top = {path[0] for path in self.paths.values()}
        self.model_key = MODEL_KEY if MODEL_KEY in self.top else MODEL_PARALLEL_MODEL_KEY
        self.model = {  # the weights' storage metadata by name
            path[1]: md
            for _, path, md in self._under(self.model_key)
            if len(path) == 2 and not isinstance(md, BytesStorageMetadata)
        }
        self.model_shapes = {name: torch.Size(md.size) for name, md in self.model.items()}
        self.num_optimizers = len([key for key in self.top if _OPTIMIZER_KEY.match(str(key))])

    def _under(self, key: str) -> list[tuple[str, tuple, Any]]:
        """``(fqn, path, storage md)`` of everything saved under the top-level ``key``."""
        return [(fqn, p, self.storage[fqn]) for fqn, p in self.paths.items() if p[0] == key]

    def read_targets(self, key: str, target: Callable[[tuple, Any], Any]) -> Any:
        """The nested value saved under ``key``, each leaf ``target(path, storage md)``."""
        flat = {fqn: target(path, md) for fqn, path, md in self._under(key)}
        return unflatten_state_dict(flat, self.paths)[key]
