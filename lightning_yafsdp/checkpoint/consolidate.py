"""Consolidate and inspect checkpoints in ONE process, no process group needed."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.checkpoint.full import read_file, split_full_checkpoint
from lightning_yafsdp.checkpoint.sharded import (
    FORMAT_KEY,
    MODEL_KEY,
    MODEL_PARALLEL_MODEL_KEY,
    CheckpointLayout,
    read_meta,
)
from lightning_yafsdp.checkpoint.verify import verify_checkpoint


def consolidate_checkpoint(path: str | os.PathLike, *, weights_only: bool = False) -> dict:
    """Read a whole checkpoint into one dict of full tensors in CPU memory.

    A sharded directory gives what Lightning's consolidation utility and torch's
    ``dcp_to_torch_save`` give (the same DCP planner), ``{"model": {name: tensor},
    "optimizer_0": {...}, **meta.pt}`` (``weights_only``: the model entry alone); a single
    file is returned as loaded. Raises ``DamagedCheckpointError`` before reading a bad one.
    """
    path = Path(path)
    atomic.recover(path)
    # Sizes and structure only: a meta.pt rewritten on purpose after the save (an
    # upgrade, a hand edit) must still load; `yafsdp inspect --verify` compares CRCs.
    verify_checkpoint(path)
    if path.is_file():
        return read_file(path)
    checkpoint: dict[str, Any] = {}
    keys = {MODEL_KEY, MODEL_PARALLEL_MODEL_KEY} if weights_only else None
    planner = _EmptyStateDictLoadPlanner(keys=keys)  # fills ``checkpoint`` in place
    _load_state_dict(checkpoint, FileSystemReader(path), planner=planner, no_dist=True)
    return checkpoint if weights_only else {**checkpoint, **read_meta(path)}


def consolidated_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full weights of any checkpoint we read, under the original names and shapes."""
    checkpoint = consolidate_checkpoint(path, weights_only=True)
    if Path(path).is_dir():
        return dict(next(iter(checkpoint.values()), {}))
    return split_full_checkpoint(checkpoint)[0]


def inspect_checkpoint(path: str | os.PathLike, *, checksums: bool = False) -> dict[str, Any]:
    """What a checkpoint is, without reading its tensors (``checksums``: CRC-32s compared).
    ``world_size`` and ``shard_size`` are None for foreign files; ``parameter_count`` counts
    the sharded parameters, else every floating weight."""
    path = Path(path)
    verified = verify_checkpoint(path, checksums=checksums)
    if path.is_file():
        meta, shapes, counted, num_optimizers = _file_contents(path)
        size = path.stat().st_size
    else:
        meta, (shapes, counted, num_optimizers) = read_meta(path), _directory_contents(path)
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    info = meta.get(FORMAT_KEY, {})
    steps = [meta[key] for key in ("global_step", "step") if isinstance(meta.get(key), int)]
    return {
        "path": str(path),
        "kind": "full" if path.is_file() else "sharded",
        "step": steps[0] if steps else None,
        "epoch": meta.get("epoch"),
        "world_size": info.get("world_size"),
        "shard_size": info.get("shard_size"),
        "parameter_count": info.get("parameter_count", counted),
        "num_tensors": len(shapes),
        "tensor_names": sorted(shapes),
        "num_optimizers": info.get("num_optimizers", num_optimizers),
        "size_bytes": size,
        "verified": verified,
    }


def _directory_contents(path: Path) -> tuple[dict[str, torch.Size], int, int]:
    """``({weight name: shape}, floating elements, optimizer count)`` from ``.metadata``."""
    layout = CheckpointLayout(FileSystemReader(path).read_metadata())
    floating = [md for md in layout.model.values() if md.properties.dtype.is_floating_point]
    counted = sum(md.size.numel() for md in floating)
    return layout.model_shapes, counted, layout.num_optimizers


def _file_contents(path: Path) -> tuple[Mapping[str, Any], dict[str, torch.Size], int, int]:
    """``(the rest, {weight name: shape}, floating elements, optimizer count)`` of a file."""
    model, optimizers, rest = split_full_checkpoint(read_file(path))
    tensors = {n: v for n, v in model.items() if isinstance(v, torch.Tensor)}
    # Tied weights are one tensor under two names: counted once.
    unique = {v.untyped_storage().data_ptr(): v for v in tensors.values()}.values()
    counted = sum(v.numel() for v in unique if v.is_floating_point())
    return rest, {n: v.shape for n, v in tensors.items()}, counted, len(optimizers)
