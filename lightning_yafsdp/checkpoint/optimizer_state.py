"""Optimizer state of a sharded engine, per original parameter, under its name: torch's
``get_optimizer_state_dict`` layout, a full file torch's index-keyed one (docs/design.md).

[Note: index-keyed optimizer state by position]
``optimizer.state_dict()`` numbers parameters in the order the optimizer holds them,
group by group; a DDP run saves that. Under ``strategy="yafsdp"`` the model keeps its
parameters, so the same ``configure_optimizers`` builds the same groups over the same
parameters in the same order: saved index ``i`` is the current optimizer's ``i``-th
parameter. Checked, not assumed: group count and sizes, every state tensor's shape, and
the names where the file has them (a common prefix such as ``"model."`` may differ).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError, name_list
from lightning_yafsdp.checkpoint.state import StateDictType, gather_shards
from lightning_yafsdp.core import YaFSDPEngine
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor

_NOT_HYPERPARAMETERS = ("params", "param_names")
_LOAD_WEIGHTS_ONLY = "Or load the weights only (no optimizers)"


class ParamNames:
    """Every parameter of an engine by name and by object: optimizer positions to names.

    ``sharded``: every alias of a sharded parameter (its ``_placement`` says its full
    shape and this rank's elements); ``replicated``: the plain (frozen, full) ones.
    """

    def __init__(self, engine: YaFSDPEngine) -> None:
        self._names: dict[int, str] = {}
        self.sharded: dict[str, torch.nn.Parameter] = {}
        self.replicated: dict[str, torch.nn.Parameter] = {}
        for param in engine.sharded_parameters(frozen=True):
            self._names[id(param)] = param._placement.name
            self.sharded.update({alias: param for alias in param._placement.aliases})
        for name, param in engine.root.named_parameters():
            if id(param) not in self._names:
                self._names[id(param)] = name
                self.replicated[name] = param

    def name_of(self, param: torch.Tensor) -> str:
        name = self._names.get(id(param))
        if name is None:
            raise CheckpointMismatchError(
                f"the optimizer holds a tensor of shape {tuple(param.shape)} that is not a "
                "parameter of the sharded model; build the optimizer from the model's parameters "
                "after sharding (configure_optimizers, or module.parameters() after shard_model)"
            )
        return name

    def groups(self, optimizer: torch.optim.Optimizer) -> list[dict]:
        """``optimizer.param_groups`` with every hyperparameter and the parameters' names."""
        return [
            {**_hyperparameters(group), "params": [self.name_of(p) for p in group["params"]]}
            for group in optimizer.param_groups
        ]


def optimizer_entry(
    engine: YaFSDPEngine, optimizer: torch.optim.Optimizer, kind: StateDictType
) -> dict[str, Any]:
    """An optimizer's state as a checkpoint holds it: name-keyed ranges, or for ``"full"``
    torch's layout with full tensors on rank 0 (``{}`` elsewhere; collective)."""
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a Lightning/Fabric wrapper
    entry = full_optimizer_state_dict if kind == "full" else sharded_optimizer_state_dict
    return entry(engine, optimizer)


def sharded_optimizer_state_dict(
    engine: YaFSDPEngine, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The optimizer's state, name-keyed, per-element state as ``RangeShardedTensor``s (no copy)."""
    names = ParamNames(engine)
    state: dict[str, dict[str, Any]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if optimizer.state.get(param):  # never stepped: no state
                name = names.name_of(param)
                state[name] = {
                    key: _as_sharded(param, name, key, value)
                    for key, value in optimizer.state[param].items()
                }
    return {"state": state, "param_groups": names.groups(optimizer)}


@torch.no_grad()
def full_optimizer_state_dict(
    engine: YaFSDPEngine, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """torch's index-keyed layout with full tensors (CPU) and every group's
    ``"param_names"``: what ``optimizer.state_dict()`` over the unsharded model gives.
    Collective; ranks other than 0 return ``{}``."""
    full = gather_shards(engine, sharded_optimizer_state_dict(engine, optimizer))
    if engine.rank != 0:
        return {}
    position: dict[str, int] = {}
    groups = []
    for group in full["param_groups"]:
        names = list(group["params"])
        ids = [position.setdefault(name, len(position)) for name in names]
        groups.append({**_hyperparameters(group), "params": ids, "param_names": names})
    state = {position[name]: dict(entry) for name, entry in full["state"].items()}
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def optimizer_state_to_load(
    names: ParamNames, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any]
) -> dict[str, Any]:
    """``saved`` as ``optimizer.load_state_dict`` takes it: this rank's pieces, the saved
    hyperparameters of each current group.

    ``saved``: name-keyed or torch's index-keyed layout, full or already this rank's
    pieces (``RangeShardedTensor``s). Everything is checked first: a mismatch raises
    ``CheckpointMismatchError`` before anything is modified.
    """
    current = names.groups(optimizer)
    if len(current) != len(saved["param_groups"]):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer has {len(saved['param_groups'])} param groups, the "
            f"current optimizer {len(current)}; build the param groups (configure_optimizers) "
            f"the way they were when the checkpoint was saved. {_LOAD_WEIGHTS_ONLY}"
        )
    params = [p for group in saved["param_groups"] for p in group["params"]]
    if params and all(not isinstance(p, str) for p in params):  # torch's index-keyed layout
        saved = _named_by_position(saved, current)
    hyperparameters = _restored_groups(current, saved["param_groups"])
    saved_state = saved.get("state", {})  # absent from a DCP entry of a never-stepped one
    check_state_names(names, saved_state, what="the checkpoint's optimizer state")
    position = {name: i for i, name in enumerate(n for g in current for n in g["params"])}
    state = {
        position[name]: {key: _local_value(names, name, key, v) for key, v in entry.items()}
        for name, entry in saved_state.items()
    }
    groups = []
    for group, now, hyper in zip(optimizer.param_groups, current, hyperparameters, strict=True):
        kept = {k: group[k] for k in ("param_names",) if k in group}
        groups.append({**hyper, **kept, "params": [position[n] for n in now["params"]]})
    return {"state": state, "param_groups": groups}


def check_optimizer_count(path: Any, *, saved: int, given: int) -> None:
    if given and given != saved:
        raise CheckpointMismatchError(
            f"checkpoint {path} holds the state of {saved} optimizer(s) but {given} were "
            "given; configure the same optimizers as when it was saved, or load the weights "
            "only (no optimizers)"
        )


def check_state_names(names: ParamNames, state: Mapping[str, Any], *, what: str) -> None:
    unknown = set(state) - set(names.sharded) - set(names.replicated)
    if unknown:
        raise CheckpointMismatchError(
            f"{what} has entries for parameters the model does not have: {name_list(unknown)}; "
            f"load it into the model it was saved from. {_LOAD_WEIGHTS_ONLY}"
        )


# -- helpers -------------------------------------------------------------------------------


def _as_sharded(param, name: str, key: str, value: Any) -> Any:
    """One state value as it is checkpointed: per-element -> ``RangeShardedTensor``."""
    if isinstance(value, RangeShardedTensor):
        return value.detach()
    if not isinstance(param, RangeShardedTensor) or not isinstance(value, torch.Tensor):
        return value  # a replicated parameter's state, a Python value
    if value.dim() == 0:
        return value
    if value.dim() == 1 and value.numel() == param._placement.numel:
        return RangeShardedTensor(value.detach(), param._placement, param._group)
    raise CheckpointMismatchError(
        f"optimizer state {key!r} of {name!r} has shape {tuple(value.shape)}: neither "
        f"per-element (this rank's {param._placement.numel} elements of the parameter) nor a "
        "scalar, so it cannot be saved by parameter name; optimizers with factored or "
        "shape-dependent state are not supported with strategy='yafsdp' checkpoints"
    )


def _local_value(names: ParamNames, name: str, key: str, value: Any) -> Any:
    """A saved value as this rank keeps it: per-element -> its own 1-D piece (a copy)."""
    if isinstance(value, RangeShardedTensor):
        return value._local
    if not isinstance(value, torch.Tensor):
        return value
    param = names.sharded.get(name)
    if param is None or value.dim() == 0:
        # A copy: torch keeps a loaded step tensor as it is, and one file tensor may be
        # reachable from several parameters.
        return value.clone()
    placement = param._placement
    if torch.Size(value.shape) != placement.shape:
        raise CheckpointMismatchError(
            f"optimizer state {key!r} of {name!r} in the checkpoint has shape "
            f"{tuple(value.shape)}, the parameter {tuple(placement.shape)}; the checkpoint's "
            f"optimizer was built over other parameters (or in another order). {_LOAD_WEIGHTS_ONLY}"
        )
    piece = value.reshape(-1)[placement.start : placement.end]
    return piece.to(param._local.device).clone()


def _hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS}


def _restored_groups(current: list[dict], saved_groups: list[dict]) -> list[dict]:
    """The saved groups' hyperparameters, by position, once each holds the same names."""
    for position, (now, then) in enumerate(zip(current, saved_groups, strict=True)):
        now, then = list(now["params"]), list(then["params"])
        if now == then:
            continue
        missing, extra = set(now) - set(then), set(then) - set(now)
        detail = (
            f"missing from the checkpoint: {name_list(missing)}; only in the checkpoint: "
            f"{name_list(extra)}"
            if missing or extra
            else "same names in a different order"
        )
        raise CheckpointMismatchError(
            f"optimizer param group {position} holds different parameters than the "
            f"checkpoint's ({detail}); the model or the optimizer's param groups changed "
            "since it was saved"
        )
    return [_hyperparameters(group) for group in saved_groups]


def _named_by_position(saved: Mapping[str, Any], current: list[dict]) -> dict:
    """torch's index-keyed layout mapped onto the current optimizer's names (see the note)."""
    saved_groups = saved["param_groups"]
    state = {}
    for position, (now, then) in enumerate(zip(current, saved_groups, strict=True)):
        if len(now["params"]) != len(then["params"]):
            raise CheckpointMismatchError(
                f"optimizer param group {position} holds {len(now['params'])} parameters, the "
                f"checkpoint's {len(then['params'])}; configure_optimizers must build the same "
                f"groups as the run that saved it. {_LOAD_WEIGHTS_ONLY}"
            )
        saved_names = then.get("param_names") or now["params"]
        for index, (name, then_name) in enumerate(zip(now["params"], saved_names, strict=True)):
            # A LightningModule's names ("model.layers.0.w") vs an inner module's ("layers.0.w").
            if not (f".{then_name}".endswith(f".{name}") or f".{name}".endswith(f".{then_name}")):
                raise CheckpointMismatchError(
                    f"optimizer param group {position}, parameter {index}: the checkpoint has "
                    f"{then_name!r} there, the current optimizer {name!r}; build the param "
                    "groups over the same parameters in the same order as the run that saved it"
                )
        for name, param_id in zip(now["params"], then["params"], strict=True):
            if param_id in saved["state"]:
                state[name] = dict(saved["state"][param_id])
    groups = [{**then, "params": now["params"]} for now, then in zip(current, saved_groups)]
    return {"state": state, "param_groups": groups}
