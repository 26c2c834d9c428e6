"""One save and one load for both kinds of checkpoint (the strategies call these two)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.checkpoint.background import BackgroundSaver
from lightning_yafsdp.checkpoint.full import load_full, save_full
from lightning_yafsdp.checkpoint.optimizer_state import optimizer_entry
from lightning_yafsdp.checkpoint.sharded import load_sharded, save_sharded
from lightning_yafsdp.checkpoint.state import StateDictType, model_entry
from lightning_yafsdp.checkpoint.verify import verify_on_rank_zero
from lightning_yafsdp.core import YaFSDPEngine


def save_checkpoint(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    extra: Mapping[str, Any] | None = None,
    state_dict_type: StateDictType = "sharded",
    model_state: Mapping[str, Any] | None = None,
    optimizer_states: Sequence[Mapping[str, Any]] | None = None,
    background: BackgroundSaver | None = None,
) -> None:
    """Save ``engine``'s weights and ``optimizers``' state (collective, atomic).

    ``"sharded"`` (default): a DCP directory, every rank writing its own elements
    (``background``: written in that saver's thread). ``"full"``: one ``torch.save``
    file written by rank 0. ``extra`` (picklable; sharded tensors in it are written
    sharded or gathered) comes back from ``load_checkpoint``. ``model_state`` /
    ``optimizer_states``: ready entries (``model_entry`` / ``optimizer_entry`` of the
    same kind) instead of the engine's and ``optimizers``'.
    """
    if state_dict_type not in ("sharded", "full"):
        raise ValueError(f"state_dict_type must be 'sharded' or 'full', got {state_dict_type!r}")
    if model_state is None:
        model_state = model_entry(engine, engine.root, state_dict_type)
    if optimizer_states is None:
        optimizer_states = [optimizer_entry(engine, o, state_dict_type) for o in optimizers]
    if state_dict_type == "full":
        save_full(path, engine, model_state, optimizer_states, extra=extra)
    else:
        save_sharded(path, engine, model_state, optimizer_states, extra, background=background)


def load_checkpoint(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    strict: bool = True,
    verify_checksums: bool = True,
    expected: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a sharded directory or a single file (ours, DDP's, a consolidated one, a bare
    state dict) into ``engine`` and ``optimizers``, at any world size (collective).

    Verified first (CRC-32s unless ``verify_checksums=False``), names and shapes checked:
    a damaged or mismatched checkpoint raises (``NotACheckpointError``,
    ``DamagedCheckpointError``, ``CheckpointMismatchError``) before anything is loaded.
    ``expected``: the entry names of a Fabric file (``split_full_checkpoint``). Returns
    ``extra`` (for a Lightning checkpoint: all but weights and optimizer states).
    """
    path = Path(path)
    # A save killed between its two renames ([Note: atomic commit]) is undone first.
    error = atomic.attempt(lambda: atomic.recover(path)) if engine.rank == 0 else None
    atomic.agree(error, group=engine.group, doing=f"recovering checkpoint {path}")
    verify_on_rank_zero(path, group=engine.group, checksums=verify_checksums)
    if path.is_file():
        return load_full(path, engine, optimizers=optimizers, strict=strict, expected=expected)
    return load_sharded(path, engine, optimizers=optimizers, strict=strict)
