"""The shard mesh both strategies build once the process group exists, and what they keep."""

from __future__ import annotations

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_yafsdp.adapters.hosts import (
    OversubscribedWarning,
    oversubscription_warning,
    warn_if_shard_groups_are_spread,
)
from lightning_yafsdp.adapters.options import ShardingOptions
from lightning_yafsdp.core.comm.mesh import ShardMesh, check_shard_size, default_shard_size


def build_mesh(options: ShardingOptions, *, world_size: int, num_nodes: int) -> ShardMesh:
    """The groups the model is sharded and replicated over ([Note: hybrid sharding]).

    ``device_mesh`` (a DeviceMesh, or ``(replicas, shard_size)`` as FSDPStrategy takes
    it) or ``shard_size``; neither: one node's ranks per shard group when the run has
    several nodes, every rank otherwise. Collective: every rank creates the groups.
    """
    mesh = options.device_mesh
    if mesh is not None and not isinstance(mesh, (tuple, list)):
        built = ShardMesh.from_device_mesh(mesh)
    else:
        if mesh is not None:
            replicas, shard_size = mesh
            if replicas * shard_size != world_size:
                raise ValueError(
                    f"device_mesh=({replicas}, {shard_size}) has {replicas * shard_size} "
                    f"ranks but the run has {world_size} (devices x num_nodes)"
                )
            check_shard_size(shard_size, world_size)
        else:
            shard_size = default_shard_size(
                options.shard_size, world_size=world_size, num_nodes=num_nodes
            )
        built = ShardMesh.hybrid(shard_size, timeout=options.timeout)
    if built.is_hybrid:
        rank_zero_info(f"yafsdp: hybrid sharding, {built.describe()} (shard_size= to change)")
        warn_if_shard_groups_are_spread(built)
    return built


class ShardingState:
    """Mixed into both strategies: their options and their mesh, built once.

    Each strategy sets ``_options`` in ``__init__`` and calls ``_ensure_mesh()`` once its
    process group exists; Lightning sets the Trainer's environment up again for every
    fit/validate/test/predict, and the groups must not be created again.
    """

    _options: ShardingOptions
    _mesh: ShardMesh | None = None
    num_nodes: int
    parallel_devices: list | None

    @property
    def options(self) -> ShardingOptions:
        """The sharding options this strategy was built with (read-only)."""
        return self._options

    @property
    def mesh(self) -> ShardMesh | None:
        """The shard and replicate groups ([Note: hybrid sharding]); None before setup."""
        return self._mesh

    def _check_against_run(self) -> None:
        """The options against the run's size and device, once Lightning set the devices.

        Lightning sets them while the Trainer / Fabric object is built (its connector then
        calls ``set_world_ranks``), before launching: a shard size that cannot divide the
        world is refused there, not after every rank started ([Note: arguments checked in
        the constructor]).
        """
        devices = self.parallel_devices or []
        if devices:
            self._options.check_against_run(
                world_size=self.num_nodes * len(devices), device_type=devices[0].type
            )
            warning = oversubscription_warning(len(devices), devices[0].type)
            if warning:  # said once: Python shows a warning once per place it is raised
                rank_zero_warn(warning.removeprefix("warning: "), category=OversubscribedWarning)

    def _ensure_mesh(self) -> None:
        if self._mesh is None:
            self._mesh = build_mesh(
                self._options, world_size=self.world_size, num_nodes=self.num_nodes
            )
