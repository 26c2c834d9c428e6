"""A sharded model's and its optimizers' entries in a checkpoint, for either kind of save.

Shared by the Trainer strategy and Fabric's ``fabric.save`` (``fabric_format.py``).

``"sharded"``: the module's own ``state_dict()`` (an override is honoured), whose
trainable values are ``RangeShardedTensor``s written as this rank's ranges, and the
name-keyed optimizer state as ranges. ``"full"``: whole tensors gathered to rank 0 one
group at a time (``{}`` on the other ranks). Both are collective for ``"full"``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import nn

from lightning_yafsdp.checkpoint.optimizer_state import (
    full_optimizer_state_dict,
    sharded_optimizer_state_dict,
)
from lightning_yafsdp.checkpoint.state import full_model_state_dict
from lightning_yafsdp.core import YaFSDPEngine

StateDictType = Literal["sharded", "full"]


def model_entry(engine: YaFSDPEngine, module: nn.Module, kind: StateDictType) -> dict[str, Any]:
    if kind == "full":
        return full_model_state_dict(engine)
    return module.state_dict()


def optimizer_entry(
    engine: YaFSDPEngine, optimizer: torch.optim.Optimizer, kind: StateDictType
) -> dict[str, Any]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # a Lightning/Fabric wrapper
    if kind == "full":
        return full_optimizer_state_dict(engine, optimizer)
    return sharded_optimizer_state_dict(engine, optimizer)
