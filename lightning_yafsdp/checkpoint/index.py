"""Where each original parameter lives in a sharded engine, for checkpointing.

The engine stores every trainable parameter as a run of elements inside one of
(at most) two master parameters (``_yafsdp_flat_shard`` and
``_yafsdp_norm_shard``). Per-element optimizer state (AdamW's ``exp_avg``,
``exp_avg_sq``) has the master's shape, so the same runs index it too. This
module turns the engine's layouts into that table, once per save or load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lightning_yafsdp.core import YaFSDPEngine


@dataclass(frozen=True)
class OwnedRun:
    """The elements of one original parameter that this rank holds.

    Attributes:
        name: the parameter's original name (first alias when tied).
        aliases: every name it is reachable under (``name`` first).
        shape: the full parameter's shape.
        start: first held element of the flattened parameter.
        end: one past the last held element.
        master: index of the master parameter holding it (in ``master_parameters()``).
        master_offset: where the run starts inside that master shard (elements).
    """

    name: str
    aliases: tuple[str, ...]
    shape: torch.Size
    start: int
    end: int
    master: int
    master_offset: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class ShardIndex:
    """Every original parameter of an engine and this rank's run of it.

    Attributes:
        masters: the engine's master parameters (what optimizers hold).
        names_by_master: per master, the names (first aliases) of all the
            parameters stored in it, in layout order, whether or not this rank
            holds elements of them.
        shapes: full shape of every parameter, by every alias.
        aliases: first alias -> every alias.
        runs: this rank's runs, in layout order (parameters it holds no elements of
            are absent).
        prefix: prepended to every name (the engine's root inside a larger module).
    """

    masters: tuple[nn.Parameter, ...]
    names_by_master: tuple[tuple[str, ...], ...]
    shapes: dict[str, torch.Size]
    aliases: dict[str, tuple[str, ...]]
    runs: tuple[OwnedRun, ...]
    prefix: str = ""

    def master_index(self, param: torch.Tensor) -> int | None:
        for index, master in enumerate(self.masters):
            if param is master:
                return index
        return None


def build_index(engine: YaFSDPEngine, *, prefix: str = "") -> ShardIndex:
    """The parameter table of ``engine`` for this rank; ``prefix`` is added to every name."""
    masters = tuple(engine.master_parameters())
    names_by_master: list[list[str]] = [[] for _ in masters]
    shapes: dict[str, torch.Size] = {}
    aliases: dict[str, tuple[str, ...]] = {}
    runs: list[OwnedRun] = []
    for group in engine.groups():
        master = _master_of(group.master_shard, masters, group.name)
        base = group.grad_range[0]
        for index, (span, owners) in enumerate(zip(group.layout.spans, group.owners, strict=True)):
            names = tuple(prefix + owner.name for owner in owners)
            names_by_master[master].append(names[0])
            aliases[names[0]] = names
            for name in names:
                shapes[name] = span.shape
            piece = group.layout.shard_slice(index, engine.rank)
            if piece is None:
                continue
            runs.append(
                OwnedRun(
                    name=names[0],
                    aliases=names,
                    shape=span.shape,
                    start=piece.param_start,
                    end=piece.param_end,
                    master=master,
                    master_offset=base + piece.shard_offset,
                )
            )
    return ShardIndex(
        masters=masters,
        names_by_master=tuple(tuple(n) for n in names_by_master),
        shapes=shapes,
        aliases=aliases,
        runs=tuple(runs),
        prefix=prefix,
    )


def replicated_state(engine: YaFSDPEngine, *, prefix: str = "") -> dict[str, torch.Tensor]:
    """Persistent buffers and frozen parameters: whole on every rank, by original name."""
    master_ids = {id(p) for p in engine.master_parameters()}
    return {
        prefix + name: tensor.detach()
        for name, tensor in engine.root.state_dict(keep_vars=True).items()
        if id(tensor) not in master_ids
    }


def _master_of(shard: torch.Tensor, masters: tuple[nn.Parameter, ...], group: str) -> int:
    pointer = shard.untyped_storage().data_ptr()
    for index, master in enumerate(masters):
        if master.untyped_storage().data_ptr() == pointer:
            return index
    raise RuntimeError(f"group {group!r}: its master shard is a view of no master parameter")
