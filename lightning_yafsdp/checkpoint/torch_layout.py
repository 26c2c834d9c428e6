"""torch's own optimizer layout (index-keyed), to and from our name-keyed one.

``optimizer.state_dict()`` numbers parameters in the order the optimizer holds
them, group by group: ``{"state": {i: {...}}, "param_groups": [{..., "params":
[i, ...]}]}``. A DDP (or single-device) run saves that; torch >= 2.6 adds
``"param_names"`` to each group when the optimizer was built from
``named_parameters()``. Our full single-file checkpoints write the same layout,
always with ``"param_names"``, so DDP loads them with ``optimizer.load_state_dict``.

[Note: index-keyed optimizer state by position]
Under ``strategy="yafsdp"`` the model keeps its parameters, so the same
``configure_optimizers`` builds the same groups over the same parameters in the
same order as under DDP: saved index ``i`` is the ``i``-th parameter of the
current optimizer, group by group. That is checked, not assumed: the group
count and each group's size, every state tensor's shape against its
parameter's, and the names where the checkpoint has them (``"param_names"``;
a common prefix such as ``"model."`` may differ).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from lightning_yafsdp.checkpoint.errors import CheckpointMismatchError


def to_torch_layout(named: Mapping[str, Any]) -> dict[str, Any]:
    """Name-keyed optimizer state -> torch's index-keyed layout with ``"param_names"``."""
    position: dict[str, int] = {}
    groups = []
    for group in named["param_groups"]:
        names = list(group["params"])
        for name in names:
            position.setdefault(name, len(position))
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        groups.append({**hyper, "params": [position[n] for n in names], "param_names": names})
    state = {position[name]: dict(entry) for name, entry in named["state"].items()}
    return {"state": dict(sorted(state.items())), "param_groups": groups}


def is_index_keyed(state: Mapping[str, Any]) -> bool:
    """True for torch's layout (integer parameter ids), False for a name-keyed one."""
    params = [p for group in state.get("param_groups", []) for p in group["params"]]
    return bool(params) and all(not isinstance(p, str) for p in params)


def named_from_torch_layout(
    saved: Mapping[str, Any],
    current_groups: list[dict],
    shapes: Mapping[str, torch.Size],
) -> dict[str, Any]:
    """Map torch's layout onto the current optimizer's names by position (see the note).

    Args:
        saved: ``{"state": {i: ...}, "param_groups": [...]}`` from a checkpoint.
        current_groups: the current optimizer's groups with parameter names
            (``named_param_groups``).
        shapes: full shape of every parameter, by name.

    Returns:
        The name-keyed form, ``"param_groups"`` being the saved groups' hyperparameters
        with the current names.

    Raises:
        CheckpointMismatchError: another group count or size, a name or shape mismatch.
    """
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(current_groups):
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer state (index-keyed, as DDP saves it) has "
            f"{len(saved_groups)} param groups, the current optimizer {len(current_groups)}; "
            "configure_optimizers must build the same groups as the run that saved it. Or "
            "load the weights only (no optimizers)"
        )
    saved_state = saved["state"]
    state: dict[str, dict[str, Any]] = {}
    for position, (now, then) in enumerate(zip(current_groups, saved_groups, strict=True)):
        names, ids = list(now["params"]), list(then["params"])
        if len(names) != len(ids):
            raise CheckpointMismatchError(
                f"optimizer param group {position} holds {len(names)} parameters, the "
                f"checkpoint's {len(ids)}; configure_optimizers must build the same groups as "
                "the run that saved it. Or load the weights only (no optimizers)"
            )
        _check_names(position, names, then.get("param_names"))
        for name, param_id in zip(names, ids, strict=True):
            entry = saved_state.get(param_id)
            if entry is None:
                continue
            _check_shapes(name, param_id, entry, shapes[name])
            state[name] = dict(entry)
    groups = [
        {**{k: v for k, v in then.items() if k not in ("params", "param_names")}, "params": n}
        for then, n in zip(saved_groups, (g["params"] for g in current_groups), strict=True)
    ]
    return {"state": state, "param_groups": groups}


def _check_names(position: int, names: list[str], saved_names: list[str] | None) -> None:
    if saved_names is None:
        return
    for index, (now, then) in enumerate(zip(names, saved_names, strict=True)):
        if not _same_parameter(now, then):
            raise CheckpointMismatchError(
                f"optimizer param group {position}, parameter {index}: the checkpoint has "
                f"{then!r} there, the current optimizer {now!r}; build the param groups over "
                "the same parameters in the same order as the run that saved it"
            )


def _same_parameter(a: str, b: str) -> bool:
    # A LightningModule's names ("model.layers.0.w") vs an inner module's ("layers.0.w").
    return a == b or a.endswith("." + b) or b.endswith("." + a)


def _check_shapes(name: str, param_id: Any, entry: Mapping[str, Any], shape: torch.Size) -> None:
    for key, value in entry.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shape:
            raise CheckpointMismatchError(
                f"optimizer state {key!r} of parameter #{param_id} has shape "
                f"{tuple(value.shape)}, but the parameter at that position, {name!r}, has "
                f"{tuple(shape)}; configure_optimizers must build the same groups over the "
                "same parameters in the same order as the run that saved it. Or load the "
                "weights only (no optimizers)"
            )
