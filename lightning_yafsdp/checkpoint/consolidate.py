"""Consolidate and inspect checkpoints in ONE process, no process group needed.

``consolidate_checkpoint`` turns a sharded directory into the dict Lightning's
consolidation utility produces (``"model"``, ``"optimizer_<i>"``, plus
``meta.pt``'s contents); ``inspect_checkpoint`` reports what a checkpoint is without
reading its tensors. Exports (safetensors, Hugging Face) are ``lightning_yafsdp.export``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.checkpoint.errors import NotACheckpointError
from lightning_yafsdp.checkpoint.full import split_full_checkpoint
from lightning_yafsdp.checkpoint.sharded import (
    FORMAT_KEY,
    META_FILENAME,
    MODEL_KEY,
    CheckpointLayout,
    is_sharded_checkpoint,
)
from lightning_yafsdp.checkpoint.verify import (
    describe_non_checkpoint,
    verified_checks,
    verify_checkpoint,
)


def consolidate_checkpoint(path: str | os.PathLike, *, weights_only: bool = False) -> dict:
    """Read a whole sharded checkpoint into one dict of full tensors (one process).

    The dict is the one ``lightning.fabric.utilities.load._load_distributed_checkpoint``
    builds: ``{"model": {name: tensor}, "optimizer_0": {...}, **meta.pt}``. With
    ``weights_only`` only the weights are read. A single-file checkpoint is returned
    as loaded. Needs the whole model in CPU memory. One ``dcp.load`` with DCP's default
    planner into full-shape targets, as ``dcp_to_torch_save`` does.

    Raises:
        DamagedCheckpointError: a file is missing or truncated (checked before reading).
    """
    path = Path(path)
    atomic.recover(path)
    # Sizes and structure only: a meta.pt rewritten on purpose after the save (an
    # upgrade, a hand edit) must still load; `yafsdp inspect --verify` compares CRCs.
    verify_checkpoint(path)
    if path.is_file():
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    if not is_sharded_checkpoint(path):
        raise NotACheckpointError(describe_non_checkpoint(path))
    layout = CheckpointLayout(FileSystemReader(path).read_metadata())
    keys = [layout.model_key] if weights_only else sorted(layout.top_level, key=str)
    checkpoint = {key: layout.read_targets(key, _full_target) for key in keys}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(checkpoint, storage_reader=FileSystemReader(path), no_dist=True)
    if not weights_only and (path / META_FILENAME).is_file():
        checkpoint.update(torch.load(path / META_FILENAME, map_location="cpu", weights_only=False))
    return checkpoint


def _full_target(_: tuple, md: Any) -> torch.Tensor | None:
    if isinstance(md, BytesStorageMetadata):
        return None  # a pickled object: DCP puts it in place
    return torch.empty(md.size, dtype=md.properties.dtype)


def consolidated_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full weights of any checkpoint we read, under the original names and shapes."""
    checkpoint = consolidate_checkpoint(path, weights_only=True)
    if Path(path).is_dir():
        return dict(next(iter(checkpoint.values()), {}))
    return split_full_checkpoint(checkpoint)[0]


