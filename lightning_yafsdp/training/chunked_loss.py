"""Next-token cross-entropy with the output head run over chunks of tokens.

[Note: chunked loss] The whole logits of a micro-batch are ``tokens x vocab``: for
Llama-3-8B (vocab 128256) at 8192 tokens that is 4.2 GB in fp32, and backward holds
their gradient (and autograd the softmax) beside them. Here the head and the loss run
``chunk_tokens`` tokens at a time, each chunk under non-reentrant activation
checkpointing (``torch.utils.checkpoint``, ``use_reentrant=False``): the forward keeps
only the chunk's input (a slice of the final hidden states, which exist anyway) and its
summed loss; the backward recomputes the chunk's logits and backpropagates through
them, one chunk after another. So at most one chunk's logits (and their gradient)
exist at a time, and the result equals the unchunked mean to float round-off (the same
per-token terms, summed in another order).

The head is called as a module in every chunk, forward and recomputation alike, so a
sharded head (a unit or row chunks, [Note: root units], [Note: row chunks]) gathers its
weights through its own hooks: the engine's multi-call and recompute-in-backward paths
([Note: unit state machine]), exact against the whole loss (tests/test_chunked_loss.py).
Non-reentrant, because DDP refuses parameters marked ready in several reentrant
backward passes. The price, measured in docs/performance.md: the head is
reduce-scattered once per chunk instead of once per step; a head in row chunks is also
gathered once to three times more per chunk. Chunks of thousands of tokens keep that to
a few per step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_yafsdp.config import RunConfig

AUTO_CHUNK_LOGITS_BYTES = 2**31
"""``"auto"``: chunks whose fp32 logits are at most this many bytes (2 GiB)."""
AUTO_MIN_VOCAB = 32768
"""``"auto"`` chunks the loss of vocabularies at least this large (Llama-2's 32000 is not)."""


def recipe_chunk_tokens(config: RunConfig) -> int | None:
    """Tokens per loss chunk of a recipe's model (None: whole logits; ``kind="hf"``)."""
    if config.model.kind != "llama":
        return None
    from lightning_yafsdp.training.models import llama_config

    vocab_size = llama_config(config).vocab_size
    return chunk_tokens_for(config.model.loss_chunk_size, vocab_size=vocab_size)


def chunk_tokens_for(setting: str, *, vocab_size: int) -> int | None:
    """Tokens per chunk for a ``model.loss_chunk_size`` setting (None: whole logits).

    ``"auto"``: vocabularies of ``AUTO_MIN_VOCAB`` or more in chunks of
    ``AUTO_CHUNK_LOGITS_BYTES`` of fp32 logits (Llama-3's 128256: 4186 tokens rounded
    down to 4096), smaller ones whole; ``"none"`` or ``"0"``: whole; a number: that many
    tokens.
    """
    if setting in ("none", "0"):
        return None
    if setting == "auto":
        if vocab_size < AUTO_MIN_VOCAB:
            return None
        tokens = AUTO_CHUNK_LOGITS_BYTES // (4 * vocab_size)
        return max(64, 1 << (tokens.bit_length() - 1))  # a power of two: even chunks
    return int(setting) or None


def chunked_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    *,
    chunk_tokens: int,
    fp32: bool,
) -> torch.Tensor:
    """Mean cross-entropy of ``head(hidden)`` against ``targets``, ``chunk_tokens`` at a time.

    Args:
        hidden: The head's input, ``[..., dim]`` (e.g. ``[batch, seq, dim]``).
        head: The output projection, called as a module on each chunk.
        targets: Token ids, ``hidden.shape[:-1]``.
        chunk_tokens: Tokens per chunk (the last chunk may be shorter).
        fp32: Cast each chunk's logits to fp32 before the softmax ([YaLM]).

    Returns:
        The mean over all tokens (nats), in fp32: the chunks' sums are added in fp32
        whatever the logits' dtype.
    """
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = targets.reshape(-1)
    total = None
    for start in range(0, hidden.shape[0], chunk_tokens):
        args = (head, hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens])
        if torch.is_grad_enabled():  # no backward (validation): nothing to recompute
            part = checkpoint(_summed_loss, *args, fp32, use_reentrant=False)
        else:
            part = _summed_loss(*args, fp32)
        part = part.float()
        total = part if total is None else total + part
    return total / hidden.shape[0]


def _summed_loss(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, fp32: bool
) -> torch.Tensor:
    logits = head(hidden)
    if fp32:
        logits = logits.float()
    return F.cross_entropy(logits, targets, reduction="sum")
