"""State dicts of a sharded engine and its optimizers, under the original parameter names.

Two shapes of the same schema:

- sharded: every trainable parameter is a ``FlatRange`` (this rank's run of
  it); the input of a DCP save, and the target of a DCP load.
- full: every trainable parameter is a full tensor (rank 0 only), gathered one
  flat group at a time so no rank ever holds more than one group unsharded
  on top of what it keeps.

Optimizer state, in both shapes (the "name-keyed" format, like FSDP's)::

    {"state": {"layers.0.attn.wq.weight": {"exp_avg": ..., "exp_avg_sq": ..., "step": ...}},
     "param_groups": [{"lr": 3e-4, ..., "params": ["layers.0.attn.wq.weight", ...]}]}

Per-element state (a tensor with the master's shape) is split by name like the
weights; scalar state (``step``) is repeated under every name of its master.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError, name_list
from lightning_yafsdp.checkpoint.index import ShardIndex, build_index, replicated_state
from lightning_yafsdp.checkpoint.ranges import FlatRange
from lightning_yafsdp.core import YaFSDPEngine
from lightning_yafsdp.core.collectives import CommStats, all_gather_into

# -- model -------------------------------------------------------------------------------


def sharded_model_state_dict(engine: YaFSDPEngine, *, prefix: str = "") -> dict[str, Any]:
    """Original-name state dict whose trainable parameters are this rank's ``FlatRange``s.

    Ranges are views into the master shards (no copy). Tied parameters appear
    under every alias; buffers and frozen parameters are plain tensors (the
    same on every rank). Parameters this rank holds no element of are absent.
    """
    index = build_index(engine, prefix=prefix)
    state: dict[str, Any] = replicated_state(engine, prefix=prefix)
    for run in index.runs:
        local = _master_slice(index, run.master, run.master_offset, run.numel)
        for alias in run.aliases:
            state[alias] = FlatRange(run.shape, run.start, run.end, local)
    return state


@torch.no_grad()
def full_model_state_dict(
    engine: YaFSDPEngine, *, prefix: str = "", rank0_only: bool = True, cpu: bool = True
) -> dict[str, torch.Tensor]:
    """Full weights under the original names, gathered one flat group at a time.

    Collective: call on every rank. With ``rank0_only`` (default) ranks other
    than 0 return ``{}`` and keep nothing; tied aliases share one tensor.
    """
    keep = engine.rank == 0 or not rank0_only
    state = dict(replicated_state(engine, prefix=prefix)) if keep else {}
    for group in engine.groups():
        full = _gather_group(engine, group.master_shard)
        if not keep:
            continue
        for span, owners in zip(group.layout.spans, group.owners, strict=True):
            value = full[span.offset : span.end].view(span.shape).clone()
            value = value.cpu() if cpu else value
            for owner in owners:
                state[prefix + owner.name] = value
    if keep and cpu:
        state = {k: v.cpu() for k, v in state.items()}
    return state


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
    index = build_index(engine, prefix=prefix)
    buffers = replicated_state(engine, prefix=prefix)
    check_names_and_shapes(
        expected={**index.shapes, **{k: v.shape for k, v in buffers.items()}},
        found={k: torch.Size(v.shape) for k, v in state_dict.items()},
        what="model state dict",
        strict=strict,
    )
    for run in index.runs:
        source = _first_present(state_dict, run.aliases)
        if source is None:
            continue
        target = _master_slice(index, run.master, run.master_offset, run.numel)
        target.copy_(source.reshape(-1)[run.start : run.end])
    for name, buffer in buffers.items():
        if name in state_dict:
            buffer.copy_(state_dict[name])
    engine.mark_weights_changed()


# -- optimizer -----------------------------------------------------------------------------


def sharded_optimizer_state_dict(
    engine: YaFSDPEngine, optimizer: torch.optim.Optimizer, *, prefix: str = ""
) -> dict[str, Any]:
    """The optimizer's state, name-keyed, with per-element state as ``FlatRange``s (no copy)."""
    index = build_index(engine, prefix=prefix)
    state: dict[str, dict[str, Any]] = {}
    for master_id, master in enumerate(index.masters):
        for key, value in optimizer.state.get(master, {}).items():
            kind = _state_kind(key, value, master)
            if kind == "element":
                for run in index.runs:
                    if run.master == master_id:
                        local = value.detach()[run.master_offset : run.master_offset + run.numel]
                        state.setdefault(run.name, {})[key] = FlatRange(
                            run.shape, run.start, run.end, local
                        )
            else:
                for name in index.names_by_master[master_id]:
                    state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": named_param_groups(index, optimizer)}


