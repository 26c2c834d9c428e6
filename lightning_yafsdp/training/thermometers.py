"""YaLM "thermometers": activation max/min per unit and the global grad norm.

In the YaLM-100B run a rising max of the attention output foretold divergence
thousands of steps ahead. Measuring costs a forward hook per unit and one
all_reduce, so it runs on one step in ``every_n_steps`` only: the hooks are
installed at that step's start and removed after its optimizer step.

Logged keys (one step in N): ``thermo/<unit>/act_max``, ``thermo/<unit>/act_min``
for each unit's output, the same for its ``attention`` submodule when it has one
(``thermo/<unit>.attention/...``), and ``thermo/grad_norm`` (before clipping).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_yafsdp.core.comm.collectives import all_reduce_
from lightning_yafsdp.core.plan.policy import find_units
from lightning_yafsdp.training.stats import log_event_metrics


class Thermometers(Callback):
    """Measure on every ``every_n_steps``-th optimizer step.

    Args:
        every_n_steps: Measurement period (optimizer steps).
    """

    def __init__(self, every_n_steps: int) -> None:
        self.every_n_steps = every_n_steps
        self._points: list[tuple[str, nn.Module]] = []
        self._handles: list[Any] = []
        self._extremes: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.last: dict[str, float] = {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._points = []
        for name, unit in _units(trainer, pl_module):
            self._points.append((name, unit))
            attention = getattr(unit, "attention", None) or getattr(unit, "self_attn", None)
            if isinstance(attention, nn.Module):
                self._points.append((f"{name}.attention", attention))

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step % self.every_n_steps != 0 or self._handles:
            return
        self._extremes = {}
        for name, module in self._points:
            self._handles.append(module.register_forward_hook(self._recorder(name)))

    def _recorder(self, name: str):
        def record(module: nn.Module, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            if not isinstance(out, torch.Tensor) or not torch.is_grad_enabled():
                return  # validation forwards, and activation-checkpoint recomputation
            low, high = torch.aminmax(out.detach().float())
            if name in self._extremes:
                old_low, old_high = self._extremes[name]
                low, high = torch.minimum(low, old_low), torch.maximum(high, old_high)
            self._extremes[name] = (low, high)

        return record

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if not self._handles:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        names = [name for name, _ in self._points if name in self._extremes]
        device = next(iter(pl_module.parameters())).device
        # One MAX all_reduce for every max and every (negated) min.
        stacked = (
            torch.stack(
                [self._extremes[n][1] for n in names] + [-self._extremes[n][0] for n in names]
            ).to(device)
            if names
            else torch.zeros(0, device=device)
        )
        if dist.is_available() and dist.is_initialized() and stacked.numel():
            all_reduce_(stacked, None, op=dist.ReduceOp.MAX)
        values = {}
        for i, name in enumerate(names):
            values[f"thermo/{name}/act_max"] = stacked[i].item()
            values[f"thermo/{name}/act_min"] = -stacked[len(names) + i].item()
        values["thermo/grad_norm"] = global_grad_norm(trainer, pl_module)
        self.last = values
        log_event_metrics(trainer, values)


def global_grad_norm(trainer: pl.Trainer, pl_module: pl.LightningModule) -> float:
    """The L2 norm of the whole model's gradient, the same on every rank.

    Under YaFSDP each gradient is a sharded tensor whose norm is already global (one
    all_reduce, [Note: sharded parameters]); under DDP the gradients are whole.
    """
    grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
    if not grads:
        return 0.0
    norms = torch.stack([torch.linalg.vector_norm(g.detach(), 2).float() for g in grads])
    return float(torch.linalg.vector_norm(norms, 2))


def _units(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[tuple[str, nn.Module]]:
    engine = getattr(trainer.strategy, "_engine", None)
    if engine is not None:
        # Every block of a unit of grouped blocks by its own name ([Note: grouped blocks]).
        names = {id(m): name for name, m in engine.root.named_modules()}
        return [(names.get(id(m), unit.name), m) for unit in engine.units for m in unit.modules]
    model = getattr(pl_module, "model", pl_module)
    return find_units(model)
