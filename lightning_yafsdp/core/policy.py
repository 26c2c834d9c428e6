"""Which modules are sharded as units, and which parameters are norms.

The default policy needs no configuration for ordinary transformer code: the
units are the repeated blocks of the model (the largest ``nn.ModuleList`` /
``nn.Sequential`` whose children all share one class, e.g. ``model.layers[*]``
or ``transformer.h[*]``), and the norm modules are recognised by class
(``nn.LayerNorm``, ``nn.RMSNorm`` and look-alikes such as Hugging Face's
``LlamaRMSNorm``). Every parameter outside the units that is not a norm
parameter forms the root remainder (embeddings, output head).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Union

from torch import nn

UnitPredicate = Callable[[str, nn.Module], bool]
UnitsSpec = Union[None, type, tuple, list, UnitPredicate]  # noqa: UP007 - readable alias
NormSpec = Union[None, type, tuple, list]  # noqa: UP007

DEFAULT_NORM_CLASSES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)

# Class-name suffixes that mark a module as a norm even when it is not a torch
# class: Hugging Face defines its own (LlamaRMSNorm, T5LayerNorm, Qwen2RMSNorm).
_NORM_NAME_SUFFIXES = ("RMSNorm", "LayerNorm", "RmsNorm")


def find_units(root: nn.Module, units: UnitsSpec = None) -> list[tuple[str, nn.Module]]:
    """Return ``(name, module)`` for each unit, in module registration order.

    Args:
        root: the model being sharded.
        units: None to auto-detect the repeated blocks; a module class or a
            tuple/list of classes; a list of submodule names; or a predicate
            ``(name, module) -> bool``. Only the outermost match is kept when
            matches nest.

    Raises:
        ValueError: if nothing matches, with what was looked for.
    """
    if units is None:
        found = _auto_detect_blocks(root)
        if not found:
            raise ValueError(
                f"could not auto-detect the repeated blocks of {type(root).__name__}: no "
                "nn.ModuleList/nn.Sequential of two or more modules of one class holds parameters. "
                "Pass units= with the block class (e.g. units=MyBlock), a list of module names, "
                "or a predicate (name, module) -> bool."
            )
        return found
    matcher = _matcher(root, units)
    found = []
    for name, module in root.named_modules():
        if module is root or not matcher(name, module):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue  # nested inside a unit already taken
        found.append((name, module))
    if not found:
        raise ValueError(
            f"units={units!r} matched no submodule of {type(root).__name__}; "
            "check the class or names (module names as printed by model.named_modules())."
        )
    return found


def is_norm_module(module: nn.Module, norm_classes: NormSpec = None) -> bool:
    """True if ``module``'s own parameters belong to the norm group.

    Args:
        module: any module.
        norm_classes: None for the default detection (torch norm classes and
            class names ending in RMSNorm/LayerNorm); a class or a sequence of
            classes to use instead; an empty tuple to disable the norm group.
    """
    if norm_classes is None:
        if isinstance(module, DEFAULT_NORM_CLASSES):
            return True
        return type(module).__name__.endswith(_NORM_NAME_SUFFIXES)
    classes = tuple(norm_classes) if isinstance(norm_classes, (list, tuple)) else (norm_classes,)
    return bool(classes) and isinstance(module, classes)


def _auto_detect_blocks(root: nn.Module) -> list[tuple[str, nn.Module]]:
    best: list[tuple[str, nn.Module]] = []
    best_params = 0
    for name, container in root.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 2:
            continue
        children = list(container.named_children())
        if len({type(child) for _, child in children}) != 1:
            continue
        params = sum(p.numel() for p in container.parameters())
        if params > best_params:
            prefix = f"{name}." if name else ""
            best = [(prefix + child_name, child) for child_name, child in children]
            best_params = params
    return best


def _matcher(root: nn.Module, units: UnitsSpec) -> UnitPredicate:
    if isinstance(units, type):
        return lambda name, module: isinstance(module, units)
    if isinstance(units, (tuple, list)):
        if all(isinstance(u, type) for u in units):
            classes = tuple(units)
            return lambda name, module: isinstance(module, classes)
        if all(isinstance(u, str) for u in units):
            return _name_matcher(root, units)
        raise TypeError("units= list must hold only module classes or only module names")
    if callable(units):
        return units
    raise TypeError(
        f"units= must be None, a class, a list of classes or names, or a predicate; got {units!r}"
    )


def _name_matcher(root: nn.Module, names: Sequence[str]) -> UnitPredicate:
    known = dict(root.named_modules())
    missing = [n for n in names if n not in known]
    if missing:
        raise ValueError(f"units= names {missing} are not submodules of {type(root).__name__}")
    wanted = set(names)
    return lambda name, module: name in wanted
