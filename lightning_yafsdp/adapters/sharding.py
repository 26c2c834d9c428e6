"""Sharding a module the way both strategies do, and re-pointing early optimizers.

``shard_module`` is the strategies' one call into the engine: it takes a module as the
user built it (on the meta device, or with real tensors on any device) and shards it
in place with ``shard_model``. ``rebind_optimizers`` serves Fabric's
``fabric.setup(model, optimizer)``, where the optimizer was built from the parameters
before they were sharded.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Protocol

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_yafsdp.adapters.options import ShardingOptions
from lightning_yafsdp.core import YaFSDPEngine, shard_model
from lightning_yafsdp.core.comm.mesh import ShardMesh
from lightning_yafsdp.core.plan.materialize import Materializer
from lightning_yafsdp.hf_init import hf_model_init
from lightning_yafsdp.model_checks import check_single_device, check_still_sharded


class DtypeSource(Protocol):
    """What sharding needs of a precision plugin: the two dtypes of its policy."""

    master_dtype: torch.dtype
    param_dtype: torch.dtype


def shard_module(
    module: nn.Module,
    options: ShardingOptions,
    precision: DtypeSource,
    *,
    device: torch.device,
    mesh: ShardMesh | None = None,
) -> YaFSDPEngine:
    """Shard ``module`` in place (once: a module already sharded keeps its engine).

    A meta-built module is materialized, initialized and sharded one unit at a time on
    ``device``; a module built with real tensors is moved to ``device`` whole first (its
    meta buffers, e.g. rotary tables of a model loaded onto a meta build, are rebuilt).
    ``mesh``: the strategy's shard and replicate groups (None: every rank, flat).
    """
    existing = module.__dict__.get("_yafsdp_engine")
    if existing is not None:
        check_still_sharded(module, existing)
        return existing
    check_single_device(module)
    if options.activation_checkpointing not in (None, (), []):
        train_without_kv_cache(module)
    built_on_meta = any(p.is_meta for p in module.parameters())
    if not built_on_meta:
        # [Note: meta buffers beside loaded parameters] in core/plan/materialize.py. The seed
        # is fixed, so every rank derives the same values without a collective.
        Materializer(
            module, device=device, init_fn=None, seed=0, model_init=hf_model_init
        ).materialize_meta_buffers()
        module.to(device)
    return shard_model(
        module,
        mesh=mesh,
        units=options.units,
        norm_classes=options.norm_classes,
        param_dtype=precision.param_dtype,
        reduce_dtype=options.reduce_dtype,
        master_dtype=precision.master_dtype,
        zero_stage=options.zero_stage,
        activation_checkpointing=options.activation_checkpointing,
        # As DDP: a model built with real tensors starts from rank 0's weights and
        # buffers on every rank, seeded alike or not. A meta-built model needs no
        # broadcast: it is initialized from a seed broadcast from rank 0 ([Note: init seed]).
        sync_module_states=(
            options.sync_module_states
            if options.sync_module_states is not None
            else not built_on_meta
        ),
        cast_forward_inputs=options.cast_forward_inputs,
        vocab_chunks=options.vocab_chunks,
        blocks_per_unit=options.blocks_per_unit,
        param_init_fn=options.param_init_fn or getattr(module, "init_submodule", None),
        model_init=hf_model_init,
    )


def train_without_kv_cache(module: nn.Module) -> None:
    """Turn off the default KV cache of the Hugging Face models in ``module``, with a warning.

    [Note: no KV cache under activation checkpointing] A checkpointed block runs its
    forward again in backward; a block that appends its keys and values to a cache
    (``use_cache=True``, the default of every HF causal LM config) appends them a second
    time, and the recomputed attention sees twice the keys: a shape error in backward
    under a padding mask, and a result right only by luck without one. Hugging Face's own
    activation checkpointing (``activation_checkpointing_enable()``, formerly
    ``gradient_checkpointing_enable()``) sets ``use_cache=False`` while training, with a
    warning; so do we, on the config, so the forward and its recomputation agree (both
    build no cache). A call that passes ``use_cache=True`` itself (generation) still gets
    a cache; without gradients nothing is recomputed.
    """
    transformers = sys.modules.get("transformers")  # not imported: no HF model here
    if transformers is None:
        return
    configs = {}
    for submodule in module.modules():
        # getattr: configs of models without a cache (ViT, ResNet, a composite's outer
        # config) have no use_cache at all.
        if isinstance(submodule, transformers.PreTrainedModel) and getattr(
            submodule.config, "use_cache", False
        ):
            configs.setdefault(id(submodule.config), (submodule.config, type(submodule).__name__))
    for config, _ in configs.values():
        config.use_cache = False
    if configs:  # one warning, naming every model whose cache went (T5: encoder and decoder)
        owners = ", ".join(dict.fromkeys(owner for _, owner in configs.values()))
        rank_zero_warn(
            f"activation_checkpointing recomputes each block in backward, where the KV cache "
            f"of {owners} would be written a second time: its config.use_cache is now False, "
            "as under Hugging Face's own activation_checkpointing_enable() (pass use_cache=True to "
            "the calls that need a cache, such as generation)"
        )


def place_module(module: nn.Module, engine: YaFSDPEngine, device: torch.device) -> None:
    """Move what sharding left behind (metrics, buffers made in ``__init__``) to ``device``.

    [Note: non-parameter state on the root device] Sharding puts every parameter on the
    device, but a model built on meta leaves what was created outside (torchmetrics
    states, registered buffers) where it was created. Moved as DDP moves the model:
    ``Module.to()`` keeps a tensor already on the device as it is, so the engine's
    shards and views stay.
    """
    if engine.device != device:
        raise RuntimeError(
            f"the model was sharded on {engine.device} but the strategy runs on {device}; "
            "moving it would detach the shards from the engine"
        )
    module.to(device)


ParameterNames = dict[int, str]


def parameter_names(module: nn.Module) -> ParameterNames:
    """``id(parameter) -> name`` of every parameter, tied aliases included (before sharding)."""
    return {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}


def rebind_optimizers(
    optimizers: Sequence[torch.optim.Optimizer],
    names_before: ParameterNames,
    module: nn.Module,
) -> None:
    """Point optimizers built from ``module``'s parameters before sharding at the sharded ones.

    Sharding replaces every parameter by a sharded one under the same name, so each
    parameter an optimizer holds is swapped by name; hyperparameters and group dicts
    stay. The ``"params"`` lists are edited in place (LBFGS keeps a reference to its
    list). Call ``refuse_optimizers_with_state`` before sharding: state of the old
    parameters cannot follow them.
    """
    now = dict(module.named_parameters(remove_duplicate=False))
    current = {id(p) for p in now.values()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"][:] = [
                _sharded_twin(p, names_before, now, current) for p in group["params"]
            ]


def refuse_optimizers_with_state(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Before sharding: optimizer state of the whole parameters cannot follow them."""
    for index, optimizer in enumerate(optimizers):
        if optimizer.state:
            raise ValueError(
                f"optimizer {index} already has state (it was stepped or loaded before "
                "setup); sharding cannot carry whole-parameter optimizer state over. Set "
                "the model and optimizer up first, then load the state with "
                "fabric.load(path, {'model': model, 'optimizer': optimizer})"
            )


def _sharded_twin(
    param: torch.Tensor, names_before: ParameterNames, now: dict, current: set[int]
) -> torch.Tensor:
    if id(param) in current:
        return param
    name = names_before.get(id(param))
    # Not a parameter of this module: left for check_optimizers_hold_model_params to name.
    return now.get(name, param) if name is not None else param
