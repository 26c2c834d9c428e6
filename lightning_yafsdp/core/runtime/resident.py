"""Resident groups: the norm group and the root remainder.

[Note: resident groups]
Some parameters are used at scattered moments of the step rather than inside
one block: norm weights (in every block and after the last one) and the small
parameters outside all blocks that are no root unit (position embeddings,
poolers, a ``cls_token`` on the root: [Note: root units]; the root remainder).
Each such group has a buffer of its own. Its weights are gathered ONCE after
every optimizer step and stay resident; its grads accumulate in a full-size
grad buffer during backward and are reduce-scattered ONCE, at the end of
backward. For norms this is the YaFSDP article's fix for the "fir tree": no
tiny per-layer collectives or copies. Norms get their own master parameter
(a separate optimizer param group, usually without weight decay); the root
remainder lives in the units' master parameter.

[Note: batched step-boundary collectives]
A step has two boundaries where several small collectives meet: the first forward
after an optimizer step gathers every resident group, and the end of backward
reduces every resident group and all-reduces the used-parameter flags. Issued and
waited one at a time they cost one round trip each (on gloo ~0.2-1 ms, all of it
exposed: nothing computes meanwhile). The engine issues all of a boundary's
collectives first (``start_gather`` / ``start_reduction``), then waits for them, so
a boundary costs about one round trip. The order of issue is the same on every
rank, as the order guard requires.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_yafsdp.core.comm.buffers import GradBuffer, WeightBuffer
from lightning_yafsdp.core.comm.collectives import all_gather_into
from lightning_yafsdp.core.comm.step_timing import timed_hook
from lightning_yafsdp.core.optim.grads import ShardGrads
from lightning_yafsdp.core.runtime.context import StepContext
from lightning_yafsdp.core.runtime.flat_group import FlatParamGroup


class ResidentGroup(FlatParamGroup):
    """A flat group gathered once per optimizer step and reduced once per backward.

    Args:
        context: the step context of the engine ([Note: step context]).
        grads: the master-dtype gradient its reduced shard is added to.
        **group_kwargs: see ``FlatParamGroup``.
    """

    def __init__(self, context: StepContext, *, grads: ShardGrads, **group_kwargs: Any) -> None:
        super().__init__(**group_kwargs)
        self.context = context
        self.grads = grads
        device = self.master_shard.device
        self.weight_buffer = WeightBuffer(
            -1, self.layout.padded_numel, dtype=context.param_dtype, device=device
        )
        self.grad_buffer = GradBuffer(
            -1, self.layout.padded_numel, dtype=context.reduce_dtype, device=device
        )
        # Its index in collective-order tags (units use 0, 1, ...).
        self.guard_index = -2 if grads is context.norm_grads else -1
        self._view_version = -1
        self._views_differentiable = False
        self._views_in_graph = False  # differentiable views handed out since the last backward
        self._gather_source: torch.Tensor | None = None  # what a gather in flight reads

    def start_gather(self) -> None:
        """Issue the gather of the weights if they changed since the last one; no wait.

        The engine starts every resident's gather before waiting for any
        (``ensure_views``), so the groups' round trips overlap ([Note: batched
        step-boundary collectives]).
        """
        ctx = self.context
        version = ctx.compute_version
        buffer = self.weight_buffer
        if buffer.holds(self, version):
            return
        buffer.holder, buffer.version = self, version
        # [Note: cast on gather] Without a compute twin, a cast copy of the shard
        # (small, once per optimizer step) is the gather source.
        source, after = self.compute_shard, None
        if source is None:
            source = self.master_shard.to(ctx.param_dtype)
            after = ctx.scheduler.compute_marker()  # the gather reads the cast
        # Kept until the gather is waited: freed earlier, the cast's memory could be
        # reused on the compute stream while the comm stream still reads it (CUDA).
        self._gather_source = source
        buffer.gather = ctx.scheduler.issue(
            "gather",
            unit=self.name,
            slot=None,
            tag=(self.guard_index, self.layout.padded_numel),
            launch=lambda async_op, exchange: all_gather_into(
                buffer.tensor, source, exchange.group, async_op=async_op, stats=ctx.comm_stats,
                key=exchange.key,
            ),  # fmt: skip
            after=after,
        )

    @timed_hook
    def ensure_views(self) -> None:
        """Gather if the weights changed, and expose views fit for the current grad mode."""
        self.start_gather()
        buffer = self.weight_buffer
        if buffer.gather is not None:
            buffer.gather.wait()
            buffer.gather = None
        self._gather_source = None
        version = self.context.compute_version
        differentiable = torch.is_grad_enabled()
        if self._view_version == version and (self._views_differentiable or not differentiable):
            return  # differentiable views also serve no-grad forwards
        self.install_views(buffer.tensor, differentiable=differentiable)
        self._view_version = version
        self._views_differentiable = differentiable
        self._views_in_graph |= differentiable

    @timed_hook
    def accumulate_param_grad(self, index: int, grad: torch.Tensor) -> None:
        if not self.has_grad_target:
            self.context.enter_backward()
            self.begin_grad_writes(self.grad_buffer)
        super().accumulate_param_grad(index, grad)

    def start_reduction(self) -> Callable[[], None] | None:
        """Issue the end-of-backward reduction; returns what completes it (None: none needed).

        Issued on every rank whenever the group's differentiable views took part
        in the forward, even if no grad reached them here, so that all ranks
        issue the same collectives in the same order; and whenever grads were
        written in this backward, even through views of an earlier backward's
        graph (a second ``backward`` of a retained graph). Skipping that case
        lost those grads and left the buffer's write marks set, so the next
        backward ADDED onto them and never re-zeroed the spans it did not
        reach: a stale grad. The engine issues every resident's reduction before
        completing any ([Note: batched step-boundary collectives]).
        """
        if not self._views_in_graph and not self.has_grad_target:
            return None
        ctx = self.context
        if not self.has_grad_target:
            self.begin_grad_writes(self.grad_buffer)
        self.finish_grad_writes()
        full = self.grad_buffer.tensor
        start, end = self.grad_range
        # Into the gradient window, or staged in the grad buffer ([Note: reduce into the
        # gradient window]).
        reduced, on_reduced, _ = ctx.reduce_output(self.grads, start, end, full)
        pending = ctx.issue_reduction(
            unit=self.name,
            slot=None,
            tag=(self.guard_index, self.layout.padded_numel),
            scatter=ctx.reduce_scatter(full, reduced),
            replicate=ctx.replicate(reduced),
        )
        # The graph that used the views is consumed; the next grad-mode forward re-creates them.
        self._views_in_graph = False
        self.uninstall_views()
        self.forget_views()

        def finish() -> None:
            pending.wait()
            on_reduced()

        return finish

    def forget_views(self) -> None:
        """The installed views are gone: the next forward installs fresh ones."""
        self._view_version = -1
        self._views_differentiable = False
