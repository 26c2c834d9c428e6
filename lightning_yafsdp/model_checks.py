"""What the strategy refuses before the first step, and why (one message each, with the fix).

Checks of the LightningModule the Trainer hands to ``YaFSDPStrategy.setup``: how it was
built (meta device or real tensors), what its optimizers select, and Lightning
conventions that cannot work in the current setting. Each raises with what was found,
why it cannot work, and what to do instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor
from lightning_yafsdp.core.plan.meta_build import constructor_values

if TYPE_CHECKING:
    from lightning_yafsdp.core import YaFSDPEngine


_SELECT_IN_CONFIGURE_OPTIMIZERS = (
    "Select parameters inside configure_optimizers() (self.parameters(), "
    "self.named_parameters(), a submodule's parameters())."
)


def check_optimizers_hold_model_params(
    modules: nn.Module | Sequence[nn.Module],
    optimizers,
    *,
    fix: str = _SELECT_IN_CONFIGURE_OPTIMIZERS,
) -> None:
    """Refuse an optimizer holding parameters the sharded model(s) no longer have.

    Sharding replaces every trainable parameter by a sharded one under the same
    name. Parameter objects taken before that (a list kept from ``__init__``) are
    no longer part of the model: stepping them would train nothing, silently.
    """
    modules = [modules] if isinstance(modules, nn.Module) else list(modules)
    current = {id(p) for module in modules for p in module.parameters()}
    for index, optimizer in enumerate(optimizers):
        stale = [
            tuple(p.shape)
            for group in optimizer.param_groups
            for p in group["params"]
            if id(p) not in current
        ]
        if stale:
            raise ValueError(
                f"optimizer {index} holds {len(stale)} tensors (shapes {stale[:3]}) that are not "
                "parameters of the sharded model: they were taken before sharding (e.g. a "
                "list of parameters kept from __init__), and sharding replaced every "
                "parameter by a sharded one under the same name, so stepping them would "
                f"train nothing. {fix}"
            )


def check_single_device(module: nn.Module) -> None:
    # [Note: constructor values in meta builds]: small real tensors beside meta ones are
    # values the constructor computed (CLIP's logit_scale), kept and synced by shard_model.
    kept = {id(p) for _, p in constructor_values(module)}
    meta = [name for name, p in module.named_parameters() if p.is_meta]
    real = [name for name, p in module.named_parameters() if not p.is_meta and id(p) not in kept]
    if meta and real:
        raise ValueError(
            f"{type(module).__name__} mixes parameters built on the meta device in "
            "configure_model or under trainer.init_module(empty_init=True) and never loaded "
            f"({meta[:3]}...) with real ones, built eagerly (e.g. in __init__) or loaded with "
            f"load_state_dict(..., assign=True) ({real[:3]}...); they cannot be sharded "
            "together. Build all of them in configure_model, load all of them (a state dict "
            "with every parameter, strict=True), or build all of them with real tensors (in "
            "__init__, or in configure_model under `with torch.device('cpu'):`)."
        )


def check_sync_batchnorm_device(module: nn.Module, device: torch.device) -> None:
    synced = [name for name, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)]
    if synced and device.type == "cpu":
        raise ValueError(
            f"the model has SyncBatchNorm layers ({synced[:3]}), from sync_batchnorm=True or "
            "built in, and trains on CPU: torch's SyncBatchNorm runs on GPUs only (it has no "
            "CPU kernels; DDP refuses it on CPU too). Train on GPUs, or drop "
            "sync_batchnorm=True (each rank then normalizes with its own batch statistics)."
        )


def check_no_meta_metric_states(module: nn.Module) -> None:
    from torchmetrics import Metric

    on_meta = [
        f"{name}.{state}"
        for name, metric in module.named_modules()
        if isinstance(metric, Metric)
        for state, value in metric.metric_state.items()
        if any(t.is_meta for t in (value if isinstance(value, list) else [value]))
    ]
    if on_meta:
        raise ValueError(
            f"metric states {on_meta[:3]} are on the meta device: the metrics were created "
            "under trainer.init_module(empty_init=True), which gives tensors no values, and a "
            "metric's starting state cannot be restored from there. Create the metrics outside "
            "it: build the model under trainer.init_module() without empty_init=True, or build "
            "the layers in configure_model() and keep the metrics in __init__."
        )


def check_still_sharded(module: nn.Module, engine: YaFSDPEngine) -> None:
    sharded = {id(p) for p in engine.sharded_parameters()}
    added = [
        name
        for name, p in module.named_parameters()
        if id(p) not in sharded and not isinstance(p, RangeShardedTensor) and p.requires_grad
    ]
    if added:
        raise RuntimeError(
            f"configure_model() added parameters {added[:3]} to a model that is already "
            "sharded (configure_model runs again for every fit/validate/test/predict). Make it "
            "idempotent: return early when the model exists, e.g. "
            "`if self.model is not None: return`."
        )
