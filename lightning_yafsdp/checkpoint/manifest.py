"""The manifest of a sharded checkpoint: every file's size and CRC-32, as written.

[Note: checkpoint manifest]
``save_sharded`` ends by writing ``yafsdp-manifest.json`` next to DCP's files:
``{"manifest_version": 1, "files": {name: {"bytes": int, "crc32": "8 hex digits"}}}``.
Each rank digests the files it wrote (DCP names them ``__<rank>_<i>.distcp``), rank 0
also ``.metadata`` and ``meta.pt``; one ``all_gather_object`` brings the digests to
rank 0, which writes the manifest inside the same atomic save ([Note: atomic
commit]). The files were just written, so they are read back from the page cache:
CRC-32 runs at about 1.5 GB/s per rank, in parallel over ranks (0.18 s of a 1.9 s
save of 121 MiB on 2 ranks sharing 2 busy cores). Verification ([Note: verify before
reading]) checks the recorded sizes on every load, which gives the exact expected length
of ``meta.pt`` and ``.metadata`` too; the checksums, which read every byte, on every load
unless ``verify_checksums=False`` ([Note: checksums on load]) and with ``yafsdp inspect
--verify``. Directories written before the manifest existed, or by
Lightning's FSDP strategy, have none and verify by sizes from ``.metadata``.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_yafsdp.checkpoint.atomic import DCP_METADATA_FILENAME, fsync_file
from lightning_yafsdp.core.comm.collectives import all_gather_objects

MANIFEST_FILENAME = "yafsdp-manifest.json"
MANIFEST_VERSION = 1
_READ_CHUNK_BYTES = 8 << 20


def file_digest(path: Path) -> dict[str, Any]:
    """``{"bytes": size, "crc32": "hex"}`` of one file, read in 8 MiB chunks."""
    crc = 0
    with open(path, "rb") as stream:
        while chunk := stream.read(_READ_CHUNK_BYTES):
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

    Args:
        directory: the (temporary) checkpoint directory, every file already written.
        rank_zero_files: names rank 0 wrote besides its DCP data (``meta.pt``).
        group: the process group that saved (None: the default group, or no group).
        failure: this rank's error while writing its files; every rank still calls
            in, so none waits forever, and nothing is written.

    Raises:
        BaseException: ``failure`` itself, on the rank that passed it.
        OSError: on the other ranks when any rank failed or could not read its files.
    """
    rank, world_size = _rank_and_size(group)
    digests: dict[str, Any] = {}
    error = None if failure is None else f"rank {rank}: {type(failure).__name__}: {failure}"
    if failure is None:
        own = sorted(p.name for p in directory.glob(f"__{rank}_*.distcp"))
        if rank == 0:
            own += [DCP_METADATA_FILENAME, *rank_zero_files]
        try:
            digests = {name: file_digest(directory / name) for name in own}
        except OSError as exc:
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
    gathered: list[Any] = [(digests, error)]
    if world_size > 1:
        gathered = all_gather_objects((digests, error), group=group)
    errors = [e for _, e in gathered if e is not None]
    if failure is not None:
        raise failure
    if errors:
        raise OSError(
            f"writing the checkpoint files or reading them back failed ({'; '.join(errors)})"
        )
    if rank == 0:
        files = {name: digest for d, _ in gathered for name, digest in d.items()}
        target = directory / MANIFEST_FILENAME
        manifest = {"manifest_version": MANIFEST_VERSION, "files": dict(sorted(files.items()))}
        target.write_text(json.dumps(manifest, indent=1) + "\n")
        fsync_file(target)


def read_manifest(directory: Path) -> dict[str, dict[str, Any]] | None:
    """``{name: {"bytes", "crc32"}}`` from the manifest; None when there is none.

    Raises:
        ValueError: the manifest exists but is not the JSON we write (damaged).
    """
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


def _rank_and_size(group) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1
