"""Model summaries that count the real (unsharded) parameters of a sharded LightningModule.

After sharding, ``module.parameters()`` yields only this rank's master shards, so
Lightning's :class:`~lightning.pytorch.callbacks.ModelSummary` would report every layer
with 0 parameters and the root with ``1/world_size`` of the model. The counts here come
from the engine's flat layouts instead: each original parameter, by its original name,
with its full shape. ``YaFSDPStrategy.setup`` switches the Trainer's summary callbacks
to these classes; nothing else changes in how they print.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.model_summary import LayerSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary
from torch import nn
from typing_extensions import override

from lightning_yafsdp.core import get_engine

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_yafsdp.core import YaFSDPEngine


def original_parameter_names(engine: YaFSDPEngine) -> dict[str, list[str]]:
    """``{first name: every name}`` of each sharded parameter (tied aliases share one entry)."""
    names: dict[str, list[str]] = {}
    for group in engine.groups():
        for owners in group.owners:
            names[owners[0].name] = [owner.name for owner in owners]
    return names


def original_parameter_numels(engine: YaFSDPEngine) -> dict[str, int]:
    """``{first name: numel}`` of each sharded parameter: the full size, not the shard."""
    return {span.name: span.numel for group in engine.groups() for span in group.layout.spans}


class YaFSDPSummary(Summary):
    """A :class:`~lightning.pytorch.utilities.model_summary.ModelSummary` of a sharded model.

    Args:
        model: a LightningModule sharded by ``YaFSDPStrategy`` (or ``shard_model``).
        max_depth: as for Lightning's summary: 1 lists the direct children.
    """

    def __init__(self, model: pl.LightningModule, max_depth: int = 1) -> None:
        engine = get_engine(model)
        self._numels = original_parameter_numels(engine)
        # Every name a parameter is reachable under, so that a layer owning only the
        # second alias of a tied weight still counts it (as nn.Module.parameters does).
        self._canonical = {
            alias: name
            for name, aliases in original_parameter_names(engine).items()
            for alias in aliases
        }
        super().__init__(model, max_depth)

    def _layer_numel(self, layer_name: str) -> int:
        prefix = layer_name + "."
        inside = {name for alias, name in self._canonical.items() if alias.startswith(prefix)}
        return sum(self._numels[name] for name in inside)

    @override
    def summarize(self) -> dict[str, LayerSummary]:
        summary: OrderedDict[str, LayerSummary] = OrderedDict(
            (name, _ShardedLayerSummary(module, self._layer_numel(name)))
            for name, module in self.named_modules
        )
        if self._model.example_input_array is not None:
            self._forward_example_input()
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for name in [name for name in summary if name.count(".") >= self._max_depth]:
                del summary[name]
        return summary

    @property
    @override
    def total_parameters(self) -> int:
        return self.trainable_parameters

    @property
    @override
    def trainable_parameters(self) -> int:
        return sum(self._numels.values())


class _ShardedLayerSummary(LayerSummary):
    def __init__(self, module: nn.Module, num_parameters: int) -> None:
        super().__init__(module)
        self._num_parameters = num_parameters

    @property
    @override
    def num_parameters(self) -> int:
        return self._num_parameters


class _ShardedSummaryCallback:
    """Mixin for Lightning's summary callbacks: summarize sharded modules by their real sizes."""

    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        if pl_module.__dict__.get("_yafsdp_engine") is None:
            return super()._summary(trainer, pl_module)  # type: ignore[misc]
        return YaFSDPSummary(pl_module, max_depth=self._max_depth)  # type: ignore[attr-defined]


class YaFSDPModelSummary(_ShardedSummaryCallback, ModelSummary):
    """:class:`~lightning.pytorch.callbacks.ModelSummary` that reports unsharded sizes."""


class YaFSDPRichModelSummary(_ShardedSummaryCallback, RichModelSummary):
    """:class:`~lightning.pytorch.callbacks.RichModelSummary` that reports unsharded sizes."""


def use_sharded_summaries(trainer: pl.Trainer) -> None:
    """Switch the Trainer's stock summary callbacks to the sharded-aware subclasses.

    Only the class changes (the subclasses add no state), so every option the user
    passed to the callback is kept.
    """
    for callback in trainer.callbacks:
        if type(callback) is ModelSummary:
            callback.__class__ = YaFSDPModelSummary
        elif type(callback) is RichModelSummary:
            callback.__class__ = YaFSDPRichModelSummary
