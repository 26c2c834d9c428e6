"""Packed fixed-length sequences over one flat token stream.

Documents are concatenated into one stream and cut into windows of
``seq_len + 1`` tokens that start every ``seq_len`` tokens (each window's last
token is the next one's first): the model reads ``window[:-1]`` and predicts
``window[1:]``, and no token of the stream is wasted. The stream is split
before windowing, train first, validation the tail, so no window straddles the
two.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Dataset


class PackedSequences(Dataset):
    """Windows of ``seq_len + 1`` tokens over a 1-D token array (memmap or in memory).

    Args:
        tokens: 1-D integer array (uint16/uint32/int64).
        seq_len: Tokens the model reads per sequence.

    Raises:
        ValueError: if the stream is shorter than one window.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"only {len(tokens)} tokens: fewer than one sequence of {seq_len} + 1; "
                "use more text (data.max_bytes) or a shorter data.seq_len"
            )
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * self.seq_len
        window = np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)
        return torch.from_numpy(window)


def split_tokens(tokens: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """Split a stream into ``(train, val)``: validation is the last ``val_fraction``."""
    val_len = max(1, int(len(tokens) * val_fraction))
    return tokens[: len(tokens) - val_len], tokens[len(tokens) - val_len :]


def unigram_entropy(tokens: np.ndarray, vocab_size: int) -> float:
    """Entropy of the token frequencies of ``tokens`` in nats.

    The loss of the best model that ignores context: a trained language model's
    validation loss should end clearly below it.
    """
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=vocab_size)
    probs = counts[counts > 0] / counts.sum()
    return float(-(probs * np.log(probs)).sum()) if len(probs) else math.nan
