"""Registers ``"yafsdp"`` with Lightning without importing Lightning first.

Lightning has no entry point for strategies: ``import lightning_yafsdp`` is what
makes ``Trainer(strategy="yafsdp")`` work. But ``lightning_yafsdp.core`` must stay
usable (and fast to import) without Lightning, and importing ``core`` runs this
package's ``__init__``. So registration happens when ``lightning.pytorch`` is
(or already was) imported: right away if it is loaded, otherwise from a one-shot
post-import hook on ``lightning.pytorch``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from types import ModuleType
from typing import Any

_LIGHTNING = "lightning.pytorch"


def register_when_lightning_loads() -> None:
    """Register now if Lightning is loaded, else as soon as it finishes loading."""
    if _LIGHTNING in sys.modules:
        _register()
    elif not any(isinstance(finder, _RegisterAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())


def _register() -> None:
    # strategy.py registers itself when it finishes loading. If it is loading right now
    # (``from lightning_yafsdp import YaFSDPStrategy`` is what imported Lightning), it is
    # already in sys.modules, half-initialized: importing it here would be circular.
    if "lightning_yafsdp.strategy" not in sys.modules:
        import lightning_yafsdp.strategy  # noqa: F401


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` through the other finders, registering after it runs."""

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None):
        if fullname != _LIGHTNING:
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        _register()

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... for tools
        return getattr(self._inner, name)
