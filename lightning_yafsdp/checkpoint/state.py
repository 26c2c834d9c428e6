"""Model state dicts of a sharded engine: the model's own ``state_dict()``, whose sharded
parameters are ``RangeShardedTensor``s ([Note: element ranges as boxes]).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import torch
from torch import nn

from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError, name_list
from lightning_yafsdp.checkpoint.gather import gather_full
from lightning_yafsdp.core import YaFSDPEngine
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor

StateDictType = Literal["sharded", "full"]


def model_entry(engine: YaFSDPEngine, module: nn.Module, kind: StateDictType) -> dict[str, Any]:
    """The weights as a checkpoint holds them: ``module.state_dict()`` or, for ``"full"``,
    full tensors on rank 0 (``{}`` elsewhere; collective)."""
    return full_model_state_dict(engine) if kind == "full" else module.state_dict()


def gather_shards(engine: YaFSDPEngine, tree: Any, *, rank0_only: bool = True, **kwargs) -> Any:
    """``gather_full`` of ``tree`` over the shard group (collective).

    [Note: hybrid sharding] Every replica holds the same shards, so the shard group
    holding rank 0 (replica 0) gathers everything rank 0 needs. With ``rank0_only`` the
    other replicas skip the gather and get ``tree`` back unchanged.
    """
    if rank0_only and engine.mesh.replicate_rank != 0:
        return tree
    return gather_full(tree, group=engine.shard_group, rank0_only=rank0_only, **kwargs)


@torch.no_grad()
def full_model_state_dict(
    engine: YaFSDPEngine, *, rank0_only: bool = True, cpu: bool = True
) -> dict[str, torch.Tensor]:
    """Full weights under the original names, gathered one tensor at a time (collective).
    With ``rank0_only`` (default) ranks other than 0 return ``{}``."""
    full = gather_shards(engine, engine.root.state_dict(), rank0_only=rank0_only, cpu=cpu)
    if rank0_only and engine.rank != 0:
        return {}
    return {name: value.detach() for name, value in full.items()}


@torch.no_grad()
def load_full_model_state_dict(
    engine: YaFSDPEngine, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True
) -> None:
    """Copy a plain full state dict (e.g. a DDP checkpoint's ``"state_dict"``) into the shards.

    Not collective: every rank needs ``state_dict`` (a memory-mapped ``torch.load`` keeps
    that cheap) and copies only its own elements. A mismatch raises
    ``CheckpointMismatchError`` before anything is modified.
    """
    targets = engine.root.state_dict()
    check_targets(engine, targets, {k: v.shape for k, v in state_dict.items()}, strict=strict)
    for name, target in targets.items():
        if name not in state_dict:
            continue
        source = state_dict[name]
        if isinstance(target, RangeShardedTensor):
            placement = target._placement
            target, source = target._local, source.reshape(-1)[placement.start : placement.end]
        target.copy_(source)
    engine.mark_weights_changed()


def check_targets(
    engine: YaFSDPEngine,
    targets: Mapping[str, Any],
    found: Mapping[str, torch.Size],
    *,
    strict: bool,
    what: str = "model state dict",
) -> None:
    """Raise ``CheckpointMismatchError`` before a load that cannot work: missing or
    unexpected names (with ``strict``), other shapes, or sharded targets that are not
    views of the engine's parameters (a ``state_dict()`` override's computed tensors:
    loading into those would change nothing, yet succeed)."""
    expected = {k: torch.Size(v.shape) for k, v in targets.items()}
    problems = []
    if strict and set(expected) - set(found):
        problems.append(f"missing from the checkpoint: {name_list(set(expected) - set(found))}")
    if strict and set(found) - set(expected):
        problems.append(f"not in the model: {name_list(set(found) - set(expected))}")
    wrong = [
        f"{name!r}: checkpoint {tuple(found[name])}, model {tuple(expected[name])}"
        for name in sorted(set(expected) & set(found))
        if torch.Size(found[name]) != expected[name]
    ]
    if wrong:
        problems.append("shape mismatch: " + "; ".join(wrong[:10]))
    if problems:
        raise CheckpointMismatchError(
            f"the {what} does not match the model: " + ". ".join(problems) + ". Load it into "
            "the model it was saved from (same architecture and config)"
            + (", or pass strict=False to skip missing/unexpected names" if strict else "")
        )
    _check_writable(engine, targets)


def _check_writable(engine: YaFSDPEngine, targets: Mapping[str, Any]) -> None:
    storages = {
        p._local.untyped_storage().data_ptr() for p in engine.sharded_parameters(frozen=True)
    }
    foreign = [
        name
        for name, value in targets.items()
        if isinstance(value, RangeShardedTensor)
        and value._local.numel()
        and value._local.untyped_storage().data_ptr() not in storages
    ]
    if foreign:
        raise CheckpointMismatchError(
            f"the model's state_dict() returns {name_list(foreign)} as sharded tensors that are "
            "not views of its parameters (computed values?), so a checkpoint cannot be loaded "
            "into them. Return the parameters themselves (e.g. super().state_dict() entries, "
            "renamed or filtered) from the state_dict() override"
        )
