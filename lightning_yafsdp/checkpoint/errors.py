"""Checkpoint errors: each says what was found, why it cannot work, and what to do."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every checkpoint error raised by ``lightning_yafsdp.checkpoint``."""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The path does not exist or holds no checkpoint this package can read."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint does not fit the model or optimizers it is loaded into."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint file is missing, truncated or unreadable; nothing was loaded from it."""


class CheckpointSaveError(CheckpointError):
    """A save failed on at least one rank; raised on every rank, the old checkpoint kept."""


def name_list(names, limit: int = 10) -> str:
    """``a, b, c`` (sorted), cut after ``limit`` names with a count of the rest."""
    names = sorted(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    if len(names) > limit:
        shown += f" and {len(names) - limit} more"
    return shown


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message (its type's name when it has none)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
