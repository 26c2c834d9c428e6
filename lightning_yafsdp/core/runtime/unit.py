"""A sharded unit (a transformer block): its hooks, driven by its state machine.

A training step, seen from one unit ``i`` (ZeRO-3, two weight buffers):

forward   pre-forward hook: wait for its gather into weight buffer i % 2
          (condition 1), prefetch unit i + 1 into the other buffer, gate the
          inputs and the buffer (``GateGradFlow``), expose params as views.
          post-forward hook (``always_call``: also when forward raises):
          release the buffer (condition 2), wrap the outputs in
          ``PreBackwardGate``.
backward  ``PreBackwardGate.backward`` -> ``pre_backward``: claim grad buffer
          i % 2 once the previous user's reduce_scatter is done (condition 3),
          re-gather the weights if the buffer was taken (ZeRO-3), prefetch the
          unit before it.
          ``Narrow.backward`` writes each param grad into the grad buffer.
          ``GateGradFlow.backward`` -> ``post_backward``: one call's grads are
          all in the buffer; after the last call (condition 4) issue the
          reduce_scatter (hybrid sharding: then the replicate all_reduce of
          the reduced shard), straight into the master-dtype grad window (or
          staged in the grad buffer: [Note: reduce into the gradient window]);
          it is divided there (or added) right before the next reduce_scatter
          from that grad buffer, or at the end of backward.

Which of these a hook may do is decided by the unit's ``UnitLifecycle``
([Note: unit state machine], ``unit_state.py``): every transition, the
exceptional ones too, goes through it.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from lightning_yafsdp.core.comm.collectives import all_gather_into
from lightning_yafsdp.core.comm.step_timing import timed_hook
from lightning_yafsdp.core.comm.work_list import WorkList
from lightning_yafsdp.core.compat import outside_compile
from lightning_yafsdp.core.runtime.autograd import GateGradFlow, PreBackwardGate
from lightning_yafsdp.core.runtime.context import StepContext
from lightning_yafsdp.core.runtime.flat_group import FlatParamGroup
from lightning_yafsdp.core.runtime.tensor_tree import map_tensors, tensors_in
from lightning_yafsdp.core.runtime.unit_state import UnitLifecycle, UnitState

__all__ = ["ShardedUnit", "UnitState"]


class ShardedUnit(FlatParamGroup):
    """One unit: a module whose parameters are gathered around its forward and backward.

    Args:
        context: the step context of the engine: buffers, schedule ([Note: step context]).
        index: position in module order; selects the weight and grad buffers.
        modules: the unit's modules: one block, or a root unit's modules (an
            embedding, a head; several when a tied tensor joins them, each call
            of any of them is one call of the unit).
        is_block: a block the policy chose; False for a root unit ([Note: root
            units]), whose views are dropped after each forward.
        **group_kwargs: see ``FlatParamGroup``.
    """

    def __init__(
        self,
        context: StepContext,
        index: int,
        modules: list[nn.Module],
        *,
        is_block: bool = True,
        **group_kwargs: Any,
    ) -> None:
        super().__init__(**group_kwargs)
        self.context = context
        self.index = index
        self.modules = modules
        self.module = modules[0]
        self.is_block = is_block
        # [Note: weightless backward] nn.Embedding's backward reads the indices and the
        # output grad, never the weight: a unit made only of plain embeddings (the usual
        # first root unit) is not re-gathered for its backward (ZeRO-3 saves one
        # embedding-sized all_gather per step). Subclasses may override forward: they
        # are re-gathered as any unit.
        # (ShardingPlan.backward_reads_weights applies the same rule, for estimates.)
        self.backward_reads_weights = not all(type(m) is nn.Embedding for m in modules)
        self.weight_buffer = context.weight_slot(index)
        self.grad_buffer = context.grad_slot(index)
        self.life = UnitLifecycle(self.name)
        self._hooks = []
        for module in modules:
            self._hooks += [
                module.register_forward_pre_hook(
                    outside_compile(self._pre_forward), with_kwargs=True
                ),
                module.register_forward_hook(outside_compile(self._post_forward), always_call=True),
            ]
        self._original_forwards: list[tuple[nn.Module, Any]] = []  # under checkpointing

    @property
    def state(self) -> UnitState:
        return self.life.state

    @property
    def in_forward(self) -> bool:
        """Whether the unit's forward is running (a unit called now is nested in it)."""
        return self.life.state in (UnitState.FORWARD, UnitState.NO_GRAD_FORWARD)

    @property
    def is_computing(self) -> bool:
        """Whether the unit computes with its weight buffer now (the buffer is in use)."""
        if self.life.state is UnitState.BACKWARD and not self.backward_reads_weights:
            return False  # [Note: weightless backward]
        return self.life.computing

    # -- gathering -------------------------------------------------------------

    def prefetch(self) -> None:
        """Start gathering into this unit's buffer if it is free; never blocks."""
        buffer = self.weight_buffer
        if self._holds_weights(buffer) or buffer.in_use:
            return
        self._issue_gather()

    def _holds_weights(self, buffer) -> bool:
        """Whether ``buffer`` holds (or is receiving) this unit's current weights."""
        return buffer.holds(self, self.context.compute_version)

    def _ensure_gathered(self) -> None:
        buffer = self.weight_buffer
        if not self._holds_weights(buffer):
            if buffer.in_use:
                raise RuntimeError(
                    f"unit '{self.name}' is called while its weight buffer {buffer.index} is "
                    f"held by '{buffer.holder.name}', whose forward/backward has not finished. "
                    "Nested sharded units are not supported: list only the outer module in "
                    "units=."
                )
            self._issue_gather()
        if buffer.gather is not None:
            buffer.gather.wait()  # condition 1
            buffer.gather = None

    def _issue_gather(self) -> None:
        buffer = self.weight_buffer
        if buffer.gather is not None:
            buffer.gather.wait()  # a prefetch for another unit: let it land before overwriting
        ctx = self.context
        if buffer.holder is not None and buffer.holder is not self:
            buffer.holder.yield_buffer()
        buffer.holder = self
        buffer.version = ctx.compute_version
        launch, after, staged = self._gather_launch(buffer)
        buffer.gather = ctx.scheduler.issue(
            "gather",
            unit=self.name,
            slot=buffer.index,
            tag=(self.index, self.layout.padded_numel),
            launch=launch,
            after=after,
        )
        buffer.release_event = None
        if staged:
            ctx.staged_read(self.index, buffer.gather)

    def _gather_launch(self, buffer) -> tuple:
        """``(launch, after, staged)``: the collectives writing ``buffer``, the compute
        event they wait for, and whether they read gather staging ([Note: cast on gather])."""
        ctx = self.context
        padded = self.layout.padded_numel
        source, after = self.compute_shard, buffer.release_event  # condition 2
        if source is None:
            # [Note: cast on gather] The cast runs on the compute stream after the
            # release point, so a marker after it orders the gather after both.
            source = ctx.stage(self.index, self.master_shard)
            after = ctx.scheduler.compute_marker()
        pieces = [(buffer.tensor[:padded], source)]
        if self.frozen_layout is not None:  # [Note: frozen shards] right after, no grads
            frozen_end = padded + self.frozen_layout.padded_numel
            pieces.append((buffer.tensor[padded:frozen_end], self.frozen_shard))

        def launch(async_op: bool, exchange):
            works = [
                all_gather_into(
                    out, shard, exchange.group, async_op=async_op, stats=ctx.comm_stats,
                    key=exchange.key,
                )  # fmt: skip
                for out, shard in pieces
            ]
            return WorkList(works) if async_op else None

        return launch, after, self.compute_shard is None

    def yield_buffer(self) -> None:
        """Another unit gathers into this block's weight buffer between its forward and
        the end of the step: the views the forward left ([Note: views outlive forward])
        would read that unit's weights, so until pre-backward installs fresh ones the
        attributes are ``UngatheredWeight``s, which refuse to compute ([Note: ungathered
        weights]). A penalty on ``layer.weight`` computed after the forward then raises
        instead of training on another block's weights."""
        waiting = (UnitState.AWAITING_BACKWARD, UnitState.BACKWARD_PAUSED, UnitState.BACKWARD_DONE)
        if self.is_block and self.life.state in waiting:
            self.uninstall_views()
            buffer = self.weight_buffer.tensor
            self.param_group.expose_ungathered(buffer.dtype, buffer.device)

    def _release_weights(self, note: str) -> None:
        """The unit stops computing with its weight buffer (condition 2's release point)."""
        if note == "backward_end" and not self.backward_reads_weights:
            self.context.scheduler.note("backward_end_weightless", self.name, None)
            return  # it never took the buffer for its backward
        buffer = self.weight_buffer
        buffer.release_event = self.context.scheduler.compute_marker()
        self.context.scheduler.note(note, self.name, buffer.index)

    # -- forward ---------------------------------------------------------------

    @timed_hook
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if all(module is not own for own in self.modules):
            raise RuntimeError(
                f"the forward of a deep copy of the sharded unit '{self.name}' was called: a "
                "copy of a sharded model (copy.deepcopy, an EMA's AveragedModel) holds this "
                "rank's shards only and cannot compute. Average, save or load it, or run the "
                "original model (swap weights into it, as WeightAveraging does)."
            )
        if self.life.state is UnitState.BACKWARD:
            # Non-reentrant checkpointing re-runs forward (with hooks) inside this
            # unit's backward: the weights are gathered already; fresh views that
            # require grad make recomputation save what forward saved.
            self.install_views(self.weight_buffer.tensor, differentiable=True)
            return None
        ctx = self.context
        ctx.begin_forward()
        ctx.refuse_nested_call(self)
        self.refuse_unfrozen()
        grad_enabled = torch.is_grad_enabled()
        if grad_enabled and ctx.inside_autograd_backward():
            # A reentrant checkpoint recomputes this unit inside the OUTER backward,
            # then runs a nested backward over it: the end-of-backward callback must
            # be queued now, on the outer graph task (see StepContext.enter_backward).
            ctx.enter_backward()
        if grad_enabled and self.life.state is UnitState.BACKWARD_PAUSED:
            self._reduce()  # a new call cannot join a backward already under way
        self._ensure_gathered()
        self.life.fire("forward" if grad_enabled else "no_grad_forward")
        ctx.scheduler.note("forward_start", self.name, self.weight_buffer.index)
        if not ctx.in_backward:
            ctx.prefetch_next(self)
        args, kwargs = ctx.cast_inputs(args, kwargs)
        if not grad_enabled:
            self.install_views(self.weight_buffer.tensor, differentiable=False)
            return args, kwargs
        where = f"the inputs of unit '{self.name}'"
        found = tensors_in((args, kwargs), where=where, objects=False)
        inputs = [t for t in found if t.requires_grad]
        gated_buffer, *gated = GateGradFlow.apply(self, self.weight_buffer.tensor, *inputs)
        self.install_views(gated_buffer, differentiable=True)
        return _substitute((args, kwargs), inputs, gated, where=where, objects=False)

    @timed_hook
    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        state = self.life.state
        if state not in (UnitState.FORWARD, UnitState.NO_GRAD_FORWARD):
            return output  # recomputation inside backward, or our pre-hook refused the call
        # always_call: torch also runs this hook when forward raised (output is None).
        failed = output is None and sys.exc_info()[0] is not None
        self._release_weights("forward_end")
        if state is UnitState.NO_GRAD_FORWARD or failed:
            no_grad = state is UnitState.NO_GRAD_FORWARD
            self.life.fire("no_grad_done" if no_grad else "forward_failed")
            # A pending backward does not need these attributes: pre_backward installs
            # fresh views ([Note: fresh views for recomputation]).
            self.uninstall_views()
            self.expose_placeholders()
            return output
        self.life.fire("forward_done")
        if not self.is_block:
            # [Note: root units] Nothing recomputes a root unit without our hooks, and
            # a later read of its weights (a head reading the embedding's weight) must
            # not see whatever unit the buffer holds by then: it finds an
            # UngatheredWeight, which refuses to compute ([Note: ungathered weights]).
            self.uninstall_views()
            self.expose_placeholders()
        # [Note: views outlive forward] After a grad-enabled forward the views
        # stay installed until the end of backward: activation checkpointing
        # may re-run the module's forward without our hooks (Hugging Face calls
        # ``layer.forward`` directly), and pre_backward has re-gathered the
        # weights into the buffer those views read by then; pre_backward also
        # installs fresh ones for recomputation inside backward.
        where = f"the output of unit '{self.name}'"
        outputs = [t for t in tensors_in(output, where=where, objects=True) if t.requires_grad]
        if not outputs:
            return output
        gated = PreBackwardGate.apply(self, *outputs)
        return _substitute(output, outputs, gated, where=where, objects=True)

    # -- backward --------------------------------------------------------------

    @timed_hook
    def pre_backward(self) -> None:
        """Claim the grad buffer and the gathered weights for this unit's backward."""
        state = self.life.state
        if state is UnitState.BACKWARD:
            return
        ctx = self.context
        ctx.enter_backward()
        if state is not UnitState.BACKWARD_PAUSED:
            self._claim_grad_buffer()
        if not self.backward_reads_weights:
            self.life.fire("pre_backward")
            ctx.scheduler.note("backward_start_weightless", self.name, None)
            return
        self._ensure_gathered()
        self.life.fire("pre_backward")
        if not self.is_block:  # root units are never recomputed: their saved views suffice
            ctx.scheduler.note("backward_start", self.name, self.weight_buffer.index)
            ctx.prefetch_previous(self)
            return
        # [Note: fresh views for recomputation] Recomputation in this backward reads
        # the module attributes. Views of the forward's gated buffer would tie a
        # reentrant checkpoint's NESTED backward to the outer graph (through
        # GateGradFlow to the earlier units, whose checkpoints would then run twice);
        # views of the plain buffer end the nested graph at this unit. GateGradFlow
        # still runs in the outer backward, after the nested one wrote every grad.
        # (Autograd runs backward hooks with grad mode off: the views need it on.)
        with torch.enable_grad():
            self.install_views(self.weight_buffer.tensor, differentiable=True)
        ctx.scheduler.note("backward_start", self.name, self.weight_buffer.index)
        ctx.prefetch_previous(self)

    def _claim_grad_buffer(self) -> None:
        grad_buffer = self.grad_buffer
        holder = grad_buffer.holder
        if holder is not None and holder is not self and holder.life.holds_grad_buffer:
            if holder.life.state is UnitState.BACKWARD:
                raise RuntimeError(
                    f"the backward of unit '{self.name}' starts while '{holder.name}' still "
                    f"writes grad buffer {grad_buffer.index}: units interleave in backward, "
                    "which two grad buffers cannot serve. Make units run one after another "
                    "(no unit calling another)."
                )
            holder.flush()  # paused between two calls: reduce its partial sum now
        grad_buffer.wait_scatter()  # condition 3
        grad_buffer.holder = self
        self.begin_grad_writes(grad_buffer)

    @timed_hook
    def accumulate_param_grad(self, index: int, grad: torch.Tensor) -> None:
        if self.life.state is not UnitState.BACKWARD:
            self.pre_backward()  # a grad that bypassed the unit's outputs
        super().accumulate_param_grad(index, grad)

    @timed_hook
    def post_backward(self) -> None:
        """One call's grads are all in the grad buffer; after the last call, reduce them."""
        if self.life.state is not UnitState.BACKWARD:
            self.pre_backward()
        self._release_weights("backward_end")
        if self.life.fire("call_done") is UnitState.BACKWARD:
            self._reduce()

    def flush(self) -> None:
        """Reduce-scatter what a paused unit has accumulated so far (frees its grad buffer)."""
        self._reduce()

    def finish_backward(self) -> None:
        """End of the backward pass: reduce whatever this unit still holds."""
        state = self.life.state
        if state is UnitState.BACKWARD:
            self._release_weights("backward_end")
        if state in (UnitState.BACKWARD, UnitState.BACKWARD_PAUSED):
            self._reduce()

    def _reduce(self) -> None:
        ctx = self.context
        self.finish_grad_writes()
        ctx.advance_reductions()  # hybrid sharding on CPU: start earlier all_reduces
        grad_buffer = self.grad_buffer
        grad_buffer.complete_reduce()  # the previous user's reduced shard is read first
        self.life.fire("reduce")
        pending, on_reduced, in_buffer = self._issue_reduction(grad_buffer)
        grad_buffer.start_reduce(pending, on_reduced, result_in_buffer=in_buffer)

    def _issue_reduction(self, grad_buffer) -> tuple:
        """``(pending, on_reduced, in_buffer)``: the reduction of ``grad_buffer`` issued,
        what divides or adds its result in the master-dtype grad once it is final, and
        whether that result is staged in the grad buffer ([Note: reduce into the
        gradient window])."""
        ctx = self.context
        full = grad_buffer.tensor[: self.layout.padded_numel]
        start, end = self.grad_range
        reduced, on_reduced, in_buffer = ctx.reduce_output(ctx.unit_grads, start, end, full)
        pending = ctx.issue_reduction(
            unit=self.name,
            slot=grad_buffer.index,
            tag=(self.index, self.layout.padded_numel),
            scatter=ctx.reduce_scatter(full, reduced),
            replicate=ctx.replicate(reduced),
        )
        return pending, on_reduced, in_buffer

    # -- activation checkpointing ---------------------------------------------

    def enable_activation_checkpointing(self, blocks=None) -> None:
        """Run this unit's forward under non-reentrant ``torch.utils.checkpoint``.

        The hooks stay outside the checkpointed region; recomputation runs
        inside this unit's backward, with the weights already re-gathered into
        the buffer the forward's views read (see [Note: views outlive forward]).
        """
        if self._original_forwards:
            return
        # Every module of the unit (``blocks``: those it accepts): grouped blocks are
        # checkpointed block by block ([Note: grouped blocks]), as without grouping.
        for module in self.modules:
            if blocks is not None and not blocks(module):
                continue
            self._original_forwards.append((module, module.forward))
            module.forward = _checkpointed(module.forward)

    def end_iteration(self) -> None:
        if self.life.state is not UnitState.IDLE or not self.is_block:
            self.uninstall_views()
        self.life.fire("end_iteration")

    def expose_placeholders(self) -> None:
        """A root unit not gathered now: its weight attributes tell shape and compute dtype.

        [Note: ungathered weights] Installed while a forward is under way (from the
        context's ``begin_forward`` and after the unit's own forward), removed at the
        end of the iteration. Blocks keep their views ([Note: views outlive forward]).
        """
        if not self.is_block:
            buffer = self.weight_buffer.tensor
            self.param_group.expose_ungathered(buffer.dtype, buffer.device)

    def abandon_iteration(self) -> None:
        """The backward raised: back to IDLE from wherever it stopped."""
        self.uninstall_views()
        self.life.fire("abandon")

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        for module, forward in self._original_forwards:
            module.forward = forward
        self._original_forwards = []


def _checkpointed(inner):
    """``inner`` run under non-reentrant activation checkpointing when grads are on."""

    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

    return checkpointed_forward


def _substitute(value: Any, originals: list, replacements, *, where: str, objects: bool) -> Any:
    """``value`` with each tensor of ``originals`` replaced by its gated twin."""
    if not originals:
        return value
    twin = {id(t): g for t, g in zip(originals, replacements, strict=True)}
    return map_tensors(value, lambda t: twin.get(id(t), t), where=where, objects=objects)
