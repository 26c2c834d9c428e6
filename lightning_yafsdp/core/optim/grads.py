"""The gradient of a master shard parameter, accumulated across micro-batches.

[Note: divide after reduce]
Gradients are reduce-scattered as SUMS and divided by the configured factor
(world size by default) only after the collective, as each reduced shard is
added into the master-dtype gradient. Nothing runs before a reduce_scatter
(no predivision on the communication path), and each backward's contribution
is divided exactly once, so accumulation over k micro-batches whose losses
are divided by k (as Lightning and DDP users do) equals one large batch,
without the engine having to know which backward is the last.

The first backward after ``optimizer.zero_grad()`` (every ``.grad is None``, the
torch default) writes into a new gradient window, one tensor of the master
shard's size (its reductions write straight into it: [Note: reduce into the
gradient window]); later backwards add. [Note: per-parameter grads] Each sharded
parameter's ``.grad`` is a RangeShardedTensor over its piece of the window, set at
the end of a backward for every parameter that some rank wrote a grad for; a
parameter no rank used keeps ``grad is None``, so the optimizer skips it, as
under DDP. Nothing but those ``.grad`` views references the window: when
``zero_grad`` has set them all to None, the window is freed. When only some
are None (two optimizers, each zeroing its own), their ranges are zeroed in
the live window at the next backward, so that they start from nothing.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from lightning_yafsdp.core.optim.huge_pages import empty_on_huge_pages
from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor


class ShardGrads:
    """Accumulates the gradients of one master shard and hands them to its parameters.

    Args:
        master: the flat master shard (fp32 by default).
        params: the sharded parameters stored in it, with their ranges in it.
    """

    def __init__(self, master: torch.Tensor, params: list[tuple[nn.Parameter, int, int]]) -> None:
        self.master = master
        self.params = params
        self._live: weakref.ref | None = None  # the window the params' .grad views read
        self._fresh: torch.Tensor | None = None  # a new window, until the end of backward
        self._written: set[tuple[int, int]] = set()
        # Ranges some reduction of this backward was issued for (it may not have landed).
        self._taken: set[tuple[int, int]] = set()

    def window(self) -> torch.Tensor | None:
        """The gradient window the parameters' grads are views of, if any grad is set."""
        if self._fresh is not None:
            return None
        live = self._live() if self._live is not None else None
        if live is not None and not any(p.grad is not None for p, _, _ in self.params):
            return None
        return live

    def begin_backward(self) -> None:
        """Called once at the start of every backward pass."""
        self._written.clear()
        self._taken.clear()
        live = self.window()
        if live is None:
            # Freed again at zero_grad: [Note: huge pages for the gradient window]
            self._fresh = empty_on_huge_pages(self.master)
            return
        for param, start, end in self.params:
            if param.grad is None:
                live[start:end].zero_()
            elif not _is_window_view(param.grad, live, start):
                _refuse_replaced_grad(param)

    def first_writes(
        self, ranges: list[tuple[int, int]], dtype: torch.dtype
    ) -> list[torch.Tensor] | None:
        """The window's slices for ``ranges``, if a reduction may write them directly.

        [Note: reduce into the gradient window] Only a fresh window (the first backward
        after ``zero_grad``) in ``dtype``, and only ranges no reduction of this backward
        was issued for: their first write, which replaces. The ranges count as written
        from now on (the caller divides them once the reduction is final). None: the
        reduction stages its result and adds it (``add``) once final.
        """
        window, taken = self._fresh, self._taken
        direct = (
            window is not None and window.dtype == dtype and not any(r in taken for r in ranges)
        )
        taken.update(ranges)  # a later reduction of these ranges adds, whichever path
        if not direct:
            return None
        self._written.update(ranges)
        return [window[start:end] for start, end in ranges]

    def add(self, start: int, end: int, reduced: torch.Tensor, divide_factor: float) -> None:
        """Add one reduced shard (a sum over ranks) into elements ``[start, end)``.

        A reduced shard in a narrower dtype (``reduce_dtype=torch.bfloat16``) is
        widened to the window's dtype first and divided there, so accumulation
        across micro-batches happens in the master dtype.
        """
        window = self._fresh if self._fresh is not None else self._live()
        target = window[start:end]
        first = self._fresh is not None and (start, end) not in self._written
        if reduced.dtype == window.dtype:
            reduced.div_(divide_factor)
            target.copy_(reduced) if first else target.add_(reduced)
        elif first:
            target.copy_(reduced).div_(divide_factor)
        else:
            target.add_(reduced, alpha=1.0 / divide_factor)
        if self._fresh is not None:
            self._written.add((start, end))

    def abandon_backward(self) -> None:
        """A backward raised before its end: drop what it accumulated in a fresh window."""
        self._fresh = None
        self._written.clear()
        self._taken.clear()

    def end_backward(self, ranges: list[tuple[int, int]], used: list[bool]) -> None:
        """Expose the window as ``.grad`` of every parameter some rank used.

        Args:
            ranges: the master ranges of every group of this master (to zero the
                ones no reduce wrote in a fresh window).
            used: per parameter of ``params``, whether any rank wrote a grad for it
                in this backward.
        """
        window = self._fresh
        if window is not None:
            if not any(used):
                self._fresh = None  # nothing to hand out: every grad stays None
                return
            for start, end in ranges:
                if (start, end) not in self._written:
                    window[start:end].zero_()
            self._live, self._fresh = weakref.ref(window), None
        window = self._live()
        for (param, start, end), was_used in zip(self.params, used, strict=True):
            if was_used and param.grad is None:
                param.grad = RangeShardedTensor(window[start:end], param._placement, param._group)


def _is_window_view(grad: torch.Tensor, live: torch.Tensor, start: int) -> bool:
    return (
        isinstance(grad, RangeShardedTensor)
        and grad._local.untyped_storage().data_ptr() == live.untyped_storage().data_ptr()
        and grad._local.storage_offset() == live.storage_offset() + start
    )


def _refuse_replaced_grad(param: nn.Parameter) -> None:
    raise RuntimeError(
        f"the .grad of the sharded parameter {param._placement.name!r} was replaced by "
        "another tensor. The engine adds each backward's gradients into its own "
        "gradient window; set .grad to None (optimizer.zero_grad()) or modify it in "
        "place (p.grad.mul_(...)) instead of assigning a new tensor."
    )
