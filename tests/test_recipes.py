"""Every recipe validates against the schema; the default recipe is the schema's defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from lightning_yafsdp.config import RunConfig, load_config, to_yaml
from lightning_yafsdp.estimate import estimate

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))
SBATCH = sorted((Path(__file__).resolve().parent.parent / "recipes" / "slurm").glob("*.sbatch"))


def test_the_documented_recipes_exist() -> None:
    names = {path.stem for path in RECIPES}
    assert {"tiny-cpu", "llama-1b", "llama3-8b", "llama2-70b", "finetune-hf"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_validates_against_the_schema(recipe: Path) -> None:
    config = load_config(recipe)
    assert isinstance(config, RunConfig)
    assert config.recipe == recipe.stem


@pytest.mark.parametrize(
    "recipe", [p for p in RECIPES if p.stem != "finetune-hf"], ids=lambda p: p.stem
)
def test_recipe_estimate_runs_on_the_meta_device(recipe: Path) -> None:
    est = estimate(load_config(recipe))
    assert est.total > est.master_shards > 0


def test_tiny_cpu_recipe_is_the_embedded_default() -> None:
    assert to_yaml(load_config("tiny-cpu")) == to_yaml(load_config(None))


def test_multi_gpu_recipes_keep_activations_within_their_budget() -> None:
    for name in ("llama3-8b", "llama2-70b"):
        config = load_config(name)
        est = estimate(config)
        budget = config.strategy.activation_memory_gb * 2**30
        assert est.activations(est.checkpointed_units) <= budget, name


@pytest.mark.parametrize("template", SBATCH, ids=lambda p: p.name)
def test_sbatch_templates_launch_with_srun_and_requeue(template: Path) -> None:
    # What the command lines are: tests/test_slurm_templates.py runs the templates.
    text = template.read_text()
    assert "srun" in text and "(train " in text
    assert "--requeue" in text and "--signal=SIGUSR1" in text
    assert "--ntasks-per-node" in text


def test_finetune_hf_recipe_builds_a_local_hf_model_without_network(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    import torch

    from lightning_yafsdp.models.llama import LlamaConfig, hf_llama_config
    from lightning_yafsdp.training.models import build_model, model_init_fn

    hf_llama_config(LlamaConfig.from_name("tiny")).save_pretrained(tmp_path)  # config only
    overrides = [f"model.hf_path={tmp_path}", "model.pretrained=false", "data.seq_len=64"]
    config = load_config("finetune-hf", overrides)
    est = estimate(config, world_size=2)
    # Four blocks plus the embedding and the head (root units); same shape as ours.
    assert est.num_blocks == 4 and len(est.units) == 6 and est.num_parameters == 229_952
    with torch.device("meta"):
        model = build_model(config)
    block = model.model.layers[0].to_empty(device="cpu")
    model_init_fn(model)(block)
    assert torch.isfinite(block.self_attn.q_proj.weight).all()
    assert block.self_attn.q_proj.weight.std() > 0
