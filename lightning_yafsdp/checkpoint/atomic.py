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

[Note: a failed write is one line]
A full disk or any other write error surfaces inside DCP, which wraps every rank's
exception with its traceback into one ``CheckpointException`` (a ``BaseException``,
so ``except Exception`` lets it through, and the partial ``-tmp`` directory used to
stay behind) and raises it on every rank: 200+ lines naming no checkpoint. ``agree``
takes DCP's exception apart into one ``rank r: Type: first line`` per failed rank
(each rank sends what it knows, duplicates dropped), and the write phase's message
says what a retry needs: the bytes the checkpoint takes (each rank's share, summed),
what is free on that filesystem, and that the previous checkpoint stays in place
until the new one is complete, so replacing a checkpoint needs room for both at once.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from lightning_yafsdp.checkpoint.errors import CheckpointSaveError
from lightning_yafsdp.core.comm.collectives import all_gather_objects

# What a save may raise: DCP's wrapper of every rank's error is a BaseException.
SAVE_FAILURES = (Exception, CheckpointException)
_TORCH_SAVE_SHORT_WRITE = "inline_container.cc"  # "[enforce fail at ...] unexpected pos"

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
def atomic_directory(path: str | os.PathLike, *, group=None, bytes_here: int = 0) -> Iterator[Path]:
    """Yield a fresh temporary directory that becomes ``path`` when the block succeeds.

    Collective over ``group``: every rank enters, writes its files into the
    yielded directory, and leaves; the rename happens once all ranks succeeded.
    ``bytes_here``: about how many bytes this rank writes (for the message when a
    write fails, [Note: a failed write is one line]).

    Raises:
        CheckpointSaveError: on every rank when any rank failed (one line); ``path``
            is untouched and the temporary directory removed.
    """
    path = Path(path)
    tmp = tmp_path_for(path)
    rank = _rank(group)
    error = None
    if rank == 0:
        error = _attempt(lambda: _prepare(path, tmp, directory=True))
    agree(error, group=group, doing=f"preparing to save {str(path)!r}")
    try:
        yield tmp
    except SAVE_FAILURES as exc:  # reported to every rank by agree()
        error = exc
    else:
        if before_commit is not None:
            before_commit(tmp)
    _agree_or_clean_up(error, group=group, path=path, tmp=tmp, bytes_here=bytes_here)
    if rank == 0:
        error = _attempt(lambda: _commit(tmp, path))
        if error is not None:  # the new files are dropped; the old checkpoint comes back
            shutil.rmtree(tmp, ignore_errors=True)
            _attempt(lambda: recover(path))
    agree(error, group=group, doing=f"committing checkpoint {str(path)!r}")


def _agree_or_clean_up(
    error: BaseException | None, *, group, path: Path, tmp: Path, bytes_here: int
) -> None:
    """The write phase's ``agree``: on failure rank 0 removes ``tmp`` before raising."""
    try:
        agree(
            error,
            group=group,
            doing=f"writing checkpoint {str(path)!r}",
            bytes_here=bytes_here,
            room_for=path,
        )
    except CheckpointSaveError:
        if _rank(group) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_file(
    path: str | os.PathLike, write: Callable[[Path], None], *, group=None, bytes_needed: int = 0
) -> None:
    """Rank 0 calls ``write(tmp_file)``; the file then replaces ``path`` atomically.

    Collective over ``group`` (other ranks only wait for the outcome). ``bytes_needed``
    (rank 0): about the file's size, for the message when the write fails.

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
    agree(
        error,
        group=group,
        doing=f"saving checkpoint {str(path)!r}",
        bytes_here=bytes_needed,
        room_for=path,
    )


def agree(
    error: BaseException | None,
    *,
    group=None,
    doing: str,
    bytes_here: int = 0,
    room_for: Path | None = None,
) -> None:
    """Raise ``CheckpointSaveError`` on every rank if ``error`` is set on any rank.

    One line ([Note: a failed write is one line]); with ``room_for`` (the checkpoint's
    path) it also says how many bytes the save needs (``bytes_here`` summed over the
    ranks, or the size of the checkpoint it replaces if larger) and how many are free.
    """
    # Rank 0 alone reads the free space, so every rank raises the same message.
    free = _free_bytes(room_for) if room_for is not None and _rank(group) == 0 else None
    report = (failure_lines(error, _rank(group)), bytes_here, free)
    if _world_size(group) > 1:
        reports = all_gather_objects(report, group=group)
    else:
        reports = [report]
    failures: dict[int, str] = {}
    for lines, _, _ in reports:
        for rank, line in lines:
            failures.setdefault(rank, line)
    if not failures:
        return
    shown = sorted(failures.items())
    detail = "; ".join(f"rank {rank}: {line}" for rank, line in shown[:2])
    if len(shown) > 2:
        detail += f" and {len(shown) - 2} more rank(s)"
    room = ""
    if room_for is not None:
        room = _room(sum(r[1] for r in reports), reports[0][2], room_for)
    raise CheckpointSaveError(
        f"{doing} failed ({detail}).{room} The previous checkpoint at that path, if any, is "
        "intact, no partial files were left, and the training state in memory is unchanged; "
        "check that the directory is writable and has free space, then save again"
    ) from (error if isinstance(error, Exception) else None)


def failure_lines(error: BaseException | None, rank: int) -> list[tuple[int, str]]:
    """``[(rank, "Type: first line")]``: DCP's ``CheckpointException`` gives one per rank."""
    if error is None:
        return []
    if isinstance(error, CheckpointException):
        return [(r, _one_line(exc)) for r, (exc, _) in sorted(error.failures.items())]
    return [(rank, _one_line(error))]


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else ""
    if _TORCH_SAVE_SHORT_WRITE in first:
        # torch.save's C++ writer reports a short write without the OS's errno.
        first = (
            "torch.save could not write the whole file (the disk is full, a quota or file "
            f"size limit was reached, or the filesystem failed; torch said: {first})"
        )
    return f"{type(error).__name__}: {first}".rstrip(": ")


def _room(tensor_bytes: int, free_bytes: int | None, path: Path) -> str:
    """What a retry needs: the checkpoint's bytes, and what is free beside ``path``."""
    # The tensors' bytes leave out DCP's few hundred bytes per stored box, which only
    # matter for tiny models; the checkpoint being replaced is the better measure.
    needed = max(tensor_bytes, _bytes_on_disk(path))
    if free_bytes is None:
        free = "the free space there could not be read"
    else:
        free = f"{_size(free_bytes)} are free there"
    return (
        f" The checkpoint needs at least {_size(needed)} and {free}; a checkpoint it "
        "replaces stays until the new one is complete, so replacing one needs room for both."
    )


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path.parent).free
    except OSError:
        return None


def _bytes_on_disk(path: Path) -> int:
    try:
        if path.is_file():
            return path.stat().st_size
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    except OSError:
        return 0


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit} ({nbytes:,} bytes)"
    return f"{nbytes:,} bytes"


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
    except SAVE_FAILURES as exc:  # reported to every rank by agree()
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
