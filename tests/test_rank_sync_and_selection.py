"""Models that differ per rank, parameter selections, and frozen blocks, as under DDP.

- A model built with real tensors and NOT seeded alike on every rank (no
  ``seed_everything``): DDP starts every rank from rank 0's weights and buffers, and so
  does ``strategy="yafsdp"`` (``sync_module_states=None`` resolves to a broadcast for
  such models). Without it each rank would keep its own slice: a silent mix of ranks.
- Selecting parameters by name or submodule in ``configure_optimizers`` trains exactly as
  under DDP (the model keeps its parameters, sharded, under their names); an optimizer
  over parameter objects kept from before sharding is refused before the first step.
- An auto-detected block frozen before fit stays out of the units (replicated, like
  every frozen tensor) and the rest trains exactly as under DDP.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_yafsdp  # noqa: F401 - registers strategy="yafsdp"
from tests.distributed import dist_run

STEPS = 4
WIDTH = 16
ROUND_OFF = 1e-6  # measured 0.0 on two ranks (sums of two are exact); margin for other CPUs


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(_Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 2)
        # Drawn at random in __init__, used in forward: must be rank 0's everywhere.
        self.register_buffer("shift", torch.randn(WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x) + self.shift
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Regression(pl.LightningModule):
    def __init__(self, *, seed: int, optimizers: str = "all", freeze_first: bool = False):
        super().__init__()
        torch.manual_seed(seed)
        self.net = _Net()
        if freeze_first:
            self.net.blocks[0].requires_grad_(False)
        self.optimizers_kind = optimizers
        self.kept_from_init = list(self.parameters())
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.optimizers_kind == "by_name":  # the usual "no decay on biases" split
            named = list(self.named_parameters())
            return torch.optim.AdamW(
                [
                    {"params": [p for n, p in named if "bias" not in n], "weight_decay": 0.1},
                    {"params": [p for n, p in named if "bias" in n], "weight_decay": 0.0},
                ],
                lr=1e-2,
            )
        if self.optimizers_kind == "by_submodule":
            return torch.optim.SGD(self.net.blocks.parameters(), lr=0.1)
        if self.optimizers_kind == "kept_from_init":  # objects sharding has replaced
            return torch.optim.SGD(self.kept_from_init, lr=0.1)
        return torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1
        )


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(STEPS * 2 * 4, 8, generator=generator)
    y = torch.randn(STEPS * 2 * 4, 2, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=4)


def _fit(strategy: str, **module_options) -> dict:
    rank = torch.distributed.get_rank()
    model = _Regression(seed=module_options.pop("seed", rank), **module_options)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    try:
        trainer.fit(model, _loader())
    except Exception as error:  # noqa: BLE001 - the refusal is the fact under test
        return {"error": f"{type(error).__name__}: {error}", "losses": model.losses}
    if strategy == "yafsdp":
        weights = trainer.strategy.engine.full_state_dict()
    else:
        weights = model.state_dict()
    weights = {k: v.detach().clone() for k, v in weights.items() if k.startswith("net.")}
    return {"error": None, "losses": model.losses, "weights": weights}


def _runs() -> dict:
    runs = {}
    for name, options in (
        ("rank_seeded", {}),
        ("frozen_block", {"freeze_first": True, "seed": 0}),
    ):
        runs[name] = {strategy: _fit(strategy, **options) for strategy in ("ddp", "yafsdp")}
    for kind in ("by_name", "by_submodule"):
        runs[kind] = {s: _fit(s, optimizers=kind, seed=0) for s in ("ddp", "yafsdp")}
    runs["kept_from_init"] = _fit("yafsdp", optimizers="kept_from_init", seed=0)
    return runs


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return dist_run(2, _runs, timeout_s=240)


def _assert_matches_ddp(ranks: list[dict], name: str) -> None:
    for rank, facts in enumerate(ranks):
        ddp, ours = facts[name]["ddp"], facts[name]["yafsdp"]
        assert ours["error"] is None, ours["error"]
        torch.testing.assert_close(ours["losses"], ddp["losses"], rtol=ROUND_OFF, atol=0)
        assert ours["weights"].keys() == ddp["weights"].keys(), rank
        for key, expected in ddp["weights"].items():
            scale = expected.abs().max().clamp_min(1e-3)
            error = (ours["weights"][key] - expected).abs().max() / scale
            assert error <= ROUND_OFF, (rank, key, error.item())


def test_ranks_seeded_differently_start_from_rank_zeros_model_as_under_ddp(runs):
    # Each rank seeds with its own rank: the weights AND the random buffer differ per rank.
    _assert_matches_ddp(runs, "rank_seeded")


def test_an_auto_detected_block_frozen_before_fit_trains_like_ddp(runs):
    _assert_matches_ddp(runs, "frozen_block")
    for facts in runs:  # the frozen block did not move
        ddp = facts["frozen_block"]["ddp"]["weights"]
        ours = facts["frozen_block"]["yafsdp"]["weights"]
        assert torch.equal(ours["net.blocks.0.linear.weight"], ddp["net.blocks.0.linear.weight"])


@pytest.mark.parametrize("kind", ["by_name", "by_submodule"])
def test_parameter_selections_by_name_and_submodule_train_like_ddp(runs, kind):
    _assert_matches_ddp(runs, kind)


def test_an_optimizer_over_parameters_kept_from_before_sharding_is_refused(runs):
    for facts in runs:
        error = facts["kept_from_init"]["error"]
        assert error is not None and "not parameters of the sharded model" in error, error
        assert "inside configure_optimizers()" in error, error
        assert facts["kept_from_init"]["losses"] == [], "refused before the first step"
