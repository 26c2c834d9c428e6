"""Causal-LM training for ``yafsdp train``: the LightningModule, YaLM practices, output."""

from lightning_yafsdp.training.curriculum import Curriculum
from lightning_yafsdp.training.guard import DivergenceGuard
from lightning_yafsdp.training.module import CausalLMModule
from lightning_yafsdp.training.thermometers import Thermometers

__all__ = ["CausalLMModule", "Curriculum", "DivergenceGuard", "Thermometers"]