def inspect_checkpoint(path: str | os.PathLike, *, checksums: bool = False) -> dict[str, Any]:
    """What a checkpoint is, without reading its tensors (unless ``checksums``).

    Args:
        path: a sharded checkpoint directory or a single-file checkpoint.
        checksums: also compare every file with the CRC-32 recorded at save (reads
            every byte); default False checks sizes and structure only.

    Returns:
        ``path``, ``kind`` ("sharded" or "full"), ``step`` (Lightning's
        ``global_step``, else an ``extra["step"]``; None if neither), ``epoch``,
        ``world_size`` (ranks that wrote it; None for foreign full files),
        ``parameter_count`` (elements of the unique trainable parameters, or of
        every floating tensor in the weights when unknown), ``num_tensors``,
        ``tensor_names`` (weights), ``num_optimizers``, ``size_bytes`` (on disk),
        ``verified`` (what ``verify_checkpoint`` checked).

    Raises:
        DamagedCheckpointError: a file is missing or truncated (one line naming it).
    """
    path = Path(path)
    verified = verified_checks(path, checksums=checksums)
    if path.is_file():
        return {**_inspect_file(path), "verified": verified}
    if not is_sharded_checkpoint(path):
        raise NotACheckpointError(describe_non_checkpoint(path))
    metadata = FileSystemReader(path).read_metadata()
    paths = metadata.planner_data or {}
    meta = (
        torch.load(path / META_FILENAME, map_location="cpu", weights_only=False)
        if (path / META_FILENAME).is_file()
        else {}
    )
    info = meta.get(FORMAT_KEY, {})
    model = {
        fqn: md
        for fqn, md in metadata.state_dict_metadata.items()
        if paths.get(fqn, (fqn,))[0] == MODEL_KEY and not isinstance(md, BytesStorageMetadata)
    }
    writers = {p.name.split("_")[2] for p in path.glob("__*_*.distcp")}
    optimizers = {paths[fqn][0] for fqn in paths if str(paths[fqn][0]).startswith("optimizer_")}
    return {
        "path": str(path),
        "kind": "sharded",
        "step": _step_of(meta),
        "epoch": meta.get("epoch"),
        "world_size": info.get("world_size", len(writers) or None),
        "shard_size": info.get("shard_size"),
        "parameter_count": info.get(
            "parameter_count",
            sum(md.size.numel() for md in model.values() if md.properties.dtype.is_floating_point),
        ),
        "num_tensors": len(model),
        "tensor_names": sorted(model),
        "num_optimizers": info.get("num_optimizers", len(optimizers)),
        "size_bytes": sum(p.stat().st_size for p in path.rglob("*") if p.is_file()),
        "verified": verified,
    }


def _writers(info: Mapping[str, Any]) -> str:
    world, shard = info.get("world_size"), info.get("shard_size")
    if not world:
        return "-"
    if shard and shard < world:  # [Note: hybrid sharding]
        return f"{world} rank(s): {world // shard} replicas x {shard} sharded ranks"
    return f"{world} rank(s)"


def render_inspection(info: Mapping[str, Any]):
    """A ``rich.table.Table`` of ``inspect_checkpoint``'s result (print it with a Console)."""
    from rich.table import Table

    table = Table(title=f"checkpoint {info['path']}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value")
    rows = [
        ("format", info["kind"]),
        ("step", _or_dash(info.get("step"))),
        ("epoch", _or_dash(info.get("epoch"))),
        ("written by", _writers(info)),
        ("parameters", f"{info['parameter_count']:,}"),
        ("tensors (weights)", f"{info['num_tensors']:,}"),
        ("optimizers", str(info["num_optimizers"])),
        ("size on disk", _human_bytes(info["size_bytes"])),
        ("verified", info.get("verified", "-")),
    ]
    for field, value in rows:
        table.add_row(field, value)
    return table


# -- helpers ---------------------------------------------------------------------------------


def _inspect_file(path: Path) -> dict[str, Any]:
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as exc:
        raise NotACheckpointError(
            f"{str(path)!r} is not a checkpoint torch.load can read ({type(exc).__name__}: {exc})"
        ) from exc
    model, optimizers, rest = split_full_checkpoint(checkpoint)
    info = rest.get(FORMAT_KEY, {})
    return {
        "path": str(path),
        "kind": "full",
        "step": _step_of(rest),
        "epoch": rest.get("epoch"),
        "world_size": info.get("world_size"),
        "shard_size": info.get("shard_size"),
        "parameter_count": info.get(
            "parameter_count",
            sum(
                t.numel()
                for t in {v.untyped_storage().data_ptr(): v for v in model.values()}.values()
                if isinstance(t, torch.Tensor) and t.is_floating_point()
            ),
        ),
        "num_tensors": len(model),
        "tensor_names": sorted(model),
        "num_optimizers": len(optimizers),
        "size_bytes": path.stat().st_size,
    }


def _step_of(meta: Mapping[str, Any]) -> int | None:
    for key in ("global_step", "step"):
        if isinstance(meta.get(key), int):
            return meta[key]
    return None


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _human_bytes(size: int) -> str:
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"
