"""``ShardMesh``: the ranks a model is sharded over, and the ranks it is replicated over.

[Note: hybrid sharding]
With one flat group every all_gather and reduce_scatter spans all ranks. At a
few hundred GPUs each rank's piece of a unit shrinks to kilobytes and every
collective crosses the slowest links. Hybrid sharding (HSDP, FSDP2's 2-D mesh,
DeepSpeed's hpZ) splits the world into ``replicate_size`` groups of
``shard_size`` consecutive ranks (one node, usually): parameters, grads and
optimizer state are sharded inside a shard group exactly as in a flat world of
``shard_size`` ranks, and every shard group holds the same shards. Gathers and
reduce_scatters run inside the shard group; after a unit's reduce_scatter its
reduced shard (``1/shard_size`` of the unit) is all-reduced across the
replicate group, the ranks holding the same shard in the other groups. That is
the only collective that crosses groups, and it moves one shard, not a unit.

Layout: ``mesh[replicate][shard]`` = global rank ``replicate * shard_size +
shard``, the order of ``init_device_mesh(..., (R, K), mesh_dim_names=
("replicate", "shard"))`` and of Lightning's rank numbering (node-major).

What needs the whole world (which parameters some rank used, the init seed,
``sync_module_states``, checkpoint commits) uses ``world_group``; the rest of
the engine sees the shard group only, so a K-rank shard group behaves like a
flat world of K ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["ShardMesh", "check_shard_size", "default_shard_size", "resolve_mesh"]


@dataclass(frozen=True)
class ShardMesh:
    """The process groups of one sharded model.

    Attributes:
        world_group: every rank of the model.
        shard_group: the ranks that split this rank's units between them.
        replicate_group: the ranks holding the same shard as this rank in the
            other shard groups (None when there is one shard group).
    """

    world_group: ProcessGroup
    shard_group: ProcessGroup
    replicate_group: ProcessGroup | None

    @property
    def rank(self) -> int:
        return dist.get_rank(self.world_group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.world_group)

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard_group)

    @property
    def shard_size(self) -> int:
        return dist.get_world_size(self.shard_group)

    @property
    def replicate_rank(self) -> int:
        return 0 if self.replicate_group is None else dist.get_rank(self.replicate_group)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    @property
    def is_hybrid(self) -> bool:
        return self.replicate_group is not None

    def describe(self) -> str:
        if not self.is_hybrid:
            return f"{self.world_size} rank(s), one shard group"
        return (
            f"{self.world_size} ranks: {self.replicate_size} replicas x {self.shard_size} "
            "sharded ranks"
        )

    @classmethod
    def flat(cls, group: ProcessGroup | None = None) -> ShardMesh:
        group = group or dist.group.WORLD
        return cls(world_group=group, shard_group=group, replicate_group=None)

    @classmethod
    def hybrid(cls, shard_size: int, *, timeout: timedelta | None = None) -> ShardMesh:
        """Groups of ``shard_size`` consecutive ranks of the world, replicated across groups.

        Collective over the world: every rank creates every group, in the same order.
        ``shard_size`` equal to the world size is a flat mesh. ``timeout``: of the new
        groups (torch gives new groups its default, not the world group's).
        """
        world = dist.get_world_size()
        check_shard_size(shard_size, world)
        if shard_size == world:
            return cls.flat()
        replicas = world // shard_size
        shard_groups = [list(range(r * shard_size, (r + 1) * shard_size)) for r in range(replicas)]
        replicate_groups = [list(range(s, world, shard_size)) for s in range(shard_size)]
        shard_group, _ = dist.new_subgroups_by_enumeration(shard_groups, timeout=timeout)
        replicate_group, _ = dist.new_subgroups_by_enumeration(replicate_groups, timeout=timeout)
        return cls(dist.group.WORLD, shard_group, replicate_group)

    @classmethod
    def from_device_mesh(cls, mesh: Any) -> ShardMesh:
        """A 1-D mesh (flat) or a 2-D mesh with dims ``("replicate", "shard")``."""
        names = tuple(mesh.mesh_dim_names or ())
        if mesh.ndim == 1:
            return cls.flat(mesh.get_group())
        if mesh.ndim != 2 or names != ("replicate", "shard"):
            raise ValueError(
                f"device_mesh has {mesh.ndim} dimension(s) named {names or 'nothing'}: the "
                "engine takes a 1-D mesh (flat sharding) or a 2-D mesh with "
                "mesh_dim_names=('replicate', 'shard') (hybrid sharding), e.g. "
                "init_device_mesh('cuda', (num_nodes, gpus_per_node), "
                "mesh_dim_names=('replicate', 'shard'))"
            )
        if mesh.size() != dist.get_world_size():
            raise ValueError(
                f"device_mesh covers {mesh.size()} of the {dist.get_world_size()} ranks: a "
                "hybrid mesh must span every rank of the world"
            )
        standard = list(range(mesh.size()))
        if mesh.mesh.flatten().tolist() != standard:
            raise ValueError(
                "device_mesh must place the ranks in order (mesh[replicate][shard] = "
                "replicate * shard_size + shard, as init_device_mesh does): shard groups of "
                f"consecutive ranks; got {mesh.mesh.tolist()}"
            )
        shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
        if mesh.size(0) == 1:
            return cls.flat(shard)
        return cls(dist.group.WORLD, shard, replicate)


def check_shard_size(shard_size: Any, world_size: int) -> None:
    """One-line error unless ``shard_size`` is a positive divisor of ``world_size``."""
    if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
        raise ValueError(f"shard_size must be a positive integer, got {shard_size!r}")
    if world_size % shard_size:
        raise ValueError(
            f"shard_size={shard_size} does not divide the world size {world_size}: every "
            f"shard group needs the same number of ranks (divisors of {world_size}: "
            f"{[k for k in range(1, world_size + 1) if world_size % k == 0]})"
        )


def default_shard_size(requested: int | None, *, world_size: int, num_nodes: int) -> int:
    """The shard group size: ``requested``, else one node's ranks on several nodes, else all.

    One node's ranks share the fast links (NVLink), so by default a multi-node run
    shards inside each node and replicates across nodes; a single node shards over
    all its ranks. (A model whose sharded state does not fit one node's memory
    needs a larger ``shard_size``: ``yafsdp estimate`` tells.)
    """
    if requested is not None:
        check_shard_size(requested, world_size)
        return requested
    if num_nodes > 1 and world_size % num_nodes == 0:
        return world_size // num_nodes
    return world_size


def resolve_mesh(
    *,
    process_group: ProcessGroup | None,
    shard_size: int | None,
    device_mesh: Any,
    mesh: ShardMesh | None,
) -> ShardMesh:
    """The mesh ``shard_model`` shards over, from whichever of its arguments was given."""
    given = [
        name
        for name, value in (
            ("process_group", process_group),
            ("shard_size", shard_size),
            ("device_mesh", device_mesh),
            ("mesh", mesh),
        )
        if value is not None
    ]
    if len(given) > 1:
        raise ValueError(
            f"pass at most one of process_group, shard_size, device_mesh and mesh; got "
            f"{', '.join(given)}"
        )
    if mesh is not None:
        return mesh
    if device_mesh is not None:
        return ShardMesh.from_device_mesh(device_mesh)
    if shard_size is not None:
        return ShardMesh.hybrid(shard_size)
    return ShardMesh.flat(process_group)
