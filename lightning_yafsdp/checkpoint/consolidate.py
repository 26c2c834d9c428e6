"""Consolidate, export and inspect checkpoints in ONE process, no process group needed.

``consolidate_checkpoint`` turns a sharded directory into the dict Lightning's
consolidation utility produces (``"model"``, ``"optimizer_<i>"``, plus
``meta.pt``'s contents); ``export_checkpoint`` writes the weights with original
names and shapes as safetensors (or ``.pt``) that ``from_pretrained`` and
``load_state_dict`` read; ``inspect_checkpoint`` reports what a checkpoint is
without reading its tensors.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.checkpoint.errors import NotACheckpointError
from lightning_yafsdp.checkpoint.full import split_full_checkpoint
from lightning_yafsdp.checkpoint.ranges import RangeLoadPlanner
from lightning_yafsdp.checkpoint.sharded import (
    FORMAT_KEY,
    META_FILENAME,
    MODEL_KEY,
    describe_non_checkpoint,
    is_sharded_checkpoint,
)
from lightning_yafsdp.checkpoint.trees import lists_from_int_keys, set_nested
from lightning_yafsdp.checkpoint.verify import verified_checks, verify_checkpoint

ExportFormat = Literal["safetensors", "pt"]


def consolidate_checkpoint(path: str | os.PathLike, *, weights_only: bool = False) -> dict:
    """Read a whole sharded checkpoint into one dict of full tensors (one process).

    The dict is the one ``lightning.fabric.utilities.load._load_distributed_checkpoint``
    builds: ``{"model": {name: tensor}, "optimizer_0": {...}, **meta.pt}``. With
    ``weights_only`` only ``"model"`` is read. A single-file checkpoint is returned
    as loaded. Needs the whole model in CPU memory.

    Raises:
        DamagedCheckpointError: a file is missing or truncated (checked before reading).
    """
    path = Path(path)
    atomic.recover(path)
    verify_checkpoint(path)
    if path.is_file():
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    if not is_sharded_checkpoint(path):
        raise NotACheckpointError(describe_non_checkpoint(path))
    metadata = FileSystemReader(path).read_metadata()
    paths = metadata.planner_data or {}
    targets: dict[str, Any] = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if weights_only and paths.get(fqn, (fqn,))[0] != MODEL_KEY:
            continue
        targets[fqn] = (
            None
            if isinstance(md, BytesStorageMetadata)
            else torch.empty(md.size, dtype=md.properties.dtype)
        )
    planner = RangeLoadPlanner()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(targets, storage_reader=FileSystemReader(path), planner=planner, no_dist=True)
    checkpoint: dict[str, Any] = {}
    for fqn, value in targets.items():
        value = planner.loaded_objects.get(fqn, value)
        set_nested(checkpoint, tuple(paths.get(fqn, (fqn,))), value)
    checkpoint = lists_from_int_keys(checkpoint)
    if not weights_only and (path / META_FILENAME).is_file():
        checkpoint.update(torch.load(path / META_FILENAME, map_location="cpu", weights_only=False))
    return checkpoint


def consolidated_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full weights of any checkpoint we read, under the original names and shapes."""
    checkpoint = consolidate_checkpoint(path, weights_only=True)
    if Path(path).is_dir():
        return dict(checkpoint.get(MODEL_KEY, {}))
    return split_full_checkpoint(checkpoint)[0]


def export_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    fmt: ExportFormat = "safetensors",
    hf_config: Any = None,
    strip_prefix: str = "",
    dtype: torch.dtype | None = None,
) -> Path:
    """Write a checkpoint's consolidated weights to ``out_dir``; returns the weights file.

    Args:
        checkpoint_dir: a sharded checkpoint directory or a single-file checkpoint.
        out_dir: created if needed; receives ``model.safetensors`` (or ``model.pt``)
            and, with ``hf_config``, ``config.json``.
        fmt: ``"safetensors"`` (default) or ``"pt"`` (``torch.save`` of the state dict).
        hf_config: a ``transformers.PretrainedConfig`` (or a plain dict) saved as
            ``config.json``, so ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads
            the export.
        strip_prefix: removed from the start of every name, e.g. ``"model."`` when
            the LightningModule holds the HF model as ``self.model``.
        dtype: cast floating tensors (e.g. ``torch.bfloat16``); default keeps fp32.
    """
    state = consolidated_state_dict(checkpoint_dir)
    if strip_prefix:
        state = {
            k[len(strip_prefix) :] if k.startswith(strip_prefix) else k: v for k, v in state.items()
        }
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        target = out_dir / "model.safetensors"
        # safetensors refuses tensors that share memory (tied weights from a full
        # file): every entry gets its own contiguous copy.
        seen: set[int] = set()
        tensors = {}
        for name, tensor in state.items():
            pointer = tensor.untyped_storage().data_ptr()
            shared = pointer in seen
            seen.add(pointer)
            tensors[name] = tensor.clone() if shared else tensor.contiguous()
        atomic.atomic_file(target, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    elif fmt == "pt":
        target = out_dir / "model.pt"
        atomic.atomic_file(target, lambda tmp: torch.save(state, tmp))
    else:
        raise ValueError(f"fmt must be 'safetensors' or 'pt', got {fmt!r}")
    if hf_config is not None:
        if hasattr(hf_config, "save_pretrained"):
            hf_config.save_pretrained(out_dir)
        else:
            (out_dir / "config.json").write_text(json.dumps(dict(hf_config), indent=2))
    return target


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
        ("written by", f"{info['world_size']} rank(s)" if info.get("world_size") else "-"),
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
