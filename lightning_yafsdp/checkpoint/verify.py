"""Is a checkpoint complete? Checked from sizes and file structure, before anything is read.

[Note: verify before reading]
A truncated or missing file otherwise surfaces deep inside DCP or ``torch.load`` as a
bare ``EOFError`` naming no file, on every rank, after the model may already be half
loaded. Every reader (``load_sharded``, ``load_full``, ``load_lightning_checkpoint``,
``consolidate_checkpoint``, ``inspect_checkpoint``) therefore calls
``verify_checkpoint`` first. What it checks costs a few ``stat`` calls and reading
two small files, never the tensors:

- sharded directory: every file the manifest lists ([Note: checkpoint manifest]; absent
  from older directories) exists and has its recorded size; ``.metadata`` exists and
  unpickles; ``meta.pt`` exists and is a complete torch (zip) file; every storage
  file that ``.metadata`` references exists and is at least as long as the largest
  ``offset + length`` of its items. With ``checksums=True`` (every load, unless
  ``verify_checksums=False``: [Note: checksums on load]; ``yafsdp inspect --verify``)
  every file's CRC-32 is compared with the manifest's.
- single file: a torch zip file has its central directory (it is written last, so
  any truncation removes it) and every entry lies inside the file. A legacy
  (non-zip) ``torch.save`` file cannot be checked this way and is left to
  ``torch.load``.

In a process group, rank 0 verifies and tells the others
(``verify_on_rank_zero``), so the message naming the bad file appears once.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata

from lightning_yafsdp.checkpoint.atomic import DCP_METADATA_FILENAME
from lightning_yafsdp.checkpoint.errors import DamagedCheckpointError, NotACheckpointError
from lightning_yafsdp.checkpoint.manifest import MANIFEST_FILENAME, file_digest, read_manifest
from lightning_yafsdp.core.comm.collectives import all_gather_objects, broadcast_object

META_FILENAME = "meta.pt"  # sharded.META_FILENAME (sharded.py imports this module)
_ZIP_MAGIC = b"PK\x03\x04"
_READ_CHUNK_BYTES = 8 << 20
# What was checked, as inspect shows it; a legacy pickle file only torch.load can check.
CHECKED_BY_SIZES = "sizes and file structure"
CHECKED_WITH_CHECKSUMS = "sizes, file structure and CRC-32 checksums"
NO_CHECKSUMS_RECORDED = "sizes and file structure (no checksums were recorded at save)"
NOT_CHECKED = "not checked (legacy torch.save file)"


def verify_checkpoint(path: str | os.PathLike, *, checksums: bool = False) -> None:
    """Raise if a checkpoint directory or file is incomplete; read no tensors.

    Args:
        path: a sharded checkpoint directory or a single-file checkpoint.
        checksums: also compare every file of a sharded directory with the CRC-32
            recorded at save ([Note: checkpoint manifest]), and every entry of a
            single (zip) file with the CRC-32 torch stored for it; this reads every
            byte. Default False: sizes and structure only (a few ``stat`` calls).
            Loads pass True ([Note: checksums on load]).

    Raises:
        NotACheckpointError: ``path`` does not exist.
        DamagedCheckpointError: one line naming the bad file, what is wrong with it
            (missing, truncated: N of M bytes, unreadable) and which other
            checkpoints next to it can be used instead.
    """
    verified_checks(path, checksums=checksums)


def verified_checks(path: str | os.PathLike, *, checksums: bool = False) -> str:
    """``verify_checkpoint``, returning what was checked (for ``inspect``'s table)."""
    path = Path(path)
    if path.is_file():
        checked = _verify_torch_file(path, checkpoint=path)
        if checksums and checked == CHECKED_BY_SIZES:
            _verify_zip_checksums(path, checkpoint=path)
            return CHECKED_WITH_CHECKSUMS
        return checked
    if looks_like_sharded_checkpoint(path):
        return _verify_directory(path, checksums=checksums)
    raise NotACheckpointError(describe_non_checkpoint(path))


def verify_on_rank_zero(path: str | os.PathLike, *, group=None, checksums: bool = False) -> None:
    """``verify_checkpoint`` on rank 0 of ``group``; every rank raises if it failed.

    Collective when a process group is initialised. Rank 0 raises the full message;
    the other ranks a short one pointing to it, so a damaged checkpoint is
    described once instead of once per rank. With ``checksums`` the CRC-32s are
    then compared too, the files shared out over the ranks ([Note: checksums on load]).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        verify_checkpoint(path, checksums=checksums)
        return
    error: Exception | None = None
    if dist.get_rank(group) == 0:
        try:
            verify_checkpoint(path)
        except Exception as exc:  # noqa: BLE001 - the others must hear of any failure
            error = exc
    outcome = broadcast_object(
        type(error).__name__ if error is not None else None, src_rank=0, group=group
    )
    if error is not None:
        raise error
    if outcome is not None:
        _raise_reported_by_rank_zero(path, outcome)
    if checksums:
        _compare_checksums_over_ranks(Path(path), group=group)


def _raise_reported_by_rank_zero(path: str | os.PathLike, kind_name: str) -> NoReturn:
    kind = NotACheckpointError if kind_name == "NotACheckpointError" else DamagedCheckpointError
    raise kind(f"rank 0 reported that checkpoint {str(path)!r} cannot be loaded (see its message)")


def _compare_checksums_over_ranks(path: Path, *, group) -> None:
    """Each rank checks its share of the files; rank 0 raises the first mismatch found.

    [Note: checksums on load]
    A flipped bit inside a shard keeps every size right, so only the CRC-32 recorded in
    the manifest ([Note: checkpoint manifest]) notices it; without it a resume trains on
    the damaged weights and says nothing. Every load therefore compares the checksums
    unless the user opts out (``verify_checksums=False``). Reading every byte is the
    cost, so the work is shared: ``__<r>_<i>.distcp`` goes to rank ``r % world_size``
    (at the same world size, the file that rank is about to read, which leaves it in
    the page cache for DCP) and rank 0 takes the small files. One all_gather of the
    messages follows, so every rank stops before anything is loaded.
    """
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    message = None
    try:
        if path.is_dir():
            _verify_directory_checksums(path, rank=rank, world_size=world_size)
        elif rank == 0:
            _verify_zip_checksums(path, checkpoint=path)
    except DamagedCheckpointError as exc:
        message = str(exc)
    messages = all_gather_objects(message, group=group)
    found = [m for m in messages if m is not None]
    if found and rank == 0:
        raise DamagedCheckpointError(found[0])
    if found:
        _raise_reported_by_rank_zero(path, "DamagedCheckpointError")


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


def _verify_directory(path: Path, *, checksums: bool) -> str:
    """Sizes (manifest, then ``.metadata``), structure, and on request checksums."""
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
    recorded = _recorded_digests(path)
    for name, digest in (recorded or {}).items():
        _check_size(path, path / name, digest["bytes"], listed_by=MANIFEST_FILENAME)
    metadata = _read_metadata(path, metadata_file)
    meta_file = path / META_FILENAME
    if not meta_file.is_file():
        _damaged(path, meta_file, "is missing (rank 0 writes it with the training state)")
    _verify_torch_file(meta_file, checkpoint=path)
    for name, needed in sorted(_bytes_needed(metadata).items()):
        _check_size(path, path / name, needed, listed_by=DCP_METADATA_FILENAME)
    if not checksums:
        return CHECKED_BY_SIZES
    if recorded is None:
        return NO_CHECKSUMS_RECORDED
    _compare_checksums(path, recorded)
    return CHECKED_WITH_CHECKSUMS


def _verify_directory_checksums(path: Path, *, rank: int, world_size: int) -> None:
    """This rank's share of ``_compare_checksums`` (see [Note: checksums on load])."""
    recorded = _recorded_digests(path) or {}
    mine = {
        name: digest
        for name, digest in recorded.items()
        if _checksum_rank(name, world_size) == rank
    }
    _compare_checksums(path, mine)


def _checksum_rank(name: str, world_size: int) -> int:
    """Which rank checks ``name``: the one that wrote it, modulo the world size."""
    parts = name.split("_")
    if name.startswith("__") and len(parts) >= 4 and parts[2].isdigit():
        return int(parts[2]) % world_size
    return 0


def _compare_checksums(path: Path, recorded: dict[str, dict]) -> None:
    for name, digest in sorted(recorded.items()):
        found = file_digest(path / name)["crc32"]
        if found != digest["crc32"]:
            _damaged(
                path,
                path / name,
                f"does not match its checksum (CRC-32 {found}, {digest['crc32']} when saved): "
                "its contents changed after the save (if on purpose, load with "
                "verify_checksums=False)",
            )


def _recorded_digests(path: Path) -> dict[str, dict] | None:
    try:
        return read_manifest(path)
    except ValueError as exc:
        _damaged(path, path / MANIFEST_FILENAME, f"cannot be read: {exc}")


def _check_size(checkpoint: Path, file: Path, needed: int, *, listed_by: str) -> None:
    """``file`` must exist and hold at least ``needed`` bytes (what ``listed_by`` records)."""
    if not file.is_file():
        _damaged(checkpoint, file, f"is missing ({_writer(file.name)}{listed_by} lists it)")
    size = file.stat().st_size
    if size < needed:
        _damaged(checkpoint, file, f"is truncated: {size:,} of {needed:,} bytes")


def _read_metadata(path: Path, metadata_file: Path) -> Metadata:
    try:
        return FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle means a damaged file
        size = metadata_file.stat().st_size
        _damaged(
            path,
            metadata_file,
            f"cannot be read, it is truncated or corrupt ({size:,} bytes; "
            f"{type(exc).__name__}: {_first_line(exc)})",
        )


def _bytes_needed(metadata: Metadata) -> dict[str, int]:
    """Per storage file, the end of its last item: a shorter file is truncated."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    return needed


def _writer(name: str) -> str:
    """``"rank 1's data; "`` for DCP's ``__1_0.distcp`` (its writer's rank), else ``""``."""
    parts = name.split("_")
    if name.startswith("__") and len(parts) >= 4 and parts[2].isdigit():
        return f"rank {parts[2]}'s data; "
    return ""


# -- single files ----------------------------------------------------------------------


def _verify_torch_file(path: Path, *, checkpoint: Path) -> str:
    """A ``torch.save`` file: not empty, and complete if it is a zip (every modern one)."""
    if path.stat().st_size == 0:
        _damaged(checkpoint, path, "is empty (0 bytes)")
    if not _is_zip(path):
        return NOT_CHECKED
    _verify_zip(path, checkpoint=checkpoint)
    return CHECKED_BY_SIZES


def _verify_zip(path: Path, *, checkpoint: Path) -> None:
    """A ``torch.save`` file is a zip: its directory is written last and maps every entry."""
    size = path.stat().st_size
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


def _verify_zip_checksums(path: Path, *, checkpoint: Path) -> None:
    """Every entry of a ``torch.save`` zip against the CRC-32 torch's writer stored for it."""
    if not _is_zip(path):
        return
    try:
        with zipfile.ZipFile(path) as archive:
            for entry in archive.infolist():
                with archive.open(entry) as stream:
                    while stream.read(_READ_CHUNK_BYTES):
                        pass  # zipfile compares the CRC-32 at the entry's end
    except (zipfile.BadZipFile, OSError) as exc:
        _damaged(
            checkpoint,
            path,
            f"does not match its checksums ({_first_line(exc)}): its contents changed after "
            "the save (if on purpose, load with verify_checksums=False)",
        )


