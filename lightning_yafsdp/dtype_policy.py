"""The three precision modes of a sharded model, shared by the Trainer and Fabric plugins.

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
the compute shards after every optimizer step.

``16-mixed`` needs a loss scaler whose inf/nan check spans every rank's shards; it is
not implemented and is rejected rather than silently run without scaling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import torch
from lightning_utilities import apply_to_collection

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

SUPPORTED = tuple(_DTYPES)


@dataclass(frozen=True)
class DtypePolicy:
    """One mode: its flag, the dtype of the master shards and of the compute shards."""

    precision: str
    master_dtype: torch.dtype
    param_dtype: torch.dtype

    @classmethod
    def from_flag(cls, flag: str | int) -> DtypePolicy:
        """The policy of a precision flag; a ValueError with the alternative otherwise."""
        flag = _ALIASES.get(flag, flag)
        if flag in _REJECTED:
            raise ValueError(
                f"YaFSDPStrategy does not support precision={flag!r}: {_REJECTED[flag]}."
            )
        if flag not in _DTYPES:
            raise ValueError(
                f"unknown precision {flag!r} for YaFSDPStrategy; choose one of {', '.join(_DTYPES)}"
            )
        return cls(flag, *_DTYPES[flag])

    @contextlib.contextmanager
    def forward_context(self, device_type: str) -> Generator[None, None, None]:
        # [Note: bf16-mixed autocast] The units already run in bf16 (their gathered
        # weights are bf16 and their floating inputs are cast). Autocast covers the
        # user's code between and after them (loss, metrics, heads called by hand) so
        # that it sees the same dtypes as under DDP's bf16-mixed: matmuls in bf16,
        # softmax/cross-entropy in fp32.
        if self.precision == "bf16-mixed":
            with torch.autocast(device_type, dtype=torch.bfloat16):
                yield
        elif self.precision == "bf16-true":
            with default_dtype(torch.bfloat16):
                yield
        else:
            yield


class PolicyBacked:
    """A precision plugin's ``precision`` / ``master_dtype`` / ``param_dtype``, read from
    its ``policy`` (Trainer and Fabric plugins alike; listed first among the bases, so
    Lightning's class attribute ``precision`` is shadowed)."""

    policy: DtypePolicy

    @property
    def precision(self) -> str:
        return self.policy.precision

    @property
    def master_dtype(self) -> torch.dtype:
        return self.policy.master_dtype

    @property
    def param_dtype(self) -> torch.dtype:
        return self.policy.param_dtype


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def cast_floating(data: Any, dtype: torch.dtype) -> Any:
    """``data`` with every floating tensor in it cast to ``dtype`` (others untouched)."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(dtype) if torch.is_floating_point(tensor) else tensor

    return apply_to_collection(data, torch.Tensor, cast)


def adopt_flag_plugin(plugin: Any, ours: type, plain: type, from_flag: tuple[type, ...]) -> Any:
    """Map the plugin Lightning built from ``precision=`` onto ``ours``; refuse foreign ones.

    Exact types: ``plain`` (32-true) and ``from_flag`` are what the Trainer's or Fabric's
    connector builds from the flag. Subclasses (FSDPPrecision, DeepSpeedPrecision,
    bitsandbytes, ...) carry their own dtype policy and are refused.
    """
    if plugin is None or isinstance(plugin, ours):
        return plugin
    if type(plugin) is plain:
        return ours("32-true")
    if type(plugin) in from_flag:
        return ours(plugin.precision)
    raise TypeError(
        f"YaFSDPStrategy owns the dtype policy and cannot use the precision plugin "
        f"{type(plugin).__name__}. Remove it from plugins= and pass the precision= flag "
        "instead ('32-true', 'bf16-mixed' or 'bf16-true'), or pass YaFSDPPrecision(...)."
    )
