"""The gradient of a master shard parameter, accumulated across micro-batches.

[Note: divide after reduce]
Gradients are reduce-scattered as SUMS and divided by the configured factor
(world size by default) only after the collective, as each reduced shard is
added into the master-dtype gradient. Nothing runs before a reduce_scatter
(no predivision on the communication path), and each backward's contribution
is divided exactly once, so accumulation over k micro-batches whose losses
are divided by k (as Lightning and DDP users do) equals one large batch,
without the engine having to know which backward is the last.

The first backward after ``optimizer.zero_grad()`` (``.grad is None``, the
torch default) writes into a new gradient tensor; later backwards add. The
optimizer sees one fused gradient per master parameter.
"""

from __future__ import annotations

import torch
from torch import nn


class ShardGrads:
    """Accumulates the gradient of one master shard parameter.

    The gradient tensor is allocated at the first backward of an accumulation
    window and handed to ``master.grad``; the engine keeps no reference, so
    ``optimizer.zero_grad()`` (``set_to_none=True``) frees it between steps,
    as torch does for ordinary parameters.

    Args:
        master: the master shard parameter (fp32 by default).
    """

    def __init__(self, master: nn.Parameter) -> None:
        self.master = master
        self._window: torch.Tensor | None = None  # a fresh window's grad, until end of backward
        self._written: set[tuple[int, int]] = set()

    def begin_backward(self) -> None:
        """Called once at the start of every backward pass."""
        self._written.clear()
        if self.master.grad is None:
            self._window = torch.empty_like(self.master, memory_format=torch.contiguous_format)

    def add(self, start: int, end: int, reduced: torch.Tensor, divide_factor: float) -> None:
        """Add one reduced shard (a sum over ranks) into elements ``[start, end)``."""
        reduced.div_(divide_factor)
        if self._window is not None and (start, end) not in self._written:
            self._window[start:end].copy_(reduced)
            self._written.add((start, end))
        else:
            target = self.master.grad if self._window is None else self._window
            target[start:end].add_(reduced)

    def abandon_backward(self) -> None:
        """A backward raised before its end: drop what it accumulated in a fresh window."""
        self._window = None
        self._written.clear()

    def end_backward(self, ranges: list[tuple[int, int]]) -> None:
        """Zero what no reduce wrote in a fresh window and expose it as ``.grad``."""
        if self._window is None:
            return
        for start, end in ranges:
            if (start, end) not in self._written:
                self._window[start:end].zero_()
        self.master.grad, self._window = self._window, None
