"""Full (single-file) checkpoints: written by rank 0, read by every rank.

A full checkpoint is an ordinary ``torch.save`` file in the layout of a Lightning DDP
checkpoint, ``{"state_dict": {name: full tensor}, "optimizer_states": [torch's optimizer
layout], ...extra}``, so ``load_from_checkpoint``, ``model.load_state_dict(ckpt["state_dict"])``
and a DDP run's ``optimizer.load_state_dict(ckpt["optimizer_states"][0])`` accept it.
Fabric's layout keeps every entry under the user's key instead (``fabric_keys``), as
Fabric's other strategies write it. Saving gathers every sharded tensor anywhere in the
dict one at a time, and only rank 0 keeps them ([Note: ragged gather of element ranges]).

Reading also takes a DDP/Lightning checkpoint (index-keyed optimizer state, [Note:
index-keyed optimizer state by position]), Lightning's consolidated FSDP file
(``"model"`` and ``optimizer_<i>``) and a bare ``torch.save(model.state_dict())``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.checkpoint.errors import NotACheckpointError
from lightning_yafsdp.checkpoint.gather import sharded_leaves, tensor_bytes
from lightning_yafsdp.checkpoint.optimizer_state import (
    ParamNames,
    check_optimizer_count,
    optimizer_state_to_load,
    sharded_optimizer_state_dict,
    to_torch_layout,
)
from lightning_yafsdp.checkpoint.sharded import FORMAT_KEY, format_info
from lightning_yafsdp.checkpoint.state import (
    gather_shards,
    load_full_model_state_dict,
    module_state,
)
from lightning_yafsdp.checkpoint.verify import describe_non_checkpoint, verify_checkpoint
from lightning_yafsdp.core import YaFSDPEngine

STATE_DICT_KEY = "state_dict"
OPTIMIZER_STATES_KEY = "optimizer_states"
# Written by fabric.save: {"module": key, "optimizers": [key, ...], "entries": [...]}, the
# names under which the weights and optimizer states sit ([Note: one checkpoint format
# for Fabric and the Trainer] in fabric_format.py).
FABRIC_KEYS = "yafsdp_fabric"


def save_full(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    extra: Mapping[str, Any] | None = None,
    model_state: Mapping[str, Any] | None = None,
    optimizer_states: Sequence[Mapping[str, Any]] | None = None,
    fabric_keys: Mapping[str, Any] | None = None,
) -> None:
    """Write one ``torch.save`` file with full weights and optimizer state (rank 0 writes).

    Collective (the gathers) and atomic. ``model_state`` and ``optimizer_states`` (one
    per optimizer) may be sharded (gathered and converted here) or already full on rank 0
    (torch's optimizer layout); sharded tensors in ``extra`` are gathered too.
    ``fabric_keys``: Fabric's layout instead (every entry under the user's key, recorded
    as ``FABRIC_KEYS``), which Fabric's other strategies and litgpt's scripts read.
    Raises ``CheckpointSaveError`` on every rank when rank 0 failed to write.
    """
    if model_state is None:
        model_state = module_state(engine)
    if optimizer_states is None:
        optimizer_states = [sharded_optimizer_state_dict(engine, opt) for opt in optimizers]
    # Lightning's layout: the optimizers under temporary names, then in one list.
    model_key = STATE_DICT_KEY
    optimizer_keys = [f"{OPTIMIZER_STATES_KEY}.{i}" for i in range(len(optimizer_states))]
    if fabric_keys is not None:
        model_key, optimizer_keys = fabric_keys["module"], list(fabric_keys["optimizers"])
    checkpoint = {
        **dict(extra or {}),
        model_key: dict(model_state),
        **dict(zip(optimizer_keys, optimizer_states, strict=True)),
    }
    if fabric_keys is not None:
        checkpoint[FABRIC_KEYS] = dict(fabric_keys)
    sharded_optimizers = [bool(sharded_leaves(state)) for state in optimizer_states]
    checkpoint = gather_shards(engine, checkpoint)
    if engine.rank == 0:
        for key, sharded in zip(optimizer_keys, sharded_optimizers, strict=True):
            if sharded:
                checkpoint[key] = to_torch_layout(checkpoint[key])
        if fabric_keys is None:
            checkpoint[OPTIMIZER_STATES_KEY] = [checkpoint.pop(k) for k in optimizer_keys]
    checkpoint[FORMAT_KEY] = format_info(engine, "full", len(optimizer_states))
    needed = tensor_bytes(checkpoint) if engine.rank == 0 else 0  # for a failure's message
    with atomic.atomic_path(path, group=engine.group, directory=False, bytes_here=needed) as tmp:
        if engine.rank == 0:
            torch.save(checkpoint, tmp)


def load_full(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    strict: bool = True,
    expected: Mapping[str, Any] | None = None,
    verify_checksums: bool = True,
) -> dict[str, Any]:
    """Load a single-file checkpoint into ``engine`` and ``optimizers``; return the rest.

    Not collective: every rank reads the file. ``expected`` names the entries of a Fabric
    file (``split_full_checkpoint``). A mismatch raises before anything is modified.
    """
    path = Path(path)
    if not path.is_file():
        raise NotACheckpointError(describe_non_checkpoint(path))
    verify_checkpoint(path, checksums=verify_checksums)
    model_state, optimizer_states, rest = split_full_checkpoint(read_file(path), expected)
    check_optimizer_count(path, saved=len(optimizer_states), given=len(optimizers))
    # Check and map every optimizer state first: a mismatch then leaves the model untouched.
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
