"""Full (single-file) checkpoints, written by rank 0 and read by every rank: Lightning's
DDP layout (``"state_dict"``, ``"optimizer_states"``) or Fabric's. Reading also takes a
DDP file, Lightning's consolidated FSDP file and a bare state dict.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.checkpoint.errors import NotACheckpointError
from lightning_yafsdp.checkpoint.gather import tensor_bytes
from lightning_yafsdp.checkpoint.optimizer_state import (
    ParamNames,
    check_optimizer_count,
    optimizer_state_to_load,
)
from lightning_yafsdp.checkpoint.sharded import FORMAT_KEY, format_info
from lightning_yafsdp.checkpoint.state import gather_shards, load_full_model_state_dict
from lightning_yafsdp.core import YaFSDPEngine

STATE_DICT_KEY = "state_dict"
OPTIMIZER_STATES_KEY = "optimizer_states"
# Written by fabric.save: {"module": key, "optimizers": [key, ...], "entries": [...]}, the
# names of the weights and optimizer states ([Note: one checkpoint format for Fabric and
# the Trainer]).
FABRIC_KEYS = "yafsdp_fabric"


def save_full(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    model_state: Mapping[str, Any],
    optimizer_states: Sequence[Mapping[str, Any]],
    *,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Write one ``torch.save`` file (collective: sharded tensors in ``extra`` are gathered;
    atomic: rank 0 writes). ``model_state`` / ``optimizer_states``: full on rank 0, in
    torch's layouts. With ``extra[FABRIC_KEYS]``: Fabric's layout, under the user's keys.
    Raises ``CheckpointSaveError`` on every rank when rank 0 failed to write.
    """
    checkpoint = dict(extra or {})
    fabric_keys = checkpoint.get(FABRIC_KEYS)
    if fabric_keys is None:  # Lightning's layout
        checkpoint[STATE_DICT_KEY] = dict(model_state)
        checkpoint[OPTIMIZER_STATES_KEY] = list(optimizer_states)
    else:
        checkpoint[fabric_keys["module"]] = dict(model_state)
        checkpoint.update(zip(fabric_keys["optimizers"], optimizer_states, strict=True))
    checkpoint = gather_shards(engine, checkpoint)
    checkpoint[FORMAT_KEY] = format_info(engine, "full", len(optimizer_states))
    needed = tensor_bytes(checkpoint) if engine.rank == 0 else 0  # for a failure's message
    with atomic.atomic_path(path, group=engine.group, directory=False, bytes_here=needed) as tmp:
        if engine.rank == 0:
            torch.save(checkpoint, tmp)


def load_full(
    path: Path,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    strict: bool = True,
    expected: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a verified single-file checkpoint into ``engine`` and ``optimizers``; return the
    rest. Every rank reads the file; a mismatch raises before anything is modified."""
    model_state, optimizer_states, rest = split_full_checkpoint(read_file(path), expected)
    check_optimizer_count(path, saved=len(optimizer_states), given=len(optimizers))
    names = ParamNames(engine)
    prepared = [
        optimizer_state_to_load(names, optimizer, state)
        for optimizer, state in zip(optimizers, optimizer_states, strict=False)
    ]
    load_full_model_state_dict(engine, model_state, strict=strict)
    for optimizer, state in zip(optimizers, prepared, strict=False):
        optimizer.load_state_dict(state)
    return rest


def read_file(path: Path) -> dict[str, Any]:
    """A single-file checkpoint, memory-mapped (each rank touches only the pages it reads)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as exc:
        raise NotACheckpointError(
            f"{str(path)!r} is not a checkpoint torch.load can read ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(checkpoint, dict):
        raise NotACheckpointError(f"{str(path)!r} holds a {type(checkpoint).__name__}, not a dict")
    return checkpoint


def split_full_checkpoint(
    checkpoint: dict, expected: Mapping[str, Any] | None = None
) -> tuple[dict, list, dict]:
    """``(weights, optimizer states, the rest)`` of any supported single-file layout.

    A file written by ``fabric.save`` names its entries (``FABRIC_KEYS``); ``expected``
    names them (same shape) for a Fabric file of another strategy, which does not.
    """
    rest = dict(checkpoint)
    layout = rest.get(FABRIC_KEYS) or expected
    if layout and layout.get("module") in rest:
        model_state = rest.pop(layout["module"])
        optimizer_states = [rest.pop(k) for k in layout.get("optimizers", ()) if k in rest]
        return dict(model_state), optimizer_states, rest
    if STATE_DICT_KEY in rest:
        model_state = rest.pop(STATE_DICT_KEY)
    elif isinstance(rest.get("model"), Mapping):
        model_state = rest.pop("model")
    elif rest and all(isinstance(v, torch.Tensor) for v in rest.values()):
        return rest, [], {}
    else:
        raise NotACheckpointError(
            "the file holds no weights: expected a 'state_dict' or 'model' entry or a bare "
            f"state dict; found keys {sorted(rest)[:10]}"
        )
    optimizer_states = list(rest.pop(OPTIMIZER_STATES_KEY, []))
    while f"optimizer_{len(optimizer_states)}" in rest:
        optimizer_states.append(rest.pop(f"optimizer_{len(optimizer_states)}"))
    return dict(model_state), optimizer_states, rest
