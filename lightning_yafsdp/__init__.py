"""YaFSDP-style fully sharded data parallelism as a PyTorch Lightning strategy.

Importing this package stays cheap: it does not import lightning. The engine lives in
``lightning_yafsdp.core`` (torch only); the Lightning strategy, once it exists, will be
registered here under the name ``"yafsdp"``.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("lightning-yafsdp")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
