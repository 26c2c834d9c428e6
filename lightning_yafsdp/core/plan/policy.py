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
        units: None to auto-detect the blocks (see [Note: auto-detected units]); a
            module class or a tuple/list of classes; a list of submodule names; or a
            predicate ``(name, module) -> bool``. Only the outermost match is kept when
            matches nest.

    Raises:
        ValueError: if nothing matches, with what was looked for and what to pass.
    """
    if units is None:
        found = auto_detect_units(root)
        if not found:
            raise ValueError(_no_blocks_message(root))
        return found
    matcher = _matcher(root, units)
    found = []
    for name, module in root.named_modules():
        if module is root or not matcher(name, module):
            continue
        if any(name.startswith(outer + ".") for outer, _ in found):
            continue  # nested inside a unit already taken
        if not has_own_forward(module):
            raise ValueError(_never_called_message(name, module))
        found.append((name, module))
    if not found:
        raise ValueError(
            f"units={units!r} matched no submodule of {type(root).__name__}; "
            "check the class or names (module names as printed by model.named_modules())."
        )
    return found


def has_own_forward(module: nn.Module) -> bool:
    """False for containers that are never called (``nn.ModuleList``, ``nn.ModuleDict``).

    A unit is gathered by hooks on its forward; a module without a forward of its own
    only holds children that its parent calls one by one, so hooks on it never run.
    """
    return type(module).forward is not nn.Module.forward


def _never_called_message(name: str, module: nn.Module) -> str:
    children = [_join(name, child) for child, _ in module.named_children()]
    classes = sorted({type(child).__name__ for child in module.children()})
    return (
        f"units= selects {name!r}, a {type(module).__name__}, which has no forward of its "
        "own: its parent calls its children one by one, so it never runs as a unit and its "
        "weights would never be gathered. Select the modules it holds instead, e.g. "
        f"units={children[:4]!r} or units=[{', '.join(classes) or 'TheBlockClass'}]."
    )


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


# [Note: auto-detected units]
# Units are what a model repeats. In order, the first rule that finds anything wins:
# 1. every outermost nn.ModuleList / nn.Sequential of two or more children of one class
#    that hold parameters: ALL of them, not only the largest, so that an encoder-decoder
#    (T5's encoder.block and decoder.block) or a vision tower beside a language model is
#    sharded whole instead of staying in the resident root group on every rank;
# 2. sibling modules of one class (two or more children of one parent, each holding
#    parameters) that are blocks written by the user (``self.block1``, ``self.block2``),
#    or any class when they are direct children of the model's trunk (the root, or what
#    its wrappers hold: ``self.fc1``, ``self.fc2``);
# 3. the parameter-holding children of the largest nn.Sequential (a plain stack of layers).
# A unit is always a module with a forward of its own: a ModuleList/ModuleDict is never
# called (its parent calls its children), so hooks on it would never gather its weights.
# Rules 2 and 3 are guesses about code without a block container: they count only when
# the units they find hold at least half of the model's parameters. Otherwise
# auto-detection gives up and the error names what to pass.
_FALLBACK_MIN_SHARE = 0.5
# torch's containers that are never called (their parent calls their children).
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def auto_detect_units(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The units the default policy picks for ``root`` (empty if none; see the note)."""
    found = _outermost(_repeated_containers(root))
    if found:
        return found
    total = _numel(root)
    for rule in (_same_class_siblings, _plain_stack):
        found = _outermost(rule(root))
        if found and sum(_numel(m) for _, m in found) >= _FALLBACK_MIN_SHARE * total:
            return found
    return []


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _repeated_containers(root: nn.Module) -> list[tuple[str, nn.Module]]:
    found = []
    for name, container in root.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 2:
            continue
        children = list(container.named_children())
        if len({type(child) for _, child in children}) != 1 or not _numel(container):
            continue
        if isinstance(children[0][1], _CONTAINERS):
            continue  # a list of lists: the inner lists' children are the blocks
        found.extend((_join(name, child_name), child) for child_name, child in children)
    return found


def _trunk(root: nn.Module) -> tuple[str, nn.Module]:
    """The model under its wrappers: descend while one child holds every parameter.

    A LightningModule holding ``self.model`` (or a HF ``...ForCausalLM`` holding its
    ``model``) is a wrapper; the layers worth naming are the children of its trunk.
    """
    name, module = "", root
    while True:
        holders = [(n, child) for n, child in module.named_children() if _numel(child)]
        if len(holders) != 1 or _numel(holders[0][1]) != _numel(module):
            return name, module
        name, module = _join(name, holders[0][0]), holders[0][1]


def _same_class_siblings(root: nn.Module) -> list[tuple[str, nn.Module]]:
    _, trunk = _trunk(root)
    found = []
    for name, parent in root.named_modules():
        by_class: dict[type, list[tuple[str, nn.Module]]] = {}
        for child_name, child in parent.named_children():
            if _numel(child) and not isinstance(child, _CONTAINERS):
                by_class.setdefault(type(child), []).append((_join(name, child_name), child))
        for cls, siblings in by_class.items():
            user_block = not cls.__module__.startswith("torch.")
            if len(siblings) >= 2 and (user_block or parent is trunk):
                found.extend(siblings)
    return found


def _plain_stack(root: nn.Module) -> list[tuple[str, nn.Module]]:
    stacks = [(n, m) for n, m in root.named_modules() if isinstance(m, nn.Sequential)]
    if not stacks:
        return []
    name, stack = max(stacks, key=lambda item: _numel(item[1]))
    layers = [
        (_join(name, n), child)
        for n, child in stack.named_children()
        if _numel(child) and not isinstance(child, _CONTAINERS)
    ]
    return layers if len(layers) >= 2 else []


def _outermost(candidates: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Drop candidates nested in other candidates and repeats of one module; keep order."""
    names = [name for name, _ in candidates]
    kept, seen = [], set()
    for name, module in candidates:
        nested = any(name.startswith(other + ".") for other in names)
        if not nested and id(module) not in seen:
            seen.add(id(module))
            kept.append((name, module))
    return kept


def _no_blocks_message(root: nn.Module) -> str:
    trunk_name, trunk = _trunk(root)
    children = sorted(
        (
            (_join(trunk_name, name), _numel(child))
            for name, child in trunk.named_children()
            if _numel(child)
        ),
        key=lambda item: -item[1],
    )
    listed = ", ".join(f"{name!r} ({numel:,} parameters)" for name, numel in children[:6])
    suggestion = [name for name, _ in children]
    return (
        f"could not auto-detect the blocks of {type(root).__name__}: no nn.ModuleList/"
        "nn.Sequential of two or more modules of one class, no repeated sibling blocks and no "
        "plain nn.Sequential stack holds most of its parameters. Its parameter-holding children "
        f"are {listed or 'none'}. Pass units= naming the modules to gather one at a time, "
        f"e.g. units={suggestion!r} (module names as in model.named_modules()), a block "
        "class (units=MyBlock, e.g. a layer that is called several times), or a predicate "
        "(name, module) -> bool."
    )


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
