"""Tokens for training: sources, byte-level tokenizer, packed sequences, ``.bin`` files."""

from lightning_yafsdp.data.datamodule import TokenDataModule
from lightning_yafsdp.data.packed import PackedSequences, split_tokens, unigram_entropy
from lightning_yafsdp.data.prepare import prepare_bin, read_bin
from lightning_yafsdp.data.sources import read_documents, stdlib_files
from lightning_yafsdp.data.tokenizer import ByteTokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "PackedSequences",
    "TokenDataModule",
    "load_tokenizer",
    "prepare_bin",
    "read_bin",
    "read_documents",
    "split_tokens",
    "stdlib_files",
    "unigram_entropy",
]
