"""One save and one load for both kinds of checkpoint (the strategies call these two).

Every sharded tensor anywhere in what is saved (a callback's entries too) is written
sharded (``"sharded"``) or gathered to a full tensor (``"full"``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_yafsdp.checkpoint.background import BackgroundSaver
from lightning_yafsdp.checkpoint.full import load_full, save_full
from lightning_yafsdp.checkpoint.sharded import load_sharded, save_sharded
from lightning_yafsdp.checkpoint.state import StateDictType
from lightning_yafsdp.checkpoint.verify import verify_on_rank_zero
from lightning_yafsdp.core import YaFSDPEngine


def save_checkpoint(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    extra: Mapping[str, Any] | None = None,
    state_dict_type: StateDictType = "sharded",
    model_state: Mapping[str, Any] | None = None,
    optimizer_states: Sequence[Mapping[str, Any]] | None = None,
    background: BackgroundSaver | None = None,
) -> None:
    """Save ``engine``'s weights and ``optimizers``' state (collective, atomic).

    ``"sharded"`` (default): a DCP directory at ``path``, every rank writing its own
    elements (``save_sharded``; ``background``: written in that saver's thread).
    ``"full"``: one ``torch.save`` file at ``path`` written by rank 0, gathered one
    tensor at a time (``save_full``). ``extra`` (picklable) comes back from
    ``load_checkpoint``; ``model_state`` / ``optimizer_states``: see ``save_sharded``.
    """
    kwargs = dict(optimizers=optimizers, extra=extra, model_state=model_state)
    kwargs["optimizer_states"] = optimizer_states
    if state_dict_type == "sharded":
        save_sharded(path, engine, **kwargs, background=background)
    elif state_dict_type == "full":
        save_full(path, engine, **kwargs)
    else:
        raise ValueError(f"state_dict_type must be 'sharded' or 'full', got {state_dict_type!r}")


def load_checkpoint(
    path: str | os.PathLike,
    engine: YaFSDPEngine,
    *,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    strict: bool = True,
    verify_checksums: bool = True,
    expected: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load a sharded directory or a full file into ``engine`` (and ``optimizers``).

    Collective; works at any world size. Every file is first verified on rank 0 and,
    unless ``verify_checksums=False``, compared with the checksums recorded at save, so a
    damaged checkpoint is named once and nothing is loaded from it. ``path`` may also be
    a single-file checkpoint of another strategy (DDP, a consolidated one, a bare state
    dict; ``expected``: the entry names of a Fabric file, see ``split_full_checkpoint``).
    Returns ``extra`` (for a Lightning checkpoint: all but weights and optimizer states).

    Raises:
        NotACheckpointError, DamagedCheckpointError, CheckpointMismatchError.
    """
    path = Path(path)
    if not path.is_file():  # load_sharded recovers an interrupted commit, then verifies
        return load_sharded(
            path, engine, optimizers=optimizers, strict=strict, verify_checksums=verify_checksums
        )
    verify_on_rank_zero(path, group=engine.group, checksums=verify_checksums)
    return load_full(
        path, engine, optimizers=optimizers, strict=strict, expected=expected,
        verify_checksums=False,  # just compared, shared over the ranks
    )
