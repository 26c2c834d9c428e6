"""``yafsdp prepare``: tokenize text once into a flat ``.bin`` token file.

A ``.bin`` file is the raw token stream, little-endian uint16 (vocab <= 65536) or
uint32, readable with ``np.memmap``; a ``.json`` sidecar next to it records the
dtype, vocab size, token count and tokenizer so training needs no guess.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lightning_yafsdp.data.sources import read_documents
from lightning_yafsdp.data.tokenizer import load_tokenizer


def sidecar_path(bin_path: str | Path) -> Path:
    return Path(bin_path).with_suffix(".json")


def prepare_bin(
    output: str | Path,
    *,
    source: str,
    path: str | None = None,
    tokenizer: str = "byte",
    max_bytes: int = 1 << 40,
    jsonl_field: str = "text",
    seed: int = 0,
) -> dict:
    """Tokenize a text source into ``output`` (``.bin``) and its ``.json`` sidecar.

    Returns:
        The sidecar's content: ``dtype``, ``vocab_size``, ``num_tokens``, ``tokenizer``.
    """
    docs = read_documents(
        source, path=path, max_bytes=max_bytes, jsonl_field=jsonl_field, seed=seed
    )
    tok = load_tokenizer(tokenizer)
    tokens = tok.encode_documents(docs)
    dtype = np.uint16 if tok.vocab_size <= 2**16 else np.uint32
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tokens.astype(np.dtype(dtype).newbyteorder("<")).tofile(output)
    meta = {
        "dtype": np.dtype(dtype).name,
        "vocab_size": tok.vocab_size,
        "num_tokens": int(len(tokens)),
        "tokenizer": tok.name,
        "source": source if source == "stdlib" else f"{source}:{path}",
    }
    sidecar_path(output).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def read_bin(path: str | Path, *, dtype: str | None = None) -> tuple[np.memmap, dict]:
    """Memory-map a ``.bin`` token file; the dtype comes from its sidecar (or ``dtype``).

    Raises:
        FileNotFoundError / ValueError: with what to pass instead.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"token file {path} does not exist; write it with yafsdp prepare")
    meta: dict = {}
    sidecar = sidecar_path(path)
    if sidecar.is_file():
        meta = json.loads(sidecar.read_text())
    dtype = dtype or meta.get("dtype")
    if dtype not in ("uint16", "uint32"):
        raise ValueError(
            f"{path}: no {sidecar.name} sidecar saying the dtype; .bin files are uint16 or "
            "uint32 (write them with yafsdp prepare)"
        )
    tokens = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")
    meta.setdefault("num_tokens", int(len(tokens)))
    return tokens, meta
