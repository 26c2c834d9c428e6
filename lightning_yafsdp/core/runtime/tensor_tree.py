"""Find every tensor in a unit's inputs or outputs, whatever holds it.

[Note: gates see every tensor]
A gate that misses a grad-requiring tensor is a silent race: if a unit's
output hides a tensor from ``PreBackwardGate``, the first backward op of the
unit runs before the pre-backward hook re-gathers its weights, and reads
whatever the shared weight buffer holds by then (another unit's weights on
CPU and in ZeRO-3; a race on CUDA). So the gates look through everything
pytree knows (tuples, lists, dicts, named tuples, Hugging Face ``ModelOutput``)
and also into dataclasses and plain objects' attributes, rebuilding them
with the gated tensors (a shallow copy: the caller's object is not mutated).
What cannot be seen into (extension types with neither ``__dict__`` nor
``__slots__``) is refused with the type's name.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from lightning_yafsdp.core import compat

_ATOMS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    enum.Enum,
    torch.dtype,
    torch.device,
    torch.Size,
)
_NEVER_ACTIVATIONS = (torch.nn.Module, type, torch.Generator)
_MAX_DEPTH = 8
# The 2.11/2.13 pytree-leaf name shim lives in core/compat.py.
_is_leaf = compat.tree_is_leaf


class OpaqueValueError(TypeError):
    """A unit's output holds a value the engine cannot look into."""


def map_tensors(
    value: Any, fn: Callable[[torch.Tensor], torch.Tensor], *, where: str, objects: bool
) -> Any:
    """``value`` with every tensor ``t`` replaced by ``fn(t)``.

    Containers and objects whose tensors all map to themselves are returned as
    they are (same identity); others are rebuilt (pytree) or shallow-copied.

    Args:
        value: a unit's ``(args, kwargs)`` or its output.
        fn: called once per tensor occurrence, in a deterministic order.
        where: for error messages, e.g. ``"the output of unit 'layers.3'"``.
        objects: also look into plain objects (``__dict__`` / ``__slots__``) and
            refuse what cannot be looked into. Off for inputs: they may be
            stateful objects (a KV cache) that a copy would break, and a grad
            that bypasses the input gate is caught by the grad-buffer checks.
            Dataclasses are looked into either way.

    Raises:
        OpaqueValueError: with ``objects``, a value that is neither a tensor, a
            pytree container, a dataclass, an object with attributes, nor an atom
            (None, numbers, strings, dtypes, devices, enums, callables).
    """
    return _map(value, fn, where, depth=0, objects=objects)


def tensors_in(value: Any, *, where: str, objects: bool) -> list[torch.Tensor]:
    """Every tensor in ``value``, in the order ``map_tensors`` visits them."""
    found: list[torch.Tensor] = []

    def collect(tensor: torch.Tensor) -> torch.Tensor:
        found.append(tensor)
        return tensor

    _map(value, collect, where, depth=0, objects=objects)
    return found


def _map(value: Any, fn, where: str, *, depth: int, objects: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, _ATOMS) or callable(value):
        return value
    if depth >= _MAX_DEPTH or isinstance(value, _NEVER_ACTIVATIONS):
        return value

    def child(item: Any) -> Any:
        return _map(item, fn, where, depth=depth + 1, objects=objects)

    if not _is_leaf(value):
        children, spec = pytree.tree_flatten(value, is_leaf=lambda x: x is not value)
        mapped = [child(c) for c in children]
        if all(m is c for m, c in zip(mapped, children)):
            return value
        return pytree.tree_unflatten(mapped, spec)
    if dataclasses.is_dataclass(value):
        attributes = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    elif objects:
        attributes = _attributes(value)
        if attributes is None:
            raise OpaqueValueError(
                f"{where} contains a {type(value).__module__}.{type(value).__qualname__}, which "
                "the engine cannot look into: a tensor inside it would escape the backward "
                "gates and its backward could read another unit's weights. Return tensors, "
                "tuples, dicts, dataclasses or plain objects, or register the type with "
                "torch.utils._pytree.register_pytree_node."
            )
    else:
        return value
    mapped = {name: child(item) for name, item in attributes.items()}
    if all(mapped[name] is item for name, item in attributes.items()):
        return value
    clone = copy.copy(value)
    for name, item in mapped.items():
        object.__setattr__(clone, name, item)
    return clone


def _attributes(value: Any) -> dict[str, Any] | None:
    """An object's attributes (``__dict__`` and ``__slots__``), or None if it has neither."""
    attributes = dict(vars(value)) if hasattr(value, "__dict__") else {}
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                attributes[name] = getattr(value, name)
    if not attributes and not hasattr(value, "__dict__"):
        return None
    return attributes
