"""Model state dicts of a sharded engine, under the original parameter names.

The model's own ``state_dict()`` is the source (a ``LightningModule.state_dict()``
override included): sharded parameters (trainable, and frozen ones of units) are
``RangeShardedTensor``s, buffers and replicated frozen parameters plain tensors, the same
keys on every rank. Two shapes of it:

- sharded: as it is; a ``RangeShardedTensor`` speaks DCP's protocol ([Note: element
  ranges as boxes]), so the dict is the input of a DCP save and the target of a DCP load.
- full: every ``RangeShardedTensor`` becomes its full tensor on rank 0, gathered
  one tensor at a time ([Note: ragged gather of element ranges]).

Optimizer state dicts are in ``optimizer_state.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError, name_list
from lightning_yafsdp.checkpoint.gather import gather_full, world_info
from lightning_yafsdp.core import YaFSDPEngine
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor

__all__ = [
    "check_names_and_shapes",
    "check_writable",
    "full_model_state_dict",
    "load_full_model_state_dict",
    "module_state",
    "sharded_model_state_dict",
    "gather_shards",
    "world_info",
]


def module_state(engine: YaFSDPEngine, *, prefix: str = "") -> dict[str, Any]:
    """``engine.root.state_dict()`` (overrides honoured) with ``prefix`` added to every key.

    Values are ``RangeShardedTensor``s (detached views of the parameters) and plain
    tensors (buffers, frozen parameters); tied parameters appear under every alias.
    """
    return {prefix + name: value for name, value in engine.root.state_dict().items()}


def gather_shards(engine: YaFSDPEngine, tree: Any, *, rank0_only: bool = True, **kwargs) -> Any:
    """``gather_full`` of ``tree`` over the shard group (collective).

    [Note: hybrid sharding] Every replica holds the same shards, so the shard group
    holding rank 0 (replica 0; its first rank is rank 0) gathers everything rank 0
    needs. With ``rank0_only`` the other replicas skip the gather and get ``tree``
    back unchanged.
    """
    if rank0_only and engine.mesh.replicate_rank != 0:
        return tree
    return gather_full(tree, group=engine.shard_group, rank0_only=rank0_only, **kwargs)


def sharded_model_state_dict(engine: YaFSDPEngine, *, prefix: str = "") -> dict[str, Any]:
    """The model's state dict, sharded parameters as ``RangeShardedTensor``s (no copy).

    What ``dcp.save`` takes and ``dcp.load`` reads into, with DCP's default planners.
    """
    return module_state(engine, prefix=prefix)


@torch.no_grad()
def full_model_state_dict(
    engine: YaFSDPEngine, *, prefix: str = "", rank0_only: bool = True, cpu: bool = True
) -> dict[str, torch.Tensor]:
    """Full weights under the original names, gathered one tensor at a time.

    Collective: call on every rank. With ``rank0_only`` (default) ranks other
    than 0 return ``{}``; tied aliases share one tensor.
    """
    full = gather_shards(
        engine, module_state(engine, prefix=prefix), rank0_only=rank0_only, cpu=cpu
    )
    if rank0_only and engine.rank != 0:
        return {}
    return {k: v.detach().cpu() if cpu else v.detach() for k, v in full.items()}


@torch.no_grad()
def load_full_model_state_dict(
    engine: YaFSDPEngine,
    state_dict: Mapping[str, torch.Tensor],
    *,
    prefix: str = "",
    strict: bool = True,
) -> None:
    """Copy a plain full state dict (e.g. a DDP checkpoint's ``"state_dict"``) into the shards.

    Every rank needs ``state_dict`` (a memory-mapped ``torch.load`` keeps that
    cheap) and copies only the elements it owns. Not collective.

    Raises:
        CheckpointMismatchError: missing or unexpected names (with ``strict``),
            or a shape that differs from the model's; nothing is modified then.
    """
    targets = module_state(engine, prefix=prefix)
    check_names_and_shapes(
        expected={k: torch.Size(v.shape) for k, v in targets.items()},
        found={k: torch.Size(v.shape) for k, v in state_dict.items()},
        what="model state dict",
        strict=strict,
    )
    check_writable(engine, targets)
    for name, target in targets.items():
        if name not in state_dict:
            continue
        source = state_dict[name]
        if isinstance(target, RangeShardedTensor):
            placement = target._placement
            target._local.copy_(source.reshape(-1)[placement.start : placement.end])
        else:
            target.copy_(source)
    engine.mark_weights_changed()


# -- checks ----------------------------------------------------------------------------------


def check_writable(engine: YaFSDPEngine, targets: Mapping[str, Any]) -> None:
    """Raise if a sharded value of ``targets`` is not a view of one of the engine's parameters.

    A ``state_dict()`` override may return computed tensors; loading into those
    would change nothing and report success.
    """
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


def check_names_and_shapes(
    *,
    expected: Mapping[str, torch.Size],
    found: Mapping[str, torch.Size],
    what: str,
    strict: bool = True,
) -> None:
    """Raise ``CheckpointMismatchError`` listing missing/unexpected names and shape mismatches."""
    problems = []
    missing = set(expected) - set(found)
    unexpected = set(found) - set(expected)
    if strict and missing:
        problems.append(f"missing from the checkpoint: {name_list(missing)}")
    if strict and unexpected:
        problems.append(f"not in the model: {name_list(unexpected)}")
    wrong = [
        f"{name!r}: checkpoint {tuple(found[name])}, model {tuple(expected[name])}"
        for name in sorted(set(expected) & set(found))
        if torch.Size(found[name]) != torch.Size(expected[name])
    ]
    if wrong:
        problems.append("shape mismatch: " + "; ".join(wrong[:10]))
    if problems:
        raise CheckpointMismatchError(
            f"the {what} does not match the model: " + ". ".join(problems) + ". Load it into "
            "the model it was saved from (same architecture and config)"
            + ("" if not strict else ", or pass strict=False to skip missing/unexpected names")
        )
