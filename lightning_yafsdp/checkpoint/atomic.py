"""Atomic checkpoint writes: a checkpoint becomes visible only when complete.

[Note: atomic commit]
Every save writes into a hidden sibling, ``.<name>.yafsdp-tmp``, in the target's
directory (same filesystem, so the final rename is atomic), fsyncs every file
(DCP's writer fsyncs the shards; we fsync the rest) and the directory, and only
then renames it to ``<name>``. A checkpoint that already exists under that name
is first renamed to ``.<name>.yafsdp-old`` and deleted after the new one is in
place: POSIX cannot atomically replace a non-empty directory, so for the two
renames' instant the old checkpoint lives under the ``-old`` name, and
``recover`` (run by every save and load) renames it back if the process died
right there. A process killed at any other point leaves the previous checkpoint
untouched and a ``-tmp`` sibling that the next save of the same name deletes
and that readers never look at.

[Note: file modes]
Some writers create private files (safetensors' writer makes them 0600), and a
checkpoint or export that only its writer can read surprises whoever shares the
run directory. Before the commit every committed file gets the mode a plain
``open()`` would give, ``0o666 & ~umask``, and every directory ``0o777 & ~umask``.

Ranks agree on the outcome with one ``all_gather_object`` of error messages
after each phase, so a failure on one rank (an unwritable path, a full disk)
raises the same ``CheckpointSaveError`` on every rank instead of leaving the
others waiting in a collective. Nothing here touches training state.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist

from lightning_yafsdp.checkpoint.errors import CheckpointSaveError

TMP_SUFFIX = ".yafsdp-tmp"
DCP_METADATA_FILENAME = ".metadata"  # what makes a directory a sharded checkpoint
OLD_SUFFIX = ".yafsdp-old"

# Test hook: called on every rank after the checkpoint's files are written into
# the temporary directory and before ranks agree and commit (``hook(tmp_path)``).
# Tests use it to pause a save and kill a rank mid-save.
before_commit: Callable[[Path], None] | None = None


def tmp_path_for(path: Path) -> Path:
    return path.parent / f".{path.name}{TMP_SUFFIX}"


def old_path_for(path: Path) -> Path:
    return path.parent / f".{path.name}{OLD_SUFFIX}"


def recover(path: Path) -> None:
    """Undo a save that died between its two renames (see [Note: atomic commit])."""
    old = old_path_for(path)
    if old.exists() and not path.exists():
        os.replace(old, path)
        fsync_directory(path.parent)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, *, group=None) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``path`` when the block succeeds.

    Collective over ``group``: every rank enters, writes its files into the
    yielded directory, and leaves; the rename happens once all ranks succeeded.

    Raises:
        CheckpointSaveError: on every rank when any rank failed; ``path`` is untouched.
    """
    path = Path(path)
    tmp = tmp_path_for(path)
    rank = _rank(group)
    error = None
    if rank == 0:
        error = _attempt(lambda: _prepare(path, tmp, directory=True))
    agree(error, group=group, doing=f"preparing to save {path}")
    try:
        yield tmp
    except Exception as exc:  # noqa: BLE001 - reported to every rank by agree()
        error = exc
    else:
        if before_commit is not None:
            before_commit(tmp)
    try:
        agree(error, group=group, doing=f"writing checkpoint {path}")
    except CheckpointSaveError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if rank == 0:
        error = _attempt(lambda: _commit(tmp, path))
    agree(error, group=group, doing=f"committing checkpoint {path}")


def atomic_file(path: str | os.PathLike, write: Callable[[Path], None], *, group=None) -> None:
    """Rank 0 calls ``write(tmp_file)``; the file then replaces ``path`` atomically.

    Collective over ``group`` (other ranks only wait for the outcome).

    Raises:
        CheckpointSaveError: on every rank when rank 0 failed; ``path`` is untouched.
    """
    path = Path(path)
    tmp = tmp_path_for(path)
    error = None
    if _rank(group) == 0:

        def run() -> None:
            _prepare(path, tmp, directory=False)
            write(tmp)
            fsync_file(tmp)
            if before_commit is not None:
                before_commit(tmp)
            _commit(tmp, path)

        error = _attempt(run)
        if error is not None:
            with contextlib.suppress(OSError):
                tmp.unlink()
    agree(error, group=group, doing=f"saving checkpoint {path}")


