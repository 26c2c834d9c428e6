"""Atomic checkpoint writes: a checkpoint becomes visible only when complete.

[Note: atomic commit]
A save writes into a hidden sibling, ``.<name>.yafsdp-tmp`` (same filesystem, so the
rename is atomic), fsyncs every file and directory, then renames it to ``<name>``. POSIX
cannot atomically replace a non-empty directory, so an existing checkpoint is first
renamed to ``.<name>.yafsdp-old`` and deleted after the new one is in place; ``recover``
(run by every save and load) renames it back if the process died between the renames.
A kill at any other point leaves the previous checkpoint untouched and a ``-tmp``
sibling that readers ignore and the next save of that name deletes.

[Note: file modes]
Some writers create private files (safetensors: 0600). Before the commit every file
gets the mode a plain ``open()`` gives, ``0o666 & ~umask`` (directories ``0o777``).

[Note: a failed write is one line]
Ranks agree on each phase's outcome with one object all-gather of error messages
(``agree``), so a failure on any rank raises the same ``CheckpointSaveError`` on every
rank instead of leaving the others in a collective: one ``rank r: Type: first line`` per
failed rank (DCP's ``CheckpointException`` holds 200+ lines of tracebacks naming no
checkpoint) and what a retry needs (docs/design.md, "Checkpoints").
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from lightning_yafsdp.checkpoint.errors import CheckpointSaveError, first_line
from lightning_yafsdp.checkpoint.gather import world_info
from lightning_yafsdp.core.comm.collectives import all_gather_objects

# What a save may raise: DCP's wrapper of every rank's error is a BaseException.
SAVE_FAILURES = (Exception, CheckpointException)
_TORCH_SAVE_SHORT_WRITE = "inline_container.cc"  # "[enforce fail at ...] unexpected pos"
TMP_SUFFIX = ".yafsdp-tmp"
OLD_SUFFIX = ".yafsdp-old"
DCP_METADATA_FILENAME = ".metadata"  # what makes a directory a sharded checkpoint

# Test hook: called on every rank after the checkpoint's files are written into the
# temporary path and before the commit (``hook(tmp_path)``); tests kill a rank there.
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
        fsync(path.parent)


@contextlib.contextmanager
def atomic_path(
    path: str | os.PathLike, *, group=None, directory: bool = True, bytes_here: int = 0
) -> Iterator[Path]:
    """Yield a temporary path that becomes ``path`` once every rank of ``group`` is done.

    Collective. ``directory``: a fresh directory every rank writes its files into; else a
    file name for rank 0 to write (the other ranks wait for the outcome). ``bytes_here``:
    about what this rank writes. Raises ``CheckpointSaveError`` on every rank when any rank
    failed (one line); ``path`` is then untouched and the temporary path removed.
    """
    path, rank = Path(path), world_info(group)[0]
    tmp = tmp_path_for(path)
    error = attempt(lambda: _prepare(path, tmp, directory=directory)) if rank == 0 else None
    agree(error, group=group, doing=f"preparing to save {str(path)!r}")
    try:
        yield tmp
    except SAVE_FAILURES as exc:  # reported to every rank by agree()
        error = exc
    else:
        if before_commit is not None:
            before_commit(tmp)
    try:
        doing = f"writing checkpoint {str(path)!r}"
        agree(error, group=group, doing=doing, bytes_here=bytes_here, room_for=path)
    except CheckpointSaveError:
        if rank == 0:
            attempt(lambda: _remove(tmp))
        raise
    if rank == 0 and (error := attempt(lambda: _commit(tmp, path))) is not None:
        attempt(lambda: _remove(tmp))  # the new files go; the old checkpoint stays
        attempt(lambda: recover(path))
    agree(error, group=group, doing=f"committing checkpoint {str(path)!r}")


def agree(
    error: BaseException | None,
    *,
    group=None,
    doing: str,
    bytes_here: int = 0,
    room_for: Path | None = None,
) -> None:
    """Raise ``CheckpointSaveError`` on every rank if ``error`` is set on any rank: one line
    that, with ``room_for`` (the checkpoint's path), says what the save needs and what is free."""
    rank = world_info(group)[0]
    free = None  # read by rank 0 alone, so every rank raises the same message
    if room_for is not None and rank == 0:
        with contextlib.suppress(OSError):
            free = shutil.disk_usage(room_for.parent).free
    reports = all_gather_objects((failure_lines(error, rank), bytes_here, free), group=group)
    # A rank's first reported line wins (each report names a rank at most once).
    failures = {r: line for lines, _, _ in reversed(reports) for r, line in lines}
    if not failures:
        return
    shown = sorted(failures.items())
    detail = "; ".join(f"rank {r}: {line}" for r, line in shown[:2])
    if len(shown) > 2:
        detail += f" and {len(shown) - 2} more rank(s)"
    room = _room(sum(r[1] for r in reports), reports[0][2], room_for) if room_for else ""
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
        return [(r, error_line(exc)) for r, (exc, _) in sorted(error.failures.items())]
    return [(rank, error_line(error))]


def error_line(error: BaseException) -> str:
    first = first_line(error) if str(error).strip() else ""
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
    needed = tensor_bytes
    with contextlib.suppress(OSError):
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        needed = max(needed, sum(p.stat().st_size for p in files))
    free = "the free space there could not be read"
    if free_bytes is not None:
        free = f"{_size(free_bytes)} are free there"
    return (
        f" The checkpoint needs at least {_size(needed)} and {free}; a checkpoint it "
        "replaces stays until the new one is complete, so replacing one needs room for both."
    )


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit} ({nbytes:,} bytes)"
    return f"{nbytes:,} bytes"


# -- the filesystem ----------------------------------------------------------------------


def umask() -> int:
    """The process umask, read without changing it where Linux allows (a background
    save's thread may be creating files meanwhile)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    current = os.umask(0o022)  # elsewhere the only way to read it: restored at once
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


def fsync(path: Path) -> None:
    """Persist a file's data or a directory's entries (best effort for a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        if not path.is_dir():
            raise


def attempt(fn: Callable[[], None]) -> BaseException | None:
    """Run ``fn``; return what it raised (for ``agree`` to report to every rank)."""
    try:
        fn()
    except SAVE_FAILURES as exc:
        return exc
    return None


def _prepare(path: Path, tmp: Path, *, directory: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
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
    _remove(tmp)  # left by a save that died
    _remove(old_path_for(path))  # left by a save that died after its commit
    if directory:
        tmp.mkdir()


def _commit(tmp: Path, path: Path) -> None:
    apply_default_modes(tmp)
    for item in [*tmp.rglob("*"), tmp] if tmp.is_dir() else [tmp]:
        fsync(item)
    if path.exists() and (path.is_dir() or tmp.is_dir()):
        old = old_path_for(path)
        os.replace(path, old)
        os.replace(tmp, path)
        fsync(path.parent)
        _remove(old)
    else:
        os.replace(tmp, path)
    fsync(path.parent)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _chmod(path: Path, mode: int) -> None:
    # A mode is a courtesy, not worth failing a save for (e.g. another user's file).
    with contextlib.suppress(OSError):
        os.chmod(path, mode)
