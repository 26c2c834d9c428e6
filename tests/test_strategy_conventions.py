"""Lightning's model conventions hold under strategy="yafsdp" as under strategy="ddp".

- ``Trainer(sync_batchnorm=True)`` turns every BatchNorm of the sharded model into a
  SyncBatchNorm ([Note: sync_batchnorm] in strategy.py). torch's SyncBatchNorm has no
  CPU kernels, so on CPU "as under DDP" means: converted the same way, and refused
  before the first step (DDP refuses when it wraps the model). Without the flag, a model with
  BatchNorm trains exactly as under DDP (its weight and bias sit in a unit's flat group,
  its running statistics stay per-rank buffers, as rank 0's under DDP).
- Non-parameter state created in ``__init__`` (torchmetrics states, registered buffers)
  ends on the strategy's root device with a model built in ``configure_model``
  ([Note: non-parameter state on the root device]); metric states created on the meta
  device (``trainer.init_module(empty_init=True)``) are refused before the first step.

One ``dist_run`` fits every Trainer and returns plain facts; the tests assert on them.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import torchmetrics
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, TensorDataset

from lightning_yafsdp import YaFSDPStrategy
from tests.distributed import dist_run

STEPS = 4
WIDTH = 16
ROUND_OFF = 1e-6  # measured: 0.0 (two-rank sums are exact), a margin for other CPUs


class _NormedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.BatchNorm1d(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.linear(x)))


class _BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(_NormedBlock() for _ in range(3))
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Regression(pl.LightningModule):
    """A BatchNorm model with a metric and a buffer made in ``__init__``.

    Args:
        build: ``"eager"`` (the model in ``__init__``) or ``"configure_model"`` (built
            there: on the meta device under yafsdp).
    """

    def __init__(self, *, build: str = "eager") -> None:
        super().__init__()
        self.register_buffer("target_scale", torch.full((4,), 0.5))
        self.train_mean = torchmetrics.MeanMetric()
        self.net: nn.Module | None = None
        self.losses: list[float] = []
        self.seen: dict = {}
        if build == "eager":
            torch.manual_seed(0)
            self.net = _BatchNormNet()

    def configure_model(self) -> None:
        if self.net is None:
            self.net = _BatchNormNet()

    def on_train_start(self) -> None:
        self.seen["norm_classes"] = _norm_classes(self)
        self.seen["devices"] = {
            "root": str(self.trainer.strategy.root_device),
            "buffer": str(self.target_scale.device),
            "metric": str(self.train_mean.device),
            "metric_states": sorted({str(v.device) for v in self.train_mean.metric_state.values()}),
        }

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.net(x), y * self.target_scale)
        self.losses.append(loss.item())
        self.train_mean.update(loss.detach())
        return loss

    def on_train_end(self) -> None:
        self.seen["train_mean"] = self.train_mean.compute().item()  # synced across ranks

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _norm_classes(module: nn.Module) -> list[str]:
    return sorted({type(m).__name__ for m in module.modules() if isinstance(m, _BatchNorm)})


class _NormClassesAtError(pl.Callback):
    """What the BatchNorm layers were when the fit failed (before any teardown)."""

    def on_exception(self, trainer, pl_module, exception) -> None:
        pl_module.seen["norm_classes"] = _norm_classes(pl_module)


def _loader() -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    rows = STEPS * 4 * 2  # batch 4 on each of two ranks
    data = TensorDataset(torch.randn(rows, 8, generator=generator), torch.randn(rows, 4))
    return DataLoader(data, batch_size=4, shuffle=False)


def _trainer(strategy: str, **options) -> pl.Trainer:
    return pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        precision="32-true",
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[_NormClassesAtError()],
        **options,
    )


def _weights(trainer: pl.Trainer, module: _Regression) -> dict[str, torch.Tensor]:
    if isinstance(trainer.strategy, YaFSDPStrategy):
        state = trainer.strategy.engine.full_state_dict()
    else:
        state = module.state_dict()
    return {k.removeprefix("net."): v.detach().clone() for k, v in state.items() if "net." in k}


def _fit(strategy: str, *, build: str = "eager", **options) -> dict:
    torch.manual_seed(0)
    module = _Regression(build=build)
    trainer = _trainer(strategy, **options)
    try:
        trainer.fit(module, _loader())
    except Exception as exc:  # noqa: BLE001 - the test compares what each strategy raised
        error = f"{type(exc).__name__}: {exc}"
        return {"error": error, "steps_run": len(module.losses), **module.seen}
    return {"losses": module.losses, "weights": _weights(trainer, module), **module.seen}


def _meta_metric_error() -> str | None:
    trainer = _trainer("yafsdp")
    with trainer.init_module(empty_init=True):
        module = _Regression(build="eager")
    try:
        trainer.fit(module, _loader())
    except Exception as exc:  # noqa: BLE001 - the test checks which error it is
        return f"{type(exc).__name__}: {exc}"
    return None


def _convention_runs() -> dict:
    return {
        "ddp": _fit("ddp"),
        "yafsdp": _fit("yafsdp"),
        "yafsdp-meta": _fit("yafsdp", build="configure_model"),
        "meta-metric": _meta_metric_error(),
        # Last: the fits below are refused in setup (no SyncBatchNorm on CPU).
        "ddp-sync": _fit("ddp", sync_batchnorm=True),
        "yafsdp-sync": _fit("yafsdp", sync_batchnorm=True),
    }


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return dist_run(2, _convention_runs, timeout_s=300)


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def test_a_batchnorm_model_trains_as_under_ddp(runs):
    for rank in runs:
        assert rank["yafsdp"]["losses"] == pytest.approx(rank["ddp"]["losses"], rel=ROUND_OFF)
    params = {k: v for k, v in runs[0]["ddp"]["weights"].items() if "running" not in k}
    assert params  # BatchNorm weight and bias included
    ours = {k: runs[0]["yafsdp"]["weights"][k] for k in params}
    assert _max_difference(ours, params) <= ROUND_OFF


def test_batchnorm_running_statistics_match_ddp_rank_zero(runs):
    # DDP broadcasts rank 0's buffers before each forward, so only rank 0's own are comparable.
    ddp, ours = runs[0]["ddp"]["weights"], runs[0]["yafsdp"]["weights"]
    stats = {k: v for k, v in ddp.items() if "running" in k or "num_batches" in k}
    assert len(stats) == 3 * 3
    assert _max_difference({k: ours[k] for k in stats}, stats) <= ROUND_OFF


def test_sync_batchnorm_converts_every_batchnorm_as_ddp_does(runs):
    for rank in runs:
        assert rank["ddp"]["norm_classes"] == rank["yafsdp"]["norm_classes"] == ["BatchNorm1d"]
        assert rank["ddp-sync"]["norm_classes"] == ["SyncBatchNorm"]
        assert rank["yafsdp-sync"]["norm_classes"] == ["SyncBatchNorm"]


def test_sync_batchnorm_on_cpu_is_refused_before_the_first_step_as_under_ddp(runs):
    for rank in runs:
        assert "SyncBatchNorm layers only work with GPU modules" in rank["ddp-sync"]["error"]
        ours = rank["yafsdp-sync"]["error"]
        assert ours.startswith("ValueError: the model has SyncBatchNorm layers")
        assert "blocks.0.norm" in ours and "runs on GPUs only" in ours
        assert "drop sync_batchnorm=True" in ours
        assert rank["yafsdp-sync"]["steps_run"] == 0


def test_metric_states_and_buffers_from_init_are_on_the_root_device(runs):
    for rank in runs:
        for run in ("ddp", "yafsdp", "yafsdp-meta"):
            devices = rank[run]["devices"]
            root = devices.pop("root")
            assert devices == {
                "buffer": root,
                "metric": root,
                "metric_states": [root],
            }, run


def test_metrics_updated_in_training_agree_with_ddp(runs):
    for rank in runs:
        assert rank["yafsdp"]["train_mean"] == pytest.approx(rank["ddp"]["train_mean"], rel=1e-6)
        assert rank["yafsdp-meta"]["train_mean"] > 0


def test_metric_states_on_the_meta_device_are_refused_before_the_first_step(runs):
    for rank in runs:
        message = rank["meta-metric"]
        assert message is not None and message.startswith("ValueError: metric states")
        assert "train_mean" in message
        assert "meta device" in message and "empty_init=True" in message
