"""The only Lightning-shaped part of checkpointing: a Lightning checkpoint dict in, out.

Lightning's ``trainer.save_checkpoint`` builds one dict on every rank:
``"state_dict"`` (from ``strategy.lightning_module_state_dict()``: the module's
own ``state_dict()``, ``RangeShardedTensor`` values), ``"optimizer_states"`` (from
``strategy.optimizer_state(opt)``) and the rest (loops, schedulers, callbacks,
hyperparameters; a ``WeightAveraging`` callback moves our weights to
``"current_model_state"`` and puts its averaged ones in ``"state_dict"``). Every
sharded tensor anywhere in that dict is written sharded (``"sharded"``) or
gathered to a full tensor (``"full"``). Nothing here imports lightning.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_yafsdp.checkpoint.background import BackgroundSaver
from lightning_yafsdp.checkpoint.full import (
    OPTIMIZER_STATES_KEY,
    STATE_DICT_KEY,
    load_full,
    save_full,
)
from lightning_yafsdp.checkpoint.sharded import load_sharded, save_sharded
from lightning_yafsdp.checkpoint.state import module_state
from lightning_yafsdp.checkpoint.verify import verify_on_rank_zero
from lightning_yafsdp.core import YaFSDPEngine

StateDictType = Literal["sharded", "full"]


def save_lightning_checkpoint(
    checkpoint: dict[str, Any],
    path: str | os.PathLike,
    *,
    engine: YaFSDPEngine,
    state_dict_type: StateDictType = "sharded",
    background: BackgroundSaver | None = None,
) -> None:
    """Write Lightning's checkpoint dict: a DCP directory + ``meta.pt``, or one file.

    Collective. ``checkpoint["state_dict"]`` holds ``RangeShardedTensor``s
    and plain tensors (or, for ``"full"``, rank 0's full tensors);
    ``checkpoint["optimizer_states"]`` come from ``sharded_optimizer_state_dict``
    (either type) or ``full_optimizer_state_dict`` (``"full"``). The dict itself
    is not modified. ``background``: written by that saver's thread ([Note: background
    saves]; sharded only).
    """
    rest = dict(checkpoint)
    model_state = rest.pop(STATE_DICT_KEY)
    optimizer_states = rest.pop(OPTIMIZER_STATES_KEY, [])
    if state_dict_type not in ("sharded", "full"):
        raise ValueError(f"state_dict_type must be 'sharded' or 'full', got {state_dict_type!r}")
    if state_dict_type == "full":
        save_full(
            path, engine, extra=rest, model_state=model_state, optimizer_states=optimizer_states
        )
        return
    save_sharded(
        path,
        engine,
        extra=rest,
        model_state=model_state,
        optimizer_states=optimizer_states,
        background=background,
    )


def load_lightning_checkpoint(
    path: str | os.PathLike,
    *,
    engine: YaFSDPEngine,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    strict: bool = True,
    expected: Mapping[str, Any] | None = None,
    verify_checksums: bool = True,
) -> dict[str, Any]:
    """Load weights and optimizer states in place; return the rest for Lightning to restore.

    Collective. ``path`` may be one of our sharded directories, a full file
    (ours, a DDP/single-device Lightning checkpoint, a consolidated one) or a bare
    state dict file (``expected``: the entry names of a Fabric file that does not record
    them, see ``full.split_full_checkpoint``). The returned dict's ``"state_dict"`` is the module's
    ``state_dict()`` after loading (sharded views), for hooks and callbacks that
    read it (``WeightAveraging.on_load_checkpoint``). ``verify_checksums`` (default
    True): see ``load_sharded``.

    Raises:
        DamagedCheckpointError: before anything is loaded, when a file of the checkpoint
            is missing, truncated or changed since the save: rank 0 names the file, the
            other ranks point to rank 0.
    """
    path = Path(path)
    if path.is_file():
        # load_full verifies on every rank (it is not collective); here rank 0 speaks first.
        verify_on_rank_zero(path, group=engine.group, checksums=verify_checksums)
        rest = load_full(
            path,
            engine,
            optimizers=optimizers,
            strict=strict,
            expected=expected,
            verify_checksums=False,  # just compared, shared over the ranks
        )
    else:  # recovers an interrupted commit, then verifies on rank 0
        rest = load_sharded(
            path,
            engine,
            optimizers=optimizers,
            strict=strict,
            verify_checksums=verify_checksums,
        )
    rest[STATE_DICT_KEY] = module_state(engine)
    return rest
