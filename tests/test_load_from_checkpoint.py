"""``LightningModule.load_from_checkpoint`` reads the sharded checkpoints yafsdp writes.

Our default checkpoint is a directory (DCP files + ``meta.pt``); Lightning reads a
checkpoint with one ``torch.load``. Importing ``lightning_yafsdp`` wraps the reader
Lightning uses there (``lightning_yafsdp/_registration.py``) so that our directories are
consolidated in memory and every other path goes to Lightning unchanged.

One spawned run (2 gloo ranks) fits the same tiny model twice, under ``"yafsdp"`` and
under ``"ddp"``, each with a ``ModelCheckpoint``, and returns the checkpoint paths and
the trained weights; the tests load those checkpoints in the test process.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.utilities import cloud_io
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_yafsdp  # noqa: F401  (the import is what teaches Lightning our format)
from lightning_yafsdp import _registration
from lightning_yafsdp.checkpoint import is_sharded_checkpoint
from tests.distributed import dist_run
from tests.lightning_models import CausalLMModule, token_loader

ROWS = 12  # 3 steps of 2 rows per rank
DDP_PARITY = 1e-5  # relative: the same math, gradients reduced in another order
HPARAMS = {"lr": 2e-2, "note": "trained under yafsdp"}


class HyperLM(CausalLMModule):
    """The shared tiny Llama (seeded init), with hyperparameters saved in the checkpoint."""

    def __init__(self, lr: float = 1e-2, note: str = "default") -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


def _fit(strategy: str, root: str) -> tuple[str, pl.Trainer]:
    checkpoint = ModelCheckpoint(dirpath=f"{root}/{strategy}", monitor="train_loss", mode="min")
    trainer = pl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=1,
        precision="32-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[checkpoint],
        default_root_dir=root,
    )
    trainer.fit(HyperLM(**HPARAMS), token_loader(ROWS))
    return checkpoint.best_model_path, trainer


def _fit_both(root: str) -> dict:
    yafsdp_path, trainer = _fit("yafsdp", root)
    trained = trainer.strategy.engine.full_state_dict()  # collective; full on rank 0
    ddp_path, _ = _fit("ddp", root)
    return {
        "yafsdp_path": yafsdp_path,
        "ddp_path": ddp_path,
        "trained": {k: v.clone() for k, v in trained.items()} if trainer.is_global_zero else None,
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("load-from-checkpoint")
    return dist_run(2, _fit_both, str(root), timeout_s=300)[0]


@pytest.fixture(scope="module")
def loaded(runs) -> HyperLM:
    return HyperLM.load_from_checkpoint(runs["yafsdp_path"])


def _assert_same_weights(actual: dict, expected: dict, **tolerance) -> None:
    assert sorted(actual) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(
            actual[name], value, msg=lambda m, n=name: f"{n}: {m}", **tolerance
        )


def test_the_best_checkpoint_under_yafsdp_is_a_sharded_directory(runs):
    assert is_sharded_checkpoint(runs["yafsdp_path"]), runs["yafsdp_path"]


def test_load_from_checkpoint_gives_the_trained_weights(runs, loaded):
    _assert_same_weights(loaded.state_dict(), runs["trained"], rtol=0.0, atol=0.0)
    untrained = HyperLM(**HPARAMS).state_dict()
    changed = [k for k, v in untrained.items() if not torch.equal(v, runs["trained"][k])]
    assert len(changed) == len(untrained), "training must have moved every weight"


def test_load_from_checkpoint_restores_the_hyperparameters(loaded):
    assert dict(loaded.hparams) == HPARAMS
    assert loaded.lr == HPARAMS["lr"]


def test_sharded_yafsdp_and_single_file_ddp_checkpoints_load_to_the_same_weights(runs, loaded):
    assert Path(runs["ddp_path"]).is_file()  # Lightning's own format, read by Lightning
    from_ddp = HyperLM.load_from_checkpoint(runs["ddp_path"])
    _assert_same_weights(loaded.state_dict(), from_ddp.state_dict(), rtol=DDP_PARITY, atol=1e-7)


def test_a_directory_that_is_not_a_checkpoint_still_gets_lightnings_own_error(tmp_path):
    with pytest.raises(IsADirectoryError):
        HyperLM.load_from_checkpoint(tmp_path)


def test_lightning_still_reads_checkpoints_through_the_name_we_wrap():
    """Fails when a Lightning release moves the reader: re-point _registration.LOADER_*."""
    saving = importlib.import_module(_registration.LOADER_MODULE)
    where = f"{_registration.LOADER_MODULE}.{_registration.LOADER_NAME}"
    reader = getattr(saving, _registration.LOADER_NAME, None)
    assert reader is not None, (
        f"{where} is gone in Lightning {pl.__version__}: find the function "
        "_load_from_checkpoint now reads checkpoints with and wrap that one instead"
    )
    assert _registration.LOADER_NAME in saving._load_from_checkpoint.__code__.co_names, (
        f"Lightning {pl.__version__}'s _load_from_checkpoint no longer calls {where}: "
        "wrap the reader it calls now"
    )
    assert getattr(reader, "_yafsdp_reads_sharded_directories", False), (
        f"{where} is not our wrapper after `import lightning_yafsdp`"
    )
    assert reader.__wrapped__ is cloud_io._load, (
        f"{where} no longer wraps lightning.fabric.utilities.cloud_io._load"
    )