@torch.no_grad()
def full_optimizer_state_dict(
    engine: YaFSDPEngine,
    optimizer: torch.optim.Optimizer,
    *,
    prefix: str = "",
    rank0_only: bool = True,
) -> dict[str, Any]:
    """The optimizer's state, name-keyed, with full tensors, gathered one group at a time.

    Collective. With ``rank0_only`` ranks other than 0 return ``{}``.
    """
    index = build_index(engine, prefix=prefix)
    keep = engine.rank == 0 or not rank0_only
    state: dict[str, dict[str, Any]] = {}
    masters = index.masters
    for group in engine.groups():
        master_id = next(i for i, m in enumerate(masters) if _shares_storage(m, group.master_shard))
        lo, hi = group.grad_range
        for key, value in sorted(optimizer.state.get(masters[master_id], {}).items()):
            kind = _state_kind(key, value, masters[master_id])
            if kind != "element":
                continue
            full = _gather_group(engine, value.detach()[lo:hi])
            if keep:
                for span, owners in zip(group.layout.spans, group.owners, strict=True):
                    state.setdefault(prefix + owners[0].name, {})[key] = (
                        full[span.offset : span.end].view(span.shape).clone().cpu()
                    )
    if not keep:
        return {}
    for master_id, master in enumerate(masters):
        for key, value in optimizer.state.get(master, {}).items():
            if _state_kind(key, value, master) != "element":
                if isinstance(value, torch.Tensor):
                    value = value.detach().cpu()
                for name in index.names_by_master[master_id]:
                    state.setdefault(name, {})[key] = value
    return {"state": state, "param_groups": named_param_groups(index, optimizer)}


def named_param_groups(index: ShardIndex, optimizer: torch.optim.Optimizer) -> list[dict]:
    """``optimizer.param_groups`` with each master shard replaced by its parameters' names."""
    groups = []
    for group in optimizer.param_groups:
        names: list[str] = []
        for param in group["params"]:
            master_id = index.master_index(param)
            if master_id is None:
                raise CheckpointMismatchError(
                    f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not "
                    "one of the engine's master shards; build the optimizer from "
                    "engine.param_groups() or module.parameters() after shard_model"
                )
            names += index.names_by_master[master_id]
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return groups


def load_full_optimizer_state_dict(
    engine: YaFSDPEngine,
    optimizer: torch.optim.Optimizer,
    state_dict: Mapping[str, Any],
    *,
    prefix: str = "",
) -> None:
    """Load a name-keyed full optimizer state dict (``full_optimizer_state_dict``'s output).

    Every rank needs ``state_dict``; each copies its own elements. Not collective.
    """
    index = build_index(engine, prefix=prefix)
    check_param_groups(index, optimizer, state_dict["param_groups"])
    saved = state_dict["state"]
    states: dict[int, dict[str, Any]] = {}
    for master_id, master in enumerate(index.masters):
        names = [n for n in index.names_by_master[master_id] if saved.get(n)]
        if not names:
            continue
        entry: dict[str, Any] = {}
        for key in dict.fromkeys(k for n in names for k in saved[n]):
            holders = [n for n in names if key in saved[n]]
            if _is_element_entry(saved[holders[0]][key], index.shapes[holders[0]]):
                tensor = torch.zeros_like(master, memory_format=torch.contiguous_format)
                for run in index.runs:
                    if run.master == master_id and key in saved.get(run.name, {}):
                        source = saved[run.name][key].reshape(-1)[run.start : run.end]
                        tensor[run.master_offset : run.master_offset + run.numel].copy_(source)
                entry[key] = tensor
            else:
                entry[key] = saved[holders[0]][key]
        states[master_id] = entry
    load_optimizer_state(index, optimizer, param_groups=state_dict["param_groups"], states=states)


