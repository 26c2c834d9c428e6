"""YaFSDPPrecision for Fabric: the dtype policy (``dtype_policy.py``) in Fabric's terms.

``Fabric(strategy="yafsdp", precision=...)`` builds it from the flag. What goes in and
out of the model's ``forward`` is converted as Fabric's own plugins for the same flag
do under DDP (``MixedPrecision`` / ``HalfPrecision``): floating inputs to bf16 under
``bf16-mixed`` and ``bf16-true``, floating outputs back to the default dtype; under
``bf16-true`` ``fabric.init_module()`` builds in bf16 and ``fabric.setup`` casts the
module (buffers too) to bf16. The master and compute shards
are the engine's (fp32 / bf16 / bf16 as in the table). Clipping is the strategy's.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from lightning.fabric.plugins.precision import (
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from torch import nn
from typing_extensions import override

from lightning_yafsdp.dtype_policy import (
    DtypePolicy,
    PolicyBacked,
    adopt_flag_plugin,
    cast_floating,
    default_dtype,
)

_Mode = Literal["32-true", "bf16-mixed", "bf16-true"]


class YaFSDPPrecision(PolicyBacked, Precision):
    """Precision plugin of :class:`lightning_yafsdp.fabric.YaFSDPStrategy`.

    Args:
        precision: ``"32-true"`` (default), ``"bf16-mixed"`` or ``"bf16-true"``.

    Raises:
        ValueError: for ``"16-mixed"``, ``"16-true"``, ``"64-true"`` or an unknown flag,
            with the supported alternative.
    """

    def __init__(self, precision: _Mode | str | int = "32-true") -> None:
        self.policy = DtypePolicy.from_flag(precision)
        self.device_type = "cpu"  # set by the strategy once it knows its device

    @override
    def forward_context(self) -> AbstractContextManager:
        return self.policy.forward_context(self.device_type)

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        return cast_floating(data, torch.bfloat16)

    @override
    def convert_output(self, data: Any) -> Any:
        if self.precision == "32-true":
            return data
        return cast_floating(data, torch.get_default_dtype())

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        # As Fabric's HalfPrecision under "ddp": the whole module, buffers too, in bf16.
        return module.to(dtype=torch.bfloat16) if self.precision == "bf16-true" else module

    @override
    def tensor_init_context(self) -> AbstractContextManager:
        return default_dtype(torch.bfloat16) if self.precision == "bf16-true" else nullcontext()

    @override
    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.precision!r})"


def to_fabric_precision(plugin: Precision | None) -> YaFSDPPrecision | None:
    """Map the plugin Fabric built from ``precision=`` onto ours; refuse foreign ones."""
    flag_types = (MixedPrecision, HalfPrecision, DoublePrecision)
    return adopt_flag_plugin(plugin, YaFSDPPrecision, Precision, flag_types)
