"""Registers ``"yafsdp"`` with Lightning without importing Lightning first.

Lightning has no entry point for strategies: ``import lightning_yafsdp`` is what
makes ``Trainer(strategy="yafsdp")`` and ``Fabric(strategy="yafsdp")`` work. But
``lightning_yafsdp.core`` must stay usable (and fast to import) without Lightning, and
importing ``core`` runs this package's ``__init__``. So each registration happens when
its front door is (or already was) imported: the Trainer's when ``lightning.pytorch``
loads, Fabric's when ``lightning.fabric`` loads (a Fabric-only program never loads the
Trainer), right away if it is loaded, otherwise from a post-import hook.

At the same moment, ``LightningModule.load_from_checkpoint`` learns to read our
sharded checkpoint directories (``_read_sharded_directories_in_load_from_checkpoint``):
Lightning reads a checkpoint there with one ``torch.load`` of one file, so a
directory (our default format) would fail with a raw ``IsADirectoryError``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import os
import sys
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

_TRAINER = "lightning.pytorch"
_FABRIC = "lightning.fabric"
# ``lightning.pytorch.core.saving._load_from_checkpoint`` (behind every
# ``load_from_checkpoint``) reads the file through this module-level name, an alias of
# ``lightning.fabric.utilities.cloud_io._load``. tests/test_load_from_checkpoint.py fails
# with a clear message if a Lightning release renames or stops using it.
LOADER_MODULE = "lightning.pytorch.core.saving"
LOADER_NAME = "pl_load"


def register_when_lightning_loads() -> None:
    """Register now where Lightning is loaded, else as soon as it finishes loading."""
    waiting = [name for name in _REGISTRATIONS if name not in sys.modules]
    for name in _REGISTRATIONS:
        if name in sys.modules:
            _REGISTRATIONS[name]()
    if waiting and not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport(waiting))


STRATEGY_NAME = "yafsdp"
STRATEGY_DESCRIPTION = "YaFSDP fully sharded data parallel (lightning_yafsdp)"


# [Note: the class path as a strategy name] LightningCLI types Trainer(strategy=) as
# ``Union[str, Strategy]``, and jsonargparse gives a flag without init args to the
# ``str`` branch: ``--trainer.strategy=lightning_yafsdp.YaFSDPStrategy`` reaches the
# Trainer as that string, which Lightning lower-cases and looks up in its registry.
# These names make that string mean our class (YAML ``class_path`` needs nothing).
CLASS_PATH_NAMES = ("lightning_yafsdp.yafsdpstrategy", "lightning_yafsdp.strategy.yafsdpstrategy")


def _register_trainer() -> None:
    _read_sharded_directories_in_load_from_checkpoint()
    _name_the_right_class_for_a_strategy_of_the_other_front_door(_TRAINER)
    from lightning.pytorch.strategies import StrategyRegistry

    _register_strategy_module("lightning_yafsdp.strategy", StrategyRegistry)
    for name in CLASS_PATH_NAMES:
        if name not in StrategyRegistry:
            # A factory: the strategy module may be half-built right now (see below).
            StrategyRegistry.register(
                name,
                _StrategyOnFirstUse("lightning_yafsdp.strategy"),
                description=STRATEGY_DESCRIPTION,
            )


def _register_fabric() -> None:
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    _name_the_right_class_for_a_strategy_of_the_other_front_door(_FABRIC)
    _register_strategy_module("lightning_yafsdp.fabric", STRATEGY_REGISTRY)


def _register_strategy_module(module_name: str, registry: Any) -> None:
    """Import the module that registers its strategy class, or register it for later.

    [Note: registering while our own modules load] The module registers its class when
    it finishes loading. If it is loading right now (``from lightning_yafsdp import
    YaFSDPStrategy`` is what imported Lightning), it is in sys.modules half-built and
    will register itself. If another module of this package is half-built (say
    ``from lightning_yafsdp.precision import YaFSDPPrecision`` imported Lightning), the
    strategy module would import it and find its names missing: then the name is
    registered to a factory that imports the strategy module when Lightning first
    builds ``"yafsdp"``, and the class replaces it once the module loads.
    """
    if module_name in sys.modules:
        return
    if _a_module_of_ours_is_loading():
        registry.register(
            STRATEGY_NAME,
            _StrategyOnFirstUse(module_name),
            description=STRATEGY_DESCRIPTION,
            override=True,
        )
        return
    importlib.import_module(module_name)


def _a_module_of_ours_is_loading() -> bool:
    # ``__spec__._initializing`` is what the import system itself reads to tell a
    # half-built module (its "most likely due to a circular import" error).
    return any(
        name.startswith("lightning_yafsdp.")
        and getattr(getattr(module, "__spec__", None), "_initializing", False)
        for name, module in list(sys.modules.items())
    )


class _StrategyOnFirstUse:
    """Stands in the registry for a strategy class until its module has loaded."""

    imports_on_first_use = True
    strategy_name = STRATEGY_NAME  # as the class has it, for code that reads the entry

    def __init__(self, module_name: str) -> None:
        self._module_name = module_name

    def __call__(self, **init_params: Any) -> Any:
        module = importlib.import_module(self._module_name)
        return module.YaFSDPStrategy(**init_params)


_REGISTRATIONS: dict[str, Callable[[], None]] = {
    _FABRIC: _register_fabric,
    _TRAINER: _register_trainer,
}


def _read_sharded_directories_in_load_from_checkpoint() -> None:
    """Wrap Lightning's checkpoint reader so a sharded directory is consolidated in memory.

    Every other path (files, URLs, file objects, directories that are not our checkpoints)
    goes to Lightning's reader unchanged. Idempotent.
    """
    saving = importlib.import_module(LOADER_MODULE)
    reader = getattr(saving, LOADER_NAME, None)
    if reader is None:
        warnings.warn(
            f"lightning_yafsdp: {LOADER_MODULE}.{LOADER_NAME} does not exist in this Lightning "
            "release, so LightningModule.load_from_checkpoint cannot read sharded yafsdp "
            'checkpoint directories; save with YaFSDPStrategy(state_dict_type="full"), or '
            "build the module and load_state_dict(lightning_yafsdp.checkpoint."
            "consolidated_state_dict(path))",
            stacklevel=2,
        )
        return
    if getattr(reader, "_yafsdp_reads_sharded_directories", False):
        return
    setattr(saving, LOADER_NAME, _reading_sharded_directories(reader))


def _reading_sharded_directories(reader: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(reader)
    def read_checkpoint(path_or_url: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(path_or_url, (str, os.PathLike)):
            from lightning_yafsdp.checkpoint.verify import (
                looks_like_sharded_checkpoint,
                verify_checkpoint,
            )

            # A truncated file or shard otherwise fails deep in torch.load, naming no file.
            if os.path.isfile(path_or_url) or looks_like_sharded_checkpoint(path_or_url):
                verify_checkpoint(path_or_url)
            if looks_like_sharded_checkpoint(path_or_url):
                checkpoint = _lightning_checkpoint_from_directory(path_or_url, *args, **kwargs)
                return _as_lightning_checkpoint(checkpoint)
        return _as_lightning_checkpoint(reader(path_or_url, *args, **kwargs))

    read_checkpoint._yafsdp_reads_sharded_directories = True  # type: ignore[attr-defined]
    return read_checkpoint


# [Note: the other front door's strategy] The Trainer and Fabric each take only their own
# Strategy base class, and both of ours are named YaFSDPStrategy:
# Fabric(strategy=lightning_yafsdp.YaFSDPStrategy()) got Lightning's generic "You selected
# an invalid strategy name: `strategy=<...object at 0x...>`", which does not say that the
# other class exists. Lightning offers no hook before that check, so the method that makes
# it (each connector's ``_check_config_and_set_final_flags``, private, named in
# STRATEGY_CHECKS) is wrapped to refuse our other class first with one line naming the
# right one; anything else reaches Lightning's own check unchanged.
# tests/test_strategy_front_doors.py fails if a Lightning release renames the method.
STRATEGY_CHECKS = {
    _TRAINER: (
        "lightning.pytorch.trainer.connectors.accelerator_connector",
        "_AcceleratorConnector",
    ),
    _FABRIC: ("lightning.fabric.connector", "_Connector"),
}
STRATEGY_CHECK_METHOD = "_check_config_and_set_final_flags"
# front door -> (the module of the other front door's class, the call, whose class it is,
# what this front door takes, the class to use)
_OTHER_CLASS = {
    _TRAINER: (
        "lightning_yafsdp.fabric.strategy",
        "Trainer(strategy=lightning_yafsdp.fabric.YaFSDPStrategy(...))",
        "Fabric's",
        "the Trainer runs only lightning.pytorch strategies",
        "lightning_yafsdp.YaFSDPStrategy",
    ),
    _FABRIC: (
        "lightning_yafsdp.strategy",
        "Fabric(strategy=lightning_yafsdp.YaFSDPStrategy(...))",
        "the Trainer's",
        "Fabric runs only lightning.fabric strategies",
        "lightning_yafsdp.fabric.YaFSDPStrategy",
    ),
}


def _name_the_right_class_for_a_strategy_of_the_other_front_door(front_door: str) -> None:
    """Wrap the connector's strategy check of ``front_door`` (see the note). Idempotent."""
    module_name, class_name = STRATEGY_CHECKS[front_door]
    connector = getattr(importlib.import_module(module_name), class_name, None)
    check = getattr(connector, STRATEGY_CHECK_METHOD, None)
    if check is None or getattr(check, "_yafsdp_names_the_right_class", False):
        return  # renamed in this release: Lightning's own error stays (a test says so)

    signature = inspect.signature(check)

    @functools.wraps(check)
    def check_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        # By name, whether Lightning passes it by keyword (2.6 does) or by position; a call
        # that does not bind is left to Lightning's own method to refuse.
        try:
            strategy = signature.bind_partial(self, *args, **kwargs).arguments.get("strategy")
        except TypeError:
            strategy = None
        refuse_the_other_front_doors_strategy(strategy, front_door)
        return check(self, *args, **kwargs)

    check_config._yafsdp_names_the_right_class = True  # type: ignore[attr-defined]
    setattr(connector, STRATEGY_CHECK_METHOD, check_config)


