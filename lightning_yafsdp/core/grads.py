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
torch default) writes; later backwards add. ``.grad`` is always this object's
tensor, so the optimizer sees one fused gradient per master parameter.
"""

from __future__ import annotations

import torch
from torch import nn


class ShardGrads:
    """Owns the gradient tensor of one master shard parameter.

    Args:
        master: the master shard parameter (fp32 by default).
    """

    def __init__(self, master: nn.Parameter) -> None:
        self.master = master
        self.storage = torch.zeros_like(master, memory_format=torch.contiguous_format)
        self._fresh = False
        self._written: set[tuple[int, int]] = set()

    def begin_backward(self) -> None:
        """Called once at the start of every backward pass."""
        self._fresh = self.master.grad is None
        self._written.clear()

    def add(self, start: int, end: int, reduced: torch.Tensor, divide_factor: float) -> None:
        """Add one reduced shard (a sum over ranks) into elements ``[start, end)``."""
        reduced.div_(divide_factor)
        target = self._target()[start:end]
        if self._fresh and (start, end) not in self._written:
            target.copy_(reduced)
            self._written.add((start, end))
        else:
            target.add_(reduced)

    def end_backward(self, ranges: list[tuple[int, int]]) -> None:
        """Zero the ranges no reduce wrote in a fresh window and expose ``.grad``."""
        if self._fresh:
            for start, end in ranges:
                if (start, end) not in self._written:
                    self.storage[start:end].zero_()
        if self.master.grad is None:
            self.master.grad = self.storage
        self._fresh = False

    def _target(self) -> torch.Tensor:
        return self.storage if self.master.grad is None else self.master.grad