def agree(error: BaseException | None, *, group=None, doing: str) -> None:
    """Raise ``CheckpointSaveError`` on every rank if ``error`` is set on any rank."""
    message = None if error is None else f"{type(error).__name__}: {error}"
    if _world_size(group) > 1:
        messages: list[str | None] = [None] * _world_size(group)
        dist.all_gather_object(messages, message, group=group)
    else:
        messages = [message]
    failed = [(rank, m) for rank, m in enumerate(messages) if m is not None]
    if not failed:
        return
    detail = "; ".join(f"rank {rank}: {m}" for rank, m in failed)
    raise CheckpointSaveError(
        f"{doing} failed ({detail}). The previous checkpoint at that path, if any, is intact "
        "and the training state in memory is unchanged; check that the directory is writable "
        "and has free space, then save again"
    ) from error


def umask() -> int:
    """The process umask, read without changing it where Linux allows."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    # Elsewhere the only way to read it is to set it: restored at once.
    current = os.umask(0o022)
    os.umask(current)
    return current


def apply_default_modes(path: Path) -> None:
    """Give ``path`` (a file, or a directory and all it holds) the modes of a plain
    ``open()`` / ``mkdir``: see [Note: file modes]."""
    mask = umask()
    if not path.is_dir():
        _chmod(path, 0o666 & ~mask)
        return
    for root, _, files in os.walk(path):
        _chmod(Path(root), 0o777 & ~mask)
        for name in files:
            _chmod(Path(root) / name, 0o666 & ~mask)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(path: Path) -> None:
    """Persist a directory's entries (renames, new files); a no-op where unsupported."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file under ``path`` and the directories themselves."""
    for root, _, files in os.walk(path):
        for name in files:
            fsync_file(Path(root) / name)
        fsync_directory(Path(root))


# -- rank 0's steps ---------------------------------------------------------------------


def _prepare(path: Path, tmp: Path, *, directory: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    _refuse_to_replace_a_foreign_directory(path)
    _remove(tmp)  # left by a save that died
    if old_path_for(path).exists():  # left by a save that died after its commit
        _remove(old_path_for(path))
    if directory:
        tmp.mkdir()


def _refuse_to_replace_a_foreign_directory(path: Path) -> None:
    # A commit replaces whatever is at ``path``; a directory holding anything but a
    # sharded checkpoint (e.g. trainer.save_checkpoint("outputs")) would be deleted.
    if (
        path.is_dir()
        and not path.is_symlink()
        and any(path.iterdir())
        and not (path / DCP_METADATA_FILENAME).is_file()
    ):
        raise IsADirectoryError(
            f"{str(path)!r} is a directory that is not a sharded checkpoint; saving there "
            "would replace everything in it. Pass a new path (e.g. a file name inside it) "
            "or remove the directory first"
        )


def _commit(tmp: Path, path: Path) -> None:
    apply_default_modes(tmp)
    if tmp.is_dir():
        fsync_tree(tmp)
    if path.exists() and (path.is_dir() or tmp.is_dir()):
        old = old_path_for(path)
        os.replace(path, old)
        os.replace(tmp, path)
        fsync_directory(path.parent)
        _remove(old)
    else:
        os.replace(tmp, path)
    fsync_directory(path.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _attempt(fn: Callable[[], None]) -> BaseException | None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported to every rank by agree()
        return exc
    return None


def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _world_size(group) -> int:
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


def _chmod(path: Path, mode: int) -> None:
    # A mode is a courtesy, not worth failing a save for (e.g. another user's
    # file on a shared filesystem).
    with contextlib.suppress(OSError):
        os.chmod(path, mode)
