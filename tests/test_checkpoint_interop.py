"""torch's own DCP tools read our sharded checkpoints.

A 2-rank Trainer run (the model built eagerly, and on the meta device in
``configure_model``) writes a sharded checkpoint; torch's
``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` must turn it, with no
code of ours, into a plain state dict under the original parameter names with full
shapes, equal element for element to our consolidation and to the run's own full
weights (gathered in the run).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.tensor import DTensor

from lightning_yafsdp.checkpoint import consolidate_checkpoint
from lightning_yafsdp.strategy import YaFSDPStrategy
from tests.distributed import dist_run
from tests.lightning_models import CausalLMModule, quiet_trainer, token_loader


def _fit_and_save(root: str, build: str) -> dict[str, torch.Tensor]:
    trainer = quiet_trainer("yafsdp", root, max_steps=2)
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


# -- FSDP2 through Lightning's ModelParallelStrategy --------------------------------------


class FSDP2Module(CausalLMModule):
    """The same module, sharded by FSDP2's ``fully_shard`` (ModelParallelStrategy's way)."""

    def configure_model(self) -> None:
        super().configure_model()
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


def _fsdp2() -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)


def _full_weights_of(trainer: pl.Trainer) -> dict[str, torch.Tensor]:
    """Every weight of the trained module, whole, whichever strategy sharded it."""
    if isinstance(trainer.strategy, YaFSDPStrategy):
        return trainer.strategy.engine.full_state_dict()
    return {
        name: value.full_tensor() if isinstance(value, DTensor) else value
        for name, value in trainer.lightning_module.state_dict().items()
    }


def _fsdp2_to_yafsdp(root: str) -> dict[str, dict[str, torch.Tensor]]:
    trainer = quiet_trainer(_fsdp2(), root, max_steps=2)
    trainer.fit(FSDP2Module(), token_loader(8))
    trainer.save_checkpoint(f"{root}/fsdp2.ckpt")
    saved = _full_weights_of(trainer)
    torch.manual_seed(1)  # other weights, so a load that does nothing shows
    module = CausalLMModule(build="configure_model")
    trainer = quiet_trainer("yafsdp", root, max_steps=2)
    trainer.validate(module, token_loader(4), ckpt_path=f"{root}/fsdp2.ckpt", verbose=False)
    return {"saved": saved, "loaded": _full_weights_of(trainer)}


def test_an_fsdp2_checkpoint_of_model_parallel_strategy_loads_into_yafsdp(tmp_path) -> None:
    ranks = dist_run(2, _fsdp2_to_yafsdp, str(tmp_path), timeout_s=240)

    for facts in ranks:
        assert facts["loaded"].keys() == facts["saved"].keys()
        for name, tensor in facts["saved"].items():
            assert torch.equal(facts["loaded"][name], tensor), name


def _yafsdp_to_fsdp2(root: str, consolidated: str) -> dict[str, dict[str, torch.Tensor]]:
    saved = torch.load(consolidated, weights_only=False)["state_dict"]
    torch.manual_seed(1)
    trainer = quiet_trainer(_fsdp2(), root, max_steps=2)
    trainer.validate(FSDP2Module(), token_loader(4), ckpt_path=consolidated, verbose=False)
    return {"saved": saved, "loaded": _full_weights_of(trainer)}


def test_our_checkpoint_consolidated_by_lightning_loads_into_model_parallel_strategy(
    tmp_path,
) -> None:
    # ModelParallelStrategy reads the weights of a DCP directory under "state_dict",
    # FSDPStrategy and we under "model" (what Lightning's consolidation expects), so the
    # way from ours to FSDP2 is Lightning's own consolidation utility, then the file.
    dist_run(2, _fit_and_save, str(tmp_path), "eager", timeout_s=240)
    checkpoint = tmp_path / "step-2.ckpt"
    command = [sys.executable, "-m", "lightning.pytorch.utilities.consolidate_checkpoint"]
    subprocess.run([*command, str(checkpoint)], check=True, capture_output=True, timeout=120)

    ranks = dist_run(2, _yafsdp_to_fsdp2, str(tmp_path), f"{checkpoint}.consolidated")

    for facts in ranks:
        assert facts["loaded"].keys() == facts["saved"].keys()
        for name, tensor in facts["saved"].items():
            assert torch.equal(facts["loaded"][name], tensor), name


# -- plain torch: an FSDP2 model reads our directory with dcp.load, no code of ours -------


def _fsdp2_reads_ours_with_plain_dcp_load(checkpoint: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)  # other weights, so a load that does nothing shows
    module = CausalLMModule()
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in module.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(module.model, mesh=mesh)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    state = {
        "model": module.state_dict(),
        # torch's own name-keyed optimizer layout is ours: state by name, groups with names.
        "optimizer_0": get_optimizer_state_dict(module, optimizer),
    }
    dcp.load(state, checkpoint_id=checkpoint)
    set_optimizer_state_dict(module, optimizer, state["optimizer_0"])
    restored = get_optimizer_state_dict(module, optimizer)  # what the optimizer now holds
    whole = lambda v: v.full_tensor() if isinstance(v, DTensor) else v  # noqa: E731
    return {
        "weights": {name: whole(value) for name, value in module.state_dict().items()},
        "exp_avg": {name: whole(entry["exp_avg"]) for name, entry in restored["state"].items()},
        "lrs": [group["lr"] for group in restored["param_groups"]],
    }


def test_an_fsdp2_model_loads_our_directory_with_plain_dcp_load(tmp_path) -> None:
    # Saved by 2 yafsdp ranks, read by 3 FSDP2 ranks: DCP reshards our boxes by itself.
    trained = dist_run(2, _fit_and_save, str(tmp_path), "configure_model", timeout_s=240)[0]
    checkpoint = tmp_path / "step-2.ckpt"
    ours = consolidate_checkpoint(checkpoint)

    ranks = dist_run(3, _fsdp2_reads_ours_with_plain_dcp_load, str(checkpoint), timeout_s=240)

    for facts in ranks:
        assert facts["weights"].keys() == trained.keys()
        for name, tensor in trained.items():
            assert torch.equal(facts["weights"][name], tensor), name
        saved_state = ours["optimizer_0"]["state"]
        assert facts["exp_avg"].keys() == saved_state.keys()
        for name, tensor in facts["exp_avg"].items():
            assert torch.equal(tensor, saved_state[name]["exp_avg"]), name
        assert facts["lrs"] == [g["lr"] for g in ours["optimizer_0"]["param_groups"]]
