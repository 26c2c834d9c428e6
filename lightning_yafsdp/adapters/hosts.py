"""Do the shard groups sit on as few machines as their size allows?

[Note: shard groups and machines]
A shard group is K consecutive global ranks ([Note: hybrid sharding]). With K equal to
the ranks per machine that is one machine when the launcher numbers ranks node by node,
as Lightning's own launcher, torchrun and SLURM's default block distribution do. A cyclic numbering
(``srun --distribution=cyclic``) puts consecutive ranks on different machines: every
all_gather and reduce_scatter of every unit then crosses the network. Training is still
correct, only slower than the flat sharding hybrid sharding was meant to beat, so the
strategies warn once at setup instead of refusing; they compare hostnames, which cost
one small all_gather.
"""

from __future__ import annotations

import os
import socket
from collections import Counter
from collections.abc import Sequence

from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_yafsdp.core.comm.collectives import all_gather_objects
from lightning_yafsdp.core.comm.mesh import ShardMesh


def spread_shard_groups(hostnames: Sequence[str], shard_size: int) -> list[tuple[int, list[str]]]:
    """The shard groups on more machines than node-major numbering would give them.

    ``hostnames[rank]`` is where each global rank runs. Each group is compared with the
    same group once the ranks are renumbered machine by machine (machines in order of
    their first rank): a group that would need as many machines then (a shard size that
    does not line up with the machines, say 6 on 8-GPU machines) is not the launcher's
    doing. Returns ``(first rank, machines)`` per spread group.
    """
    first_rank = {name: rank for rank, name in reversed(list(enumerate(hostnames)))}
    node_major = sorted(hostnames, key=first_rank.__getitem__)
    spread = []
    for first in range(0, len(hostnames), shard_size):
        machines = sorted(set(hostnames[first : first + shard_size]))
        if len(machines) > len(set(node_major[first : first + shard_size])):
            spread.append((first, machines))
    return spread


def warn_if_shard_groups_are_spread(mesh: ShardMesh) -> None:
    """Warns (rank 0) when a shard group spans more machines than it needs. Collective."""
    if not mesh.is_hybrid:
        return
    hostnames = all_gather_objects(socket.gethostname(), group=mesh.world_group)
    spread = spread_shard_groups([str(name) for name in hostnames], mesh.shard_size)
    if not spread:
        return
    first, machines = spread[0]
    shown = ", ".join(machines[:4]) + (", ..." if len(machines) > 4 else "")
    per_machine = min(Counter(hostnames).values())
    rank_zero_warn(
        f"yafsdp: {len(spread)} of {mesh.replicate_size} shard groups span more machines "
        f"than they need, e.g. ranks {first}-{first + mesh.shard_size - 1} run on "
        f"{len(machines)} machines ({shown}): every unit's all_gather and reduce_scatter "
        "then crosses the network, which hybrid sharding is meant to avoid. The launcher "
        "numbers ranks across machines instead of machine by machine (srun "
        "--distribution=cyclic?): launch with node-major ranks (srun --distribution=block, "
        f"as Lightning and torchrun do; then shard_size={per_machine} is one machine), or "
        f"shard flat with shard_size={mesh.world_size}"
    )


class OversubscribedWarning(UserWarning):
    """More CPU ranks on this machine than cores it may use (a slow run, not a wrong one)."""


def oversubscription_warning(
    ranks_per_node: int, device_type: str, *, setting: str = "devices"
) -> str | None:
    """A one-line warning when CPU ranks outnumber this machine's cores, else None.

    Each CPU rank needs at least one core: with more ranks than cores the ranks take
    turns, every collective waits for the slowest, and a step takes several times as
    long as with fewer ranks. Both strategies warn with it when ``Trainer(...)`` /
    ``Fabric(...)`` knows the devices; ``yafsdp train`` says it before launching.

    Args:
        ranks_per_node: Processes this machine will run (``devices``).
        device_type: The ranks' device type (only ``"cpu"`` ranks share the cores).
        setting: The name the fix is given under (``trainer.devices`` in a recipe).

    Returns:
        The warning text (no trailing newline), or None when the ranks fit.
    """
    if device_type != "cpu":
        return None
    cores = usable_cores()
    if ranks_per_node <= cores:
        return None
    return (
        f"warning: {ranks_per_node} CPU ranks on {cores} usable core(s): the ranks take turns "
        f"and every step waits for the slowest; set {setting}={cores} or fewer"
    )


def usable_cores() -> int:
    """The cores this process may run on (taskset, cgroups cpusets), not the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
