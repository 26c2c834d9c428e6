"""Full (single-file) checkpoints: written by rank 0, read by every rank.

A full checkpoint is an ordinary ``torch.save`` file: ``{"state_dict": {name:
full tensor}, "optimizer_states": [name-keyed optimizer state], ...extra}``,
the layout of a Lightning checkpoint, so ``LightningModule.load_from_checkpoint``
and ``model.load_state_dict(ckpt["state_dict"])`` accept it. Saving gathers
one flat group at a time and only rank 0 keeps what it gathered.

Reading accepts more than we write: a Lightning/DDP checkpoint (index-keyed
torch optimizer state), Lightning's consolidated FSDP file (``"model"`` and
``optimizer_<i>`` keys) and a bare ``torch.save(model.state_dict())``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_yafsdp.checkpoint import atomic
from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError, NotACheckpointError
from lightning_yafsdp.checkpoint.index import ShardIndex, build_index
from lightning_yafsdp.checkpoint.sharded import FORMAT_KEY, describe_non_checkpoint, format_info
from lightning_yafsdp.checkpoint.state import (
    full_model_state_dict,
    full_optimizer_state_dict,
    load_full_model_state_dict,
    load_full_optimizer_state_dict,
)
from lightning_yafsdp.core import YaFSDPEngine

STATE_DICT_KEY = "state_dict"
OPTIMIZER_STATES_KEY = "optimizer_states"


def save_full(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    extra: Mapping[str, Any] | None = None,
    prefix: str = "",
    model_state: Mapping[str, torch.Tensor] | None = None,
    optimizer_states: Sequence[Mapping[str, Any]] | None = None,
) -> None:
    """Write one ``torch.save`` file with full weights and optimizer state (rank 0 writes).

    Collective (the gathers). Atomic: written to a hidden sibling, fsynced, renamed.

    Args:
        model_state / optimizer_states: ready full state dicts (rank 0's matter;
            other ranks may pass ``{}``); gathered from ``engine`` when None.
        extra: saved alongside (``{**extra, "state_dict": ..., "optimizer_states": ...}``).

    Raises:
        CheckpointSaveError: on every rank when rank 0 failed to write.
    """
    if model_state is None:
        model_state = full_model_state_dict(engine, prefix=prefix)
    if optimizer_states is None:
        optimizer_states = [
            full_optimizer_state_dict(engine, opt, prefix=prefix) for opt in optimizers
        ]
    info = format_info(engine, "full", len(optimizer_states), prefix=prefix)
    checkpoint = {
        **dict(extra or {}),
        STATE_DICT_KEY: dict(model_state),
        OPTIMIZER_STATES_KEY: list(optimizer_states),
        FORMAT_KEY: info,
    }
    atomic.atomic_file(path, lambda tmp: torch.save(checkpoint, tmp), group=engine.group)


def load_full(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    prefix: str = "",
    strict: bool = True,
) -> dict[str, Any]:
    """Load a single-file checkpoint into ``engine`` and ``optimizers`` (every rank reads it).

    The file is memory-mapped, so each rank touches only the pages of its own
    elements. Not collective.

    Returns:
        The checkpoint without its weights and optimizer states.

    Raises:
        NotACheckpointError: not a file ``torch.load`` can read.
        CheckpointMismatchError: names, shapes or optimizers do not match.
    """
    path = Path(path)
    if not path.is_file():
        raise NotACheckpointError(describe_non_checkpoint(path))
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as exc:
        raise NotACheckpointError(
            f"{str(path)!r} is not a checkpoint torch.load can read ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(checkpoint, dict):
        raise NotACheckpointError(f"{str(path)!r} holds a {type(checkpoint).__name__}, not a dict")
    model_state, optimizer_states, rest = split_full_checkpoint(checkpoint)
    if optimizers and len(optimizer_states) != len(optimizers):
        raise CheckpointMismatchError(
            f"checkpoint {path} holds the state of {len(optimizer_states)} optimizer(s) but "
            f"{len(optimizers)} were given; configure the same optimizers as when it was saved, "
            "or load the weights only (no optimizers)"
        )
    load_full_model_state_dict(engine, model_state, prefix=prefix, strict=strict)
    index = build_index(engine, prefix=prefix)
    for optimizer, state in zip(optimizers, optimizer_states, strict=False):
        if not _is_name_keyed(state):
            state = name_keyed_from_unsharded(state, index, optimizer, list(model_state))
        load_full_optimizer_state_dict(engine, optimizer, state, prefix=prefix)
    return rest


def split_full_checkpoint(checkpoint: dict) -> tuple[dict, list, dict]:
    """``(weights, optimizer states, the rest)`` of any supported single-file layout."""
    rest = dict(checkpoint)
    if STATE_DICT_KEY in rest:
        model_state = rest.pop(STATE_DICT_KEY)
    elif "model" in rest and isinstance(rest["model"], Mapping):
        model_state = rest.pop("model")
    elif rest and all(isinstance(v, torch.Tensor) for v in rest.values()):
        return rest, [], {}
    else:
        raise NotACheckpointError(
            "the file holds no weights: expected a 'state_dict' or 'model' entry or a bare "
            f"state dict; found keys {sorted(rest)[:10]}"
        )
    optimizer_states = list(rest.pop(OPTIMIZER_STATES_KEY, []))
    index = 0
    while f"optimizer_{index}" in rest:
        optimizer_states.append(rest.pop(f"optimizer_{index}"))
        index += 1
    return dict(model_state), optimizer_states, rest


def name_keyed_from_unsharded(
    state: Mapping[str, Any],
    index: ShardIndex,
    optimizer: torch.optim.Optimizer,
    state_dict_names: Sequence[str],
) -> dict[str, Any]:
    """Convert an unsharded model's optimizer state (DDP, single process) to the name-keyed form.

    torch numbers parameters in the order the optimizer was given them; we assume
    that order is the model's registration order (``AdamW(model.parameters())``,
    one param group), which is what the checkpoint's ``state_dict`` key order
    gives. Every state tensor's shape is checked against its parameter.
    Hyperparameters come from the saved group and apply to every current group.

    Raises:
        CheckpointMismatchError: several saved param groups, a count or shape mismatch.
    """
    groups = state["param_groups"]
    if len(groups) != 1:
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer state is index-keyed (an unsharded run's) with "
            f"{len(groups)} param groups; only a single-group optimizer over model.parameters() "
            "can be mapped to parameter names. Load the weights only (no optimizers)"
        )
    names = [n for n in dict.fromkeys(state_dict_names) if n in index.aliases]
    ids = list(groups[0]["params"])
    if len(ids) != len(names):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer holds {len(ids)} parameters, the model has "
            f"{len(names)} trainable ones; load the weights only (no optimizers)"
        )
    named_state: dict[str, dict[str, Any]] = {}
    for param_id, name in zip(ids, names, strict=True):
        entry = dict(state["state"].get(param_id, {}))
        for key, value in entry.items():
            is_element = isinstance(value, torch.Tensor) and value.dim() > 0
            if is_element and value.shape != index.shapes[name]:
                raise CheckpointMismatchError(
                    f"optimizer state {key!r} of parameter #{param_id} has shape "
                    f"{tuple(value.shape)} but the parameter it maps to by order, {name!r}, has "
                    f"{tuple(index.shapes[name])}; the optimizer was not built over "
                    "model.parameters() in order. Load the weights only (no optimizers)"
                )
        named_state[name] = entry
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    from lightning_yafsdp.checkpoint.state import named_param_groups

    current = named_param_groups(index, optimizer)
    return {
        "state": named_state,
        "param_groups": [{**hyper, "params": group["params"]} for group in current],
    }


def _is_name_keyed(state: Mapping[str, Any]) -> bool:
    params = [p for group in state.get("param_groups", []) for p in group["params"]]
    return all(isinstance(p, str) for p in params)
