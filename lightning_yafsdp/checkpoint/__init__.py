"""Checkpoints of a sharded model: sharded (DCP) or full, atomic, loadable at any world size.

Torch-level API (the Lightning and Fabric strategies wire the same functions in)::

    from lightning_yafsdp.checkpoint import save_checkpoint, load_checkpoint

    save_checkpoint("ckpt/step-1000", engine, optimizers=[opt], extra={"step": 1000})
    extra = load_checkpoint("ckpt/step-1000", engine, optimizers=[opt])  # any world size

A sharded checkpoint (``sharded.py``) is a ``torch.distributed.checkpoint`` directory
whose tensors have the original names and full shapes, written through DCP's own
protocol with DCP's default planners ([Note: element ranges as boxes]), plus ``meta.pt``:
the layout of Lightning's FSDP strategy. Optimizer state is per parameter, by name
(``optimizer_state.py``); a full file (``full.py``) uses torch's own layouts, so DDP
loads it. Saves are atomic (``atomic.py``), optionally in the background
(``background.py``); every reader first verifies the files (``verify.py``).
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
from lightning_yafsdp.checkpoint.full import load_full, save_full
from lightning_yafsdp.checkpoint.optimizer_state import (
    full_optimizer_state_dict,
    sharded_optimizer_state_dict,
)
from lightning_yafsdp.checkpoint.sharded import is_sharded_checkpoint, load_sharded, save_sharded
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
    "load_full",
    "load_full_model_state_dict",
    "load_sharded",
    "save_checkpoint",
    "save_full",
    "save_sharded",
    "sharded_optimizer_state_dict",
    "verify_checkpoint",
]
