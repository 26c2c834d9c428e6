"""Lightning callbacks and utilities that read the model's parameters work as under DDP.

Issue 11: ``grad_norm`` logs one global norm per original parameter, ``WeightAveraging``
(EMA) averages the sharded parameters into the same weights as under DDP, a peft LoRA
adapter saved under ``summon_full_params`` is the one DDP saves and reloads into a fresh
model, and ``ModelSummary`` counts trainable and frozen parameters as under DDP. Each on
2 and 3 ranks against ``strategy="ddp"``, ``precision="32-true"``, one spawn per world
size (``tests/param_view_models.py`` has the shared harness).
"""

from __future__ import annotations

import os
import tempfile

import lightning.pytorch as pl
import peft
import pytest
import torch
import transformers
from lightning.pytorch.callbacks import ModelSummary, WeightAveraging
from lightning.pytorch.utilities.model_summary import summarize

from tests.distributed import dist_run
from tests.param_view_models import (
    STEPS,
    InitialWeights,
    Variant,
    assert_same_losses,
    assert_same_weights,
    compare_all,
    fixed_tokens,
    guarded,
    pair,
    strategy_for,
    tiny_llama_config,
    token_loader,
    trainer_for,
)
from tests.zoo_models import full_weights

# [Tolerance] as in tests/test_param_views.py. Measured on 3 ranks: losses 1.4e-7
# relative, grad_norm values 2.5e-7 relative, weights 1.5e-6 absolute, reloaded logits
# 1.2e-7 from DDP's (and bit for bit from the sharded model's own).
LOSS_RTOL = 1e-6
NORM_RTOL = 1e-6
WEIGHT_ATOL = 1e-5

VARIANTS = {
    "grad_norm": Variant(log_grad_norm=True, groups="by_dim", layerdrop=True),
    "ema_avg_fn": Variant(ema="ema_avg_fn", groups="by_dim"),
    "ema_multi_avg_fn": Variant(ema="ema_multi_avg_fn", groups="by_module"),
    "ema_meta": Variant(ema="ema_avg_fn", build="configure_model"),
}

# -- a peft LoRA model -------------------------------------------------------------------------

_LORA_PREFIX = "model."  # the LightningModule attribute that holds the PeftModel


def _lora_model() -> peft.PeftModel:
    base = transformers.LlamaForCausalLM(tiny_llama_config())
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    return peft.get_peft_model(base, config)


