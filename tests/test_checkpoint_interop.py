"""torch's own DCP tools read our sharded checkpoints.

A 2-rank Trainer run (the model built eagerly, and on the meta device in
``configure_model``) writes a sharded checkpoint; torch's
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` must turn it, with no
code of ours, into a plain state dict under the original parameter names with full
shapes, equal element for element to our consolidation and to the run's own full
weights (gathered in the run).
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_yafsdp.checkpoint import consolidate_checkpoint
from tests.distributed import dist_run
from tests.lightning_models import CausalLMModule, token_loader


def _fit_and_save(root: str, build: str) -> dict[str, torch.Tensor]:
    trainer = pl.Trainer(
        strategy="yafsdp",
        accelerator="cpu",
        devices=2,
        max_steps=2,
        enable_checkpointing=False,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=root,
    )
    trainer.fit(CausalLMModule(build=build), token_loader(8))
    trainer.save_checkpoint(f"{root}/step-2.ckpt")
    # The trained weights, gathered, under the LightningModule's names ("model.layers.0...").
    return trainer.strategy.engine.full_state_dict()


@pytest.mark.parametrize("build", ["eager", "configure_model"])
def test_dcp_to_torch_save_reads_our_checkpoint_as_a_plain_state_dict(tmp_path, build) -> None:
    trained = dist_run(2, _fit_and_save, str(tmp_path), build, timeout_s=240)[0]
    checkpoint = tmp_path / "step-2.ckpt"

    dcp_to_torch_save(checkpoint, tmp_path / "out.pt")

    plain = torch.load(tmp_path / "out.pt", weights_only=False)["model"]
    ours = consolidate_checkpoint(checkpoint)["model"]
    expected_shapes = {k: v.shape for k, v in CausalLMModule().state_dict().items()}
    assert {k: v.shape for k, v in plain.items()} == expected_shapes
    assert plain.keys() == ours.keys() == trained.keys()
    for name, tensor in plain.items():
        assert type(tensor) is torch.Tensor, name  # plain, full tensors
        assert torch.equal(tensor, ours[name]), name
        assert torch.equal(tensor, trained[name]), name
