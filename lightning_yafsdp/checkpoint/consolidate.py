"""Consolidate, export and inspect checkpoints in ONE process, no process group needed.

``consolidate_checkpoint`` turns a sharded directory into the dict Lightning's
consolidation utility produces (``"model"``, ``"optimizer_<i>"``, plus
``meta.pt``'s contents); ``export_checkpoint`` writes the weights as safetensors
(or ``.pt``) under their original names for ``load_state_dict``, or as a Hugging
Face directory for ``from_pretrained`` (``hf_export.py``, ``export_dir.py``);
``inspect_checkpoint`` reports what a checkpoint is without reading its tensors.
"""

from __future__ import annotations

import importlib.util
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
from lightning_yafsdp.checkpoint.export_dir import (
    ExportError,
    refuse_to_overwrite,
    write_export_directory,
)
from lightning_yafsdp.checkpoint.full import split_full_checkpoint
from lightning_yafsdp.checkpoint.hf_export import (
    find_run_config,
    load_hf_config,
    load_run_config,
    to_hugging_face,
)
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
    # Sizes and structure only: a meta.pt rewritten on purpose after the save (an
    # upgrade, a hand edit) must still load; `yafsdp inspect --verify` compares CRCs.
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
    hf: bool = False,
    hf_config: Any = None,
    run_config: str | os.PathLike | None = None,
    strip_prefix: str = "",
    dtype: torch.dtype | None = None,
    force: bool = False,
) -> Path:
    """Write a checkpoint's consolidated weights to ``out_dir``; returns the weights file.

    Without ``hf``/``hf_config`` the weights keep the names and shapes they are stored
    under (``load_state_dict`` reads them). With either, ``out_dir`` becomes a Hugging
    Face directory (``model.safetensors`` + ``config.json``) that
    ``AutoModelForCausalLM.from_pretrained`` loads with no missing or unexpected key:
    a built-in Llama is renamed to ``LlamaForCausalLM``'s names (see ``hf_export.py``).
    Everything is checked before anything is written, and the files appear together
    (see [Note: export commit]).

    Args:
        checkpoint_dir: a sharded checkpoint directory or a single-file checkpoint.
        out_dir: receives ``model.safetensors`` (or ``model.pt``) and, for Hugging Face,
            ``config.json``; created (with parents) only when the export succeeds.
        fmt: ``"safetensors"`` (default) or ``"pt"`` (``torch.save`` of the state dict;
            not with Hugging Face output, which ``from_pretrained`` reads as safetensors).
        hf: write a Hugging Face directory, the config taken from the run: built from
            the built-in Llama's config, or the run's ``model.hf_path`` for an HF model.
        hf_config: the Hugging Face config to write (implies ``hf``): a
            ``transformers.PretrainedConfig``, a dict with ``model_type``, or a local
            model/config directory. For a built-in Llama it must describe the trained
            architecture.
        run_config: the run's ``config.yaml``; default: the one ``yafsdp train`` wrote in
            the checkpoint's run directory, if any.
        strip_prefix: removed from the start of every name, e.g. ``"model."`` when
            the LightningModule holds the network as ``self.model``.
        dtype: cast floating tensors (e.g. ``torch.bfloat16``); default keeps fp32.
        force: replace an earlier export in ``out_dir`` (default: refuse).

    Raises:
        ExportError: the export cannot be done as asked (message names what and the fix);
            nothing was written.
        NotACheckpointError: ``checkpoint_dir`` is no checkpoint.
    """
    hf = hf or hf_config is not None
    _check_export_tools(fmt=fmt, hf=hf)
    out_dir = Path(out_dir)
    refuse_to_overwrite(out_dir, force=force)
    run_config_path = run_config if run_config is not None else find_run_config(checkpoint_dir)
    state = _strip(consolidated_state_dict(checkpoint_dir), strip_prefix)
    state, config = _exported_state(
        state, hf=hf, hf_config=hf_config, run_config_path=run_config_path, dtype=dtype
    )
    writers = {f"model.{fmt}": _weights_writer(state, fmt=fmt)}
    if config is not None:
        writers["config.json"] = config.to_json_file
    return write_export_directory(out_dir, writers, force=force)[0]


def _exported_state(
    state: dict[str, torch.Tensor],
    *,
    hf: bool,
    hf_config: Any,
    run_config_path: str | os.PathLike | None,
    dtype: torch.dtype | None,
) -> tuple[dict[str, torch.Tensor], Any]:
    """The weights as exported (HF names, ``dtype``) and the HF config (None without ``hf``)."""
    config = None
    if hf:
        state, config = to_hugging_face(
            state,
            run_config=load_run_config(run_config_path) if run_config_path else None,
            hf_config=load_hf_config(hf_config) if hf_config is not None else None,
        )
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        if config is not None:
            config.dtype = dtype  # from_pretrained's dtype="auto" then keeps it
    return state, config


def _check_export_tools(*, fmt: ExportFormat, hf: bool) -> None:
    """Refuse, before reading anything, an export whose writer or reader is missing."""
    if fmt not in ("safetensors", "pt"):
        raise ValueError(f"fmt must be 'safetensors' or 'pt', got {fmt!r}")
    if fmt == "safetensors" and not _importable("safetensors"):
        raise ExportError(
            "--format safetensors needs the safetensors package: pip install safetensors, "
            "or use --format pt"
        )
    if hf and fmt != "safetensors":
        raise ExportError(
            "a Hugging Face export is written as model.safetensors (what from_pretrained "
            "reads); drop --format pt"
        )
    if hf and not _importable("transformers"):
        raise ExportError(
            "a Hugging Face export needs transformers: pip install 'lightning-yafsdp[hf]'"
        )


def _importable(package: str) -> bool:
    # find_spec, not import: transformers takes seconds to import, and is imported
    # anyway once it is needed.
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # sys.modules[package] is None: imports of it are blocked
        return False


def _strip(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    if not prefix:
        return state
    return {k[len(prefix) :] if k.startswith(prefix) else k: v for k, v in state.items()}


def _weights_writer(state: dict[str, torch.Tensor], *, fmt: ExportFormat):
    if fmt == "pt":
        return lambda path: torch.save(state, path)
    from safetensors.torch import save_file

    # safetensors refuses tensors that share memory (tied weights from a full file):
    # every entry gets its own contiguous copy.
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state.items():
        pointer = tensor.untyped_storage().data_ptr()
        shared = pointer in seen
        seen.add(pointer)
        tensors[name] = tensor.clone() if shared else tensor.contiguous()
    return lambda path: save_file(tensors, path, metadata={"format": "pt"})


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
