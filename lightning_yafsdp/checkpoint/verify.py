"""Is a checkpoint complete and unchanged? Recorded at save, checked before anything is read.

[Note: checkpoint manifest]
A sharded save ends with ``yafsdp-manifest.json``, ``{"manifest_version": 1, "files":
{name: {"bytes": int, "crc32": "8 hex digits"}}}``: each rank digests the files it just
wrote (from the page cache), rank 0 also ``.metadata`` and ``meta.pt``, and one object
all-gather brings the digests to rank 0. Lightning's and torch's directories have none
and verify by the sizes ``.metadata`` implies.

[Note: verify before reading]
A truncated or missing file otherwise surfaces deep in DCP or ``torch.load`` as a bare
``EOFError`` on every rank, after the model may be half loaded. So rank 0 first checks,
reading no tensors, a directory's manifest sizes, that ``.metadata`` unpickles and
``meta.pt`` is a complete zip, and every storage file's length; a single file's zip
directory (written last) and entry extents (a legacy non-zip file is left to
``torch.load``); then it tells the others, so the message appears once.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
import zlib
from pathlib import Path
from typing import Any, NoReturn

from torch.distributed.checkpoint import FileSystemReader

from lightning_yafsdp.checkpoint.atomic import DCP_METADATA_FILENAME, attempt, error_line
from lightning_yafsdp.checkpoint.errors import (
    DamagedCheckpointError,
    NotACheckpointError,
    first_line,
)
from lightning_yafsdp.checkpoint.gather import world_info
from lightning_yafsdp.core.comm.collectives import all_gather_objects

META_FILENAME = "meta.pt"  # lightning.fabric.utilities.load._METADATA_FILENAME
MANIFEST_FILENAME = "yafsdp-manifest.json"
MANIFEST_VERSION = 1
READ_CHUNK_BYTES = 8 << 20
_ZIP_MAGIC = b"PK\x03\x04"
# What was checked, as inspect shows it.
CHECKED_BY_SIZES = "sizes and file structure"
CHECKED_WITH_CHECKSUMS = "sizes, file structure and CRC-32 checksums"
NO_CHECKSUMS_RECORDED = "sizes and file structure (no checksums were recorded at save)"
NOT_CHECKED = "not checked (legacy torch.save file)"
_CHANGED = "its contents changed after the save (if on purpose, load with verify_checksums=False)"


def verify_checkpoint(path: str | os.PathLike, *, checksums: bool = False) -> str:
    """Raise if a checkpoint directory or file is incomplete, reading no tensors; with
    ``checksums`` also compare every file's (a zip's every entry's) CRC-32, reading every
    byte. Returns what was checked (``inspect`` shows it). Raises ``NotACheckpointError``
    or ``DamagedCheckpointError`` (one line: the bad file, what is wrong, what to load).
    """
    path = Path(path)
    if path.is_file():
        checked = _verify_torch_file(path, checkpoint=path)
        if checksums and checked == CHECKED_BY_SIZES:
            _verify_zip_checksums(path, checkpoint=path)
            return CHECKED_WITH_CHECKSUMS
        return checked
    if not looks_like_sharded_checkpoint(path):
        raise NotACheckpointError(describe_non_checkpoint(path))
    recorded = _verify_directory(path)
    if not checksums:
        return CHECKED_BY_SIZES
    if recorded is None:
        return NO_CHECKSUMS_RECORDED
    _compare_checksums(path, recorded)
    return CHECKED_WITH_CHECKSUMS


def verify_on_rank_zero(path: str | os.PathLike, *, group=None, checksums: bool = False) -> None:
    """``verify_checkpoint`` on rank 0 of ``group``, then with ``checksums`` the CRC-32s
    compared by every rank; every rank raises if any failed: rank 0 the full message,
    the others a short one pointing to it. Collective in a process group."""
    rank, world_size = world_info(group)
    path = Path(path)
    _agreed(path, lambda: verify_checkpoint(path) if rank == 0 else None, group=group)
    if checksums:
        _agreed(path, lambda: _compare_my_share(path, rank, world_size), group=group)


def _compare_my_share(path: Path, rank: int, world_size: int) -> None:
    # [Note: checksums on load]
    # A flipped bit inside a shard keeps every size right: only the CRC-32 notices it, so
    # every load compares them unless the user opts out. Reading every byte is the cost,
    # shared: ``__<r>_<i>.distcp`` goes to rank ``r % world_size`` (at the same world
    # size, the file that rank is about to read, left in the page cache for DCP), the
    # small files to rank 0; a single file's zip entries are compared on rank 0.
    if path.is_dir():
        recorded = read_manifest(path) or {}
        mine = {n: d for n, d in recorded.items() if _writer_rank(n) % world_size == rank}
        _compare_checksums(path, mine)
    elif rank == 0:
        _verify_zip_checksums(path, checkpoint=path)


def _agreed(path: Path, check, *, group) -> None:
    """Run ``check`` on every rank; raise on every rank if it failed on any."""
    error = attempt(check)
    report = None if error is None else (type(error).__name__, str(error))
    found = [r for r in all_gather_objects(report, group=group) if r is not None]
    if not found:
        return
    kind = NotACheckpointError if found[0][0] == "NotACheckpointError" else DamagedCheckpointError
    if world_info(group)[0] == 0:
        raise error if error is not None else kind(found[0][1])
    raise kind(f"rank 0 reported that checkpoint {str(path)!r} cannot be loaded (see its message)")


# -- the manifest ---------------------------------------------------------------------


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "crc32": "hex"}`` of one file, read in 8 MiB chunks."""
    crc = 0
    with open(path, "rb") as stream:
        while chunk := stream.read(READ_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return {"bytes": path.stat().st_size, "crc32": f"{crc:08x}"}


def write_manifest(
    directory: Path,
    *,
    rank_zero_files: tuple[str, ...],
    group=None,
    failure: BaseException | None = None,
) -> None:
    """Collective: digest each rank's own files and write the manifest on rank 0.

    ``rank_zero_files``: what rank 0 wrote besides its DCP data. ``failure``: this rank's
    error while writing its files; every rank still calls in, so none waits forever, and
    nothing is written: the rank that failed raises ``failure``, the others ``OSError``.
    """
    rank = world_info(group)[0]
    own = sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))
    own += [DCP_METADATA_FILENAME, *rank_zero_files] if rank == 0 else []
    digests: dict[str, Any] = {}
    error = failure or attempt(lambda: digests.update({n: file_digest(directory / n) for n in own}))
    report = (digests, None if error is None else f"rank {rank}: {error_line(error)}")
    gathered = all_gather_objects(report, group=group)
    if failure is not None:
        raise failure
    errors = [e for _, e in gathered if e is not None]
    if errors:
        raise OSError(
            f"writing the checkpoint files or reading them back failed ({'; '.join(errors)})"
        )
    if rank == 0:
        files = {name: digest for d, _ in gathered for name, digest in d.items()}
        manifest = {"manifest_version": MANIFEST_VERSION, "files": dict(sorted(files.items()))}
        # Synced by the commit, with every other file ([Note: atomic commit]).
        (directory / MANIFEST_FILENAME).write_text(json.dumps(manifest, indent=1) + "\n")


