"""Optimizer state of a sharded engine, per original parameter, under its name.

After ``shard_model`` an optimizer holds the sharded parameters (``RangeShardedTensor``)
themselves, in as many param groups as the user made. Its state is per parameter:
``optimizer.state[p] = {"exp_avg": <1-D, this rank's elements of p>, "step": <scalar>}``
(a value may also be a ``RangeShardedTensor``; its ``_local`` is the piece). The
checkpoint form is name-keyed, as FSDP's::

    {"state": {"layers.0.attn.wq.weight": {"exp_avg": <sharded>, ..., "step": tensor(3.)}},
     "param_groups": [{"lr": 3e-4, "weight_decay": 0.1, ..., "params": ["layers.0...", ...]},
                      {"lr": 3e-4, "weight_decay": 0.0, ..., "params": [...]}]}

Per-element state is a ``RangeShardedTensor`` laid out as its parameter (sharded) or
a full tensor (full); scalars are as torch keeps them. That is the layout of torch's
``get_optimizer_state_dict`` for FSDP2, so either reads the other's DCP entries.
Every group keeps all its hyperparameters; loading restores them by position after
checking that each group holds the same names. Full single-file checkpoints use
torch's own index-keyed layout instead (``torch_layout.py``), so a DDP run can load them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError, name_list
from lightning_yafsdp.checkpoint.index import ShardIndex, build_index
from lightning_yafsdp.checkpoint.state import gather_shards
from lightning_yafsdp.checkpoint.torch_layout import to_torch_layout
from lightning_yafsdp.checkpoint.trees import map_leaves
from lightning_yafsdp.core import YaFSDPEngine
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor

_NOT_HYPERPARAMETERS = ("params", "param_names")


def sharded_optimizer_state_dict(
    engine: YaFSDPEngine, optimizer: torch.optim.Optimizer, *, prefix: str = ""
) -> dict[str, Any]:
    """The optimizer's state, name-keyed, per-element state as ``RangeShardedTensor``s (no copy)."""
    index = build_index(engine, prefix=prefix)
    state: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = optimizer.state.get(param)
            if not entry:
                continue  # never stepped (no grad yet, or unused everywhere): no state
            name = _name_of(index, param)
            state[name] = {
                key: _sharded_value(index, param, name, key, value) for key, value in entry.items()
            }
    return {"state": state, "param_groups": named_param_groups(index, optimizer)}


@torch.no_grad()
def full_optimizer_state_dict(
    engine: YaFSDPEngine,
    optimizer: torch.optim.Optimizer,
    *,
    prefix: str = "",
    rank0_only: bool = True,
) -> dict[str, Any]:
    """The optimizer's state in torch's index-keyed layout with full tensors (CPU).

    ``{"state": {i: {key: full tensor}}, "param_groups": [{..., "params": [i, ...],
    "param_names": [name, ...]}]}``: what ``optimizer.state_dict()`` of the same
    optimizer over the unsharded model gives, plus every group's parameter names.
    Collective. With ``rank0_only`` ranks other than 0 return ``{}``.
    """
    named = sharded_optimizer_state_dict(engine, optimizer, prefix=prefix)
    return full_from_sharded(named, engine, rank0_only=rank0_only)


def full_from_sharded(
    named: Mapping[str, Any], engine: YaFSDPEngine, *, rank0_only: bool = True
) -> dict[str, Any]:
    """Gather a name-keyed sharded optimizer state into torch's layout (collective)."""
    full = gather_shards(engine, named, rank0_only=rank0_only)
    if rank0_only and engine.rank != 0:
        return {}
    full = map_leaves(full, lambda _, v: v.detach().cpu() if isinstance(v, torch.Tensor) else v)
    return to_torch_layout(full)


def named_param_groups(index: ShardIndex, optimizer: torch.optim.Optimizer) -> list[dict]:
    """``optimizer.param_groups`` with every hyperparameter and the names of the parameters."""
    return [
        {
            **{k: v for k, v in group.items() if k != "params"},
            "params": [_name_of(index, p) for p in group["params"]],
        }
        for group in optimizer.param_groups
    ]


# -- load --------------------------------------------------------------------------------------


def load_full_optimizer_state_dict(
    engine: YaFSDPEngine,
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    *,
    prefix: str = "",
) -> None:
    """Load a name-keyed optimizer state dict with full tensors (FSDP's layout).

    Every rank needs ``state_dict``; each keeps its own elements. Not collective.

    Raises:
        CheckpointMismatchError: other param groups, unknown names, a state tensor
            whose shape is not its parameter's; nothing is modified then.
    """
    index = build_index(engine, prefix=prefix)
    groups, states = local_optimizer_state(index, optimizer, state_dict)
    load_optimizer_state(index, optimizer, param_groups=groups, states=states)


def local_optimizer_state(
    index: ShardIndex,
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
) -> tuple[list[dict], dict[str, dict[str, Any]]]:
    """Checked hyperparameters per current group and this rank's per-parameter state.

    Raises:
        CheckpointMismatchError: as ``load_full_optimizer_state_dict``; nothing is modified.
    """
    groups = restored_param_groups(index, optimizer, state_dict["param_groups"])
    check_state_names(index, state_dict["state"], what="the checkpoint's optimizer state")
    states: dict[str, dict[str, Any]] = {}
    for name, entry in state_dict["state"].items():
        param = _param_named(index, name)
        states[name] = {key: _local_value(index, param, name, key, v) for key, v in entry.items()}
    return groups, states


