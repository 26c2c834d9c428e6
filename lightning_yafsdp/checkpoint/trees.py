"""Sharded values anywhere in a checkpoint dict: find them, walk the tree, count bytes.

A Lightning checkpoint is a tree of dicts, lists and tuples built by many hands:
``"state_dict"`` (``LightningModule.state_dict()``, an override included),
``"optimizer_states"``, and whatever callbacks add (``WeightAveraging`` moves our
weights to ``"current_model_state"`` and puts its averaged copy in
``"state_dict"``). Every ``RangeShardedTensor`` in it holds only this rank's elements,
so it must be written sharded (DCP's protocol) or gathered: pickling one would keep
rank 0's piece and lose the rest without a word. These helpers walk the tree in a
fixed order (the same on every rank for the same tree), so collective steps can pair the leaves of
different ranks by position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor, local_of

__all__ = ["local_of"]  # re-exported for checkpoint code: a value's plain local piece

Path = tuple[Any, ...]  # keys and list positions from the root to a leaf


def is_sharded_leaf(value: Any) -> bool:
    return isinstance(value, RangeShardedTensor)


def map_leaves(tree: Any, fn: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """``tree`` with every non-container leaf ``x`` at ``path`` replaced by ``fn(path, x)``.

    Descends into dicts, lists and tuples (named tuples keep their type); a
    container is rebuilt only if one of its leaves changed, so untouched parts
    keep their identity.
    """
    if isinstance(tree, dict):
        mapped = {k: map_leaves(v, fn, (*path, k)) for k, v in tree.items()}
        return tree if all(mapped[k] is tree[k] for k in tree) else mapped
    if isinstance(tree, (list, tuple)):
        items = [map_leaves(v, fn, (*path, i)) for i, v in enumerate(tree)]
        if all(a is b for a, b in zip(items, tree, strict=True)):
            return tree
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):
            return type(tree)(*items)
        return type(tree)(items)
    return fn(path, tree)


def sharded_leaves(tree: Any) -> list[tuple[Path, Any]]:
    """Every ``RangeShardedTensor`` in ``tree`` with its path, in tree order."""
    found: list[tuple[Path, Any]] = []

    def visit(path: Path, value: Any) -> Any:
        if is_sharded_leaf(value):
            found.append((path, value))
        return value

    map_leaves(tree, visit)
    return found


def has_sharded_leaves(tree: Any) -> bool:
    return bool(sharded_leaves(tree))


def describe_path(path: Path) -> str:
    return "".join(f"[{p!r}]" for p in path) or "<root>"


def set_nested(root: dict, path: Path, value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, creating dicts on the way."""
    node = root
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def lists_from_int_keys(node: Any) -> Any:
    """Dicts keyed ``0..n-1`` back to lists: DCP's flattening records list positions as ints."""
    if not isinstance(node, dict):
        return node
    converted = {k: lists_from_int_keys(v) for k, v in node.items()}
    if converted and all(isinstance(k, int) for k in converted):
        return [converted[i] for i in sorted(converted)]
    return converted


def tensor_bytes(tree: Any, *, sharded: bool = True, whole: bool = True) -> int:
    """Bytes of the tensors in ``tree``: ``sharded`` ones (this rank's elements), ``whole`` ones.

    For the message of a failed save ([Note: a failed write is one line]); pickled
    objects are not counted.
    """
    total = 0

    def count(_: Path, value: Any) -> Any:
        nonlocal total
        if isinstance(value, RangeShardedTensor) and sharded:
            total += value._local.nbytes
        elif isinstance(value, torch.Tensor) and not is_sharded_leaf(value) and whole:
            total += value.nbytes
        return value

    map_leaves(tree, count)
    return total