def read_manifest(directory: Path) -> dict[str, dict[str, Any]] | None:
    """``{name: {"bytes", "crc32"}}`` from the manifest; None when there is none.
    ``ValueError`` when it exists but is not the JSON we write (damaged)."""
    path = directory / MANIFEST_FILENAME
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
        if any("/" in name or "\\" in name or name.startswith("..") for name in files):
            raise ValueError("a file name points outside the checkpoint directory")
        return {
            str(name): {"bytes": int(d["bytes"]), "crc32": str(d["crc32"])}
            for name, d in files.items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a readable manifest ({type(exc).__name__}: {exc})") from exc


# -- sharded directories ---------------------------------------------------------------


def looks_like_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """A DCP directory, or what is left of one (its ``.metadata`` may be the part missing)."""
    path = Path(path)
    if not path.is_dir():
        return False
    names = {p.name for p in path.iterdir()}
    return bool({DCP_METADATA_FILENAME, MANIFEST_FILENAME} & names) or any(
        n.endswith(".distcp") for n in names
    )


def _verify_directory(path: Path) -> dict[str, dict] | None:
    """Sizes (manifest, then ``.metadata``) and structure; the manifest's digests."""
    metadata_file = path / DCP_METADATA_FILENAME
    if not metadata_file.is_file():
        shards = sorted(p.name for p in path.glob("*.distcp"))
        _damaged(
            path,
            metadata_file,
            f"is missing (the directory holds {', '.join(shards[:4])}"
            f"{' ...' if len(shards) > 4 else ''} but no index of them: a save that never "
            "finished, or a copy that skipped hidden files)",
        )
    try:
        recorded = read_manifest(path)
    except ValueError as exc:
        _damaged(path, path / MANIFEST_FILENAME, f"cannot be read: {exc}")
    for name, digest in (recorded or {}).items():
        _check_size(path, path / name, digest["bytes"], listed_by=MANIFEST_FILENAME)
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle means a damaged file
        _damaged(
            path,
            metadata_file,
            f"cannot be read, it is truncated or corrupt ({metadata_file.stat().st_size:,} "
            f"bytes; {type(exc).__name__}: {first_line(exc)})",
        )
    meta_file = path / META_FILENAME
    if not meta_file.is_file():
        _damaged(path, meta_file, "is missing (rank 0 writes it with the training state)")
    _verify_torch_file(meta_file, checkpoint=path)
    needed: dict[str, int] = {}  # per storage file, the end of its last item
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        _check_size(path, path / name, end, listed_by=DCP_METADATA_FILENAME)
    return recorded


def _writer_rank(name: str) -> int:
    """The rank that wrote DCP's ``__<rank>_<i>.distcp`` (0 for every other file)."""
    match = re.match(r"__(\d+)_\d+\.distcp$", name)
    return int(match[1]) if match else 0


def _compare_checksums(path: Path, recorded: dict[str, dict]) -> None:
    for name, digest in sorted(recorded.items()):
        found = file_digest(path / name)["crc32"]
        if found != digest["crc32"]:
            _damaged(
                path,
                path / name,
                f"does not match its checksum (CRC-32 {found}, {digest['crc32']} when saved): "
                + _CHANGED,
            )


def _check_size(checkpoint: Path, file: Path, needed: int, *, listed_by: str) -> None:
    """``file`` must exist and hold at least ``needed`` bytes (what ``listed_by`` records)."""
    if not file.is_file():
        writer = f"rank {_writer_rank(file.name)}'s data; " if file.suffix == ".distcp" else ""
        _damaged(checkpoint, file, f"is missing ({writer}{listed_by} lists it)")
    size = file.stat().st_size
    if size < needed:
        _damaged(checkpoint, file, f"is truncated: {size:,} of {needed:,} bytes")


# -- single files ----------------------------------------------------------------------


def _verify_torch_file(path: Path, *, checkpoint: Path) -> str:
    """A ``torch.save`` file: not empty, and complete if it is a zip (every modern one).

    A zip's directory is written last and maps every entry.
    """
    size = path.stat().st_size
    if size == 0:
        _damaged(checkpoint, path, "is empty (0 bytes)")
    if not _is_zip(path):
        return NOT_CHECKED
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        _damaged(
            checkpoint,
            path,
            f"is truncated or corrupt: {size:,} bytes with no complete zip directory at its end",
        )
    for entry in entries:
        end = entry.header_offset + entry.compress_size
        if end > size:
            _damaged(checkpoint, path, f"is truncated: {size:,} of at least {end:,} bytes")
    return CHECKED_BY_SIZES


def _verify_zip_checksums(path: Path, *, checkpoint: Path) -> None:
    """Every entry of a ``torch.save`` zip against the CRC-32 torch's writer stored for it."""
    if not _is_zip(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every entry; the first one that fails
    except (zipfile.BadZipFile, OSError) as exc:
        bad = first_line(exc)
    if bad is not None:
        _damaged(checkpoint, path, f"does not match its checksums ({bad}): {_CHANGED}")


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as stream:
        return stream.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC


# -- the messages ----------------------------------------------------------------------


def _damaged(checkpoint: Path, bad_file: Path, what: str) -> NoReturn:
    """One line: the bad file, what is wrong, and which checkpoints beside it to load instead."""
    folder = checkpoint.parent
    try:
        others = sorted(
            p.name
            for p in folder.iterdir()
            if p != checkpoint
            and not p.name.startswith(".")
            and ((p / DCP_METADATA_FILENAME).is_file() or p.suffix in (".ckpt", ".pt", ".pth"))
        )
    except OSError:
        others = []
    instead = "Load an earlier checkpoint or save this one again"
    if others:
        shown = ", ".join(others[:6]) + (f" and {len(others) - 6} more" if len(others) > 6 else "")
        instead = f"Load another checkpoint instead; {str(folder)!r} also holds: {shown}"
    raise DamagedCheckpointError(
        f"damaged checkpoint: {str(bad_file)!r} {what}; nothing was loaded from it. {instead}"
    )


def describe_non_checkpoint(path: Path) -> str:
    """Why ``path`` is not a checkpoint, and what to pass instead."""
    if not path.exists():
        parent = path.parent
        siblings = sorted(p.name for p in parent.glob("*"))[:10] if parent.is_dir() else []
        return (
            f"checkpoint {str(path)!r} does not exist"
            + (f" (the directory holds: {', '.join(siblings)})" if siblings else "")
            + "; pass the path of a checkpoint directory written by save_sharded / "
            "trainer.save_checkpoint, or a checkpoint file"
        )
    if path.is_dir():
        contents = sorted(p.name for p in path.iterdir())[:10]
        return (
            f"{str(path)!r} is a directory but not a sharded checkpoint: it has no "
            f"{DCP_METADATA_FILENAME} file (it holds: {', '.join(contents) or 'nothing'}). A save "
            "that was interrupted leaves a hidden '.<name>.yafsdp-tmp' directory instead; the "
            "last complete checkpoint is the one to load"
        )
    return f"{str(path)!r} is a file, not a sharded checkpoint directory"
