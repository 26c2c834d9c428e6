"""YaFSDPPrecision: the dtype policy of a sharded model, in Lightning's terms.

Lightning's ``precision=`` flag maps onto three modes (``YaFSDPStrategy`` does the
mapping; see its ``precision_plugin`` setter):

=============  ==============  ===============  ==========================================
flag           master shards   compute shards   forward context
=============  ==============  ===============  ==========================================
32-true        fp32            fp32 (the same   none
                               tensor)
bf16-mixed     fp32            bf16             ``torch.autocast(bf16)``, like DDP's
                                                bf16-mixed, for code outside the units
bf16-true      bf16            bf16 (the same   default dtype bf16, floating batch
                               tensor)          tensors cast to bf16, like Lightning's
                                                bf16-true
=============  ==============  ===============  ==========================================

Gradients always reach the master shards in ``reduce_dtype`` (fp32 by default) and are
divided by the world size as they are added, once per backward; the engine refreshes
the compute shards after every optimizer step. Clipping goes through the engine and
touches only the parameters of the optimizer being clipped (with two optimizers each
clips its own, as under DDP); their norm is global, over every rank's shards, with one
all_reduce.

``16-mixed`` needs a loss scaler whose inf/nan check spans every rank's shards; it is
not implemented and is rejected rather than silently run without scaling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities import apply_to_collection
from torch.optim import Optimizer
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_yafsdp.core import YaFSDPEngine

_Mode = Literal["32-true", "bf16-mixed", "bf16-true"]

# flag -> (master dtype, compute dtype)
_DTYPES: dict[str, tuple[torch.dtype, torch.dtype]] = {
    "32-true": (torch.float32, torch.float32),
    "bf16-mixed": (torch.float32, torch.bfloat16),
    "bf16-true": (torch.bfloat16, torch.bfloat16),
}
_ALIASES = {"32": "32-true", "bf16": "bf16-mixed", 32: "32-true"}

_REJECTED = {
    "16-mixed": (
        "fp16 mixed precision needs a loss scaler whose overflow check spans the shards of "
        "every rank, which YaFSDPStrategy does not implement. Use precision='bf16-mixed' "
        "(same speed on Ampere or newer GPUs, no loss scaling needed)"
    ),
    "16-true": (
        "pure fp16 training without loss scaling underflows small gradients. Use "
        "precision='bf16-true' for the same memory saving"
    ),
    "64-true": "fp64 sharded training is not supported. Use precision='32-true'",
}


class YaFSDPPrecision(Precision):
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
        precision = _ALIASES.get(precision, precision)
        if precision in _REJECTED:
            raise ValueError(
                f"YaFSDPStrategy does not support precision={precision!r}: {_REJECTED[precision]}."
            )
        if precision not in _DTYPES:
            raise ValueError(
                f"unknown precision {precision!r} for YaFSDPStrategy; choose one of "
                f"{', '.join(_DTYPES)}"
            )
        self.precision = precision
        self.master_dtype, self.param_dtype = _DTYPES[precision]
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
        # [Note: bf16-mixed autocast] The units already run in bf16 (their gathered
        # weights are bf16 and their floating inputs are cast). Autocast covers the
        # user's code between and after them (loss, metrics, heads called by hand) so
        # that it sees the same dtypes as under DDP's bf16-mixed: matmuls in bf16,
        # softmax/cross-entropy in fp32.
        if self.precision == "bf16-mixed":
            with torch.autocast(self._device_type, dtype=torch.bfloat16):
                yield
        elif self.precision == "bf16-true":
            default = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)
            try:
                yield
            finally:
                torch.set_default_dtype(default)
        else:
            yield

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return _cast_floating(data, torch.bfloat16)

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


def _cast_floating(data: Any, dtype: torch.dtype) -> Any:
    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor

    return apply_to_collection(data, torch.Tensor, cast)
