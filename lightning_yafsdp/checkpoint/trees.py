"""Sharded values anywhere in a checkpoint dict: walk the tree, find them, count bytes.

A Lightning checkpoint is a tree of dicts, lists and tuples built by many hands
(``"state_dict"``, ``"optimizer_states"``, whatever callbacks add: ``WeightAveraging``
moves our weights to ``"current_model_state"``). Every ``RangeShardedTensor`` in it holds
only this rank's elements, so it must be written sharded or gathered: pickling one would
keep rank 0's piece and lose the rest without a word. The walk has a fixed order, the
same on every rank for the same tree, so collective steps pair leaves by position.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lightning_yafsdp.core.optim.sharded_param import RangeShardedTensor

Path = tuple[Any, ...]  # keys and list positions from the root to a leaf


def map_leaves(tree: Any, fn: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """``tree`` with every non-container leaf ``x`` at ``path`` replaced by ``fn(path, x)``.

    A container is rebuilt only if one of its leaves changed (named tuples keep their type).
    """
    if isinstance(tree, dict):
        mapped = {k: map_leaves(v, fn, (*path, k)) for k, v in tree.items()}
        return tree if all(mapped[k] is tree[k] for k in tree) else mapped
    if isinstance(tree, (list, tuple)):
        items = [map_leaves(v, fn, (*path, i)) for i, v in enumerate(tree)]
        if all(a is b for a, b in zip(items, tree, strict=True)):
            return tree
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return fn(path, tree)


def sharded_leaves(tree: Any) -> list[tuple[Path, RangeShardedTensor]]:
    """Every ``RangeShardedTensor`` in ``tree`` with its path, in tree order."""
    found: list[tuple[Path, Any]] = []
    map_leaves(tree, lambda path, v: found.append((path, v)) if _is_sharded(v) else None)
    return found


def describe_path(path: Path) -> str:
    return "".join(f"[{p!r}]" for p in path) or "<root>"


def tensor_bytes(tree: Any, *, whole: bool = True) -> int:
    """Bytes of this rank's sharded pieces in ``tree``, plus its other tensors if ``whole``.

    For the message of a failed save ([Note: a failed write is one line]).
    """
    total = 0

    def count(_: Path, value: Any) -> None:
        nonlocal total
        if _is_sharded(value):
            total += value._local.nbytes
        elif isinstance(value, torch.Tensor) and whole:
            total += value.nbytes

    map_leaves(tree, count)
    return total


def _is_sharded(value: Any) -> bool:
    return isinstance(value, RangeShardedTensor)
