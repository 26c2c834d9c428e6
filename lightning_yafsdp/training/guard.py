"""Divergence guard: on a NaN/inf or spiking loss, roll back, skip, optionally cut the LR.

The YaLM-100B recipe for divergence: roll back to a good state, skip the batches
that led there, lower the learning rate if it recurs.

[Note: in-memory rollback] The guard keeps its own snapshot rather than reloading
the last checkpoint (a rollback must not wait on disk, nor depend on how often the
run checkpoints): a copy of this rank's parameters (under YaFSDP
``module.parameters()`` are sharded: a copy holds this rank's pieces, 1/N of the model) and of
the optimizer state, refreshed every ``snapshot_every_n_steps`` healthy steps.
That costs one more copy of the sharded training state in host or device
memory. A rollback copies it back, tells the engine the weights changed (so the
compute shards are refreshed before the next forward), restores the optimizer
state and skips the offending batch (``training_step`` returns None: no
backward, no update; every rank decides on the same all-reduced loss, so all
skip together).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_yafsdp.config import DivergenceGuardConfig


@dataclass
class Rollback:
    """What the guard did once: at which step, why, back to which step."""

    step: int
    reason: str
    loss: float
    restored_step: int
    lr_scale: float


class DivergenceError(RuntimeError):
    pass


class DivergenceGuard:
    """Decides whether a step's loss is bad and rolls the training state back.

    Args:
        config: The ``practices.divergence_guard`` section.
    """

    def __init__(self, config: DivergenceGuardConfig) -> None:
        self.config = config
        self.rollbacks: list[Rollback] = []
        self.skipped_steps: list[int] = []
        self._running_mean: float | None = None
        self._snapshot: tuple[list[torch.Tensor], dict[str, Any]] | None = None
        self._snapshot_step = -1
        self._skip_remaining = 0
        self.lr_scale = 1.0

    # -- snapshots ---------------------------------------------------------------------

    def maybe_snapshot(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, step: int
    ) -> None:
        """Keep a copy of the training state at ``step`` if a snapshot is due."""
        if self._snapshot is not None and step - self._snapshot_step < (
            self.config.snapshot_every_n_steps
        ):
            return
        params = [p.detach().clone() for p in module.parameters()]
        self._snapshot = (params, copy.deepcopy(optimizer.state_dict()))
        self._snapshot_step = step

    # -- decisions ------------------------------------------------------------------------

    def should_skip(self, step: int) -> bool:
        """True for the extra batches to skip after a rollback."""
        if self._skip_remaining > 0:
            self._skip_remaining -= 1
            self.skipped_steps.append(step)
            return True
        return False

    def verdict(self, loss: float, step: int) -> str | None:
        """``"nan"``, ``"inf"``, ``"spike"`` or None (healthy; updates the running mean)."""
        if math.isnan(loss):
            return "nan"
        if math.isinf(loss):
            return "inf"
        mean = self._running_mean
        if (
            mean is not None
            and step >= self.config.spike_warmup_steps
            and loss > self.config.spike_factor * mean
        ):
            return "spike"
        self._running_mean = loss if mean is None else 0.9 * mean + 0.1 * loss
        return None

    # -- acting ---------------------------------------------------------------------------

    @torch.no_grad()
    def roll_back(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        step: int,
        reason: str,
        loss: float,
        schedulers: list[Any] = (),
        engine: Any = None,
    ) -> Rollback:
        """Restore the last snapshot, arrange the skips and cut the LR if configured.

        Raises:
            DivergenceError: after ``max_rollbacks`` rollbacks, or with no snapshot.
        """
        if self._snapshot is None:
            raise DivergenceError(
                f"loss is {reason} ({loss}) at step {step} before any snapshot was taken"
            )
        if len(self.rollbacks) >= self.config.max_rollbacks:
            raise DivergenceError(
                f"loss is {reason} ({loss}) at step {step} after {len(self.rollbacks)} "
                "rollbacks (practices.divergence_guard.max_rollbacks); lower optim.lr or "
                "inspect the data near this step"
            )
        params, optimizer_state = self._snapshot
        for param, saved in zip(module.parameters(), params, strict=True):
            param.copy_(saved)
            param.grad = None
        optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        if engine is not None:
            engine.mark_weights_changed()
        cut = self.config.lr_cut
        if cut != 1.0:
            self.lr_scale *= cut
            for group in optimizer.param_groups:
                group["lr"] *= cut
            for scheduler in schedulers:
                if hasattr(scheduler, "base_lrs"):
                    scheduler.base_lrs = [lr * cut for lr in scheduler.base_lrs]
        self._skip_remaining = self.config.skip_batches
        self.skipped_steps.append(step)
        event = Rollback(
            step=step,
            reason=reason,
            loss=loss,
            restored_step=self._snapshot_step,
            lr_scale=self.lr_scale,
        )
        self.rollbacks.append(event)
        return event
