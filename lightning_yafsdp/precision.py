"""YaFSDPPrecision: the dtype policy of a sharded model, in the Trainer's terms.

Lightning's ``precision=`` flag maps onto three modes (``dtype_policy.py`` has the
table; ``YaFSDPStrategy`` does the mapping in its ``precision_plugin`` setter). Clipping
goes through the engine and touches only the parameters of the optimizer being clipped
(with two optimizers each clips its own, as under DDP); their norm is global, over every
rank's shards, with one all_reduce. Fabric's plugin is ``lightning_yafsdp.fabric.precision``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Literal

from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from torch.optim import Optimizer
from typing_extensions import override

from lightning_yafsdp.dtype_policy import (
    DtypePolicy,
    PolicyBacked,
    adopt_flag_plugin,
    cast_floating,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_yafsdp.core import YaFSDPEngine

_Mode = Literal["32-true", "bf16-mixed", "bf16-true"]


class YaFSDPPrecision(PolicyBacked, Precision):
    """Precision plugin for :class:`~lightning_yafsdp.strategy.YaFSDPStrategy`.

    You rarely build it yourself: ``Trainer(strategy="yafsdp", precision="bf16-mixed")``
    creates it from the flag.

    Args:
        precision: ``"32-true"`` (default), ``"bf16-mixed"`` or ``"bf16-true"``. Aliases
            ``"32"``/``32`` and ``"bf16"`` (= bf16-mixed) are accepted.

    Raises:
        ValueError: for ``"16-mixed"``, ``"16-true"``, ``"64-true"`` or an unknown flag,
            with the supported alternative.
    """

    def __init__(self, precision: _Mode | str | int = "32-true") -> None:
        self.policy = DtypePolicy.from_flag(precision)
        self._engine: YaFSDPEngine | None = None
        self._device_type = "cpu"

    def connect_engine(self, engine: YaFSDPEngine) -> None:
        """Give the plugin the engine whose gradients it clips (done by the strategy)."""
        self._engine = engine
        self._device_type = engine.device.type

    @property
    def engine(self) -> YaFSDPEngine:
        if self._engine is None:
            raise RuntimeError(
                "YaFSDPPrecision has no engine yet: it is connected by YaFSDPStrategy.setup(); "
                "use the plugin through Trainer(strategy='yafsdp')"
            )
        return self._engine

    # -- forward -----------------------------------------------------------------------

    @contextlib.contextmanager
    @override
    def forward_context(self) -> Generator[None, None, None]:
        with self.policy.forward_context(self._device_type):
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return cast_floating(data, self.param_dtype)

    # -- optimizer step and clipping ----------------------------------------------------

    @override
    def optimizer_step(
        self,
        optimizer: Any,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, model, closure, **kwargs)
        # torch optimizers trigger the engine's step hook; any other Steppable (a
        # LightningOptimizer wrapper around a custom object) might not, so say it here.
        self.engine.mark_weights_changed()
        return output

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        # The global norm over every rank's shards (one all_reduce), not the local one,
        # of this optimizer's parameters only, as DDP's clip_grad_norm_(main_params).
        self.engine.clip_grad_norm_(float(clip_val), params=self.main_params(optimizer))

    @override
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        self.engine.clip_grad_value_(float(clip_val), params=self.main_params(optimizer))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision!r})"


def to_trainer_precision(plugin: Precision | None) -> YaFSDPPrecision | None:
    """Map the plugin the Trainer built from ``precision=`` onto ours; refuse foreign ones."""
    flag_types = (MixedPrecision, HalfPrecision, DoublePrecision)
    return adopt_flag_plugin(plugin, YaFSDPPrecision, Precision, flag_types)