def load_optimizer_state(
    index: ShardIndex,
    optimizer: torch.optim.Optimizer,
    *,
    param_groups: list[dict],
    states: Mapping[str, dict[str, Any]],
) -> None:
    """Hand per-parameter state and hyperparameters to ``optimizer.load_state_dict``.

    Args:
        param_groups: one dict of hyperparameters per current group, in order
            (``restored_param_groups``); they replace the optimizer's.
        states: name -> that parameter's state, per-element values already this
            rank's 1-D pieces.
    """
    order = [p for group in optimizer.param_groups for p in group["params"]]
    position = {_name_of(index, p): i for i, p in enumerate(order)}
    groups, cursor = [], 0
    for current, hyper in zip(optimizer.param_groups, param_groups, strict=True):
        size = len(current["params"])
        kept = {k: current[k] for k in ("param_names",) if k in current}
        groups.append({**hyper, **kept, "params": list(range(cursor, cursor + size))})
        cursor += size
    state = {position[name]: entry for name, entry in states.items()}
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def restored_param_groups(
    index: ShardIndex,
    optimizer: torch.optim.Optimizer,
    saved_groups: list[dict],
) -> list[dict]:
    """The hyperparameters each current group gets from the saved groups (names checked).

    The same number of groups, each with the same names in the same order;
    hyperparameters by position.
    """
    current = named_param_groups(index, optimizer)
    if len(current) != len(saved_groups):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, the current one "
            f"{len(current)}; configure the optimizer's param groups the way they were when "
            "the checkpoint was saved"
        )
    for position, (now, then) in enumerate(zip(current, saved_groups, strict=True)):
        _check_same_names(position, list(now["params"]), list(then["params"]))
    return [_hyperparameters(group) for group in saved_groups]


def check_state_names(index: ShardIndex, state: Mapping[str, Any], *, what: str) -> None:
    known = set(index.shapes) | set(index.replicated)
    unknown = set(state) - known
    if unknown:
        raise CheckpointMismatchError(
            f"{what} has entries for parameters the model does not have: {name_list(unknown)}; "
            "load it into the model it was saved from, or load the weights only (no optimizers)"
        )


# -- helpers -------------------------------------------------------------------------------


def _name_of(index: ShardIndex, param: torch.Tensor) -> str:
    name = index.name_of(param)
    if name is None:
        raise CheckpointMismatchError(
            f"the optimizer holds a tensor of shape {tuple(param.shape)} that is not a parameter "
            "of the sharded model; build the optimizer from the model's parameters after "
            "sharding (configure_optimizers, or module.parameters() after shard_model)"
        )
    return name


def _param_named(index: ShardIndex, name: str) -> torch.Tensor:
    entry = index.entry_named(name)
    return entry.param if entry is not None else index.replicated[name]


def _sharded_value(index: ShardIndex, param, name: str, key: str, value: Any) -> Any:
    """One state value as it is checkpointed: per-element -> ``RangeShardedTensor``."""
    if isinstance(value, RangeShardedTensor):
        return value.detach()
    entry = index.entry_of(param)
    if entry is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value  # a replicated parameter's state, a scalar, a Python value
    if value.dim() == 1 and value.numel() == entry.numel:
        return RangeShardedTensor(value.detach(), param._placement, param._group)
    raise CheckpointMismatchError(
        f"optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}: neither "
        f"per-element (this rank's {entry.numel} elements of the parameter) nor a scalar, so "
        "it cannot be saved by parameter name; optimizers with factored or shape-dependent "
        "state are not supported with strategy='yafsdp' checkpoints"
    )


def _local_value(index: ShardIndex, param, name: str, key: str, value: Any) -> Any:
    """A full checkpoint value as this rank keeps it: per-element -> its own 1-D piece."""
    entry = index.entry_of(param)
    if not isinstance(value, torch.Tensor):
        return value
    if entry is None or value.dim() == 0:
        # A copy: a file may hold ONE step tensor for many parameters (format 1 did), and
        # torch keeps a loaded step as it is, so every step would advance all of them.
        return value.clone()
    if torch.Size(value.shape) != entry.shape:
        raise CheckpointMismatchError(
            f"optimizer state {key!r} of {name!r} in the checkpoint has shape "
            f"{tuple(value.shape)}, the parameter {tuple(entry.shape)}; the checkpoint's "
            "optimizer was built over other parameters (or in another order). Load the "
            "weights only (no optimizers)"
        )
    return value.reshape(-1)[entry.start : entry.end].to(entry.local.device).clone()


def _hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}


def _check_same_names(position: int, now: list[str], then: list[str]) -> None:
    if now == then:
        return
    missing, extra = set(now) - set(then), set(then) - set(now)
    detail = (
        f"missing from the checkpoint: {name_list(missing)}; only in the checkpoint: "
        f"{name_list(extra)}"
        if missing or extra
        else "same names in a different order"
    )
    raise CheckpointMismatchError(
        f"optimizer param group {position} holds different parameters than the checkpoint's "
        f"({detail}); the model or the optimizer's param groups changed since it was saved"
    )
