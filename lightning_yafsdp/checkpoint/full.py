"""Full (single-file) checkpoints: written by rank 0, read by every rank.

A full checkpoint is an ordinary ``torch.save`` file: ``{"state_dict": {name:
full tensor}, "optimizer_states": [torch's optimizer layout], ...extra}``, the
layout of a Lightning DDP checkpoint, so ``LightningModule.load_from_checkpoint``,
``model.load_state_dict(ckpt["state_dict"])`` and a DDP run's
``optimizer.load_state_dict(ckpt["optimizer_states"][0])`` accept it. Each
optimizer group also lists its parameters' names (``"param_names"``, torch's
own key). Saving gathers sharded tensors one at a time and only rank 0 keeps them
([Note: ragged gather of element ranges]); every sharded tensor anywhere in the
dict (a callback's entries included) is written as a full tensor.

Reading accepts more than we write: a Lightning/DDP checkpoint (index-keyed
torch optimizer state, [Note: index-keyed optimizer state by position]),
Lightning's consolidated FSDP file (``"model"`` and name-keyed ``optimizer_<i>``
keys) and a bare ``torch.save(model.state_dict())``.
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
from lightning_yafsdp.checkpoint.optimizer_state import (
    load_optimizer_state,
    local_optimizer_state,
    named_param_groups,
    sharded_optimizer_state_dict,
)
from lightning_yafsdp.checkpoint.sharded import FORMAT_KEY, format_info
from lightning_yafsdp.checkpoint.state import (
    gather_shards,
    load_full_model_state_dict,
    module_state,
)
from lightning_yafsdp.checkpoint.torch_layout import (
    is_index_keyed,
    named_from_torch_layout,
    to_torch_layout,
)
from lightning_yafsdp.checkpoint.trees import has_sharded_leaves, map_leaves, tensor_bytes
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
    prefix: str = "",
    model_state: Mapping[str, Any] | None = None,
    optimizer_states: Sequence[Mapping[str, Any]] | None = None,
    fabric_keys: Mapping[str, Any] | None = None,
) -> None:
    """Write one ``torch.save`` file with full weights and optimizer state (rank 0 writes).

    Collective (the gathers). Atomic: written to a hidden sibling, fsynced, renamed.

    Args:
        model_state: the model's state dict, sharded (``RangeShardedTensor`` values,
            gathered here) or already full on rank 0; ``engine.root.state_dict()``
            when None.
        optimizer_states: per optimizer, a name-keyed sharded state
            (``sharded_optimizer_state_dict``, gathered and converted here) or torch's
            layout, already full on rank 0 (``full_optimizer_state_dict``).
        extra: saved alongside (``{**extra, "state_dict": ..., "optimizer_states": ...}``);
            sharded tensors in it are gathered too.
        fabric_keys: Fabric's layout instead (``{**extra, "model": ..., "optimizer": ...}``
            under the names it gives, recorded as ``FABRIC_KEYS``), which Fabric's other
            strategies and litgpt's scripts read.

    Raises:
        CheckpointSaveError: on every rank when rank 0 failed to write.
    """
    if model_state is None:
        model_state = module_state(engine, prefix=prefix)
    if optimizer_states is None:
        optimizer_states = [
            sharded_optimizer_state_dict(engine, opt, prefix=prefix) for opt in optimizers
        ]
    model_key, optimizer_keys = _entry_names(fabric_keys, len(optimizer_states))
    checkpoint = {
        **dict(extra or {}),
        model_key: dict(model_state),
        **dict(zip(optimizer_keys, optimizer_states, strict=True)),
    }
    if fabric_keys is not None:
        checkpoint[FABRIC_KEYS] = dict(fabric_keys)
    sharded_optimizers = [has_sharded_leaves(state) for state in optimizer_states]
    checkpoint = gather_shards(engine, checkpoint)
    if engine.rank == 0:
        checkpoint = map_leaves(checkpoint, lambda _, v: _on_cpu(v))
        for key, sharded in zip(optimizer_keys, sharded_optimizers, strict=True):
            if sharded:
                checkpoint[key] = to_torch_layout(checkpoint[key])
        if fabric_keys is None:
            checkpoint[OPTIMIZER_STATES_KEY] = [checkpoint.pop(k) for k in optimizer_keys]
    checkpoint[FORMAT_KEY] = format_info(engine, "full", len(optimizer_states), prefix=prefix)
    needed = tensor_bytes(checkpoint) if engine.rank == 0 else 0  # for a failure's message
    write = lambda tmp: torch.save(checkpoint, tmp)  # noqa: E731
    atomic.atomic_file(path, write, group=engine.group, bytes_needed=needed)


def load_full(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    prefix: str = "",
    strict: bool = True,
    expected: Mapping[str, Any] | None = None,
    verify_checksums: bool = True,
) -> dict[str, Any]:
    """Load a single-file checkpoint into ``engine`` and ``optimizers`` (every rank reads it).

    The file is memory-mapped, so each rank touches only the pages of its own
    elements. Not collective. ``expected`` names the entries of a Fabric file (see
    ``split_full_checkpoint``); ``verify_checksums``: [Note: checksums on load].

    Returns:
        The checkpoint without its weights and optimizer states.

    Raises:
        NotACheckpointError: not a file ``torch.load`` can read.
        DamagedCheckpointError: the file is truncated ([Note: verify before reading]).
        CheckpointMismatchError: names, shapes or optimizers do not match.
    """
    path = Path(path)
    if not path.is_file():
        raise NotACheckpointError(describe_non_checkpoint(path))
    verify_checkpoint(path, checksums=verify_checksums)
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
    except Exception as exc:
        raise NotACheckpointError(
            f"{str(path)!r} is not a checkpoint torch.load can read ({type(exc).__name__}: {exc})"
        ) from exc
    if not isinstance(checkpoint, dict):
        raise NotACheckpointError(f"{str(path)!r} holds a {type(checkpoint).__name__}, not a dict")
    model_state, optimizer_states, rest = split_full_checkpoint(checkpoint, expected)
    if optimizers and len(optimizer_states) != len(optimizers):
        raise CheckpointMismatchError(
            f"checkpoint {path} holds the state of {len(optimizer_states)} optimizer(s) but "
            f"{len(optimizers)} were given; configure the same optimizers as when it was saved, "
            "or load the weights only (no optimizers)"
        )
    # Check and map every optimizer state first: a mismatch then leaves the model untouched.
    index = build_index(engine, prefix=prefix)
    prepared = [
        local_optimizer_state(index, optimizer, _name_keyed(index, optimizer, state))
        for optimizer, state in zip(optimizers, optimizer_states, strict=False)
    ]
    load_full_model_state_dict(engine, model_state, prefix=prefix, strict=strict)
    for optimizer, (groups, states) in zip(optimizers, prepared, strict=False):
        load_optimizer_state(index, optimizer, param_groups=groups, states=states)
    return rest


def _entry_names(fabric_keys: Mapping[str, Any] | None, count: int) -> tuple[str, list[str]]:
    """Where the weights and each optimizer state go (temporary names in Lightning's layout)."""
    if fabric_keys is None:
        return STATE_DICT_KEY, [f"{OPTIMIZER_STATES_KEY}.{i}" for i in range(count)]
    return fabric_keys["module"], list(fabric_keys["optimizers"])


def _name_keyed(
    index: ShardIndex, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
) -> Mapping[str, Any]:
    """``state`` in the name-keyed form (torch's index-keyed layout mapped by position)."""
    if not is_index_keyed(state):
        return state
    shapes = {**index.shapes, **{n: p.shape for n, p in index.replicated.items()}}
    return named_from_torch_layout(state, named_param_groups(index, optimizer), shapes)


def _on_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


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
