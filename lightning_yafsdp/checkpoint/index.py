"""Every parameter of a sharded engine by name, for checkpointing.

After ``shard_model`` each parameter of a unit, trainable or frozen, and each
trainable resident parameter is a ``RangeShardedTensor`` in its own module
(``engine.sharded_parameters(frozen=True)``, one object per tied set): its
``_placement`` says its names, full shape and which elements ``[start, end)``
this rank holds, and ``_local`` is that piece, a view into the engine's flat
master (or frozen store). Frozen norms and ties across groups stay plain, full
and replicated. Optimizers hold these objects, so this table is what turns
optimizer positions into names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from lightning_yafsdp.core import YaFSDPEngine


@dataclass(frozen=True)
class IndexedParam:
    """One trainable parameter and this rank's piece of it.

    Attributes:
        name: the parameter's original name (first alias when tied), with the prefix.
        aliases: every name it is reachable under (``name`` first).
        shape: the full parameter's shape.
        start: first element of the flattened parameter held here.
        end: one past the last (``start == end``: this rank holds none).
        param: the sharded parameter itself, an ``nn.Parameter`` of type ``RangeShardedTensor``
            (what optimizers hold).
    """

    name: str
    aliases: tuple[str, ...]
    shape: torch.Size
    start: int
    end: int
    param: nn.Parameter

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def local(self) -> torch.Tensor:
        """This rank's elements: a 1-D view into the engine's master (writes go there)."""
        return self.param._local.detach()


@dataclass(frozen=True)
class ShardIndex:
    """The parameters of an engine, by name and by object.

    Attributes:
        sharded: the trainable parameters in layout order (units, then resident groups).
        replicated: frozen (plain, full) parameters by their first name.
        prefix: prepended to every name (the engine's root inside a larger module).
    """

    sharded: tuple[IndexedParam, ...]
    replicated: dict[str, nn.Parameter]
    prefix: str = ""
    _names: dict[int, str] = field(default_factory=dict, repr=False)
    _entries: dict[int, IndexedParam] = field(default_factory=dict, repr=False)
    _by_alias: dict[str, IndexedParam] = field(default_factory=dict, repr=False)

    @property
    def shapes(self) -> dict[str, torch.Size]:
        """Full shape of every trainable parameter, by every alias."""
        return {alias: p.shape for p in self.sharded for alias in p.aliases}

    @property
    def parameter_count(self) -> int:
        """Elements of the unique trainable parameters."""
        return sum(p.shape.numel() for p in self.sharded)

    def name_of(self, param: torch.Tensor) -> str | None:
        """The first name of ``param`` (sharded or replicated), or None if it is not ours."""
        return self._names.get(id(param))

    def entry_of(self, param: torch.Tensor) -> IndexedParam | None:
        """The sharded entry of ``param``; None for a replicated or unknown one."""
        return self._entries.get(id(param))

    def entry_named(self, name: str) -> IndexedParam | None:
        """The sharded entry reachable under ``name`` (any alias); None if there is none."""
        return self._by_alias.get(name)


def build_index(engine: YaFSDPEngine, *, prefix: str = "") -> ShardIndex:
    """The parameter table of ``engine`` for this rank; ``prefix`` is added to every name."""
    sharded = []
    names: dict[int, str] = {}
    for param in engine.sharded_parameters(frozen=True):
        placement = param._placement
        aliases = tuple(prefix + alias for alias in placement.aliases)
        sharded.append(
            IndexedParam(
                name=prefix + placement.name,
                aliases=aliases,
                shape=torch.Size(placement.shape),
                start=placement.start,
                end=placement.end,
                param=param,
            )
        )
        names[id(param)] = prefix + placement.name
    replicated = {}
    for name, param in engine.root.named_parameters():
        if id(param) not in names:
            replicated[prefix + name] = param
            names[id(param)] = prefix + name
    return ShardIndex(
        sharded=tuple(sharded),
        replicated=replicated,
        prefix=prefix,
        _names=names,
        _entries={id(entry.param): entry for entry in sharded},
        _by_alias={alias: entry for entry in sharded for alias in entry.aliases},
    )
