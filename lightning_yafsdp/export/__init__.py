"""Exports of a checkpoint: plain weights (safetensors or ``.pt``) or a Hugging Face model.

``export_checkpoint`` writes a checkpoint's consolidated weights (any checkpoint
``lightning_yafsdp.checkpoint`` reads) under their original names for
``load_state_dict``, or as a Hugging Face directory for ``from_pretrained``
(``hugging_face.py``); the output directory appears all at once (``directory.py``).
One process, no process group.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_yafsdp.checkpoint.consolidate import consolidated_state_dict
from lightning_yafsdp.export.directory import (
    ExportError,
    refuse_to_overwrite,
    write_export_directory,
)
from lightning_yafsdp.export.hugging_face import (
    find_run_config,
    load_hf_config,
    load_run_config,
    to_hugging_face,
)

ExportFormat = Literal["safetensors", "pt"]


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
    a built-in Llama is renamed to ``LlamaForCausalLM``'s names (see ``hugging_face.py``).
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


__all__ = ["ExportError", "ExportFormat", "export_checkpoint"]
