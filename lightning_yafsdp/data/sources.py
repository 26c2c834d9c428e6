"""Where text comes from: the standard library's own sources, text files, JSONL.

[Note: stdlib corpus] The default data is the ``*.py`` sources of the running
Python's standard library: present on every machine, no download, plenty of
structure for a byte-level model to learn in a couple of minutes. The file list is
sorted, then shuffled with a fixed seed (so train and validation both mix modules
rather than validation being all ``xml/`` and ``zipfile``), then read up to a byte
cap; for a given Python build the result is identical on every rank and every run.
"""

from __future__ import annotations

import glob
import json
import random
import sysconfig
from collections.abc import Iterator
from pathlib import Path

_TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst", ".text")
_SKIPPED_STDLIB_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test"}


def stdlib_files(*, seed: int = 0) -> list[Path]:
    """The standard library's ``*.py`` files in a deterministic, seed-shuffled order.

    Test suites and installed packages are left out (``test/``, ``site-packages/``).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        path
        for path in root.rglob("*.py")
        if not _SKIPPED_STDLIB_DIRS.intersection(path.relative_to(root).parts[:-1])
    )
    if not files:
        raise FileNotFoundError(
            f"no *.py files under the standard library directory {root}; this Python "
            "ships without sources: use data.source=text with data.path=..."
        )
    random.Random(seed).shuffle(files)
    return files


def read_documents(
    source: str,
    *,
    path: str | None = None,
    max_bytes: int,
    jsonl_field: str = "text",
    seed: int = 0,
) -> list[str]:
    """Read documents (one string each) from a source, up to ``max_bytes`` of UTF-8.

    Args:
        source: ``"stdlib"``, ``"text"`` or ``"jsonl"``.
        path: File, directory or glob (text/jsonl).
        max_bytes: Stop once this much text has been read (bytes, UTF-8).
        jsonl_field: JSON key of the text in each JSONL line.
        seed: Shuffle seed of the stdlib file order.

    Raises:
        FileNotFoundError: if the path matches nothing.
        ValueError: for a JSONL line without ``jsonl_field``.
    """
    if source == "stdlib":
        docs: Iterator[str] = (_read_text(p) for p in stdlib_files(seed=seed))
    elif source == "text":
        docs = (_read_text(p) for p in _expand(path, _TEXT_SUFFIXES))
    elif source == "jsonl":
        docs = (doc for p in _expand(path, (".jsonl", ".json")) for doc in _jsonl(p, jsonl_field))
    else:
        raise ValueError(f"unknown text source {source!r}: use stdlib, text or jsonl")
    out: list[str] = []
    total = 0
    for doc in docs:
        size = len(doc.encode("utf-8"))
        if total + size > max_bytes:
            remaining = max_bytes - total
            if remaining > 0:
                out.append(doc.encode("utf-8")[:remaining].decode("utf-8", errors="ignore"))
            break
        out.append(doc)
        total += size
    if not out:
        raise ValueError(f"no text read from data.source={source!r} path={path!r}")
    return out


def _expand(path: str | None, suffixes: tuple[str, ...]) -> list[Path]:
    if not path:
        raise FileNotFoundError("data.path is empty")
    candidate = Path(path).expanduser()
    if candidate.is_file():
        return [candidate]
    if candidate.is_dir():
        files = sorted(p for p in candidate.rglob("*") if p.is_file() and p.suffix in suffixes)
    else:
        files = sorted(Path(p) for p in glob.glob(str(candidate), recursive=True))
    if not files:
        raise FileNotFoundError(
            f"data.path={path!r} matches no file (looked for {', '.join(suffixes)})"
        )
    return files


def _read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _jsonl(path: Path, field: str) -> Iterator[str]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            record = json.loads(line)
            if field not in record:
                raise ValueError(
                    f"{path}:{number}: no key {field!r} in the JSON object (keys: "
                    f"{', '.join(record)}); set data.jsonl_field"
                )
            yield str(record[field])
