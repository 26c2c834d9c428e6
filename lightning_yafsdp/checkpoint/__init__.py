"""Checkpoints of a sharded model: sharded (DCP) or full, atomic, loadable at any world size.

Torch-level API (the Lightning and Fabric strategies wire the same functions in)::

    from lightning_yafsdp.checkpoint import save_checkpoint, load_checkpoint

    save_checkpoint("ckpt/step-1000", engine, optimizers=[opt], extra={"step": 1000})
    extra = load_checkpoint("ckpt/step-1000", engine, optimizers=[opt])  # any world size

The layout, the guarantees and the notes: docs/design.md, "Checkpoints".
"""

from lightning_yafsdp.checkpoint.api import load_checkpoint, save_checkpoint
from lightning_yafsdp.checkpoint.consolidate import (
    consolidate_checkpoint,
    consolidated_state_dict,
    inspect_checkpoint,
)
from lightning_yafsdp.checkpoint.errors import (
    CheckpointError,
    CheckpointMismatchError,
    CheckpointSaveError,
    DamagedCheckpointError,
    NotACheckpointError,
)
from lightning_yafsdp.checkpoint.optimizer_state import (
    full_optimizer_state_dict,
    sharded_optimizer_state_dict,
)
from lightning_yafsdp.checkpoint.sharded import is_sharded_checkpoint
from lightning_yafsdp.checkpoint.state import full_model_state_dict, load_full_model_state_dict
from lightning_yafsdp.checkpoint.verify import verify_checkpoint

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "DamagedCheckpointError",
    "NotACheckpointError",
    "consolidate_checkpoint",
    "consolidated_state_dict",
    "full_model_state_dict",
    "full_optimizer_state_dict",
    "inspect_checkpoint",
    "is_sharded_checkpoint",
    "load_checkpoint",
    "load_full_model_state_dict",
    "save_checkpoint",
    "sharded_optimizer_state_dict",
    "verify_checkpoint",
]