def load_optimizer_state(
    index: ShardIndex,
    optimizer: torch.optim.Optimizer,
    *,
    param_groups: list[dict],
    states: Mapping[int, dict[str, Any]],
) -> None:
    """Hand per-master state and the saved hyperparameters to ``optimizer.load_state_dict``.

    Args:
        param_groups: the saved, name-keyed param groups; their hyperparameters
            (lr, betas, weight decay, a scheduler's ``initial_lr``...) replace the
            optimizer's, as ``load_state_dict`` does.
        states: master index -> that master's complete state (full master shape).
    """
    check_param_groups(index, optimizer, param_groups)
    order = [p for group in optimizer.param_groups for p in group["params"]]
    position = {id(p): i for i, p in enumerate(order)}
    state = {
        position[id(index.masters[m])]: entry
        for m, entry in states.items()
        if id(index.masters[m]) in position
    }
    groups = [
        {
            **{k: v for k, v in saved.items() if k != "params"},
            "params": [position[id(p)] for p in current["params"]],
        }
        for current, saved in zip(optimizer.param_groups, param_groups, strict=True)
    ]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def check_param_groups(
    index: ShardIndex, optimizer: torch.optim.Optimizer, saved_groups: list[dict]
) -> None:
    """Raise if the saved param groups do not hold the same names as the optimizer's."""
    current = named_param_groups(index, optimizer)
    if len(current) != len(saved_groups):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer has {len(saved_groups)} param groups, the current one "
            f"{len(current)}; configure the optimizer the way it was when the checkpoint was "
            "saved (e.g. the same engine.param_groups(weight_decay=...) split)"
        )
    for position, (now, then) in enumerate(zip(current, saved_groups, strict=True)):
        if list(now["params"]) != list(then["params"]):
            missing = set(now["params"]) - set(then["params"])
            extra = set(then["params"]) - set(now["params"])
            detail = (
                f"missing from the checkpoint: {name_list(missing)}; only in the checkpoint: "
                f"{name_list(extra)}"
                if missing or extra
                else "same names in a different order"
            )
            raise CheckpointMismatchError(
                f"optimizer param group {position} holds different parameters than the "
                f"checkpoint's ({detail}); the model or the optimizer's param groups changed"
            )


# -- checks ----------------------------------------------------------------------------------


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


# -- helpers -------------------------------------------------------------------------------------


def _master_slice(index: ShardIndex, master: int, offset: int, numel: int) -> torch.Tensor:
    return index.masters[master].detach()[offset : offset + numel]


def _gather_group(engine: YaFSDPEngine, local: torch.Tensor) -> torch.Tensor:
    full = torch.empty(local.numel() * engine.world_size, dtype=local.dtype, device=local.device)
    all_gather_into(full, local.contiguous(), engine.group, async_op=False, stats=CommStats())
    return full


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _state_kind(key: str, value: Any, master: torch.Tensor) -> str:
    if isinstance(value, torch.Tensor) and value.shape == master.shape and value.dim() == 1:
        return "element"
    if isinstance(value, torch.Tensor) and value.numel() > 1:
        raise CheckpointMismatchError(
            f"optimizer state {key!r} has shape {tuple(value.shape)}: neither per-element (the "
            f"master shard's {tuple(master.shape)}) nor a scalar, so it cannot be split by "
            "parameter name; optimizers with factored state are not supported by sharded "
            "checkpoints"
        )
    return "scalar"


def _is_element_entry(value: Any, shape: torch.Size) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape


def _first_present(state_dict: Mapping[str, torch.Tensor], names: Iterable[str]):
    for name in names:
        if name in state_dict:
            return state_dict[name]
    return None


def world_info(group=None) -> tuple[int, int]:
    """``(rank, world_size)`` of ``group`` (1 process when torch.distributed is not set up)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)
