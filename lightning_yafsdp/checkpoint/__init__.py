"""Checkpoints of a sharded model: sharded (DCP) or full, atomic, loadable at any world size.

Torch-level API (the Lightning strategy wires the same functions into Lightning)::

    from lightning_yafsdp.checkpoint import save_checkpoint, load_checkpoint

    save_checkpoint("ckpt/step-1000", engine, optimizers=[opt], extra={"step": 1000})
    extra = load_checkpoint("ckpt/step-1000", engine, optimizers=[opt])  # any world size

Layout of a sharded checkpoint (``sharded.py``): a ``torch.distributed.checkpoint``
directory whose tensors have the ORIGINAL names and full shapes (each rank writes
its element ranges as boxes through DCP's own protocol with DCP's default planners,
[Note: element ranges as boxes]) plus ``meta.pt``, the layout Lightning's FSDP
strategy writes, so ``python -m lightning.pytorch.utilities.consolidate_checkpoint``
turns it into a single file. Optimizer state is per parameter, by name, with every
param group's hyperparameters (``optimizer_state.py``); a full file uses torch's own
optimizer layout (``torch_layout.py``), so DDP loads it. Saves are atomic (``atomic.py``);
every reader first checks that no file is missing or truncated (``verify.py``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_yafsdp.checkpoint.consolidate import (
    consolidate_checkpoint,
    consolidated_state_dict,
    inspect_checkpoint,
    render_inspection,
)
from lightning_yafsdp.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    DamagedCheckpointError,
    NotACheckpointError,
)
from lightning_yafsdp.checkpoint.full import load_full, save_full
from lightning_yafsdp.checkpoint.lightning_format import (
    load_lightning_checkpoint,
    save_lightning_checkpoint,
)
from lightning_yafsdp.checkpoint.optimizer_state import (
    full_optimizer_state_dict,
    load_full_optimizer_state_dict,
    sharded_optimizer_state_dict,
)
from lightning_yafsdp.checkpoint.sharded import is_sharded_checkpoint, load_sharded, save_sharded
from lightning_yafsdp.checkpoint.state import (
    full_model_state_dict,
    load_full_model_state_dict,
    sharded_model_state_dict,
)
from lightning_yafsdp.checkpoint.verify import verify_checkpoint
from lightning_yafsdp.core import YaFSDPEngine


def save_checkpoint(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    extra: Mapping[str, Any] | None = None,
    state_dict_type: Literal["sharded", "full"] = "sharded",
) -> None:
    """Save ``engine``'s weights and ``optimizers``' state (collective, atomic).

    ``"sharded"`` (default): a DCP directory at ``path``, every rank writing its
    own elements. ``"full"``: one ``torch.save`` file at ``path`` written by rank 0,
    gathered one flat group at a time. ``extra`` (picklable) comes back from
    ``load_checkpoint``.
    """
    if state_dict_type == "sharded":
        save_sharded(path, engine, optimizers=optimizers, extra=extra)
    elif state_dict_type == "full":
        save_full(path, engine, optimizers=optimizers, extra=extra)
    else:
        raise ValueError(f"state_dict_type must be 'sharded' or 'full', got {state_dict_type!r}")


def load_checkpoint(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    strict: bool = True,
    verify_checksums: bool = True,
) -> dict[str, Any]:
    """Load a sharded directory or a full file into ``engine`` (and ``optimizers``).

    Works at any world size. Returns ``extra`` (or, for a Lightning checkpoint,
    everything but weights and optimizer states). Every file is first compared with
    the checksums recorded at save unless ``verify_checksums=False``. See
    ``load_sharded`` / ``load_full`` for the errors.
    """
    load = load_full if Path(path).is_file() else load_sharded
    return load(
        path, engine, optimizers=optimizers, strict=strict, verify_checksums=verify_checksums
    )


__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "DamagedCheckpointError",
    "NotACheckpointError",
    "consolidate_checkpoint",
    "consolidated_state_dict",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "inspect_checkpoint",
    "is_sharded_checkpoint",
    "load_checkpoint",
    "load_full",
    "load_full_model_state_dict",
    "load_full_optimizer_state_dict",
    "load_lightning_checkpoint",
    "load_sharded",
    "render_inspection",
    "save_checkpoint",
    "save_full",
    "save_lightning_checkpoint",
    "save_sharded",
    "sharded_model_state_dict",
    "sharded_optimizer_state_dict",
    "verify_checkpoint",
]
