"""Build the model a recipe names: the reference Llama or a local Hugging Face causal LM.

The same builder serves training (inside ``configure_model``, on the meta device
under YaFSDP) and ``yafsdp estimate`` (always on the meta device), so the two
see the same modules, parameters and units.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_yafsdp.config import RunConfig
from lightning_yafsdp.models.llama import Llama, LlamaConfig


def llama_config(config: RunConfig) -> LlamaConfig:
    """The ``LlamaConfig`` of a recipe: preset, field overrides, practices."""
    model = config.model
    return LlamaConfig.from_name(
        model.preset,
        **model.llama_overrides(),
        embedding_norm=config.practices.embedding_norm,
        dropout=config.practices.dropout,
        fp32_residual=config.practices.fp32_residual,
    )


def build_model(config: RunConfig) -> nn.Module:
    """Build the recipe's model in the current device context (``torch.device("meta")``
    makes it free).

    Raises:
        ValueError: if ``data.seq_len`` exceeds what the model's positions cover.
    """
    if config.model.kind == "llama":
        shape = llama_config(config)
        _check_seq_len(config.data.seq_len, shape.max_seq_len, "model.max_seq_len")
        return Llama(shape)
    return _build_hf(config)


def model_init_fn(model: nn.Module) -> Callable[[nn.Module], None]:
    """How to initialise one piece of ``model`` materialized from the meta device."""
    if isinstance(model, Llama):
        return model.init_submodule
    init_weights = getattr(model, "_init_weights", None)
    if init_weights is None:
        return _reset_parameters

    def init_hf(module: nn.Module) -> None:
        with torch.no_grad():
            for sub in module.modules():
                init_weights(sub)

    return init_hf


def vocab_size_of(model: nn.Module) -> int:
    if isinstance(model, Llama):
        return model.config.vocab_size
    return int(model.config.vocab_size)


def _build_hf(config: RunConfig) -> nn.Module:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as err:
        raise ImportError(
            "model.kind='hf' needs the 'hf' extra: pip install 'lightning-yafsdp[hf]'"
        ) from err
    path = config.model.hf_path
    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.practices.dropout == 0.0:
        for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop"):
            if hasattr(hf_config, name):
                setattr(hf_config, name, 0.0)
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    if max_positions is not None:
        _check_seq_len(config.data.seq_len, max_positions, "max_position_embeddings")
    if config.model.pretrained:
        # Real weights: built on the CPU whatever the surrounding context (a meta
        # context would drop them); the strategy moves and shards them.
        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_pretrained(
                path, config=hf_config, local_files_only=True, dtype=torch.float32
            )
        return model.train()  # from_pretrained returns eval mode; we are here to train
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def _check_seq_len(seq_len: int, limit: int, what: str) -> None:
    if seq_len > limit:
        raise ValueError(
            f"data.seq_len={seq_len} exceeds the model's {what}={limit}; lower data.seq_len "
            f"or raise {what}"
        )


def _reset_parameters(module: nn.Module) -> None:
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()
