"""YaFSDP-style fully sharded data parallelism as a PyTorch Lightning strategy.

Importing this package registers the strategy with Lightning under the name
``"yafsdp"``: Lightning has no plugin entry point for strategies, so the import is
what makes ``Trainer(strategy="yafsdp")`` work (importing again is harmless). The
registration waits until Lightning itself is imported (``_registration.py``), so
``lightning_yafsdp.core`` stays torch-only and ``yafsdp --version`` stays fast.
"""

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from lightning_yafsdp._registration import register_when_lightning_loads

try:
    __version__ = version("lightning-yafsdp")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["YaFSDPPrecision", "YaFSDPStrategy", "__version__"]

register_when_lightning_loads()


def __getattr__(name: str) -> Any:
    # The Lightning classes load on first use, which also imports Lightning.
    if name == "YaFSDPStrategy":
        from lightning_yafsdp.strategy import YaFSDPStrategy

        return YaFSDPStrategy
    if name == "YaFSDPPrecision":
        from lightning_yafsdp.precision import YaFSDPPrecision

        return YaFSDPPrecision
    raise AttributeError(f"module 'lightning_yafsdp' has no attribute {name!r}")