def _is_zip(path: Path) -> bool:
    with open(path, "rb") as stream:
        return stream.read(len(_ZIP_MAGIC)) == _ZIP_MAGIC


# -- the message -----------------------------------------------------------------------


def _damaged(checkpoint: Path, bad_file: Path, what: str) -> NoReturn:
    raise DamagedCheckpointError(
        f"damaged checkpoint: {str(bad_file)!r} {what}; nothing was loaded from it. "
        f"{_alternatives(checkpoint)}"
    )


def _alternatives(checkpoint: Path) -> str:
    """Which other checkpoints sit next to the damaged one (cheap: one directory listing)."""
    folder = checkpoint.parent
    try:
        others = sorted(
            p.name
            for p in folder.iterdir()
            if p != checkpoint and not p.name.startswith(".") and _is_candidate(p)
        )
    except OSError:
        others = []
    if not others:
        return "Load an earlier checkpoint or save this one again"
    shown = ", ".join(others[:6]) + (f" and {len(others) - 6} more" if len(others) > 6 else "")
    return f"Load another checkpoint instead; {str(folder)!r} also holds: {shown}"


def _is_candidate(path: Path) -> bool:
    if path.is_dir():
        return (path / DCP_METADATA_FILENAME).is_file()
    return path.suffix in (".ckpt", ".pt", ".pth")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def describe_non_checkpoint(path: Path) -> str:
    """Why ``path`` is not a checkpoint, and what to pass instead."""
    if not path.exists():
        siblings = (
            sorted(p.name for p in path.parent.glob("*"))[:10] if path.parent.is_dir() else []
        )
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
