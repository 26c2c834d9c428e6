"""Tokenizers: UTF-8 bytes (vocab 256, no download) or a local Hugging Face tokenizer."""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    vocab_size: int
    name: str

    def encode_documents(self, docs: list[str]) -> np.ndarray: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocab 256, documents separated by a blank line."""

    vocab_size = 256
    name = "byte"

    def encode_documents(self, docs: list[str]) -> np.ndarray:
        """All documents as one uint16 token stream."""
        joined = "\n\n".join(docs).encode("utf-8")
        return np.frombuffer(joined, dtype=np.uint8).astype(np.uint16)

    def decode(self, tokens: list[int]) -> str:
        return bytes(tokens).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer from a local directory (``local_files_only``).

    Documents are separated by the tokenizer's EOS token when it has one.
    """

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as err:
            raise ImportError(
                "data.tokenizer is a Hugging Face tokenizer directory, which needs the 'hf' "
                "extra: pip install 'lightning-yafsdp[hf]'"
            ) from err
        self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = len(self._tok)
        self.name = path

    def encode_documents(self, docs: list[str]) -> np.ndarray:
        eos = self._tok.eos_token_id
        ids: list[int] = []
        for doc in docs:
            ids.extend(self._tok.encode(doc, add_special_tokens=False))
            if eos is not None:
                ids.append(eos)
        dtype = np.uint16 if self.vocab_size <= 2**16 else np.uint32
        return np.asarray(ids, dtype=dtype)


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """``"byte"`` or a local tokenizer directory."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
