"""Fabric's checkpoints and the Trainer's: one format, read by both front doors.

[Note: one checkpoint format for Fabric and the Trainer]
``fabric.save`` (``fabric/checkpoints.py``) writes a Fabric state as the Trainer does
(docs/design.md, "Checkpoints"), except that a full file keeps each entry under the
user's key, as Fabric's other strategies and litgpt's scripts read it; ``FABRIC_KEYS``
records which entry was the module and which the optimizers. Fabric gives a Trainer
checkpoint's optimizer states in the order given, a Fabric one's by name (a full file of
another strategy's: by the keys in ``state``); the Trainer reads a Fabric checkpoint
through ``as_trainer_checkpoint``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError
from lightning_yafsdp.checkpoint.full import (
    FABRIC_KEYS,
    OPTIMIZER_STATES_KEY,
    STATE_DICT_KEY,
    read_file,
    split_full_checkpoint,
)
from lightning_yafsdp.checkpoint.sharded import FORMAT_KEY, read_meta

# Entries of a checkpoint that the format itself uses: no Fabric state may be named so.
RESERVED_KEYS = (STATE_DICT_KEY, OPTIMIZER_STATES_KEY, FABRIC_KEYS, FORMAT_KEY)


def check_trainer_can_resume(extras: Mapping[str, Any] | None, *, num_schedulers: int) -> None:
    """Before loading: a Fabric checkpoint records no LR schedulers for a Trainer that has some.

    Which Fabric entry is which scheduler is unknown, and restoring none would silently
    restart their schedules.
    """
    if extras is None or FABRIC_KEYS not in extras or not num_schedulers:
        return
    raise CheckpointMismatchError(
        "this checkpoint was written by Fabric, which records no Trainer LR schedulers, "
        f"but the LightningModule configures {num_schedulers}; restore them yourself in "
        f"on_load_checkpoint from the Fabric entries {fabric_entries(extras)}, or resume "
        "without schedulers"
    )


def as_trainer_checkpoint(checkpoint: Any, *, lightning_version: str) -> Any:
    """A checkpoint written by ``fabric.save`` as the Trainer and ``load_from_checkpoint``
    read one (any other checkpoint unchanged).

    A Fabric loop records no Lightning version, Trainer loops or scheduler list: the
    loop counters start at 0, the user's own entries stay in the dict for
    ``LightningModule.on_load_checkpoint``, and a full file's weights, under the user's
    key, are also its ``"state_dict"``.
    """
    if not isinstance(checkpoint, dict) or FABRIC_KEYS not in checkpoint:
        return checkpoint
    checkpoint = dict(checkpoint)
    checkpoint.setdefault("pytorch-lightning_version", lightning_version)
    checkpoint.setdefault("lr_schedulers", [])
    module_key = checkpoint[FABRIC_KEYS].get("module")
    if STATE_DICT_KEY not in checkpoint and module_key in checkpoint:
        checkpoint[STATE_DICT_KEY] = checkpoint[module_key]
    return checkpoint


def fabric_entries(checkpoint: Mapping[str, Any]) -> list[str]:
    """The user's own entries of a checkpoint written by Fabric (step counters, ...)."""
    return list(checkpoint.get(FABRIC_KEYS, {}).get("entries", []))


def read_checkpoint_extras(
    path: str | os.PathLike, expected: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The entries of a checkpoint beside its weights and optimizer states, read cheaply.

    For checks before a load starts; ``None`` if it cannot be read (the load itself then
    reports the damaged or missing checkpoint).
    """
    path = Path(path)
    try:
        if path.is_dir():
            return read_meta(path)
        return split_full_checkpoint(read_file(path), expected)[2]
    except Exception:  # noqa: BLE001 - see above
        return None
