"""The output directory of an export: written all at once, never over an earlier one unasked.

[Note: export commit]
An export writes every file (weights, ``config.json``) into a staging directory
first and moves them into ``out_dir`` only once all are complete, so a failed
export (a refused conversion, a full disk, Ctrl-C) leaves ``out_dir`` as it was:
no half-written file and, when ``out_dir`` did not exist, no directory at all.
When ``out_dir`` is new the staging directory is its hidden sibling and one
rename publishes it; when it exists the staging directory sits inside it and
each file is renamed into place. An earlier export there (any of
:data:`EXPORT_FILES`) is refused unless ``force`` is set; with ``force`` the new
export replaces the earlier one whole, so the directory never pairs new weights
with an old ``config.json`` or keeps a stale ``model.pt`` beside a new
``model.safetensors``. Files are given normal modes ([Note: file modes] in
``atomic.py``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.checkpoint.errors import CheckpointError

EXPORT_FILES = ("model.safetensors", "model.pt", "config.json")
"""The files an export writes; any of them in ``out_dir`` marks an earlier export."""

_STAGING_NAME = ".yafsdp-export-tmp"

FileWriter = Callable[[Path], None]
"""Writes one output file at the path it is given."""


class ExportError(CheckpointError, ValueError):
    """An export was refused before anything was written (the message says why and the fix)."""


def refuse_to_overwrite(out_dir: Path, *, force: bool) -> None:
    """Raise ``ExportError`` if ``out_dir`` holds an earlier export and ``force`` is off.

    Raises:
        ExportError: naming the first existing file of :data:`EXPORT_FILES`, or
            ``out_dir`` when it is a file.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise ExportError(f"output {str(out_dir)!r} is a file, not a directory; pick another path")
    if force:
        return
    for name in EXPORT_FILES:
        if (out_dir / name).exists():
            raise ExportError(
                f"{str(out_dir / name)!r} already exists (an earlier export); pass --force to "
                "replace that export, or pick another output directory"
            )


def write_export_directory(
    out_dir: Path, writers: Mapping[str, FileWriter], *, force: bool = False
) -> list[Path]:
    """Write ``writers``' files into ``out_dir`` all at once (see [Note: export commit]).

    Args:
        out_dir: the output directory; created (with missing parents) only on success.
        writers: file name (one of :data:`EXPORT_FILES`) -> function writing that file.
        force: replace an earlier export in ``out_dir`` instead of refusing.

    Returns:
        The paths written, in ``writers``' order.

    Raises:
        ExportError: an earlier export is there and ``force`` is off.
        OSError: writing failed; ``out_dir`` is as it was.
    """
    refuse_to_overwrite(out_dir, force=force)
    existed = out_dir.is_dir()
    staging = out_dir / _STAGING_NAME if existed else atomic.tmp_path_for(out_dir)
    created_root = _first_missing_ancestor(staging.parent)
    try:
        _remove(staging)  # left by an export that died
        staging.mkdir(parents=True)
        for name, write in writers.items():
            write(staging / name)
            atomic.fsync(staging / name)
        atomic.apply_default_modes(staging)
        if existed:
            _move_files_into(staging, out_dir, names=list(writers))
        else:
            os.replace(staging, out_dir)
        atomic.fsync(out_dir.parent)
    except BaseException:
        _remove(staging)
        if created_root is not None:
            _remove(created_root)
        raise
    return [out_dir / name for name in writers]


# -- helpers ---------------------------------------------------------------------------------


def _move_files_into(staging: Path, out_dir: Path, *, names: list[str]) -> None:
    for name in names:
        os.replace(staging / name, out_dir / name)
    for name in EXPORT_FILES:  # what is left of an earlier export (force was checked)
        if name not in names and (out_dir / name).exists():
            (out_dir / name).unlink()
    staging.rmdir()
    atomic.fsync(out_dir)


def _first_missing_ancestor(path: Path) -> Path | None:
    """The outermost of ``path`` and its parents that does not exist yet (None if it does)."""
    missing = None
    for candidate in (path, *path.parents):
        if candidate.exists():
            break
        missing = candidate
    return missing


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()
