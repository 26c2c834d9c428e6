"""A sharded unit (a transformer block): its state machine and hooks.

A training step, seen from one unit ``i`` (ZeRO-3, two weight buffers):

forward   pre-forward hook: wait for its gather into weight buffer i % 2
          (condition 1), prefetch unit i + 1 into the other buffer, gate the
          inputs and the buffer (``GateGradFlow``), expose params as views.
          post-forward hook: release the buffer (condition 2), wrap the
          outputs in ``PreBackwardGate``.
backward  ``PreBackwardGate.backward`` -> ``pre_backward``: claim grad buffer
          i % 2 once the previous user's reduce_scatter is done (condition 3),
          re-gather the weights if the buffer was taken (ZeRO-3), prefetch the
          unit before it.
          ``Narrow.backward`` writes each param grad into the grad buffer.
          ``GateGradFlow.backward`` -> ``post_backward``: all grads are in the
          buffer (condition 4): issue the reduce_scatter; its result is added
          into the master-dtype grad when the buffer is next claimed or at the
          end of backward.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from lightning_yafsdp.core.autograd import GateGradFlow, PreBackwardGate
from lightning_yafsdp.core.collectives import all_gather_into, reduce_scatter_into
from lightning_yafsdp.core.flat_group import FlatParamGroup

if TYPE_CHECKING:
    from lightning_yafsdp.core.engine import YaFSDPEngine


class UnitState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"  # inside a grad-enabled forward
    FORWARD_DONE = "forward done"  # waiting for its backward
    BACKWARD = "backward"  # between pre- and post-backward (recomputation happens here)
    BACKWARD_DONE = "backward done"


class ShardedUnit(FlatParamGroup):
    """One unit: a module whose parameters are gathered around its forward and backward.

    Args:
        engine: the engine that owns the buffers and the schedule.
        index: position in module order; selects the weight and grad buffers.
        module: the unit's module.
        **group_kwargs: see ``FlatParamGroup``.
    """

    def __init__(
        self, engine: YaFSDPEngine, index: int, module: nn.Module, **group_kwargs: Any
    ) -> None:
        super().__init__(**group_kwargs)
        self.engine = engine
        self.index = index
        self.module = module
        self.weight_buffer = engine.weight_buffers[index % len(engine.weight_buffers)]
        self.grad_buffer = engine.grad_buffers[index % len(engine.grad_buffers)]
        self.state = UnitState.IDLE
        self._grad_forward = False
        self._hooks = [
            module.register_forward_pre_hook(self._pre_forward, with_kwargs=True),
            module.register_forward_hook(self._post_forward),
        ]
        self._original_forward = None

    # -- gathering -------------------------------------------------------------

    def prefetch(self) -> None:
        """Start gathering into this unit's buffer if it is free; never blocks."""
        buffer = self.weight_buffer
        if buffer.holds(self.name, self.engine.compute_version) or buffer.in_use:
            return
        self._issue_gather()

    def _ensure_gathered(self) -> None:
        buffer = self.weight_buffer
        if not buffer.holds(self.name, self.engine.compute_version):
            if buffer.in_use:
                raise RuntimeError(
                    f"unit '{self.name}' is called while its weight buffer {buffer.index} is "
                    f"held by '{buffer.holder}', whose forward/backward has not finished. "
                    "Nested sharded units "
                    "are not supported: list only the outer module in units=."
                )
            self._issue_gather()
        if buffer.gather is not None:
            buffer.gather.wait()  # condition 1
            buffer.gather = None

    def _issue_gather(self) -> None:
        buffer = self.weight_buffer
        if buffer.gather is not None:
            buffer.gather.wait()  # a prefetch for another unit: let it land before overwriting
        engine = self.engine
        buffer.holder = self.name
        buffer.version = engine.compute_version
        output = buffer.tensor[: self.layout.padded_numel]
        buffer.gather = engine.scheduler.issue(
            "gather",
            unit=self.name,
            slot=buffer.index,
            launch=lambda async_op: all_gather_into(
                output, self.compute_shard, engine.group, async_op=async_op, stats=engine.comm_stats
            ),
            after=buffer.release_event,  # condition 2
        )
        buffer.release_event = None

    # -- forward ---------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if self.state is UnitState.BACKWARD:
            # Activation checkpointing re-runs forward (with hooks) inside this
            # unit's backward: the weights are gathered already; fresh views
            # that require grad make recomputation save what forward saved.
            self.install_views(self.weight_buffer.tensor, differentiable=True)
            return None
        engine = self.engine
        engine.begin_forward()
        if engine.active_unit is not None:
            raise RuntimeError(
                f"unit '{self.name}' is called inside unit '{engine.active_unit.name}'. "
                "Nested sharded "
                "units are not supported: list only the outer module in units=."
            )
        engine.active_unit = self
        self._ensure_gathered()
        self.weight_buffer.in_use = True
        engine.scheduler.note("forward_start", self.name, self.weight_buffer.index)
        engine.prefetch_next(self)
        args, kwargs = engine.cast_inputs(args, kwargs)
        self._grad_forward = torch.is_grad_enabled()
        if not self._grad_forward:
            self.install_views(self.weight_buffer.tensor, differentiable=False)
            return args, kwargs
        self.state = UnitState.FORWARD
        flat, spec = pytree.tree_flatten((args, kwargs))
        gated_positions = [
            i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        gated_buffer, *gated = GateGradFlow.apply(
            self, self.weight_buffer.tensor, *(flat[i] for i in gated_positions)
        )
        for position, tensor in zip(gated_positions, gated, strict=True):
            flat[position] = tensor
        self.install_views(gated_buffer, differentiable=True)
        return pytree.tree_unflatten(flat, spec)

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        if self.state is UnitState.BACKWARD:
            return output  # recomputation
        if not self._grad_forward:
            self.install_placeholders()
        # [Note: views outlive forward] After a grad-enabled forward the views
        # stay installed until the end of backward: activation checkpointing
        # may re-run the module's forward without our hooks (Hugging Face calls
        # ``layer.forward`` directly), and pre_backward has re-gathered the
        # weights into the buffer those views read by then.
        engine = self.engine
        engine.active_unit = None
        buffer = self.weight_buffer
        buffer.in_use = False
        buffer.release_event = engine.scheduler.compute_marker()
        engine.scheduler.note("forward_end", self.name, buffer.index)
        if not self._grad_forward:
            return output
        self.state = UnitState.FORWARD_DONE
        flat, spec = pytree.tree_flatten(output)
        positions = [
            i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad
        ]
        if positions:
            gated = PreBackwardGate.apply(self, *(flat[i] for i in positions))
            for position, tensor in zip(positions, gated, strict=True):
                flat[position] = tensor
        return pytree.tree_unflatten(flat, spec)

    # -- backward --------------------------------------------------------------

    def pre_backward(self) -> None:
        """Claim the grad buffer and the gathered weights for this unit's backward."""
        if self.state is UnitState.BACKWARD:
            return
        engine = self.engine
        engine.enter_backward()
        grad_buffer = self.grad_buffer
        if grad_buffer.in_use:
            raise RuntimeError(
                f"the backward of unit '{self.name}' starts while '{grad_buffer.holder}' "
                f"still writes grad buffer {grad_buffer.index}: units interleave in backward, "
                "which two grad buffers cannot "
                "serve. Make units run one after another (no unit calling another)."
            )
        grad_buffer.complete_reduce()  # condition 3
        grad_buffer.holder = self.name
        grad_buffer.in_use = True
        self.begin_grad_writes(grad_buffer)
        self._ensure_gathered()
        self.weight_buffer.in_use = True
        self.state = UnitState.BACKWARD
        engine.scheduler.note("backward_start", self.name, self.weight_buffer.index)
        engine.prefetch_previous(self)

    def accumulate_param_grad(self, index: int, grad: torch.Tensor) -> None:
        if self.state is not UnitState.BACKWARD:
            self.pre_backward()  # a grad that bypassed the unit's outputs
        super().accumulate_param_grad(index, grad)

    def post_backward(self) -> None:
        """All grads of the unit are in its grad buffer: reduce_scatter them."""
        if self.state is not UnitState.BACKWARD:
            self.pre_backward()
        engine = self.engine
        self.finish_grad_writes()
        weight_buffer = self.weight_buffer
        weight_buffer.in_use = False
        weight_buffer.release_event = engine.scheduler.compute_marker()
        engine.scheduler.note("backward_end", self.name, weight_buffer.index)
        grad_buffer = self.grad_buffer
        grad_buffer.in_use = False
        full = grad_buffer.tensor[: self.layout.padded_numel]
        reduced = grad_buffer.reduced[: self.layout.shard_numel]
        start, end = self.grad_range
        # The unit's own prefix of the shared staging tensor (units differ in size).
        grad_buffer.on_reduced = lambda: engine.unit_grads.add(
            start, end, reduced, engine.divide_factor
        )
        grad_buffer.reduce = engine.scheduler.issue(
            "reduce_scatter",
            unit=self.name,
            slot=grad_buffer.index,
            launch=lambda async_op: reduce_scatter_into(
                reduced, full, engine.group, async_op=async_op, stats=engine.comm_stats
            ),
            after=engine.scheduler.compute_marker(),  # condition 4
        )
        self.state = UnitState.BACKWARD_DONE

    # -- activation checkpointing ---------------------------------------------

    def enable_activation_checkpointing(self) -> None:
        """Run this unit's forward under non-reentrant ``torch.utils.checkpoint``.

        The hooks stay outside the checkpointed region; recomputation runs
        inside this unit's backward, with the weights already re-gathered into
        the buffer the forward's views read (see [Note: views outlive forward]).
        """
        if self._original_forward is not None:
            return
        self._original_forward = inner = self.module.forward

        def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            return torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=False, **kwargs)

        self.module.forward = checkpointed_forward

    def end_iteration(self) -> None:
        if self.state is not UnitState.IDLE:
            self.install_placeholders()
        self.state = UnitState.IDLE

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        if self._original_forward is not None:
            self.module.forward = self._original_forward
            self._original_forward = None
