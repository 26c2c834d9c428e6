"""Every rank must issue the same collectives in the same order: check it, cheaply.

[Note: collective order guard]
The engine's collectives are issued by hooks, so their order follows the
model's call pattern. If ranks run different units (per-rank LayerDrop,
data-dependent routing around whole blocks), their collectives pair up wrongly:
gloo and NCCL then wait for the collective timeout (30 minutes), or, when the
two units have the same size, silently exchange shards of DIFFERENT units.

Right before each of its collectives the engine issues a tiny async all_gather
of a three-number tag (the collective's kind, the group's index, its size in
elements); when the collective is waited, the tags are checked first. Tag
exchanges are the same size on every rank, so they always pair up and
complete, even when the collectives after them do not: every rank sees the
same mismatch at the same collective and raises the same error, before the
mismatched collective is waited and before any of its data is read.

Cost: one extra tiny collective per unit collective. On CUDA the check reads the
tags on the host at each wait, a sync that defeats the CPU run-ahead that gives
prefetch, so there it is off unless asked for (``engine.verify_collective_order(True)``):
turn it on to debug a hang. On CPU each tag exchange cost ~1 ms of CPU on 2 busy
cores, so there the gathers and reductions are checked by their exchange line
instead, with no traffic of its own ([Note: exchange lines], ``exchange_line.py``);
this guard checks only hybrid sharding's replicate all_reduce on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from lightning_yafsdp.core.comm.collectives import CommStats, all_gather_into

if TYPE_CHECKING:
    from lightning_yafsdp.core.comm.mesh import ShardMesh
    from lightning_yafsdp.core.comm.step_timing import StepTiming

_KIND_CODES = {"gather": 1, "reduce_scatter": 2, "all_reduce": 3}
_TAG_NUMEL = 3


class CollectiveOrderError(RuntimeError):
    """Ranks were about to issue different collectives."""


class CollectiveOrderGuard:
    """Checks that every rank issues the same collective as this one, at each collective.

    Args:
        mesh: the engine's groups; each tag is exchanged in the group of its
            collective (the shard group; the replicate group for the replicate
            all_reduce of hybrid sharding).
        device: where the tags live (the engine's device: the backend serves it).
        describe: group index -> a name for error messages.
    """

    def __init__(
        self, mesh: ShardMesh, *, device: torch.device, describe: Callable[[int], str]
    ) -> None:
        self.mesh = mesh
        self.device = device
        # Per group: its global ranks (for error messages), computed once, not per collective.
        self._ranks = {
            id(group): [dist.get_global_rank(group, r) for r in range(dist.get_world_size(group))]
            for group in (mesh.shard_group, mesh.replicate_group)
            if group is not None
        }
        self.describe = describe
        # Counted apart from the engine's traffic, which tests compare with the design.
        self.stats = CommStats()

    def start(self, kind: str, *, unit: str, tag: tuple[int, int]) -> TagExchange | None:
        """Issue the tag exchange of the collective about to be issued (async, tiny)."""
        group = self.mesh.replicate_group if kind == "all_reduce" else self.mesh.shard_group
        ranks = self._ranks[id(group)]
        size = len(ranks)
        if size == 1:
            return None  # [Note: one rank copies] no other rank to disagree with
        mine = torch.tensor((_KIND_CODES[kind], *tag), dtype=torch.int64, device=self.device)
        every = torch.empty(size * _TAG_NUMEL, dtype=torch.int64, device=self.device)
        work = all_gather_into(
            every, mine, group, async_op=True, stats=self.stats, channel="order_guard"
        )
        return TagExchange(self, kind=kind, unit=unit, every=every, work=work, ranks=ranks)

    def explain(self, row: tuple[int, ...]) -> str:
        code, index, numel = row
        kind = {v: k for k, v in _KIND_CODES.items()}.get(code, f"collective {code}")
        return f"{kind} of '{self.describe(index)}' ({numel} elements)"


class TagExchange:
    """One collective's tag exchange; ``verify()`` runs before its collective is waited."""

    def __init__(
        self, guard: CollectiveOrderGuard, *, kind: str, unit: str, every, work, ranks: list[int]
    ) -> None:
        self._guard = guard
        self._kind, self._unit = kind, unit
        self._every = every
        self._work = work
        self.ranks = ranks  # global ranks of the group the tags were exchanged in

    def verify(self, timing: StepTiming | None = None) -> None:
        """Wait for the tags (every rank sends them before its collective); raise if any differ.

        Runs before the collective's own wait: a mismatched collective may never
        complete, but its tag exchange always does, so every rank raises here.
        ``timing``: count the wait as ``order_tag`` time ([Note: step breakdown]).
        """
        if self._work is not None:
            complete = timing is not None and self._work.is_completed()
            start = time.perf_counter()
            self._work.wait()
            if timing is not None:
                timing.add_wait("order_tag", time.perf_counter() - start, was_complete=complete)
        guard = self._guard
        rows = [tuple(row) for row in self._every.view(len(self.ranks), _TAG_NUMEL).tolist()]
        if all(row == rows[0] for row in rows):
            return
        lines = [f"  rank {r}: {guard.explain(row)}" for r, row in zip(self.ranks, rows)]
        raise CollectiveOrderError(
            order_error_message(f"the {self._kind} of '{self._unit}'", lines)
        )


def order_error_message(this_rank_issued: str, lines: list[str]) -> str:
    """The message of ``CollectiveOrderError``: what each rank issued, and the fix."""
    return (
        f"ranks issued different collectives (this rank, {dist.get_rank()}, issued "
        f"{this_rank_issued}):\n" + "\n".join(lines) + "\n"
        "Every rank must call the same sharded units in the same order in each step; "
        "they would otherwise exchange data of different units or hang. Per-rank "
        "randomness that skips or reorders units (LayerDrop, routing around whole blocks) "
        "must be drawn from a generator seeded identically on every rank."
    )