def refuse_the_other_front_doors_strategy(strategy: Any, front_door: str) -> None:
    """Raise ValueError if ``strategy`` is our strategy for the other front door."""
    other_module, call, whose, takes, right_class = _OTHER_CLASS[front_door]
    other = getattr(sys.modules.get(other_module), "YaFSDPStrategy", None)
    if other is not None and isinstance(strategy, other):
        raise ValueError(
            f"{call} got {whose} strategy class, and {takes}: use {right_class}(...) "
            'with the same arguments, or strategy="yafsdp"'
        )


def _as_lightning_checkpoint(checkpoint: Any) -> Any:
    """A checkpoint written by ``fabric.save`` as ``load_from_checkpoint`` reads one
    ([Note: one checkpoint format for Fabric and the Trainer])."""
    import lightning

    from lightning_yafsdp.checkpoint.fabric_format import as_trainer_checkpoint

    return as_trainer_checkpoint(checkpoint, lightning_version=lightning.__version__)


def _lightning_checkpoint_from_directory(
    path: str | os.PathLike, map_location: Any = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """The dict ``torch.load`` gives for a single-file Lightning checkpoint, weights only.

    ``load_from_checkpoint`` needs the weights and ``meta.pt`` (hyperparameters, the
    Lightning version); optimizer states are not read. Weights come as CPU tensors and
    move to ``map_location`` when it is a device (Lightning's default keeps CPU tensors on
    the CPU; a callable or a dict other than ``{"cpu": device}`` leaves them there).
    """
    import torch

    from lightning_yafsdp.checkpoint.consolidate import consolidate_checkpoint
    from lightning_yafsdp.checkpoint.sharded import META_FILENAME, MODEL_KEY

    state_dict = consolidate_checkpoint(path, weights_only=True).get(MODEL_KEY, {})
    meta_path = os.path.join(path, META_FILENAME)
    checkpoint = (
        torch.load(meta_path, map_location="cpu", weights_only=weights_only)
        if os.path.isfile(meta_path)
        else {}
    )
    if isinstance(map_location, dict):
        map_location = map_location.get("cpu")
    if isinstance(map_location, (str, torch.device)):
        state_dict = {name: value.to(map_location) for name, value in state_dict.items()}
    checkpoint["state_dict"] = state_dict
    return checkpoint


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Finds the awaited Lightning modules through the other finders, registering after each."""

    def __init__(self, names: list[str]) -> None:
        self._waiting = set(names)

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None):
        if fullname not in self._waiting:
            return None
        self._waiting.discard(fullname)
        # Out of the way during the lookup below (no recursion); back while others wait.
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self._waiting:
                sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader, _REGISTRATIONS[fullname])
        return spec


class _RegisteringLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, register: Callable[[], None]) -> None:
        self._inner = inner
        self._register = register

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        self._register()

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... for tools
        return getattr(self._inner, name)