class LoraModule(pl.LightningModule):
    """A tiny Llama with LoRA adapters on q/v: the base is frozen, only lora_A/B train."""

    def __init__(self, *, build: str = "eager", initial: dict | None = None) -> None:
        super().__init__()
        self.build = build
        self.initial = initial
        self.model: peft.PeftModel | None = None
        self.losses: list[float] = []
        if build == "eager":
            torch.manual_seed(0)
            self.model = _lora_model()

    def configure_model(self) -> None:
        if self.model is None:
            self.model = _lora_model()
            if self.initial is not None:
                self.load_state_dict(self.initial)

    def training_step(self, tokens: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(trainable, lr=3e-2, weight_decay=0.01)


def _save_adapter(trainer: pl.Trainer, module: LoraModule, directory: str) -> None:
    if hasattr(trainer.strategy, "summon_full_params"):
        with trainer.strategy.summon_full_params():
            module.model.save_pretrained(directory, is_main_process=trainer.is_global_zero)
    else:
        module.model.save_pretrained(directory, is_main_process=trainer.is_global_zero)
    trainer.strategy.barrier()


def _summary_facts(module: pl.LightningModule) -> dict:
    summary = summarize(module, max_depth=4)
    return {
        "total": summary.total_parameters,
        "trainable": summary.trainable_parameters,
        "layers": dict(zip(summary.layer_names, summary.param_nums)),
    }


def _reload_adapter(directory: str, trained: dict[str, torch.Tensor]) -> dict:
    """A fresh base model with the trained base weights, the saved adapter on top."""
    base = transformers.LlamaForCausalLM(tiny_llama_config())
    prefix = _LORA_PREFIX + "base_model.model."
    base_weights = {
        name[len(prefix) :].replace(".base_layer.", "."): value
        for name, value in trained.items()
        if "lora_" not in name
    }
    base.load_state_dict(base_weights)
    reloaded = peft.PeftModel.from_pretrained(base, directory).eval()
    with torch.no_grad():
        logits = reloaded(input_ids=fixed_tokens()).logits
    lora = {
        _LORA_PREFIX + name: value.detach().clone()
        for name, value in reloaded.state_dict().items()
        if "lora_" in name
    }
    return {"logits": logits, "lora": lora}


def fit_lora(strategy: str, *, build: str, directory: str, initial: dict | None = None) -> dict:
    """Train, save the adapter, reload it on rank 0; plain facts of this rank."""
    world_size = torch.distributed.get_world_size()
    module = LoraModule(build=build, initial=initial)
    start = InitialWeights()
    trainer = trainer_for(
        strategy_for(strategy), world_size=world_size, enable_model_summary=True,
        callbacks=[start, ModelSummary(max_depth=4)],
    )  # fmt: skip
    trainer.fit(module, token_loader(world_size))
    facts = {"losses": module.losses, "initial": start.weights, "steps": trainer.global_step}
    facts["final"] = full_weights(trainer, module)
    facts["summary"] = _summary_facts(module)
    module.eval()
    with torch.no_grad():
        facts["logits"] = module.model(input_ids=fixed_tokens()).logits
    _save_adapter(trainer, module, directory)
    if trainer.is_global_zero:
        from safetensors.torch import load_file

        facts["files"] = sorted(os.listdir(directory))
        facts["adapter"] = load_file(os.path.join(directory, "adapter_model.safetensors"))
        facts["reloaded"] = _reload_adapter(directory, facts["final"])
    return facts


def compare_lora(build: str, root: str, subject: str = "yafsdp") -> dict:
    ours = fit_lora(subject, build=build, directory=os.path.join(root, f"subject-{build}"))
    initial = ours["initial"] if build == "configure_model" else None
    directory = os.path.join(root, f"ddp-{build}")
    ddp = fit_lora("ddp", build=build, directory=directory, initial=initial)
    return {"subject": ours, "ddp": ddp}


def _all_fits(subject: str = "yafsdp") -> dict:
    runs = compare_all(VARIANTS, subject)
    root = tempfile.mkdtemp(prefix="lora_") if torch.distributed.get_rank() == 0 else ""
    root = _broadcast_path(root)
    runs["lora"] = guarded(compare_lora, "eager", root, subject)
    runs["lora_meta"] = guarded(compare_lora, "configure_model", root, subject)
    return runs


def _broadcast_path(path: str) -> str:
    box = [path]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def runs(request) -> list[dict]:
    return dist_run(request.param, _all_fits, timeout_s=300)


def _assert_same_training(ours: dict, ddp: dict) -> None:
    assert ours["steps"] == ddp["steps"] == STEPS
    assert_same_weights(ours["initial"], ddp["initial"], atol=0.0)
    assert_same_losses(ours["losses"], ddp["losses"], rtol=LOSS_RTOL)


# -- grad_norm -------------------------------------------------------------------------------


def test_grad_norm_logs_the_same_global_norm_per_parameter_as_ddp(runs):
    for facts in runs:
        ours, ddp = pair(facts, "grad_norm")
        assert len(ours["grad_norms"]) == STEPS
        for step, (mine, theirs) in enumerate(zip(ours["grad_norms"], ddp["grad_norms"])):
            # Same keys: the original names, and only parameters with a grad (LayerDrop
            # leaves block 2's grads None on odd steps).
            assert sorted(mine) == sorted(theirs), step
            for key, value in theirs.items():
                assert mine[key] == pytest.approx(value, rel=NORM_RTOL), (step, key)
        assert any(".layers.2." in key for key in ours["grad_norms"][0])
        assert not any(".layers.2." in key for key in ours["grad_norms"][1])


# -- WeightAveraging (EMA) -----------------------------------------------------------------


@pytest.mark.parametrize("variant", ["ema_avg_fn", "ema_multi_avg_fn", "ema_meta"])
def test_weight_averaging_gives_the_same_averaged_weights_as_ddp(runs, variant):
    for facts in runs:
        ours, ddp = pair(facts, variant)
        _assert_same_training(ours, ddp)
        assert_same_weights(ours["trained"], ddp["trained"], atol=WEIGHT_ATOL)
        # on_train_end copies the average into the model: the final weights are the EMA,
        # not the trained weights.
        assert any(not torch.equal(ours["final"][k], v) for k, v in ours["trained"].items())
        assert_same_weights(ours["final"], ddp["final"], atol=WEIGHT_ATOL)


def test_weight_averaging_private_attributes_the_strategy_rebuilds_are_still_there():
    # YaFSDPStrategy.setup rebuilds each WeightAveraging's AveragedModel from the sharded
    # module with these attributes (Lightning 2.6); if Lightning renames them, this
    # fails before the EMA tests show a shape mismatch.
    callback = WeightAveraging(device="cpu", use_buffers=False, avg_fn=None)
    assert callback._average_model is None
    assert callback._device == torch.device("cpu")
    assert callback._use_buffers is False
    assert callback._kwargs == {"avg_fn": None}


# -- peft LoRA ----------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["lora", "lora_meta"])
def test_lora_trains_as_under_ddp(runs, variant):
    for facts in runs:
        ours, ddp = pair(facts, variant)
        _assert_same_training(ours, ddp)
        assert_same_weights(ours["final"], ddp["final"], atol=WEIGHT_ATOL)


@pytest.mark.parametrize("variant", ["lora", "lora_meta"])
def test_lora_save_pretrained_under_summon_full_params_writes_ddps_adapter(runs, variant):
    ours, ddp = pair(runs[0], variant)
    assert ours["files"] == ddp["files"]
    assert_same_weights(ours["adapter"], ddp["adapter"], atol=WEIGHT_ATOL)
    # The real trained adapter: lora_B starts at zero and has moved.
    assert all(v.abs().max() > 0 for k, v in ours["adapter"].items() if "lora_B" in k)


@pytest.mark.parametrize("variant", ["lora", "lora_meta"])
def test_a_saved_lora_adapter_reloads_into_a_fresh_model(runs, variant):
    ours, ddp = pair(runs[0], variant)
    reloaded = ours["reloaded"]
    lora_final = {k: v for k, v in ours["final"].items() if "lora_" in k}
    assert sorted(reloaded["lora"]) == sorted(lora_final)
    for name, value in lora_final.items():
        assert torch.equal(reloaded["lora"][name], value), name
    torch.testing.assert_close(reloaded["logits"], ours["logits"], rtol=0, atol=1e-6)
    torch.testing.assert_close(
        reloaded["logits"], ddp["reloaded"]["logits"], rtol=0, atol=WEIGHT_ATOL
    )


# -- ModelSummary -------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["lora", "lora_meta"])
def test_model_summary_counts_trainable_and_frozen_parameters_as_ddp(runs, variant):
    for facts in runs:
        ours, ddp = (side["summary"] for side in pair(facts, variant))
        assert 0 < ours["trainable"] < ours["total"]  # LoRA: most of the model is frozen
        assert ours == ddp
