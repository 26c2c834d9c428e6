"""One user model trained under ``strategy="yafsdp"`` and ``strategy="ddp"``, compared.

The harness of the third model set (issue 35's tests): a ``LightningModule`` that builds
its model from a picklable factory (eagerly in ``__init__`` or in ``configure_model``),
draws its batches from a second factory, records every step's loss, and returns plain
facts that ``dist_run`` can carry back: losses, the full final weights, the units.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from tests.zoo_models import InitialWeights, full_weights

ModelFactory = Callable[[], nn.Module]
# (model, batch) -> scalar loss
LossFn = Callable[[nn.Module, dict], torch.Tensor]


class FactoryModule(pl.LightningModule):
    """Trains ``build()`` with ``loss_fn`` and SGD (momentum 0.9).

    SGD, not AdamW, so that a final-weight comparison measures the gradients (Adam turns
    round-off in an exactly-zero gradient into lr-sized steps).
    """

    def __init__(
        self, build: ModelFactory, loss_fn: LossFn, *, eager: bool, lr: float = 0.05,
        strategy_options: dict | None = None,
    ) -> None:  # fmt: skip
        super().__init__()
        self.build, self.loss_fn, self.lr = build, loss_fn, lr
        self.model: nn.Module | None = None
        self.losses: list[float] = []
        if eager:
            torch.manual_seed(0)
            self.model = build()

    def configure_model(self) -> None:
        if self.model is None:  # unseeded, as a user's: each rank's generator as it is
            self.model = self.build()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.loss_fn(self.model, batch)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class _Rows(Dataset):
    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


def fit(
    strategy, build: ModelFactory, loss_fn: LossFn, rows: list[dict], *, eager: bool = True,
    world_size: int, steps: int, batch_size: int = 2, lr: float = 0.05, clip: float | None = 1.0,
) -> dict:  # fmt: skip
    """One fit; its losses, first and final full weights, (under yafsdp) unit names, or its
    error."""
    module = FactoryModule(build, loss_fn, eager=eager, lr=lr)
    initial = InitialWeights()
    trainer = pl.Trainer(
        strategy=strategy, accelerator="cpu", devices=world_size, precision="32-true",
        max_steps=steps, gradient_clip_val=clip, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[initial],
    )  # fmt: skip
    try:
        trainer.fit(module, DataLoader(_Rows(rows), batch_size=batch_size, shuffle=False))
    except Exception:  # noqa: BLE001 - the test asserts on it
        return {"error": traceback.format_exc(), "losses": module.losses}
    engine = getattr(trainer.strategy, "engine", None)
    return {
        "error": None,
        "losses": module.losses,
        "initial": initial.weights,
        "final": full_weights(trainer, module),
        "units": [unit.name for unit in engine.units] if engine is not None else [],
    }


def loss_error(ours: dict, reference: dict) -> float:
    """Largest relative difference of the per-step losses."""
    assert ours["error"] is None, ours["error"]
    assert reference["error"] is None, reference["error"]
    assert len(ours["losses"]) == len(reference["losses"])
    losses = torch.tensor(ours["losses"], dtype=torch.float64)
    expected = torch.tensor(reference["losses"], dtype=torch.float64)
    return ((losses - expected).abs() / expected.abs()).max().item()


def weights_error(ours: dict, reference: dict, *, floor: float = 1e-2) -> tuple[float, str]:
    """Largest per-tensor max|a - b| / max(max|b|, floor) over the final weights, and where."""
    actual, expected = ours["final"], reference["final"]
    assert sorted(actual) == sorted(expected)
    worst = (0.0, "")
    for name, tensor in expected.items():
        if not tensor.is_floating_point():
            assert torch.equal(actual[name], tensor), name
            continue
        scale = max(tensor.abs().max().item(), floor)
        worst = max(worst, ((actual[name] - tensor).abs().max().item() / scale, name))
    return worst
