"""``Fabric(strategy="yafsdp")``: the engine in a training loop written with Fabric.

Importing ``lightning_yafsdp`` registers the name with Fabric's strategy registry (when
``lightning.fabric`` loads); the classes are here::

    from lightning_yafsdp.fabric import YaFSDPPrecision, YaFSDPStrategy

    fabric = Fabric(strategy=YaFSDPStrategy(zero_stage=2), precision="bf16-mixed")

See docs/fabric.md for the loop, the differences from FSDPStrategy and migration.
"""

from lightning.fabric.strategies import STRATEGY_REGISTRY

from lightning_yafsdp.fabric.precision import YaFSDPPrecision
from lightning_yafsdp.fabric.strategy import YaFSDPStrategy

__all__ = ["YaFSDPPrecision", "YaFSDPStrategy"]

# Loading this module registers the strategy (see lightning_yafsdp/_registration.py).
YaFSDPStrategy.register_strategies(STRATEGY_REGISTRY)
